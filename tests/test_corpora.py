"""gpt2np prepare fineweb from local parquet and jsonl fixtures (and a stand-in `datasets` for the
Hub path): llm.c's shards (eot + tokens per document, cut at exactly --shard-size, val first),
tokenized by 2 processes, resumable (finished shards skipped, the rest identical to a run in one
go); offline: one line. gpt2np prepare tinystories from json files in TinyStories_all_data's layout
(and a stand-in download of its tarball): llm.c's two files, computed here as llm.c's
tinystories.py does."""
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from gpt2np.cli import prepare as prepare_cli
from gpt2np.datasets import corpora
from gpt2np.datasets.data import read_shard
from gpt2np.formats.tokenizer import get_encoding

DOCS = [f"Story {i}. "
        + "Once upon a time a small fox found a red ball in the garden. " * (i % 5 + 1)
        for i in range(60)]
SIZE = 400                     # tokens per shard
REPO = Path(__file__).resolve().parent.parent


def expected_stream(docs):
    enc = get_encoding()
    return np.concatenate([[enc.eot_token] + enc.encode_ordinary(d)
                           for d in docs]).astype(np.uint16)


def shards_of(folder, name="edu_fineweb"):
    return sorted(folder.glob(f"{name}_*_*.bin"), key=lambda p: p.name.rsplit("_", 1)[1])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    folder = tmp_path_factory.mktemp("src")
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), folder / "docs.parquet")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n"
                                               for i, d in enumerate(DOCS)))
    return folder


def run(argv, capsys):
    code = prepare_cli.main([str(a) for a in argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_shards_are_llmc_layout_val_first(sources, tmp_path, capsys, monkeypatch, kind):
    monkeypatch.setenv("GPT2NP_PROGRESS", "plain")
    code, out = run(["fineweb", "--source", sources / f"docs.{kind}", "--shard-size", SIZE,
                     "--workers", 2, "--output-dir", tmp_path], capsys)
    assert code == 0, out.err
    files = shards_of(tmp_path)
    assert files[0].name == "edu_fineweb_val_000000.bin"
    assert [f.name for f in files[1:3]] == ["edu_fineweb_train_000001.bin",
                                            "edu_fineweb_train_000002.bin"]
    tokens = [read_shard(f) for f in files]
    assert all(len(t) == SIZE for t in tokens[:-1]) and 0 < len(tokens[-1]) <= SIZE
    np.testing.assert_array_equal(np.concatenate(tokens), expected_stream(DOCS))
    assert (tmp_path / "gpt2_tokenizer.bin").is_file()
    # the progress has a total: --source's documents (parquet rows from its metadata, jsonl lines)
    assert f"fineweb documents: {len(DOCS)}/{len(DOCS)} doc (100%)" in out.err, out.err


def test_resume_skips_finished_shards_and_matches_one_go(sources, tmp_path, capsys):
    src = sources / "docs.parquet"
    common = ["fineweb", "--source", src, "--shard-size", SIZE, "--workers", 2]
    assert run(common + ["--output-dir", tmp_path / "once"], capsys)[0] == 0
    assert run(common + ["--output-dir", tmp_path / "parts", "--shards", 2], capsys)[0] == 0
    assert len(shards_of(tmp_path / "parts")) == 2
    code, out = run(common + ["--output-dir", tmp_path / "parts"], capsys)
    assert code == 0
    assert out.out.count("done already") == 2 and "wrote" in out.out
    once, parts = shards_of(tmp_path / "once"), shards_of(tmp_path / "parts")
    assert [p.name for p in once] == [p.name for p in parts]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(once, parts))
    code, out = run(common + ["--output-dir", tmp_path / "parts"], capsys)
    assert out.out.count("done already") == len(once) and "wrote" not in out.out
    code, out = run(["fineweb", "--source", src, "--shard-size", 300, "--output-dir",
                     tmp_path / "parts"], capsys)
    assert code == 2 and "other settings" in out.err and len(out.err.strip().splitlines()) == 1


def fake_datasets(splits, calls):
    def load_dataset(hub_id, name=None, split=None, streaming=False, cache_dir=None):
        calls.append((hub_id, name, split, streaming))
        return iter([{"text": t} for t in splits[split]])
    return types.SimpleNamespace(load_dataset=load_dataset)


def write_story_files(folder, stories_per_file=(7, 5, 6)):
    """TinyStories_all_data's layout: dataNN.json files, each a json list of
    objects with a "story"."""
    folder.mkdir(parents=True, exist_ok=True)
    files, k = [], 0
    for i, n in enumerate(stories_per_file):
        stories = [{"story": f"  {DOCS[k + j]}\n ", "instruction": {"words": ["fox"]}}
                   for j in range(n)]
        k += n
        path = folder / f"data{i:02d}.json"
        path.write_text(json.dumps(stories))
        files.append((path, stories))
    return files


def llmc_tinystories(files):
    """What llm.c's tinystories.py writes for these files: val = the first, train = the rest in
    order; each file's stories shuffled by random.Random(1337 + its index in the split),
    stripped, EOT + tokens."""
    import random
    enc = get_encoding()

    def split_tokens(split_files):
        out = []
        for index, (_, stories) in enumerate(split_files):
            stories = list(stories)
            random.Random(1337 + index).shuffle(stories)
            for story in stories:
                out += [enc.eot_token] + enc.encode_ordinary(story["story"].strip())
        return np.array(out, np.uint16)

    return split_tokens(files[:1]), split_tokens(files[1:])


def test_tinystories_is_llmcs(tmp_path, capsys):
    files = write_story_files(tmp_path / "all")
    code, out = run(["tinystories", "--source", tmp_path / "all" / "*.json", "--workers", 2,
                     "--output-dir", tmp_path / "ts"], capsys)
    assert code == 0, out.err
    val, train = llmc_tinystories(files)
    np.testing.assert_array_equal(read_shard(tmp_path / "ts" / "TinyStories_val.bin"), val)
    np.testing.assert_array_equal(read_shard(tmp_path / "ts" / "TinyStories_train.bin"), train)
    assert sorted(p.name for p in (tmp_path / "ts").iterdir()) == ["TinyStories_train.bin",
                                                                   "TinyStories_val.bin",
                                                                   "gpt2_tokenizer.bin"]


def test_tinystories_downloads_and_unpacks_llmcs_tarball_once(tmp_path, capsys, monkeypatch):
    import tarfile

    from gpt2np.datasets import fetch, tinystories
    files = write_story_files(tmp_path / "made")
    tarball = tmp_path / "TinyStories_all_data.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for path, _ in files:
            tar.add(path, arcname=path.name)
    urls = []

    def fake_download(url, dest, timeout=10, **_):
        urls.append(url)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(tarball.read_bytes())
        return dest

    monkeypatch.setattr(fetch, "download", fake_download)
    cache = tmp_path / "cache"
    for _ in range(2):
        code, out = run(["tinystories", "--dir", cache, "--workers", 1, "--output-dir",
                         tmp_path / "ts"], capsys)
        assert code == 0, out.err
    # unpacked once, read from the cache the second time
    assert urls == [tinystories.TARBALL_URL]
    val, train = llmc_tinystories(files)
    np.testing.assert_array_equal(read_shard(tmp_path / "ts" / "TinyStories_val.bin"), val)
    np.testing.assert_array_equal(read_shard(tmp_path / "ts" / "TinyStories_train.bin"), train)


@pytest.mark.parametrize("content, words", [
    ('{"story": "one"}', ["data00.json", "not TinyStories' list of stories"]),
    ('[{"story": "one"}, {"text": "two"}]', ["data00.json", "item 1 has no \"story\""]),
    ("[{", ["data00.json", "not a TinyStories json file"]),
    ("alone", ["1 json file(s)", "needs 2 or more"]),
])
def test_a_bad_tinystories_source_is_one_line(tmp_path, capsys, content, words):
    folder = tmp_path / "all"
    folder.mkdir()
    (folder / "data00.json").write_text('[{"story": "fine"}]' if content == "alone" else content)
    if content != "alone":
        (folder / "data01.json").write_text('[{"story": "fine"}]')
    code, res = run(["tinystories", "--source", folder / "*.json", "--workers", 1,
                     "--output-dir", tmp_path / "o"],
                    capsys)
    assert (code == 2 and len(res.err.strip().splitlines()) == 1
            and all(w in res.err for w in words)), res.err


def test_tinystories_offline_is_one_line_naming_source(tmp_path, capsys, monkeypatch):
    from gpt2np.datasets import fetch

    def offline(url, dest, timeout=10, **_):
        raise fetch.FetchError(f"could not download {url}: [Errno -2] Name or service not "
                               "known (offline?)")

    monkeypatch.setattr(fetch, "download", offline)
    code, res = (run(["tinystories", "--dir", tmp_path / "cache", "--output-dir", tmp_path / "out"],
                     capsys))
    assert code == 2 and len(res.err.strip().splitlines()) == 1, res.err
    assert "TinyStories_all_data.tar.gz" in res.err and "--source 'DIR/*.json'" in res.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("empty", ["val", "train"])
def test_tinystories_without_stories_is_refused(tmp_path, capsys, empty):
    """A split whose files hold no story is refused in one line, as an empty text or --source is:
    no 0-token shard is written."""
    folder = tmp_path / "all"
    folder.mkdir()
    (folder / "data00.json").write_text("[]" if empty == "val" else '[{"story": "one"}]')
    (folder / "data01.json").write_text("[]")
    (folder / "data02.json").write_text("[]" if empty == "train" else '[{"story": "two"}]')
    code, res = run(["tinystories", "--source", folder / "*.json", "--workers", 1,
                     "--output-dir", tmp_path / "o"], capsys)
    files = "data00.json" if empty == "val" else "data01.json, data02.json"
    assert code == 2 and res.err.count("\n") == 1, res.err
    assert f"the {empty} split's file(s) ({files}) hold no stories: nothing to tokenize" in res.err
    assert not (tmp_path / "o").exists()


def test_a_parquet_row_or_column_without_text_is_named(tmp_path, capsys):
    """A null `text` (a row) or a column of another type: one line naming the file and the row,
    not tiktoken's TypeError."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = DOCS * 30                             # 1,800 rows: the null is in the second batch read
    texts[1500] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"text": list(range(5))}), tmp_path / "ints.parquet")
    for name, words in (
            ("nulls.parquet", "nulls.parquet: row 1500 (counting from 0): its `text` is null"),
            ("ints.parquet", "ints.parquet: its `text` column holds int64, not strings")):
        code, res = run(["fineweb", "--source", tmp_path / name, "--workers", 1,
                         "--output-dir", tmp_path / "o"], capsys)
        assert code == 2 and res.err.count("\n") == 1 and words in res.err, res.err
        assert "TypeError" not in res.err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["--shards", "--shard-size"])
def test_tinystories_takes_no_shard_flags(tmp_path, capsys, flag):
    code, res = run(["tinystories", flag, 2, "--output-dir", tmp_path], capsys)
    assert (code == 2 and f"{flag} 2: only for fineweb" in res.err
            and "TinyStories_train.bin" in res.err)


@pytest.mark.parametrize("flags, kind, hub_id, config, name", [
    ([], "edu", "HuggingFaceFW/fineweb-edu", "sample-10BT", "edu_fineweb"),
    (["-t", "edu", "-v", "100B"], "edu", "HuggingFaceFW/fineweb-edu",
     "sample-100BT", "edu_fineweb"),
    (["-t", "classic"], "classic", "HuggingFaceFW/fineweb", "sample-10BT", "fineweb"),
    (["--type", "classic", "--version", "100B"], "classic", "HuggingFaceFW/fineweb",
     "sample-100BT", "fineweb"),
])
def test_fineweb_hub_id_and_config(tmp_path, capsys, monkeypatch, flags, kind, hub_id,
                                   config, name):
    """llm.c's fineweb.py -t edu|classic and -v 10B|100B: the Hub dataset, its sample and
    the shards' names."""
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({"train": DOCS}, calls))
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: True)
    code, out = run(["fineweb", *flags, "--shards", 1, "--shard-size", SIZE, "--output-dir",
                     tmp_path], capsys)
    assert code == 0, out.err
    assert calls == [(hub_id, config, "train", True)]
    assert [f.name for f in tmp_path.glob("*_val_*.bin")] == [f"{name}_val_000000.bin"]
    assert f"fineweb ({kind} {config}): 1 shard(s)" in out.out


def test_another_sample_into_the_same_folder_is_refused(tmp_path, capsys, monkeypatch):
    """Both samples name their shards alike (llm.c keeps them in separate folders): a 100B run into
    a 10B run's folder is one line."""
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({"train": DOCS}, []))
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: True)
    common = ["fineweb", "--shards", 1, "--shard-size", SIZE, "--output-dir", tmp_path]
    assert run(common, capsys)[0] == 0
    code, out = run(common + ["-v", "100B"], capsys)
    assert code == 2 and "other settings" in out.err and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, words", [
    (["tinystories", "-t", "classic"], ["-t classic: only for fineweb", "not tinystories"]),
    (["-v", "100B"], ["-v 100B: only for fineweb", "not tinyshakespeare"]),
    (["fineweb", "--source", "docs.jsonl", "-v", "100B"], ["-v 100B", "not used with --source"]),
])
def test_fineweb_type_and_version_elsewhere_are_one_line(tmp_path, capsys, argv, words):
    code, out = run(argv + ["--output-dir", tmp_path / "out"], capsys)
    assert (code == 2 and all(w in out.err for w in words)
            and len(out.err.strip().splitlines()) == 1), out.err


def test_offline_is_one_line(tmp_path, capsys, monkeypatch):
    # installed (the data extra)
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: False)
    code, out = run(["fineweb", "--shards", 1, "--output-dir", tmp_path], capsys)
    assert code == 2 and out.err.startswith("error: cannot reach the Hugging Face Hub")
    assert "--source" in out.err and len(out.err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "datasets", None)          # not installed
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: True)
    code, out = run(["fineweb", "--output-dir", tmp_path], capsys)
    assert (code == 2 and "pip install 'gpt2np[data]'" in out.err
            and len(out.err.strip().splitlines()) == 1)


@pytest.mark.parametrize("argv, words", [
    (["fineweb", "--shards", "0"], ["--shards 0"]),
    (["fineweb", "--shard-size", "0"], ["--shard-size 0"]),
    (["fineweb", "--workers", "0"], ["--workers 0"]),
    (["fineweb", "--source", "nothing*.parquet"], ["nothing*.parquet", "no such file"]),
])
def test_bad_flags_are_one_line(tmp_path, capsys, argv, words):
    code, out = run(argv + ["--output-dir", tmp_path], capsys)
    assert code == 2 and all(w in out.err for w in words) and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("content, words", [
    (None, ["--source", "nomatch*.jsonl", "no such file"]),
    ("", ["--source", "no documents"]),
    ('{"text": "fine"}\n{"title": "no text"}\n', ["src.jsonl:2", "`text` field"]),
    ('{"text": 7}\n', ["src.jsonl:1", "not a string"]),
    (b"\xff\xfe binary", ["src.jsonl:1", "not UTF-8"]),
    ("folder", ["--source", "is a folder"]),
])
def test_a_bad_source_is_one_line_and_leaves_no_folder_behind(tmp_path, capsys, content, words):
    source = tmp_path / "src.jsonl"
    if content == "folder":
        source.mkdir()
    elif isinstance(content, bytes):
        source.write_bytes(content)
    elif content is not None:
        source.write_text(content)
    pattern = source if content is not None else tmp_path / "nomatch*.jsonl"
    out = tmp_path / "new" / "out"
    code, res = run(["fineweb", "--source", pattern, "--shard-size", 1000, "--workers", 1,
                     "--output-dir", out],
                    capsys)
    assert (code == 2 and len(res.err.strip().splitlines()) == 1
            and all(w in res.err for w in words)), res.err
    assert "tokens:" not in res.err and not (tmp_path / "new").exists()


def test_a_file_as_dir_is_said_before_the_hub_is_asked(tmp_path, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: asked.append(1) or False)
    (tmp_path / "a.txt").write_text("x")
    code, out = (run(["fineweb", "--dir", tmp_path / "a.txt", "--output-dir", tmp_path / "out"],
                     capsys))
    assert (code == 2 and not asked and out.err.startswith("error: --dir ")
            and "a.txt: is a file" in out.err), out.err
    assert len(out.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_source_that_is_not_parquet_is_named(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    code, out = run(["fineweb", "--source", tmp_path / "fake.parquet", "--workers", 1,
                     "--output-dir", tmp_path / "out"], capsys)
    assert code == 2 and "fake.parquet: not a readable parquet file" in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# ---- Ctrl-C to the process group -------------------------------------------------------------
def children(pid) -> list:
    """The process ids of pid's children (Linux's /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


def interrupt_mid_run(argv, delay, cwd):
    """`python -m gpt2np ARGV` in its own process group, sent SIGINT as a terminal's Ctrl-C is (to
    the whole group) `delay` seconds after its 2 tokenizing processes started: (exit code, seconds
    from the signal to the exit of every process of the group, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPT2NP_PROGRESS": "off"}
    env.pop("GPT2NP_DEBUG", None)
    child = subprocess.Popen([sys.executable, "-m", "gpt2np", *map(str, argv)], cwd=cwd, env=env,
                             text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    while len(children(child.pid)) < 2 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.poll() is None, f"ended before its workers were seen: {child.stderr.read()}"
    time.sleep(delay)
    sent = time.monotonic()
    os.killpg(child.pid, signal.SIGINT)
    try:
        err = child.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(map(str, argv))}: still running 30 s after SIGINT")
    while time.monotonic() - sent < 60:          # and no tokenizing process is left behind
        try:
            os.killpg(child.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return child.returncode, time.monotonic() - sent, err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers in /proc")
@pytest.mark.parametrize("dataset", ["fineweb", "tinystories"])
def test_ctrl_c_to_the_group_ends_every_process_at_once_in_one_line(dataset, tmp_path, capsys,
                                                                     monkeypatch):
    """Ctrl-C reaches the parent and its tokenizing processes alike: the workers ignore it (one
    that died of it could hold the pool's queue lock, and the parent would wait for it forever,
    after printing the workers' tracebacks); the parent terminates them and exits 130 with one
    line. A fineweb rerun resumes."""
    if dataset == "fineweb":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        docs = [f"Story {i}. " + "Once upon a time a small fox found a red ball. " * (i % 5 + 1)
                for i in range(60000)]
        pq.write_table(pa.table({"text": docs}), tmp_path / "big.parquet")
        argv = ["prepare", "fineweb", "--workers", 2, "--source", "big.parquet",
                "--shard-size", 20000]
    else:
        (tmp_path / "all").mkdir()
        for i in range(3):
            stories = [{"story": f"Story {i}-{k}. " + "A fox found a red ball. " * (k % 5 + 1)}
                       for k in range(20000)]
            (tmp_path / "all" / f"data{i:02d}.json").write_text(json.dumps(stories))
        argv = ["prepare", "tinystories", "--workers", 2, "--source", "all/*.json"]
    for delay in (0.0, 0.1, 0.3):
        code, seconds, err = interrupt_mid_run(argv + ["--output-dir", "out"], delay, tmp_path)
        assert (code, err) == (130, "error: interrupted\n"), (delay, code, err)
        assert seconds < 5, f"{seconds:.1f} s from SIGINT to the end of the group"
        assert not list(tmp_path.glob("out/.*.tmp"))            # no half-written shard left behind
    if dataset == "fineweb":
        state = json.loads((tmp_path / "out" / "edu_fineweb_progress.json").read_text())
        done = state["streams"]["all"]["shards"]
        monkeypatch.chdir(tmp_path)
        code, out = run(argv[1:] + ["--output-dir", "out", "--shards", done + 1], capsys)
        assert code == 0 and out.out.count("done already") == done, out
        assert out.out.count("wrote") == 1, out
