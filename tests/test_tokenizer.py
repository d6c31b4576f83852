"""GPT-2 tokenizer: known ids, locating files, llm.c's gpt2_tokenizer.bin round
trip and bad files."""
import json

import numpy as np
import pytest
import tiktoken

from gpt2np import paths
from gpt2np.formats import tokenizer as tk
from gpt2np.formats.tokenizer import (
    TokenizerError,
    TokenizerNotFoundError,
    get_encoding,
    load_tokenizer_bin,
    write_tokenizer_bin,
)

UNICODE_TEXT = "Héllo wörld — naïve café 🙂 世界\n\nNew section:\tdone.  "


def one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert str(needle) in msg, msg


@pytest.fixture(scope="module")
def gpt2(data_dir):
    if (not (data_dir / "gpt2_vocab.bpe").is_file()
        or not (data_dir / "gpt2_encoder.json").is_file()):
        pytest.skip(f"gpt2_vocab.bpe / gpt2_encoder.json not in {data_dir}")
    return get_encoding(data_dir)


def write_tiny_bpe(folder, merges=(("a", "b"), ("ab", "c"))):
    """OpenAI-format BPE files for a toy vocabulary: the 256 bytes, the given
    merges, <|endoftext|>."""
    byte_to_char = {b: c for c, b in tk._gpt2_char_to_byte().items()}
    encoder = {byte_to_char[b]: b for b in range(256)}
    for i, (first, second) in enumerate(merges):
        encoder[first + second] = 256 + i
    encoder[tk.EOT_TEXT] = 256 + len(merges)
    (folder / "gpt2_encoder.json").write_text(json.dumps(encoder))
    (folder / "gpt2_vocab.bpe").write_text("#version: 0.2\n"
                                           + "".join(f"{a} {b}\n" for a, b in merges))


@pytest.fixture
def tiny(tmp_path):
    write_tiny_bpe(tmp_path)
    return tk.encoding_from_bpe_files(tmp_path / "gpt2_vocab.bpe", tmp_path / "gpt2_encoder.json")


# ---------------------------------------------------------------------------------------------
# GPT-2 itself

def test_known_gpt2_ids(gpt2):
    assert gpt2.n_vocab == 50257 and gpt2.eot_token == 50256
    assert tk.encode("Hello world", gpt2) == [15496, 995]
    assert tk.encode("Hello, world!", gpt2) == [15496, 11, 995, 0]
    assert tk.encode("<|endoftext|>", gpt2) != [50256]   # plain text, not the special token
    assert tk.decode([15496, 995], gpt2) == "Hello world"
    assert tk.decode(np.array(tk.encode(UNICODE_TEXT, gpt2)), gpt2) == UNICODE_TEXT


def test_bpe_parsing_agrees_with_tiktokens_loader(gpt2, data_dir, monkeypatch):
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    # tiktoken would otherwise cache local files in /tmp
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    expected = data_gym_to_mergeable_bpe_ranks(str(data_dir / "gpt2_vocab.bpe"),
                                               str(data_dir / "gpt2_encoder.json"))
    ranks, eot = tk.load_bpe_ranks(data_dir / "gpt2_vocab.bpe", data_dir / "gpt2_encoder.json")
    assert ranks == expected and eot == 50256
    assert tk.GPT2_PAT_STR == r50k_pat_str


def test_get_encoding_is_cached(gpt2, data_dir):
    assert get_encoding(data_dir) is gpt2


def test_encoding_from_tokenizer_bin_matches_bpe_files(gpt2, data_dir, tmp_path):
    path = tmp_path / "gpt2_tokenizer.bin"
    write_tokenizer_bin(path, gpt2)
    from_bin = get_encoding(tmp_path)   # a folder holding only gpt2_tokenizer.bin
    assert from_bin.n_vocab == 50257 and from_bin.eot_token == 50256
    shakespeare = data_dir / "tinyshakespeare.txt"
    text = (shakespeare.read_text()[:20000] if shakespeare.exists() else "") + UNICODE_TEXT
    assert from_bin.encode_ordinary(text) == gpt2.encode_ordinary(text)
    assert get_encoding(path).n_vocab == 50257   # a file path works as bpe_dir too


def test_gpt2_tokenizer_bin_round_trip(gpt2, tmp_path):
    path = tmp_path / "gpt2_tokenizer.bin"
    write_tokenizer_bin(path, gpt2)
    header = np.fromfile(path, dtype="<u4", count=4)
    assert header.tolist() == [20240328, 2, 50257, 50256]
    table = load_tokenizer_bin(path)
    assert table.vocab_size == 50257 and table.eot_token == 50256
    assert table.token_bytes[15496] == b"Hello" and table.token_bytes[50256] == b"<|endoftext|>"
    ids = gpt2.encode_ordinary(UNICODE_TEXT)
    assert table.decode(ids) == UNICODE_TEXT
    assert table.decode([50256]) == "<|endoftext|>"


def test_an_empty_token_is_refused_as_llmcs_reader_does(tmp_path):
    """llm.c's tokenizer_init asserts every token has 1-255 bytes: a file with an
    empty one is damaged."""
    header = np.array([20240328, 2, 3, 2] + [0] * 252, "<u4").tobytes()
    path = tmp_path / "t.bin"
    path.write_bytes(header + b"\x01a" + b"\x00" + b"\x01c")
    with pytest.raises(TokenizerError, match="token 1 is empty"):
        load_tokenizer_bin(path)


# ---------------------------------------------------------------------------------------------
# locating files

def test_explicit_folder_without_files_does_not_fall_through(tmp_path):
    with pytest.raises(TokenizerNotFoundError) as e:
        get_encoding(tmp_path)
    one_line_error(e, tmp_path, "bpe_dir argument", "GPT2NP_BPE_DIR")


def test_search_order_and_not_found_message(tmp_path, monkeypatch):
    """GPT2NP_DATA_DIR, then checkpoints/ and checkpoints/data in the current folder (where
    `gpt2np fetch` puts them); never a ../shared folder beside the checkout."""
    user = tmp_path / "user"
    (user / "checkpoints").mkdir(parents=True)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    write_tiny_bpe(tmp_path / "shared" / "data")
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "repo")    # with ../shared/data beside it
    monkeypatch.chdir(user)
    monkeypatch.delenv("GPT2NP_BPE_DIR", raising=False)
    monkeypatch.delenv("GPT2NP_DATA_DIR", raising=False)
    with pytest.raises(TokenizerNotFoundError) as e:
        get_encoding()
    one_line_error(e, "checkpoints (in the current folder)", "checkpoints/data (in the current "
                   "folder)", "--bpe-dir", "`gpt2np fetch tokenizer`")
    assert "shared" not in str(e.value)
    write_tiny_bpe(user / "checkpoints", merges=[("a", "b")])
    assert tk.find_tokenizer_files()[1][0].resolve() == user / "checkpoints" / "gpt2_vocab.bpe"

    data = tmp_path / "data"
    data.mkdir()
    write_tiny_bpe(data)
    monkeypatch.setenv("GPT2NP_DATA_DIR", str(data))
    assert tk.find_tokenizer_files() == ("bpe",
                                         (data / "gpt2_vocab.bpe", data / "gpt2_encoder.json"))
    assert get_encoding().n_vocab == 259

    bpe = tmp_path / "bpe"
    bpe.mkdir()
    # an explicit folder wins, and must hold the files
    monkeypatch.setenv("GPT2NP_BPE_DIR", str(bpe))
    with pytest.raises(TokenizerNotFoundError):
        get_encoding()
    write_tiny_bpe(bpe, merges=[("a", "b")])
    assert get_encoding().n_vocab == 258


# ---------------------------------------------------------------------------------------------
# BPE files and gpt2_tokenizer.bin on a toy vocabulary (no data needed)

def test_tiny_bpe_merges(tiny):
    assert tiny.encode_ordinary("abc") == [257]
    assert tiny.encode_ordinary("ab") == [256]
    assert tiny.encode_ordinary("xa") == [ord("x"), ord("a")]
    assert tiny.eot_token == 258


@pytest.mark.parametrize("break_files, needle", [
    (lambda d: (d / "gpt2_vocab.bpe").write_text("#version: 0.2\nb a\nab c\n"), "line 2"),
    (lambda d: (d / "gpt2_vocab.bpe").write_text("#version: 0.2\na b\n"), "merges"),
    (lambda d: (d / "gpt2_encoder.json").write_text("{not json"), "gpt2_encoder.json"),
])
def test_inconsistent_bpe_files(tmp_path, break_files, needle):
    write_tiny_bpe(tmp_path)
    break_files(tmp_path)
    with pytest.raises(TokenizerError) as e:
        tk.encoding_from_bpe_files(tmp_path / "gpt2_vocab.bpe", tmp_path / "gpt2_encoder.json")
    one_line_error(e, needle)


def test_tokenizer_bin_round_trip_and_byte_correct_decode(tiny, tmp_path):
    path = tmp_path / "tok.bin"
    write_tokenizer_bin(path, tiny)
    table = load_tokenizer_bin(path)
    assert table.vocab_size == 259 and table.eot_token == 258
    assert table.token_bytes[257] == b"abc"
    snowman = "☃".encode()   # 3 bytes, 3 tokens: each alone is invalid utf-8
    ids = list(snowman) + [256]
    assert table.decode(ids) == "☃ab"
    # an incomplete character is replaced, not an exception
    assert table.decode(ids[:2]) == "\ufffd"
    assert table.decode_bytes(ids[:2]) == snowman[:2]
    with pytest.raises(ValueError):
        table.decode([259])
    rebuilt = tk.encoding_from_tokenizer_bin(path)
    assert rebuilt.encode_ordinary("abcab☃") == tiny.encode_ordinary("abcab☃")


def test_tokenizer_bin_version_1(tmp_path):
    tokens = [bytes([b]) for b in range(256)] + [b"<|endoftext|>"] * (50257 - 256)
    header = np.zeros(256, dtype="<u4")
    header[:3] = [20240328, 1, 50257]
    path = tmp_path / "v1.bin"
    path.write_bytes(header.tobytes() + b"".join(bytes([len(t)]) + t for t in tokens))
    table = load_tokenizer_bin(path)
    assert table.eot_token == 50256 and table.vocab_size == 50257


def set_uint(raw, index, value):
    raw[4 * index:4 * index + 4] = np.uint32(value).tobytes()
    return raw


@pytest.mark.parametrize("mutate, needle", [
    (lambda raw: set_uint(raw, 0, 20240326), "magic 20240326"),
    (lambda raw: set_uint(raw, 1, 3), "version 3"),
    (lambda raw: raw[:500], "header"),
    (lambda raw: raw[:-2], "truncated"),
    (lambda raw: raw + b"x", "unexpected bytes"),
    (lambda raw: set_uint(raw, 3, 300), "eot"),
])
def test_bad_tokenizer_bin(tiny, tmp_path, mutate, needle):
    path = tmp_path / "tok.bin"
    write_tokenizer_bin(path, tiny)
    path.write_bytes(bytes(mutate(bytearray(path.read_bytes()))))
    with pytest.raises(TokenizerError) as e:
        load_tokenizer_bin(path)
    one_line_error(e, path, needle)


def test_missing_tokenizer_bin(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer_bin(tmp_path / "none.bin")
    one_line_error(e, "none.bin")


def test_write_rejects_overlong_token(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"a" * 300] = 256   # not a reachable merge, but a valid entry for tiktoken
    enc = tiktoken.Encoding("toy", pat_str=tk.GPT2_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={tk.EOT_TEXT: 257})
    with pytest.raises(TokenizerError) as e:
        write_tokenizer_bin(tmp_path / "t.bin", enc)
    one_line_error(e, "token 256", "300 bytes")
    assert list(tmp_path.iterdir()) == []
