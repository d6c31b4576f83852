"""No behaviour change across refactors: a 10-step training run of a small model through train.py gives the
same printed loss curve, the same main.log and bitwise the same final parameters and AdamW moments as the code
produced when these numbers were recorded (before the backends/ + profiling/ restructure, commit 646b0b1).

The run touches every part of a step: gradient accumulation (-d), warmup then cosine decay, weight decay,
global-norm clipping (it triggers), validation, and a checkpoint at the end. The model file and the shards are
made here from a fixed NumPy seed, so gpt2np's own init is not part of what is pinned.
"""
import hashlib
import re
from pathlib import Path

import numpy as np

import train
from gpt2np.checkpoint import load_state, model_path, save_model, state_path
from gpt2np.config import GPT2Config
from gpt2np.data import write_shard
from gpt2np.tensors import param_shapes, views

SMALL = GPT2Config(max_seq_len=32, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=4, channels=32)

# Recorded with the code at commit 646b0b1 (numpy backend, 2-core CI machine, OpenBLAS 0.3.31 Haswell kernels).
# The z-scores (+nanz: no full outlier window in 10 steps) joined llm.c's line later; the numbers did not move.
EXPECTED_STEP_LINES = [
    'step    1/10 | loss 5.342460 (+nanz)| norm 1.6188 (+nanz)| lr 1.50e-03',
    'step    2/10 | loss 5.381507 (+nanz)| norm 1.5092 (+nanz)| lr 3.00e-03',
    'step    3/10 | loss 5.285591 (+nanz)| norm 1.5238 (+nanz)| lr 3.00e-03',
    'step    4/10 | loss 5.333940 (+nanz)| norm 1.3350 (+nanz)| lr 2.90e-03',
    'step    5/10 | loss 5.342482 (+nanz)| norm 1.3483 (+nanz)| lr 2.60e-03',
    'step    6/10 | loss 5.308047 (+nanz)| norm 1.1251 (+nanz)| lr 2.17e-03',
    'step    7/10 | loss 5.339850 (+nanz)| norm 1.0671 (+nanz)| lr 1.65e-03',
    'step    8/10 | loss 5.351943 (+nanz)| norm 1.0494 (+nanz)| lr 1.13e-03',
    'step    9/10 | loss 5.294708 (+nanz)| norm 1.0804 (+nanz)| lr 6.95e-04',
    'step   10/10 | loss 5.299899 (+nanz)| norm 1.1648 (+nanz)| lr 4.03e-04',
]
EXPECTED_LOG = (
    's:0 tel:5.3635\n'
    's:0 trl:5.3425 lr:0.001500 norm:1.62\n'
    's:1 trl:5.3815 lr:0.003000 norm:1.51\n'
    's:2 trl:5.2856 lr:0.003000 norm:1.52\n'
    's:3 trl:5.3339 lr:0.002897 norm:1.34\n'
    's:4 trl:5.3425 lr:0.002605 norm:1.35\n'
    's:5 tel:5.4003\n'
    's:5 trl:5.3080 lr:0.002167 norm:1.13\n'
    's:6 trl:5.3398 lr:0.001650 norm:1.07\n'
    's:7 trl:5.3519 lr:0.001133 norm:1.05\n'
    's:8 trl:5.2947 lr:0.000695 norm:1.08\n'
    's:9 trl:5.2999 lr:0.000403 norm:1.16\n'
    's:10 tel:5.4207\n'
)
EXPECTED_MODEL_SHA256 = '0df52b996053ff5d8c75cd000835046dc152f0fe148afa335f8a0799d55a3056'
EXPECTED_M_SHA256 = '876f66607b1bda2d84a10b14f7866e8544252d431eb5957e7073d2ab65788ace'
EXPECTED_V_SHA256 = 'd0358560184a193d4b3fd22f7a862728816d7214d1ec5484921fd95e286c821a'


def make_inputs(folder):
    rng = np.random.default_rng(2024)
    params = np.zeros(sum(int(np.prod(s)) for s in param_shapes(SMALL).values()), np.float32)
    for name, view in views(params, param_shapes(SMALL)).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            view[...] = 1.0
        elif not name.endswith("b"):
            view[...] = rng.standard_normal(view.shape).astype(np.float32) * np.float32(0.05)
    views(params, param_shapes(SMALL))["wte"][SMALL.vocab_size:] = 0.0
    save_model(folder / "small.bin", SMALL, params)
    stream = rng.integers(0, SMALL.vocab_size, 6000).astype(np.uint16)
    write_shard(folder / "val.bin", stream[:1000])
    write_shard(folder / "train.bin", stream[1000:])


def sha256(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def run_golden(tmp_path, capsys, cpu_math="exact"):
    make_inputs(tmp_path)
    out_dir = tmp_path / "out"
    argv = ["-e", tmp_path / "small.bin", "-i", tmp_path / "train.bin", "-j", tmp_path / "val.bin",
            "-b", 2, "-t", 16, "-d", 64, "-x", 10, "-l", 3e-3, "-u", 2, "-q", 0.1, "-k", "cosine", "-c", 0.1,
            "--grad-clip", 0.5, "-v", 5, "-m", 2, "-s", 0, "-n", 10, "-o", out_dir, "--device", "cpu",
            "--shuffle", 0,          # the recorded run read its shard in file order (llm.c's shuffle: test_data)
            "--seed", 7, "--cpu-math", cpu_math]
    code = train.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    step_lines = [re.sub(r" \| [0-9.]+ ms \|.*$", "", line) for line in out.out.splitlines()
                  if line.startswith("step ")]
    log = (out_dir / "main.log").read_text()
    model_bytes = Path(model_path(out_dir, 10)).read_bytes()
    _, m, v = load_state(state_path(out_dir, 10))
    return step_lines, log, hashlib.sha256(model_bytes).hexdigest(), sha256(m), sha256(v)


def test_ten_step_run_is_unchanged(tmp_path, capsys):
    step_lines, log, model_sha, m_sha, v_sha = run_golden(tmp_path, capsys)
    assert len(step_lines) == 10
    assert step_lines == EXPECTED_STEP_LINES
    assert log == EXPECTED_LOG
    assert model_sha == EXPECTED_MODEL_SHA256, "final parameters differ from the recorded run"
    assert m_sha == EXPECTED_M_SHA256 and v_sha == EXPECTED_V_SHA256, "AdamW moments differ from the recorded run"


NUMBER = re.compile(r"(trl|tel|loss|norm)[: ]([0-9.]+)")


def test_ten_step_run_with_fast_cpu_math_tracks_the_recorded_run(tmp_path, capsys):
    """--cpu-math fast (the default; not bitwise) follows the recorded exact run: every train and val loss within
    2e-6 relative, every grad norm within the printed 4 decimals' rounding plus 2e-6 relative."""
    step_lines, log, model_sha, *_ = run_golden(tmp_path, capsys, cpu_math="fast")
    assert model_sha != EXPECTED_MODEL_SHA256                  # the fast path did run: not bitwise the exact one
    # the slack of the printed rounding: the step lines' norms have 4 decimals; main.log has llm.c's 4 (losses) and 2
    # (norms)
    for got_text, want_text, slacks in ((step_lines, EXPECTED_STEP_LINES, {"norm": 1e-4}),
                                        (log.splitlines(), EXPECTED_LOG.splitlines(), {"norm": 1e-2, "trl": 1e-4,
                                                                                      "tel": 1e-4})):
        assert len(got_text) == len(want_text)
        for got_line, want_line in zip(got_text, want_text):
            got, want = NUMBER.findall(got_line), NUMBER.findall(want_line)
            assert [k for k, _ in got] == [k for k, _ in want], (got_line, want_line)
            for (key, g), (_, w) in zip(got, want):
                assert abs(float(g) - float(w)) <= 2e-6 * abs(float(w)) + slacks.get(key, 0.0), (got_line, want_line)
