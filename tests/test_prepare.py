"""Downloads (against a local HTTP server, never the network) and text -> token
shard preparation."""
import http.server
import socket
import sys
import threading
import time

import numpy as np
import pytest
import tiktoken

from gpt2np.cli import fetch as fetch_cli
from gpt2np.cli import prepare as prepare_cli
from gpt2np.datasets import fetch, prepare
from gpt2np.datasets.data import DataError, read_shard
from gpt2np.datasets.fetch import FetchError, download
from gpt2np.formats.tokenizer import EOT_TEXT, GPT2_PAT_STR, get_encoding, load_tokenizer_bin

PAYLOAD = bytes(range(256)) * 1000   # 256 kB: several chunks, so the progress bar moves
TEXT = "To be, or not to be.\n\nThat is the question.\n" * 100


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path in ("/file.bin", "/input.txt"):
            body = PAYLOAD if self.path == "/file.bin" else TEXT.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/short.bin":   # promises more than it sends
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()
            self.wfile.write(PAYLOAD[:1000])
            self.close_connection = True
        else:
            self.send_error(404, "Not Found")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert str(needle) in msg, msg


# ---------------------------------------------------------------------------------------------
# fetch

@pytest.mark.parametrize("terminal", [False, True])
def test_download_success_with_progress(server, tmp_path, capsys, monkeypatch, terminal):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    dest = download(f"{server}/file.bin", tmp_path / "sub" / "file.bin", timeout=5)
    assert dest.read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    size = f"{len(PAYLOAD) / 1e3:.1f} kB"
    if terminal:   # a bar redrawn in place; the final drawing stays, with its line end
        assert err.startswith("\rfile.bin: [") and err.endswith("B/s\x1b[K\n")
        assert f"] {size}/{size} (100%)" in err and err.count("\n") == 1
    else:          # logs get one plain line
        assert err.startswith(f"file.bin: {size}/{size} (100%), ") and err.endswith("B/s\n")
        assert "\r" not in err and err.count("\n") == 1
    assert [p.name for p in dest.parent.iterdir()] == ["file.bin"]   # no temporary file left


def test_download_404(server, tmp_path):
    with pytest.raises(FetchError) as e:
        download(f"{server}/nothing", tmp_path / "x", timeout=5, progress=False)
    one_line(e, "/nothing", "404")
    assert list(tmp_path.iterdir()) == []


def test_download_short_read(server, tmp_path):
    with pytest.raises(FetchError) as e:
        download(f"{server}/short.bin", tmp_path / "x", timeout=5, progress=False)
    one_line(e, "short.bin")
    assert list(tmp_path.iterdir()) == []


def test_download_from_silent_server_times_out_fast(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)   # connections complete in the backlog, nobody ever answers
    try:
        started = time.monotonic()
        with pytest.raises(FetchError) as e:
            download(f"http://127.0.0.1:{silent.getsockname()[1]}/f", tmp_path / "x", timeout=0.5)
        assert time.monotonic() - started < 5
        one_line(e, "0.5 s")
    finally:
        silent.close()
    assert list(tmp_path.iterdir()) == []


def test_download_connection_refused(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    with pytest.raises(FetchError) as e:
        download(f"http://127.0.0.1:{port}/f", tmp_path / "x", timeout=2)
    one_line(e, "offline?")


def test_ensure_uses_existing_file_and_knows_urls(tmp_path):
    (tmp_path / "gpt2_tokenizer.bin").write_bytes(b"present")
    assert fetch.ensure("gpt2_tokenizer.bin", tmp_path) == tmp_path / "gpt2_tokenizer.bin"
    with pytest.raises(FetchError):
        fetch.ensure("unknown.bin", tmp_path)
    assert fetch.KNOWN_FILES["gpt2_124M.bin"].startswith(fetch.STARTER_PACK_URL)
    assert fetch.STARTER_PACK_URL == ("https://huggingface.co/datasets/karpathy/llmc-starter-pack/"
                                      "resolve/main/")


def test_fetch_a_file_in_the_way_of_dir_is_one_line_before_any_download(tmp_path, capsys,
                                                                        monkeypatch):
    (tmp_path / "a.txt").write_text("x")
    monkeypatch.setattr(fetch, "download", lambda *a, **k: pytest.fail("downloaded"))
    for argv, words in (
            (["--dir", str(tmp_path / "a.txt" / "sub")], ["--dir", "a.txt/sub", "a.txt is a file"]),
            (["tokenizer", "--dir", str(tmp_path / "a.txt")], ["--dir", "a.txt: is a file"]),
            (["hellaswag", "--dir", str(tmp_path / "a.txt")], ["--dir", "a.txt: is a file"])):
        assert fetch_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert (err.count("\n") == 1 and err.startswith("error: ")
                and all(w in err for w in words)), err


def test_a_failed_fetch_leaves_no_folder_it_made(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(fetch.KNOWN_FILES, "gpt2_tokenizer.bin", f"{server}/nothing")
    assert fetch_cli.main(["tokenizer", "--dir", str(tmp_path / "new" / "sub"), "--timeout",
                           "5"]) == 1
    assert "404" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    # a success keeps it
    monkeypatch.setitem(fetch.KNOWN_FILES, "gpt2_tokenizer.bin", f"{server}/file.bin")
    assert fetch_cli.main(["tokenizer", "--dir", str(tmp_path / "new" / "sub"), "--timeout",
                           "5"]) == 0
    assert (tmp_path / "new" / "sub" / "gpt2_tokenizer.bin").read_bytes() == PAYLOAD


# ---------------------------------------------------------------------------------------------
# prepare

@pytest.fixture(scope="module")
def bytes_encoding():
    """A toy byte-level encoding (token = byte, eot = 256): prepare tests
    without the GPT-2 files."""
    return tiktoken.Encoding("bytes", pat_str=GPT2_PAT_STR,
                             mergeable_ranks={bytes([b]): b for b in range(256)},
                             special_tokens={EOT_TEXT: 256})


def test_crlf_text_gives_the_lf_texts_shards(tmp_path, bytes_encoding):
    """Windows (CRLF) and old Mac (CR) line ends are read as text mode reads them: the same
    documents and tokens as the LF file (llm.c's prepare scripts read text mode too)."""
    text = "ab\n\nc d\n\n\nlast"
    shards = {}
    for name, newline in (("lf", "\n"), ("crlf", "\r\n"), ("cr", "\r")):
        (tmp_path / f"{name}.txt").write_bytes(text.replace("\n", newline).encode())
        out = prepare.prepare_text(tmp_path / f"{name}.txt", tmp_path / name, name, 4,
                                   bytes_encoding)
        shards[name] = (read_shard(out.val).tolist(), read_shard(out.train).tolist())
    assert shards["crlf"] == shards["cr"] == shards["lf"]


def test_prepare_small_text(tmp_path, bytes_encoding):
    text = "ab\n\nc d\n\n\nlast"
    (tmp_path / "small.txt").write_text(text)
    shards = prepare.prepare_text(tmp_path / "small.txt", tmp_path / "out", "small", 4,
                                  bytes_encoding)
    assert (shards.val == tmp_path / "out" / "small_val.bin"
            and shards.train == tmp_path / "out" / "small_train.bin")
    # documents "ab\n\n", "c d\n\n", "\nlast", each after an eot (llm.c's tinyshakespeare layout)
    expected = [256, *b"ab\n\n", 256, *b"c d\n\n", 256, *b"\nlast"]
    assert read_shard(shards.val).tolist() == expected[:4]
    assert read_shard(shards.train).tolist() == expected[4:]
    table = load_tokenizer_bin(shards.tokenizer)
    assert table.vocab_size == 257 and table.eot_token == 256
    assert table.decode(expected).replace(EOT_TEXT, "") == text


def test_prepare_errors(tmp_path, bytes_encoding):
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(DataError) as e:
        prepare.prepare_text(tmp_path / "tiny.txt", tmp_path, "tiny", 32768, bytes_encoding)
    one_line(e, "tiny.txt", "4 tokens")
    with pytest.raises(DataError) as e:
        prepare.prepare_text(tmp_path / "absent.txt", tmp_path, "x", 1, bytes_encoding)
    one_line(e, "absent.txt", "not found")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError) as e:
        prepare.prepare_text(tmp_path / "latin1.txt", tmp_path, "x", 1, bytes_encoding)
    one_line(e, "latin1.txt", "utf-8")


def test_an_empty_or_too_short_text_is_refused_before_tokenizing(tmp_path, bytes_encoding, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr(prepare_cli, "get_encoding", lambda bpe_dir=None: bytes_encoding)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "short.txt").write_text("a" * 100 + "\n\n" + "b" * 100)       # at most 204 tokens
    for name, words in (("empty.txt", ["empty.txt: empty"]),
                        ("blank.txt", ["blank.txt: only whitespace"]),
                        ("short.txt", ["short.txt: 202 bytes", "at most 204 tokens", "32769",
                                       "--val-tokens"])):
        val = ["--val-tokens", "32768"] if name == "short.txt" else []   # the default adapts
        assert prepare_cli.main(["--input", str(tmp_path / name), "--output-dir",
                                 str(tmp_path / "out")] + val) == 2
        err = capsys.readouterr().err
        assert (err.count("\n") == 1 and "tokenizing" not in err
                and all(w in err for w in words)), err
    assert not (tmp_path / "out").exists()
    # 204 tokens: a training split is left
    assert prepare_cli.main(["--input", str(tmp_path / "short.txt"),
                             "--output-dir", str(tmp_path / "out"), "--val-tokens", "200"]) == 0


def test_a_small_text_gets_a_smaller_val_split_with_a_note(tmp_path, bytes_encoding, capsys,
                                                           monkeypatch):
    """A text too short for llm.c's 32,768 val tokens and a training split (100 KB of English is
    about 25,000 GPT-2 tokens): val is its first 10%, said in a note; a text too short even for
    that is one line."""
    monkeypatch.setattr(prepare_cli, "get_encoding", lambda bpe_dir=None: bytes_encoding)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2NP_PROGRESS", "off")
    (tmp_path / "small.txt").write_text(TEXT * 4)       # 17,600 bytes, 400 documents, 18,001 tokens
    assert prepare_cli.main(["--input", "small.txt"]) == 0
    out, err = capsys.readouterr()
    assert err == ("note: small.txt: 18,001 tokens, too few for the default 32,768-token val "
                   "split; val is the first 10% (1,800 tokens), train the other 16,201 "
                   "(--val-tokens N sets val)\n"), err
    assert out == ("wrote checkpoints/data/small_val.bin (1,800 tokens)\n"
                   "wrote checkpoints/data/small_train.bin (16,201 tokens)\n"), out
    val = read_shard("checkpoints/data/small_val.bin")
    train = read_shard("checkpoints/data/small_train.bin")
    assert len(val) == 1800 and len(train) == 16201 and val[0] == 256
    (tmp_path / "tiny.txt").write_text("abcdefg")                      # 8 tokens: 10% is none
    assert prepare_cli.main(["--input", "tiny.txt", "--output-dir", "tiny"]) == 2
    assert capsys.readouterr().err == ("error: tiny.txt: only 8 token(s): too few to split into "
                                       "val (10%) and train; give a longer text\n")
    assert not (tmp_path / "tiny").exists()
    (tmp_path / "mid.txt").write_bytes(b"a\r\n\r\n" * 100)  # 500 bytes; 401 tokens once tokenized
    assert prepare_cli.main(["--input", "mid.txt", "--val-tokens", "450", "--output-dir", "mid"]
                            ) == 2
    err = capsys.readouterr().err                      # an explicit --val-tokens is kept, and named
    assert err.count("\n") == 1 and "mid.txt: only 401 tokens" in err and "--val-tokens" in err, err


@pytest.mark.parametrize("argv, words", [
    (["tinyshakespeare", "--source", "x.txt"], ["--source x.txt", "only for fineweb or tinystories",
                                                "not tinyshakespeare", "--input FILE"]),
    (["--source", "x.jsonl"], ["--source x.jsonl", "not tinyshakespeare"]),
    (["--input", "x.txt", "--shards", "3"], ["--shards 3", "not --input x.txt"]),
    (["--input", "x.txt", "--shard-size", "10"], ["--shard-size 10", "not --input x.txt"]),
    (["--workers", "2"], ["--workers 2", "not tinyshakespeare"]),
    (["--dir", "cache"], ["--dir cache", "not tinyshakespeare"]),
    (["fineweb", "--val-tokens", "5"], ["--val-tokens 5", "fineweb's val split is its shard 0"]),
    (["tinystories", "--source", "x.jsonl", "--dir", "cache"],
     ["--dir cache", "not used with --source x.jsonl"]),
])
def test_flags_that_mean_nothing_here_are_refused(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert prepare_cli.main(argv + ["--output-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_of_output_dir_is_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    assert prepare_cli.main(["--input", str(tmp_path / "a.txt"), "--output-dir",
                             str(tmp_path / "a.txt" / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--output-dir" in err and "a.txt is a file" in err, err


def test_a_failed_tinyshakespeare_download_leaves_no_folder_it_made(server, tmp_path, capsys,
                                                                    monkeypatch, bytes_encoding):
    monkeypatch.setattr(prepare_cli, "get_encoding", lambda bpe_dir=None: bytes_encoding)
    monkeypatch.setattr(prepare, "find_tinyshakespeare", lambda: None)
    monkeypatch.setattr(prepare, "TINYSHAKESPEARE_URL", f"{server}/nothing")
    assert prepare_cli.main(["tinyshakespeare", "--output-dir",
                             str(tmp_path / "new" / "data")]) == 2
    assert "404" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_prepare_tinyshakespeare_downloads_when_no_local_copy(server, tmp_path, monkeypatch,
                                                              bytes_encoding):
    monkeypatch.setattr(prepare, "find_tinyshakespeare", lambda: None)
    monkeypatch.setattr(prepare, "TINYSHAKESPEARE_URL", f"{server}/input.txt")
    shards = prepare.prepare_tinyshakespeare(tmp_path, val_tokens=1000, encoding=bytes_encoding)
    assert (tmp_path / "tinyshakespeare.txt").read_text() == TEXT
    assert shards.train.name == "tiny_shakespeare_train.bin"
    assert len(read_shard(shards.val)) == 1000


@pytest.fixture(scope="module")
def gpt2(data_dir):
    if not (data_dir / "gpt2_vocab.bpe").is_file():
        pytest.skip(f"GPT-2 BPE files not in {data_dir}")
    return get_encoding(data_dir)


def test_prepare_cli(tmp_path, data_dir, gpt2, capsys):
    (tmp_path / "doc.txt").write_text("Hello world\n\nHello again, world.\n")
    rc = prepare_cli.main(["--input", str(tmp_path / "doc.txt"), "--output-dir",
                           str(tmp_path / "o"), "--val-tokens", "3", "--bpe-dir", str(data_dir)])
    assert rc == 0
    assert read_shard(tmp_path / "o" / "doc_val.bin").tolist() == [50256, 15496, 995]
    assert "doc_train.bin" in capsys.readouterr().out
    rc = prepare_cli.main(["--input", str(tmp_path / "missing.txt"), "--output-dir",
                           str(tmp_path / "o"), "--bpe-dir", str(data_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "missing.txt" in err


def test_prepare_tinyshakespeare(tmp_path, data_dir, gpt2, monkeypatch):
    if not (data_dir / "tinyshakespeare.txt").is_file():
        pytest.skip(f"tinyshakespeare.txt not in {data_dir}")
    monkeypatch.setenv("GPT2NP_DATA_DIR", str(data_dir))
    monkeypatch.setattr(prepare, "download", None)   # must use the local copy
    started = time.monotonic()
    shards = prepare.prepare_tinyshakespeare(tmp_path, encoding=gpt2)
    assert time.monotonic() - started < 10
    val, train = read_shard(shards.val), read_shard(shards.train)
    assert len(val) == 32768 and len(train) == 305260   # llm.c's counts for tinyshakespeare
    assert val[:4].tolist() == [50256, 5962, 22307, 25]   # <|endoftext|>First Citizen:
    tokens = np.concatenate([val, train])
    assert ((tokens == 50256).sum()
            == len((data_dir / "tinyshakespeare.txt").read_text().split("\n\n")))
    decoded = load_tokenizer_bin(shards.tokenizer).decode(tokens)
    assert (decoded.replace(EOT_TEXT, "")
            == (data_dir / "tinyshakespeare.txt").read_text(encoding="utf-8"))


def test_fetch_and_prepare_write_into_the_current_folder_where_train_looks(
        server, tmp_path, capsys, monkeypatch, bytes_encoding):
    """fetch and prepare write into checkpoints/ of the folder they run in (not the source tree's),
    the paths they print work as printed from there, and train's defaults
    (starter.resolve_data) find the shards there."""
    from gpt2np.datasets import starter
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPT2NP_DATA_DIR", raising=False)
    monkeypatch.setenv("GPT2NP_PROGRESS", "off")
    monkeypatch.setitem(fetch.KNOWN_FILES, "tinyshakespeare.txt", f"{server}/input.txt")
    monkeypatch.setattr(prepare_cli, "get_encoding", lambda bpe_dir=None: bytes_encoding)
    assert fetch_cli.main(["tinyshakespeare"]) == 0
    assert capsys.readouterr().err == "checkpoints/tinyshakespeare.txt: downloaded\n"
    assert (tmp_path / "checkpoints" / "tinyshakespeare.txt").read_text() == TEXT
    assert prepare_cli.main(["tinyshakespeare"]) == 0    # the fetched copy: nothing is downloaded
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["checkpoints/data/tiny_shakespeare_val.bin",
                       "checkpoints/data/tiny_shakespeare_train.bin"]
    assert all((tmp_path / path).is_file() for path in printed)
    assert starter.resolve_data(None, None) == (printed[1], printed[0])
