"""llm.c debug state files (gpt2np/formats/debug_state.py) and the compare CLI
(gpt2np/cli/compare.py).

The CLI tests run twice over: against a stand-in model (the float64 PyTorch reference behind
gpt2np's model API; tests the tool itself) and, once gpt2np.model exists, against the real
numpy backend, including a d12 check.
"""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.cli import compare
from gpt2np.config import GPT2Config, preset
from gpt2np.formats.debug_state import (
    DebugState,
    DebugStateError,
    expected_size,
    read_debug_state,
    write_debug_state,
)
from gpt2np.tensors import DECAYED_BY_DEFAULT, PARAM_NAMES, num_parameters, param_shapes, views

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                   channels=16)


def have(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


HAVE_TORCH = have("torch")
HAVE_MODEL = all(have(m) for m in ("gpt2np.model", "gpt2np.backends", "gpt2np.formats.checkpoint"))
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="the PyTorch reference needs torch")
needs_model = pytest.mark.skipif(
    not (HAVE_MODEL and HAVE_TORCH),
    reason="needs torch and gpt2np.model / gpt2np.backends / gpt2np.formats.checkpoint "
           "(not written yet)")


# ----------------------------------------------------------------------------------------------
# helpers: llm.c model files, random parameters, random debug states

def init_params(cfg, seed=0):
    """llm.c-like random init (N(0, 0.02), residual projections scaled by 1/sqrt(2L)), with
    random biases and LayerNorm parameters too so that no two tensors look alike; float32."""
    rng = np.random.default_rng(seed)
    flat = rng.standard_normal(num_parameters(cfg), dtype=np.float32)
    flat *= np.float32(0.02)
    p = views(flat, param_shapes(cfg))
    p["attprojw"] /= np.sqrt(2 * cfg.num_layers)
    p["fcprojw"] /= np.sqrt(2 * cfg.num_layers)
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name] *= 5
        p[name] += 1
    p["wte"][cfg.vocab_size:] = 0
    return flat


def write_model_file(path, cfg, flat):
    """An llm.c model file, version 3 (fp32, padded vocab)."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = (20240326, 3, cfg.max_seq_len, cfg.vocab_size, cfg.num_layers, cfg.num_heads,
                  cfg.channels, cfg.padded_vocab_size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(flat, dtype="<f4").tobytes())


def read_model_file(path):
    """Test-only stand-in for gpt2np.formats.checkpoint.load_model while that does not exist."""
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[0] == 20240326 and header[1] == 3
    maxT, V, L, NH, C, Vp = (int(v) for v in header[2:8])
    cfg = GPT2Config(maxT, V, Vp, L, NH, C)
    return cfg, np.fromfile(path, dtype="<f4", offset=1024)


def random_state(cfg, B=2, T=3, seed=0):
    rng = np.random.default_rng(seed)
    grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in param_shapes(cfg).items()}
    grads["wte"][cfg.vocab_size:] = 0
    return DebugState(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                      rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                      rng.standard_normal((B, T, cfg.vocab_size)).astype(np.float32), 4.25, grads)


def assert_same_state(a, b):
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.logits, b.logits)
    assert a.loss == b.loss
    assert list(a.grads) == list(PARAM_NAMES)
    for n in PARAM_NAMES:
        np.testing.assert_array_equal(a.grads[n], b.grads[n])


# ----------------------------------------------------------------------------------------------
# debug state files

def test_debug_state_round_trip(tmp_path):
    state = random_state(SMALL)
    path = tmp_path / "state.bin"
    write_debug_state(path, state, SMALL)
    assert os.path.getsize(path) == expected_size(SMALL, 2, 3)
    assert os.listdir(tmp_path) == ["state.bin"]    # no temp file left behind
    back = read_debug_state(path, SMALL)
    assert (back.B, back.T) == (2, 3) and back.x.dtype == np.int32
    assert_same_state(back, state)


def write_like_train_gpt2_py(path, state, cfg, version=2):
    """The byte sequence of llm.c's train_gpt2.py write_state: header, x, y, logits, loss, then each
    tensor's gradient layer by layer (version 1: wte gradient with V rows)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2], header[3] = 20240327, version, state.B, state.T
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(state.x.astype(np.int32).tobytes())
        f.write(state.y.astype(np.int32).tobytes())
        f.write(state.logits.astype(np.float32).tobytes())
        f.write(np.float32(state.loss).tobytes())
        wte = state.grads["wte"] if version == 2 else state.grads["wte"][:cfg.vocab_size]
        f.write(wte.tobytes())
        f.write(state.grads["wpe"].tobytes())
        for name in PARAM_NAMES[2:14]:
            for layer in range(cfg.num_layers):
                f.write(state.grads[name][layer].tobytes())
        f.write(state.grads["lnfw"].tobytes())
        f.write(state.grads["lnfb"].tobytes())


@pytest.mark.parametrize("version", [2, 1])
def test_reads_llmc_train_gpt2_py_layout(tmp_path, version):
    state = random_state(SMALL, seed=1)
    path = tmp_path / "llmc_state.bin"
    write_like_train_gpt2_py(path, state, SMALL, version)
    assert_same_state(read_debug_state(path, SMALL), state)   # version 1: wte padded with zeros


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[0:4] = np.int32(20240326).tobytes()
    elif how == "version":
        data[4:8] = np.int32(3).tobytes()
    elif how == "truncated":
        del data[-4:]
    elif how == "too long":
        data += b"\0" * 8
    elif how == "header only":
        del data[100:]
    elif how == "token":
        data[1024:1028] = np.int32(SMALL.vocab_size).tobytes()
    elif how == "T":
        data[12:16] = np.int32(SMALL.max_seq_len + 1).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, message", [
    ("magic", "bad magic 20240326"), ("version", "unsupported version 3"),
    ("truncated", "truncated"), ("too long", "too long"), ("header only", "shorter than the"),
    ("token", "token ids outside"), ("T", "exceeds the model's max_seq_len")])
def test_bad_debug_state_is_one_clear_line(tmp_path, how, message):
    path = tmp_path / "state.bin"
    write_debug_state(path, random_state(SMALL), SMALL)
    corrupt(path, how)
    with pytest.raises(DebugStateError) as e:
        read_debug_state(path, SMALL)
    text = str(e.value)
    assert message in text and str(path) in text and "\n" not in text


def test_debug_state_for_another_model_is_rejected(tmp_path):
    path = tmp_path / "state.bin"
    write_debug_state(path, random_state(SMALL), SMALL)
    other = GPT2Config(16, 100, 128, 3, 2, 16)
    with pytest.raises(DebugStateError, match="written for a different model"):
        read_debug_state(path, other)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_debug_state(tmp_path / "missing.bin", SMALL)


def test_write_rejects_inconsistent_state(tmp_path):
    state = random_state(SMALL)
    state.grads["wte"] = state.grads["wte"][:SMALL.vocab_size]    # unpadded
    with pytest.raises(DebugStateError, match="grad wte has shape"):
        write_debug_state(tmp_path / "s.bin", state, SMALL)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# the comparison itself

def test_error_is_relative_to_the_tensor_scale():
    ref = np.array([[100.0, 1e-3], [-2.0, 0.0]])
    ours = ref + np.array([[0.0, 5e-3], [0.0, 0.0]])
    c = compare.check_tensor("w", ours, ref, 1e-4)
    assert c.max_abs == pytest.approx(5e-3) and c.max_rel == pytest.approx(5e-5) and c.ok
    assert not compare.check_tensor("w", ours * 1.001, ref, 1e-4).ok
    nan = ours.copy()
    nan[1, 1] = np.nan
    assert not compare.check_tensor("w", nan, ref, 1e-4).ok
    assert not compare.check_tensor("w", ours[:1], ref, 1.0).ok
    assert compare.check_tensor("z", np.zeros(3), np.zeros(3), 1e-4).ok
    assert not compare.check_tensor("z", np.ones(3), np.zeros(3), 1e-4).ok
    loss = compare.check_tensor("loss", 3.00005, 3.0, 1e-4, kind="abs")
    assert loss.ok and not compare.check_tensor("loss", 3.0002, 3.0, 1e-4, kind="abs").ok


def test_batch_from_seed_or_shard(tmp_path):
    x, y = compare.make_batch(SMALL, 2, 5, seed=3)
    x2, _ = compare.make_batch(SMALL, 2, 5, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(x.ravel()[1:], y.ravel()[:-1])
    tokens = np.arange(50, dtype=np.uint16) % SMALL.vocab_size
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, tokens.size)
    shard = tmp_path / "shard.bin"
    shard.write_bytes(header.tobytes() + tokens.tobytes())
    x, y = compare.make_batch(SMALL, 2, 5, data=shard)
    np.testing.assert_array_equal(x.ravel(), np.arange(10))
    np.testing.assert_array_equal(y.ravel(), np.arange(1, 11))
    with pytest.raises(ValueError, match="shard has 50 tokens, the batch needs 101"):
        compare.make_batch(SMALL, 4, 25, data=shard)


# ----------------------------------------------------------------------------------------------
# the CLI on a stand-in model

class ReferenceAsModel:
    """gpt2np.model.GPT2's API over the float64 PyTorch reference: lets the CLI be tested before
    (and independently of) the real model. `corrupt` = (tensor, scale) perturbs one gradient."""

    def __init__(self, cfg, params, corrupt=None):
        from gpt2np.torch_gpt2 import TorchGPT2
        self.cfg, self.ref, self.corrupt = cfg, TorchGPT2(cfg, params, "float64"), corrupt
        self.num_parameters = params.size
        self.backend = NumpyBackend(threads=1)        # train_step synchronizes it

    def forward(self, x, y, for_backward=False, grad_accum_steps=1):
        self.logits, self.loss = self.ref.forward(x, y)
        return float(self.loss.detach())

    def logits_host(self):
        B, T, V = self.logits.shape
        out = np.zeros((B, T, self.cfg.padded_vocab_size), np.float32)
        out[:, :, :V] = self.logits.detach().numpy()
        return out

    def zero_grad(self):
        for p in self.ref.params.values():
            p.grad = None

    def backward(self, tokens=None, *, accumulate=True, from_logits=False):
        if not accumulate:                            # train_step's first micro-batch overwrites
            self.zero_grad()
        self.loss.backward()

    def grads_host(self):
        grads = {n: p.grad.numpy().astype(np.float32) for n, p in self.ref.params.items()}
        if self.corrupt:
            name, scale = self.corrupt
            grads[name].flat[0] += scale * np.abs(grads[name]).max()
        return grads

    def grad_norm(self):
        return self.ref.grad_norm()

    def update(self, lr, beta1, beta2, eps, weight_decay, step, grad_clip=1.0, grad_norm=None,
               shard=None):
        norm = self.grad_norm() if grad_norm is None else grad_norm
        scale = grad_clip / norm if norm > grad_clip else 1.0
        assert step == self.ref.t + 1
        self.ref.adamw_update(lr, beta1, beta2, eps, weight_decay, DECAYED_BY_DEFAULT, scale)


@pytest.fixture
def small_model(tmp_path):
    path = tmp_path / "small.bin"
    write_model_file(path, SMALL, init_params(SMALL))
    return path


@pytest.fixture
def stand_in(monkeypatch):
    """Route the CLI to ReferenceAsModel; `stand_in["corrupt"] = (name, scale)` corrupts a grad."""
    opts = {"corrupt": None, "cpu_math": []}

    def stand_in_model(cfg, backend, B, T, params, precision="fp32", attention="naive",
                       recompute=None, cpu_math=None):
        opts["cpu_math"].append(cpu_math)
        return ReferenceAsModel(cfg, params, opts["corrupt"])
    monkeypatch.setattr(compare, "build_model", stand_in_model)
    return opts


@needs_torch
def test_cli_passes_and_prints_every_tensor(small_model, stand_in, capsys):
    rc = compare.main(["-e", str(small_model), "-b", "2", "-t", "8", "--steps", "10",
                       "--weight-decay", "0.1", "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("logits", "loss") + PARAM_NAMES:
        assert f"\n{name} " in out
    assert "max|gpt2np - ref| / max|ref|" in out
    assert out.count("  ok\n") == 2 + 18 + 10 and "FAIL" not in out    # 2 table headers
    assert "OK: all 28 checks" in out
    assert compare.main(["-e", str(small_model), "-b", "2", "-t", "8", "--steps", "0", "--cpu-math",
                         "exact"]) == 0
    assert stand_in["cpu_math"] == [None, "exact"]             # None: get_backend's default (fast)


@needs_torch
def test_cli_fails_on_a_corrupted_gradient(small_model, stand_in, capsys):
    stand_in["corrupt"] = ("fcw", 1e-3)
    rc = compare.main(["-e", str(small_model), "-b", "2", "-t", "8", "--steps", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert [line.split()[0] for line in out.splitlines() if "FAIL" in line] == ["fcw", "FAIL:"]
    # a looser tolerance for that one tensor lets it pass
    rc = compare.main(["-e", str(small_model), "-b", "2", "-t", "8", "--steps", "0", "--tol",
                       "fcw=2e-3"])
    assert rc == 0


@needs_torch
def test_cli_checks_a_written_and_a_corrupted_debug_state(small_model, stand_in, tmp_path, capsys):
    state_path = tmp_path / "state.bin"
    assert compare.main(["-e", str(small_model), "-b", "2", "-t", "8", "--steps", "0",
                         "--write-debug-state", str(state_path)]) == 0
    assert compare.main(["-e", str(small_model), "--debug-state", str(state_path), "--steps",
                         "2"]) == 0
    state = read_debug_state(state_path, SMALL)
    assert (state.B, state.T) == (2, 8)
    state.grads["attprojb"][1, 3] *= 1.01
    state.loss += 1e-3
    write_debug_state(state_path, state, SMALL)
    capsys.readouterr()
    assert compare.main(["-e", str(small_model), "--debug-state", str(state_path), "--steps",
                         "0"]) == 1
    out = capsys.readouterr().out
    assert "out of tolerance: loss, attprojb" in out


@needs_torch
def test_cli_bad_input_is_one_line_and_exit_2(small_model, stand_in, tmp_path, capsys):
    bad = tmp_path / "bad_state.bin"
    bad.write_bytes(b"\0" * 2000)
    assert compare.main(["-e", str(small_model), "--debug-state", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad magic" in err and str(bad) in err
    assert compare.main(["-e", str(small_model), "-t", "17"]) == 2
    assert "max_seq_len" in capsys.readouterr().err


def test_cli_missing_model_file_subprocess(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpt2np.cli.compare", "-e",
                        str(tmp_path / "none.bin")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


# ----------------------------------------------------------------------------------------------
# the CLI on gpt2np itself

@needs_model
def test_gpt2np_numpy_matches_reference_small(small_model, tmp_path, capsys, monkeypatch):
    state_path = tmp_path / "state.bin"
    rc = compare.main(["-e", str(small_model), "-b", "3", "-t", "16", "--steps", "10",
                       "--weight-decay", "0.1", "--write-debug-state", str(state_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert compare.main(["-e", str(small_model), "--steps", "2", "--ref-dtype", "float64"]) == 0
    with monkeypatch.context() as m:     # checking a debug state needs no torch
        m.setitem(sys.modules, "torch", None)
        assert compare.main(["-e", str(small_model), "--debug-state", str(state_path), "--steps",
                             "0"]) == 0
        assert compare.main(["-e", str(small_model), "--debug-state", str(state_path)]) == 2
        assert "pip install torch" in capsys.readouterr().err
    state = read_debug_state(state_path, SMALL)
    state.grads["qkvw"][0, 5, 7] += 1e-3 * np.abs(state.grads["qkvw"]).max()
    write_debug_state(state_path, state, SMALL)
    rc = compare.main(["-e", str(small_model), "--debug-state", str(state_path), "--steps", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "out of tolerance: qkvw" in out, out


@needs_model
def test_gpt2np_numpy_matches_reference_d12(tmp_path, capsys):
    cfg = preset("d12")
    path = tmp_path / "d12.bin"
    write_model_file(path, cfg, init_params(cfg, seed=12))
    rc = compare.main(["-e", str(path), "-b", "2", "-t", "32", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out


@needs_model
def test_gpt2np_cuda_kernels_on_the_emulator_match_reference(small_model, capsys):
    """The CUDA backend (every kernel, emulated on the CPU) against the PyTorch reference: all
    tensors, 3 steps."""
    rc = compare.main(["-e", str(small_model), "--backend", "emu", "-b", "2", "-t", "16", "--steps",
                       "3", "--weight-decay", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "backend emu" in out or "emu" in out
    for name in ("logits", "loss", "wte", "qkvw", "fcprojb", "lnfb"):
        assert any(line.split()[:1] == [name] and line.rstrip().endswith("ok")
                   for line in out.splitlines()), name


@needs_model
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_flash_attention_on_the_emulator_matches_reference(tmp_path, capsys, precision):
    """The flash attention kernels (head size 64, WMMA TF32 on the emulator) in the whole model
    against the PyTorch reference, with the tf32 tolerances (the kernels multiply in TF32 at either
    precision): all tensors, 2 steps, T=40 (two key tiles, the second partial)."""
    cfg = GPT2Config(max_seq_len=48, vocab_size=100, padded_vocab_size=128, num_layers=2,
                     num_heads=2, channels=128)
    path = tmp_path / "flash.bin"
    write_model_file(path, cfg, init_params(cfg))
    rc = compare.main(["-e", str(path), "--backend", "emu", "--attention", "flash", "--precision",
                       precision, "-b", "2", "-t", "40", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "flash attention" in out
    for name in ("logits", "loss", "qkvw", "qkvb", "attprojw", "wpe"):
        assert any(line.split()[:1] == [name] and line.rstrip().endswith("ok")
                   for line in out.splitlines()), name
