"""HellaSwag (gpt2np eval hellaswag, --hellaswag N): each ending scored by the loss of its tokens
only, acc from the summed and acc_norm from the mean loss, as llm.c does; the scores are PyTorch's
(reference.TorchGPT2) on the same model, on the numpy and the emulated CUDA backends,
batched with padding."""
import json
import re

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.cli import eval as evaluate
from gpt2np.config import GPT2Config
from gpt2np.datasets import hellaswag
from gpt2np.formats.checkpoint import save_model
from gpt2np.formats.tokenizer import get_encoding
from gpt2np.model import GPT2

torch = pytest.importorskip("torch")
CFG = GPT2Config(64, 50257, 50304, 1, 2, 16)
EXAMPLES = [
    {"ctx": "A man is sitting on a roof. He", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ctx": "The cat", "label": 0,
     "endings": ["sleeps.", "jumps over the lazy dog twice today.", "is", "runs away"]},
    {"ctx": "She opened the book and", "label": 1,
     "endings": ["closed it.", "began to read aloud to the children.", "sighed", "left."]},
    {"ctx": "Rain fell all night, so in the morning the streets", "label": 2,
     "endings": ["were dry.", "burned.", "were wet and shining.", "sang"]},
    {"ctx": "He", "label": 0,
     "endings": ["ran.", "walked slowly home", "x", "laughed at the joke for a long time"]},
]


@pytest.fixture(scope="module")
def params():
    return GPT2(CFG, get_backend("numpy"), 1, 1, seed=3).params_host()


@pytest.fixture(scope="module")
def expected(params):
    """Per-ending summed and mean losses by PyTorch, each row alone (no padding), float64."""
    from gpt2np.torch_gpt2 import TorchGPT2
    ref = TorchGPT2(CFG, params, "float64")
    enc = get_encoding()
    sums, avgs = np.zeros((len(EXAMPLES), 4)), np.zeros((len(EXAMPLES), 4))
    for i, ex in enumerate(EXAMPLES):
        ctx = enc.encode(ex["ctx"])
        for j, ending in enumerate(ex["endings"]):
            end = enc.encode(" " + ending)
            row = np.array([ctx + end])
            logits, _ = ref.forward(row[:, :-1])
            logp = torch.log_softmax(logits[0], -1)
            token_losses = -logp[torch.arange(row.shape[1] - 1),
                                 torch.from_numpy(row[0, 1:])].detach().numpy()
            ending_losses = token_losses[-len(end):]
            sums[i, j], avgs[i, j] = ending_losses.sum(), ending_losses.mean()
    labels = np.array([ex["label"] for ex in EXAMPLES])
    return sums, avgs, labels


@pytest.fixture()
def jsonl(tmp_path):
    path = tmp_path / "hs.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    return path


@pytest.mark.parametrize("backend, B", [("numpy", 4), ("numpy", 3), ("numpy", 20), ("emu", 8)])
def test_scores_are_pytorchs(backend, B, params, expected, jsonl):
    _, examples = hellaswag.load(jsonl)
    model = GPT2(CFG, get_backend(backend), B, hellaswag.longest_row(examples) - 1)
    model.load_params(params)
    result = hellaswag.score(model, examples)
    sums, avgs, labels = expected
    np.testing.assert_allclose(result.sum_loss, sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.avg_loss, avgs, rtol=1e-5, atol=1e-5)
    # llm.c: pred = sum_loss.argmin()
    assert result.correct == int((sums.argmin(1) == labels).sum())
    # pred_norm = avg_loss.argmin()
    assert result.correct_norm == int((avgs.argmin(1) == labels).sum())


def write_llmc_evalfile(path, examples):
    """llm.c's eval file layout (dev/data/data_common.py write_evalfile), written here
    from its description."""
    enc, stream, longest = get_encoding(), [], 0
    for idx, ex in enumerate(examples):
        ctx = enc.encode(ex["ctx"])
        ends = [enc.encode(" " + e) for e in ex["endings"]]
        body = [idx, ex["label"], len(ends), len(ctx), *ctx] + [t for e in ends
                                                                for t in [len(e), *e]]
        size = 2 * (len(body) + 2)
        stream += [65535, size, *body]
        longest = max(longest, size)
    header = np.zeros(256, "<i4")
    header[:4] = [20240522, 1, len(examples), longest]
    path.write_bytes(header.tobytes() + np.array(stream, "<u2").tobytes())


def test_llmcs_eval_file_scores_as_the_jsonl(params, expected, jsonl, tmp_path):
    """The starter pack's hellaswag_val.bin (llm.c's eval file: the same tokens, rendered) is read
    and scored as the jsonl it was made from; -m takes its first examples."""
    path = tmp_path / "hellaswag_val.bin"
    write_llmc_evalfile(path, EXAMPLES)
    (_, from_bin), (_, from_jsonl) = hellaswag.load(path), hellaswag.load(jsonl)
    assert from_bin == from_jsonl
    assert hellaswag.load(path, max_examples=2)[1] == from_jsonl[:2]
    model = GPT2(CFG, get_backend("numpy"), 4, hellaswag.longest_row(from_bin) - 1)
    model.load_params(params)
    sums, _, labels = expected
    assert hellaswag.score(model, from_bin).correct == int((sums.argmin(1) == labels).sum())
    raw = path.read_bytes()
    # the context token count gone wrong
    path.write_bytes(raw[:1024 + 10] + b"\x00\x00" + raw[1024 + 12:])
    with pytest.raises(hellaswag.BadExamples,
                       match="example 0: its token counts do not fit .* damaged"):
        hellaswag.load(path)
    # the last example cut short
    path.write_bytes(raw[:-6])
    with pytest.raises(hellaswag.BadExamples, match="example 4 of 5 is cut short: truncated"):
        hellaswag.load(path)
    # llm.c's loader takes 4 endings
    three = [dict(EXAMPLES[0], endings=EXAMPLES[0]["endings"][:3], label=1)]
    write_llmc_evalfile(path, three)
    with pytest.raises(hellaswag.BadExamples, match="example 0: 3 endings, label 1 .* damaged"):
        hellaswag.load(path)


def test_llmcs_eval_file_with_a_token_outside_gpt2s_vocabulary_names_the_file(params, tmp_path,
                                                                              capsys):
    """A token id >= 50257 in llm.c's eval file: one line naming the file and the example (it used
    to be the model's `inputs contain token id 60000`, naming no file), for eval hellaswag -j and
    train --hellaswag-data."""
    from gpt2np.config import TrainConfig
    from gpt2np.dist import SingleProcess
    from gpt2np.train.evaluate import load_hellaswag
    path = tmp_path / "ev.bin"
    write_llmc_evalfile(path, EXAMPLES)
    raw = bytearray(path.read_bytes())
    second = 1024 + int(np.frombuffer(raw[1026:1028], "<u2")[0])         # where example 1 starts
    raw[second + 12:second + 14] = np.array([60000], "<u2").tobytes()      # its first context token
    path.write_bytes(bytes(raw))
    with pytest.raises(hellaswag.BadExamples,
                       match=r"ev\.bin: example 1: token id 60000 outside .*50257"):
        hellaswag.load(path)
    # the examples before it are fine
    assert len(hellaswag.load(path, max_examples=1)[1]) == 1
    save_model(tmp_path / "m.bin", CFG, params)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin"), "-j", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: -j {path}: example "
                                                   "1: token id 60000"), lines
    with pytest.raises(ValueError, match=r"ev\.bin: example 1: token id 60000"):
        load_hellaswag(TrainConfig(hellaswag_every=1, hellaswag_data=str(path)), CFG,
                       SingleProcess())


def test_an_empty_context_scores_the_ending_from_its_second_token(params, tmp_path):
    """llm.c's hellaswag.py: with no context the ending's first token is no target; the
    rest are (PyTorch's)."""
    from gpt2np.torch_gpt2 import TorchGPT2
    example = {"ctx": "", "label": 0,
               "endings": ["The dog ran home.", "A cat", "Birds sing at dawn every day.", "x y"]}
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps(example) + "\n")
    _, examples = hellaswag.load(path)
    model = GPT2(CFG, get_backend("numpy"), 4, hellaswag.longest_row(examples) - 1)
    model.load_params(params)
    result = hellaswag.score(model, examples)
    ref, enc = TorchGPT2(CFG, params, "float64"), get_encoding()
    for j, ending in enumerate(example["endings"]):
        row = np.array([enc.encode(" " + ending)])
        logits, _ = ref.forward(row[:, :-1])
        logp = torch.log_softmax(logits[0], -1)
        losses = -logp[torch.arange(row.shape[1] - 1),
                       torch.from_numpy(row[0, 1:])].detach().numpy()
        assert result.sum_loss[0, j] == pytest.approx(losses.sum(), rel=1e-5)
        assert result.avg_loss[0, j] == pytest.approx(losses.mean(), rel=1e-5)


def test_rows_longer_than_T_keep_their_ending(params, jsonl):
    _, examples = hellaswag.load(jsonl)
    model = GPT2(CFG, get_backend("numpy"), 4, 6)
    model.load_params(params)
    result = hellaswag.score(model, examples)
    assert np.isfinite(result.avg_loss).all() and result.n == 5


def test_endings_longer_than_T_are_said_in_a_note(tmp_path, jsonl, params, capsys, monkeypatch):
    """A row keeps its last T + 1 tokens: an ending of more than T tokens loses its start, and
    eval hellaswag says how many endings that is."""
    monkeypatch.setenv("GPT2NP_PROGRESS", "off")
    _, examples = hellaswag.load(jsonl)
    lens = [n for ex in examples for n in ex.ending_lens]
    assert hellaswag.long_endings(examples, 6) == sum(n > 6 for n in lens) == 6
    assert hellaswag.long_endings(examples, max(lens)) == 0
    save_model(tmp_path / "m.bin", CFG, params)
    model = ["hellaswag", "-e", str(tmp_path / "m.bin"), "-j", str(jsonl), "--device", "cpu"]
    assert evaluate.main(model + ["-t", "6"]) == 0
    assert capsys.readouterr().err == ("note: 6 of 20 endings have more than T = 6 tokens: only "
                                       "their last 6 tokens are scored\n")
    assert evaluate.main(model) == 0
    assert capsys.readouterr().err == ""


def test_eval_hellaswag_command(tmp_path, jsonl, params, expected, capsys, monkeypatch):
    monkeypatch.setenv("GPT2NP_PROGRESS", "plain")
    save_model(tmp_path / "m.bin", CFG, params)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin"), "-j", str(jsonl), "-b", "8",
                          "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    sums, avgs, labels = expected
    correct, correct_norm = (int((sums.argmin(1) == labels).sum()),
                             int((avgs.argmin(1) == labels).sum()))
    assert (f"hellaswag acc {correct}/5 = {correct / 5:.4f} | acc_norm {correct_norm}/5 = "
            f"{correct_norm / 5:.4f}" in out)
    assert re.search(r"hellaswag: 5/5 example \(100%\)", err)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin"), "-j", str(jsonl), "-m",
                          "2"]) == 0
    assert "2 examples" in capsys.readouterr().out


@pytest.mark.parametrize("line, words", [
    ('{"ctx": "a", "endings": ["b", "c"], "label": 0}', ["hs.jsonl:1", "4 string endings"]),
    ('{"ctx": "a"}', ["hs.jsonl:1", "ctx, endings, label"]),
    ("not json", ["hs.jsonl:1"]),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 1.5}',
     ["hs.jsonl:1", "label 1.5", "integer 0..3"]),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": true}',
     ["hs.jsonl:1", "label true", "integer 0..3"]),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}',
     ["hs.jsonl:1", "label 4", "integer 0..3"]),
])
def test_bad_jsonl_is_one_line(tmp_path, params, line, words, capsys):
    save_model(tmp_path / "m.bin", CFG, params)
    (tmp_path / "hs.jsonl").write_text(line + "\n")
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin"), "-j",
                          str(tmp_path / "hs.jsonl")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words)


def test_a_label_written_as_a_string_still_reads(tmp_path):
    """"2" (as the Hub's copy of HellaSwag writes labels) is the index 2; 1.5 and true
    are refused above."""
    (tmp_path / "hs.jsonl").write_text(json.dumps(dict(EXAMPLES[0], label="2")) + "\n")
    assert hellaswag.read_examples(tmp_path / "hs.jsonl")[0]["label"] == 2


def test_train_hellaswag_every_n_steps_logs_eval_lines(tmp_path, jsonl, params, capsys):
    import train
    from gpt2np.datasets.data import write_shard
    save_model(tmp_path / "m.bin", CFG, params)
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "train.bin", rng.integers(0, 2000, 4000))
    out_dir = tmp_path / "run"
    assert train.main(["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "4",
                       "-t", "16", "-x", "4", "--hellaswag", "2", "--hellaswag-data", str(jsonl),
                       "-s", "0", "--device", "cpu", "-o", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"HellaSwag: \d/5 = ", out)) == 3
    evals = [line for line in (out_dir / "main.log").read_text().splitlines() if "eval:" in line]
    assert [line.split()[0] for line in evals] == ["s:0", "s:2", "s:4"]
    assert all(re.fullmatch(r"s:\d eval:\d\.\d{4}", line) for line in evals)


def test_train_h_1_evaluates_at_the_v_steps_as_llmc(tmp_path, jsonl, params, capsys):
    import train
    from gpt2np.datasets.data import write_shard
    save_model(tmp_path / "m.bin", CFG, params)
    write_shard(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 2000, 4000))
    out_dir = tmp_path / "run"
    assert train.main(["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "4",
                       "-t", "16", "-x", "5", "-v", "2", "-h", "1", "--hellaswag-data", str(jsonl),
                       "-s", "0", "--device", "cpu", "-o", str(out_dir)]) == 0
    evals = [line.split()[0] for line in (out_dir / "main.log").read_text().splitlines()
             if "eval:" in line]
    # every -v step after 0 and the last, as llm.c's -h 1
    assert evals == ["s:2", "s:4", "s:5"]


def test_h_1_without_the_data_is_a_note_and_no_evaluation_as_llmc(tmp_path, params, capsys):
    """llm.c's -h 1 skips HellaSwag when its file is missing; --hellaswag N (asked for by
    interval) still stops."""
    import train
    from gpt2np.datasets.data import write_shard
    save_model(tmp_path / "m.bin", CFG, params)
    write_shard(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 2000, 4000))
    base = ["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "4", "-t", "16",
            "-x", "2", "-v", "1", "--hellaswag-data", str(tmp_path / "missing.jsonl"), "-s", "0",
            "--device", "cpu"]
    assert train.main(base + ["-h", "1", "-o", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("note: -h 1: no HellaSwag data (" in out
            and "note: -h 1: skipping HellaSwag's evaluation" in out)
    assert "eval:" not in (tmp_path / "run" / "main.log").read_text()
    # a file the run needs: bad input
    assert train.main(base + ["--hellaswag", "1"]) == 2
    assert (f"error: --hellaswag-data {tmp_path / 'missing.jsonl'}: no such file"
            in capsys.readouterr().err)


def test_train_hellaswag_needs_gpt2s_vocabulary(tmp_path, jsonl, capsys):
    import train
    small = GPT2Config(32, 100, 128, 1, 2, 16)
    save_model(tmp_path / "s.bin", small,
               GPT2(small, get_backend("numpy"), 1, 1, seed=1).params_host())
    from gpt2np.datasets.data import write_shard
    write_shard(tmp_path / "train.bin", np.arange(1000) % 100)
    assert train.main(["-e", str(tmp_path / "s.bin"), "-i", str(tmp_path / "train.bin"), "-b", "2",
                       "-t", "8", "-x", "1", "--hellaswag", "1", "--hellaswag-data", str(jsonl),
                       "-s", "0", "--device", "cpu"]) == 2
    assert "--hellaswag: the model's vocab_size is 100" in capsys.readouterr().err


def test_eval_hellaswag_reads_the_cached_val_file(tmp_path, jsonl, params, capsys, monkeypatch):
    from gpt2np.datasets.cache import mark_done
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hellaswag_val.jsonl").write_bytes(jsonl.read_bytes())
    # counts as a complete download
    mark_done(tmp_path / "cache" / "hellaswag_val.jsonl")
    save_model(tmp_path / "m.bin", CFG, params)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin")]) == 0
    assert (f"data {tmp_path / 'cache' / 'hellaswag_val.jsonl'}: 5 examples"
            in capsys.readouterr().out)


def test_train_x0_evaluates_hellaswag_once(tmp_path, jsonl, params, capsys):
    import train
    from gpt2np.datasets.data import write_shard
    save_model(tmp_path / "m.bin", CFG, params)
    write_shard(tmp_path / "train.bin", np.arange(2000) % 1000)
    assert train.main(["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "8",
                       "-t", "32", "-x", "0", "--hellaswag", "5", "--hellaswag-data", str(jsonl),
                       "-s", "0", "--device", "cpu"]) == 0
    assert len(re.findall(r"HellaSwag: \d/5 = ", capsys.readouterr().out)) == 1


def test_h_1_under_mpiexec_skips_on_every_rank_when_one_lacks_the_data(tmp_path, jsonl, params):
    """HellaSwag's scoring is a collective: when one rank cannot load the data (a download that
    timed out, a node without the cache), -h 1 skips the evaluation on every rank, and the run goes
    on (it used to hang until the collective timeout)."""
    import subprocess
    import sys

    from test_dist import clean_env, find_mpiexec

    from gpt2np.datasets.data import write_shard
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'gpt2np[dist]')")
    exe = find_mpiexec()
    if exe is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    save_model(tmp_path / "m.bin", CFG, params)
    write_shard(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 2000, 4000))
    out_dir = tmp_path / "run"
    argv = ["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "2", "-t", "16",
            "-x", "4", "-v", "2", "-h", "1", "--hellaswag-data", str(jsonl), "-s", "0", "--device",
            "cpu", "--dist-timeout", "30", "-o", str(out_dir)]
    script = tmp_path / "run.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nimport gpt2np.datasets.hellaswag as hs\n"
                      "if MPI.COMM_WORLD.Get_rank() == 1:\n"
                      "    def load(*a, **k):\n"
                      "        raise OSError('could not download hellaswag_val.jsonl: timed out')\n"
                      "    hs.load = load\n"
                      f"import train\nsys.exit(train.main({argv!r}))\n")
    proc = subprocess.run([exe, "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("note: rank 1 of 2: -h 1: no HellaSwag data (could not download hellaswag_val.jsonl"
            in proc.stdout)
    assert "note: -h 1: skipping HellaSwag's evaluation" in proc.stdout
    assert "step    4/4" in proc.stdout and "eval:" not in (out_dir / "main.log").read_text()


@pytest.mark.parametrize("case, words", [
    ("folder", ["-j", "hs: is a folder", "HellaSwag jsonl"]),
    ("binary", ["-j", "hs:1: not UTF-8 text", "not a HellaSwag jsonl file"]),
    ("shard", ["-j", "hs:1", "not a HellaSwag jsonl file"]),
    ("llmc_eval_bin", ["-j", "hs: example 0: no start marker", "damaged"]),
    ("dir_is_a_file", ["--dir", "a.txt: is a file"]),
    ("dir_under_a_file", ["--dir", "a.txt is a file"]),
    ("dir_and_j", ["--dir", "not used with -j"]),
])
def test_bad_files_and_folders_are_one_line_naming_the_flag(tmp_path, params, jsonl, case, words,
                                                            capsys, monkeypatch):
    from gpt2np.datasets import fetch
    from gpt2np.datasets.data import write_shard
    monkeypatch.setattr(fetch, "download", lambda *a, **k: pytest.fail("downloaded"))
    save_model(tmp_path / "m.bin", CFG, params)
    (tmp_path / "a.txt").write_text("x")
    hs = tmp_path / "hs"
    flags = {"folder": ["-j", hs], "binary": ["-j", hs], "shard": ["-j", hs],
             "llmc_eval_bin": ["-j", hs], "dir_is_a_file": ["--dir", tmp_path / "a.txt"],
             "dir_under_a_file": ["--dir", tmp_path / "a.txt" / "c"],
             "dir_and_j": ["-j", jsonl, "--dir", tmp_path / "cache"]}[case]
    if case == "folder":
        hs.mkdir()
    elif case == "binary":
        hs.write_bytes(b"\xff\xfe\x00bad\n")
    elif case == "shard":
        write_shard(hs, np.arange(1000) % 50257)
    elif case == "llmc_eval_bin":
        # data_common.py's write_evalfile: a 256-int header, magic 20240522
        header = np.zeros(256, "<i4")
        header[:3] = [20240522, 1, 10]
        hs.write_bytes(header.tobytes() + b"\x00" * 64)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin")]
                         + [str(f) for f in flags]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "cache").exists()


def test_a_failed_download_leaves_no_cache_folder_it_made(tmp_path, params, capsys, monkeypatch):
    import urllib.request
    def offline(request, timeout=None):
        raise OSError("network is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    save_model(tmp_path / "m.bin", CFG, params)
    assert evaluate.main(["hellaswag", "-e", str(tmp_path / "m.bin"), "--dir",
                          str(tmp_path / "new" / "c")]) == 2
    err = capsys.readouterr().err             # one line, saying that -j takes a local copy instead
    assert err.count("\n") == 1 and "could not download" in err, err
    assert err.endswith("; a local copy can be given with -j FILE (hellaswag_val.jsonl, or llm.c's "
                        "hellaswag_val.bin)\n"), err
    assert not (tmp_path / "new").exists()


def test_hellaswag_data_error_names_the_flag_only_for_the_file_itself(tmp_path, jsonl, monkeypatch):
    """--hellaswag-data that is missing is `--hellaswag-data X: no such file`; a file that is there
    but cannot be rendered (no GPT-2 BPE files: also a FileNotFoundError) keeps its own message."""
    from gpt2np.config import TrainConfig
    from gpt2np.dist import SingleProcess
    from gpt2np.formats import tokenizer
    from gpt2np.train.evaluate import load_hellaswag
    missing = TrainConfig(hellaswag_every=1, hellaswag_data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"--hellaswag-data .*nope\.jsonl: no such file"):
        load_hellaswag(missing, CFG, SingleProcess())

    def no_bpe(*args, **kwargs):
        raise tokenizer.TokenizerNotFoundError("the GPT-2 BPE files (gpt2_vocab.bpe) are not here")

    monkeypatch.setattr(tokenizer, "get_encoding", no_bpe)
    there = TrainConfig(hellaswag_every=1, hellaswag_data=str(jsonl))
    with pytest.raises(FileNotFoundError, match="BPE files") as e:
        load_hellaswag(there, CFG, SingleProcess())
    assert "no such file" not in str(e.value)
