"""gpt2np prepare fineweb / tinystories from local parquet and jsonl fixtures (and a stand-in `datasets` for the Hub
path): llm.c's shards (eot + tokens per document, cut at exactly --shard-size, val first), tokenized by 2 processes,
resumable (finished shards skipped, the rest identical to a run in one go); offline: one line."""
import json
import sys
import types

import numpy as np
import pytest

from gpt2np import corpora, prepare
from gpt2np.data import read_shard
from gpt2np.tokenizer import get_encoding

DOCS = [f"Story {i}. " + "Once upon a time a small fox found a red ball in the garden. " * (i % 5 + 1)
        for i in range(60)]
SIZE = 400                     # tokens per shard


def expected_stream(docs):
    enc = get_encoding()
    return np.concatenate([[enc.eot_token] + enc.encode_ordinary(d) for d in docs]).astype(np.uint16)


def shards_of(folder, name="edu_fineweb"):
    return sorted(folder.glob(f"{name}_*_*.bin"), key=lambda p: p.name.rsplit("_", 1)[1])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    folder = tmp_path_factory.mktemp("src")
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), folder / "docs.parquet")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)))
    return folder


def run(argv, capsys):
    code = prepare.main([str(a) for a in argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_shards_are_llmc_layout_val_first(sources, tmp_path, capsys, kind):
    code, out = run(["fineweb", "--source", sources / f"docs.{kind}", "--shard-size", SIZE, "--workers", 2,
                     "--output-dir", tmp_path], capsys)
    assert code == 0, out.err
    files = shards_of(tmp_path)
    assert files[0].name == "edu_fineweb_val_000000.bin"
    assert [f.name for f in files[1:3]] == ["edu_fineweb_train_000001.bin", "edu_fineweb_train_000002.bin"]
    tokens = [read_shard(f) for f in files]
    assert all(len(t) == SIZE for t in tokens[:-1]) and 0 < len(tokens[-1]) <= SIZE
    np.testing.assert_array_equal(np.concatenate(tokens), expected_stream(DOCS))
    assert (tmp_path / "gpt2_tokenizer.bin").is_file()


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
    code, out = run(["fineweb", "--source", src, "--shard-size", 300, "--output-dir", tmp_path / "parts"], capsys)
    assert code == 2 and "other settings" in out.err and len(out.err.strip().splitlines()) == 1


def fake_datasets(splits, calls):
    def load_dataset(hub_id, name=None, split=None, streaming=False, cache_dir=None):
        calls.append((hub_id, name, split, streaming))
        return iter([{"text": t} for t in splits[split]])
    return types.SimpleNamespace(load_dataset=load_dataset)


def test_tinystories_from_the_hub_val_split_first(tmp_path, capsys, monkeypatch):
    calls = []
    splits = {"validation": DOCS[:5], "train": DOCS[5:]}
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(splits, calls))
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: True)
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path / "cache"))
    code, out = run(["tinystories", "--shard-size", SIZE, "--workers", 2, "--output-dir", tmp_path / "ts",
                     "--shards", 3], capsys)
    assert code == 0, out.err
    files = shards_of(tmp_path / "ts", "TinyStories")
    assert [f.name for f in files] == ["TinyStories_val_000000.bin", "TinyStories_train_000001.bin",
                                       "TinyStories_train_000002.bin"]
    np.testing.assert_array_equal(read_shard(files[0]), expected_stream(DOCS[:5]))
    np.testing.assert_array_equal(np.concatenate([read_shard(f) for f in files[1:]]),
                                  expected_stream(DOCS[5:])[:2 * SIZE])
    assert calls[0] == ("roneneldan/TinyStories", None, "validation", True)


def test_fineweb_hub_id_and_config(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({"train": DOCS}, calls))
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: True)
    assert run(["fineweb", "--shards", 1, "--shard-size", SIZE, "--output-dir", tmp_path], capsys)[0] == 0
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    assert [f.name for f in shards_of(tmp_path)] == ["edu_fineweb_val_000000.bin"]


def test_offline_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: False)
    code, out = run(["fineweb", "--shards", 1, "--output-dir", tmp_path], capsys)
    assert code == 2 and out.err.startswith("error: cannot reach the Hugging Face Hub")
    assert "--source" in out.err and len(out.err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "datasets", None)          # not installed
    code, out = run(["tinystories", "--output-dir", tmp_path], capsys)
    assert code == 2 and "pip install 'gpt2np[data]'" in out.err and len(out.err.strip().splitlines()) == 1


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
    code, res = run(["tinystories", "--source", pattern, "--shard-size", 1000, "--workers", 1, "--output-dir", out],
                    capsys)
    assert code == 2 and len(res.err.strip().splitlines()) == 1 and all(w in res.err for w in words), res.err
    assert "tokens:" not in res.err and not (tmp_path / "new").exists()


def test_a_file_as_dir_is_said_before_the_hub_is_asked(tmp_path, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=5.0: asked.append(1) or False)
    (tmp_path / "a.txt").write_text("x")
    code, out = run(["fineweb", "--dir", tmp_path / "a.txt", "--output-dir", tmp_path / "out"], capsys)
    assert code == 2 and not asked and out.err.startswith("error: --dir ") and "a.txt: is a file" in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_source_that_is_not_parquet_is_named(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    code, out = run(["fineweb", "--source", tmp_path / "fake.parquet", "--workers", 1, "--output-dir",
                     tmp_path / "out"], capsys)
    assert code == 2 and "fake.parquet: not a readable parquet file" in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
