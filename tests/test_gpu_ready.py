"""The GPU path ready for first contact (issue 13), tested without a GPU: CuPy and cuBLAS are
stand-ins (tests/fake_gpu.py) where a GPU would be needed, the CUDA backend runs
on the CPU emulator.

* the startup check: one line saying what is missing or wrong (CuPy, driver, GPU,
  cuBLAS, NVRTC) and the fix;
* --precision / --tf32: the cuBLAS math mode passed (cuBLAS's CUBLAS_TF32_TENSOR_OP_MATH = 3, which
  CuPy 14 does not name), the default (tf32 on sm_80+, fp32 elsewhere), honoured for --device auto;
* a private cuBLAS handle that follows CuPy's current stream;
* launch settings and kernel scalar types checked on every runtime;
* the up-front memory check: what a run needs vs free device memory, one line naming the
  largest B that fits;
* the packaging: nvtx pinned where its API exists, cuda and test extras that give a working GPU
  install, the GPU commands of docs/gpu.md as written.
"""
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fake_gpu import FakeCublas, FakeCupy

import gpt2np.backends as backends
import train
from gpt2np.backends import BackendUnavailable, cuda_status, get_backend, resolve_precision
from gpt2np.backends.cuda import runtime_cupy
from gpt2np.backends.cuda.backend import (
    LAUNCH_SETTINGS,
    CudaBackend,
    DeviceMemoryError,
    KernelArgumentError,
)
from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.config import GPT2Config, TrainConfig, preset
from gpt2np.errors import BadInput
from gpt2np.model import GPT2
from gpt2np.train_step import train_step

REPO = Path(__file__).resolve().parent.parent
SMALL = GPT2Config(max_seq_len=32, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=4,
                   channels=32)


# ---- the startup check ---------------------------------------------------------------------------

def importer(missing=()):
    """import_module that fails for the modules named in `missing`, as a missing shared library
    does; a package's submodule fails when got as its attribute too (cupy_backends.cuda.libs loads
    its libraries on attribute access)."""
    def fail(name):
        raise ImportError(f"{missing[name]}: cannot open shared object file: No such "
                          "file or directory")

    class Package:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            full = f"{self.name}.{attr}"
            return fail(full) if full in missing else object()

    def import_module(name):
        if name in missing:
            fail(name)
        return Package(name)
    return import_module


def no_cupy(name):
    raise ModuleNotFoundError("No module named 'cupy'")


@pytest.mark.parametrize("cupy, import_module, expected, gpu_seen", [
    (None, no_cupy, r"CuPy is not installed .*pip install -e \"\.\[cuda\]\"", False),
    (FakeCupy(driver=0), importer(),
     r"no NVIDIA driver found: .*no NVIDIA GPU, or its driver is not installed", False),
    (FakeCupy(driver=12080), importer(),
     r"the NVIDIA driver supports CUDA 12\.8, CuPy for CUDA 13 needs a driver for "
     r"CUDA 13\.0 or newer: update the driver to R580", False),
    (FakeCupy(devices=[]), importer(), r"the NVIDIA driver sees no GPU: .*nvidia-smi", False),
    (FakeCupy(devices=[("Tesla V100-SXM2-16GB", 70, "0000:01:00.0")]), importer(),
     r"Tesla V100-SXM2-16GB is sm_70; CUDA 13 runs on sm_75 \(Turing\) and newer", True),
    (FakeCupy(), importer({"cupy_backends.cuda.libs.cublas": "libcublas.so.13"}),
     r"cuBLAS for CUDA 13 not found \(libcublas\.so\.13: cannot open.*\): pip install "
     r"'nvidia-cublas>=13,<14'", True),
    (FakeCupy(nvrtc=RuntimeError("libnvrtc.so.13: cannot open shared object file")), importer(),
     r"NVRTC for CUDA 13 not found .*pip install 'nvidia-cuda-nvrtc>=13,<14'", True),
    (FakeCupy(nvrtc=(12, 8)), importer(), r"NVRTC 12\.8 found, .* needs NVRTC 13", True),
])
def test_startup_check_says_what_is_wrong_in_one_line(cupy, import_module, expected, gpu_seen):
    problem, seen = cuda_status(cupy, import_module)
    assert re.search(expected, problem), problem
    assert "\n" not in problem and seen == gpu_seen


def test_startup_check_passes_on_a_working_install():
    assert cuda_status(FakeCupy(), importer()) == (None, True)


def test_device_cuda_without_a_usable_gpu_is_that_line(monkeypatch):
    monkeypatch.setattr(backends, "_status", ("no NVIDIA driver found: (the line)", False))
    with pytest.raises(BackendUnavailable,
                       match=r"^--device cuda: no NVIDIA driver found: \(the line\)$"):
        get_backend("cuda")
    with pytest.raises(BackendUnavailable, match="^--device cuda: no NVIDIA driver"):
        resolve_precision("cuda", None)
    assert backends.resolve_name("auto") == "numpy"


@pytest.mark.skipif(backends.gpu_available(), reason="this machine has a usable GPU")
def test_train_py_device_cuda_here_prints_the_line_and_exits_1():
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--device", "cuda",
                          "-e", "d12", "-x", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert (len(lines) == 1
            and lines[0] == f"error: --device cuda: {backends.cuda_problem()}"), run.stderr


# ---- precision -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, requested, capability, expected, note", [
    ("cuda", None, 80, "tf32", None),              # the default on tensor cores (A100, H100...)
    ("cuda", None, 90, "tf32", None),
    ("cuda", None, 75, "fp32", None),              # Turing: no TF32
    ("cuda", "fp32", 90, "fp32", None),            # exact fp32 one flag away
    ("cuda", "tf32", 80, "tf32", None),
    ("cuda", "tf32", 75, "fp32", "no TF32 tensor cores"),
    ("numpy", None, None, "fp32", None),
    ("numpy", "tf32", None, "fp32", "GPU precision"),
    ("emu", None, None, "fp32", None),
    ("emu", "tf32", None, "tf32", None),
])
def test_resolve_precision(name, requested, capability, expected, note):
    precision, said = resolve_precision(name, requested, capability=capability)
    assert precision == expected
    assert (said is None) if note is None else (note in said)


def test_tf32_override_0_turns_tf32_off(monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    assert resolve_precision("cuda", None, capability=90) == (
        "fp32", "NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS; the matmuls run in fp32")


def test_precision_flags():
    assert train.parse_config(["--precision", "fp32"]).requested_precision == "fp32"
    assert train.parse_config(["--tf32"]).requested_precision == "tf32"            # the alias
    assert (train.parse_config(["--tf32", "--precision", "tf32"]).validate().requested_precision
            == "tf32")
    # the device's default
    assert train.parse_config([]).requested_precision is None
    with pytest.raises(BadInput, match="--tf32 with --precision fp32"):
        train.parse_config(["--tf32", "--precision", "fp32"]).validate()
    with pytest.raises(SystemExit):
        train.parse_config(["--precision", "fp16"])
    assert train.parse_config(["--precision", "bf16", "--device",
                               "cpu"]).validate().requested_precision == "bf16"
    for device in ("cuda", "emu"):                                         # the kernels' bf16 build
        assert (train.parse_config(["--precision", "bf16", "--device", device]).validate().precision
                == "bf16")


class Chosen(Exception):
    """Stops the trainer once it has chosen the backend."""


@pytest.mark.parametrize("flags, expected", [
    ({}, "tf32"), ({"tf32": True}, "tf32"), ({"precision": "tf32"}, "tf32"),
    ({"precision": "fp32"}, "fp32"),])
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_trainer_honours_precision_whichever_way_the_gpu_was_chosen(monkeypatch, device, flags,
                                                                    expected):
    """--device auto finding a GPU gets the same precision as --device cuda (sm_90 here:
    tf32 by default)."""
    from gpt2np.train import setup, trainer
    monkeypatch.setattr(backends, "_status", (None, True))           # a usable GPU...
    monkeypatch.setattr(backends, "compute_capability", lambda: 90)  # ... with tensor cores
    chosen = []

    def fake_get_backend(name, precision="fp32", **options):
        chosen.append((name, precision))
        raise Chosen

    monkeypatch.setattr(setup, "get_backend", fake_get_backend)
    with pytest.raises(Chosen):
        trainer.train(replace(TrainConfig(device=device), **flags))
    assert chosen == [("cuda", expected)]


def test_header_says_the_precision(tmp_path, data_dir, capsys):
    from gpt2np.train import trainer
    trainer.train(TrainConfig(model="d12", device="cpu", max_steps=0, batch_size=1, seq_len=8,
                              val_every=0, sample_every=0, precision="tf32"))
    out = capsys.readouterr().out
    assert "note: --precision tf32 is a GPU precision; the CPU computes in fp32" in out
    assert re.search(r"\| precision +\| fp32 \(exact fp32 matmuls\) +\|", out)


def test_auto_on_a_gpu_machine_with_a_broken_install_says_why_it_uses_the_cpu(monkeypatch, data_dir,
                                                                              capsys):
    from gpt2np.train import trainer
    line = ("cuBLAS for CUDA 13 not found (libcublas.so.13: ...): pip install "
            "'nvidia-cublas>=13,<14'")
    monkeypatch.setattr(backends, "_status", (line, True))
    trainer.train(TrainConfig(model="d12", device="auto", max_steps=0, batch_size=1, seq_len=8,
                              val_every=0, sample_every=0))
    out = capsys.readouterr().out
    assert f"note: --device auto: the GPU is not usable, training on the CPU: {line}\n" in out
    assert re.search(r"\| device +\| numpy ", out)


# ---- cuBLAS: the math mode and a private handle --------------------------------------------------

def test_tf32_passes_cublas_own_value_where_cupy_has_no_name_for_it():
    cublas = FakeCublas()
    assert not hasattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH")              # as in CuPy 14
    tf32 = CupyRuntime(tf32=True, cupy=FakeCupy(), cublas=cublas)
    fp32 = CupyRuntime(tf32=False, cupy=FakeCupy(), cublas=cublas)
    assert cublas.of("setMathMode") == [("setMathMode", tf32.handle, 3),
                                        ("setMathMode", fp32.handle, 0)]
    assert cublas.of("setPointerMode") == [("setPointerMode", tf32.handle, 0),
                                           ("setPointerMode", fp32.handle, 0)]


def test_the_real_cupy_cublas_module_gets_mode_3():
    cupy = pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError as e:
        pytest.skip(f"CuPy's cuBLAS bindings need libcublas: {e}")
    assert (cupy and runtime_cupy.math_mode(cublas, True) == 3
            and runtime_cupy.math_mode(cublas, False) == 0)


def test_each_runtime_has_its_own_handle_following_the_current_stream():
    """CuPy's shared handle is never touched (FakeCupy raises if it is); two runtimes
    keep their own modes."""
    cublas, cupy = FakeCublas(), FakeCupy(stream=0)
    a, b = CupyRuntime(tf32=True, cupy=cupy, cublas=cublas), CupyRuntime(cupy=cupy, cublas=cublas)
    assert a.handle != b.handle and {a.handle, b.handle} <= cublas.live

    class Buf:                                           # a device array as gemm reads it
        dtype = np.dtype(np.float32)

        def __init__(self, ptr):
            self.data = type("Mem", (), {"ptr": ptr})()

    def gemm(rt, batch=1):
        rt.gemm(False, True, 2, 3, 4, 1.0, Buf(0x100), 4, 8, Buf(0x200), 4, 12, 0.0, Buf(0x300), 3,
                6, batch)

    gemm(a)
    cupy.stream.ptr = 0xbeef                             # another stream made current
    gemm(a, batch=2)
    gemm(b)
    assert [c[1:] for c in cublas.of("setStream")] == [(a.handle, 0), (a.handle, 0xbeef),
                                                       (b.handle, 0xbeef)]
    (first,) = cublas.of("sgemm")[:1]
    # C^T = op(B)^T op(A)^T: B, A swapped
    assert first[1] == a.handle and first[2:7] == (1, 0, 3, 2, 4)
    assert (cublas.of("sgemmStridedBatched")[0][1] == a.handle
            and cublas.of("sgemm")[1][1] == b.handle)
    handle = a.handle
    a.close()
    assert handle not in cublas.live and ("destroy", handle) in cublas.calls


def test_fake_cublas_has_cupys_interface():
    pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError as e:
        pytest.skip(f"CuPy's cuBLAS bindings need libcublas: {e}")
    import inspect
    fake = FakeCublas()
    for name in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_POINTER_MODE_HOST", "CUBLAS_DEFAULT_MATH"):
        assert getattr(fake, name) == getattr(cublas, name), name
    for name in ("create", "destroy", "setStream", "setPointerMode", "setMathMode", "sgemm",
                 "sgemmStridedBatched", "gemmEx", "gemmStridedBatchedEx"):
        doc = getattr(cublas, name).__doc__.strip()
        real = [p.split()[-1] for p in re.match(r"\w+\(([^)]*)\)", doc)[1].split(",") if p.strip()]
        assert real == list(inspect.signature(getattr(fake, name)).parameters), name


# ---- kernel arguments and launch settings --------------------------------------------------------

class RecordingRuntime(EmuRuntime):
    """The emulator, remembering what reached the runtime's launch."""

    def __init__(self):
        super().__init__()
        self.launched = []

    def launch(self, function, grid, block, args, shared_mem=0):
        self.launched.append(args)
        super().launch(function, grid, block, args, shared_mem)


@pytest.mark.parametrize("bad, says", [
    (0.5, r"argument 2 is float 0\.5, the kernel takes int32"),
    (np.float64(3), r"argument 2 is float64 3\.0, the kernel takes int32"),
    (7, r"argument 2 is int 7, the kernel takes int32"),
    (np.float32(7), r"argument 2 is float32 7\.0, the kernel takes int32"),
])
def test_kernel_scalars_are_checked_against_the_signature(bad, says):
    be = CudaBackend(RecordingRuntime())
    x, out = be.from_host(np.ones(7, np.float32)), be.zeros(7)
    be._launch("gelu_forward", (1,), (32,), (out, x, np.int32(7)))
    with pytest.raises(KernelArgumentError, match=says):
        be._launch("gelu_forward", (1,), (32,), (out, x, bad))
    assert len(be.rt.launched) == 1                   # the bad launch never reached the runtime


def test_kernel_arrays_are_checked_too():
    be = CudaBackend(EmuRuntime())
    x, out = be.from_host(np.ones(8, np.float32)), be.zeros(8)
    with pytest.raises(KernelArgumentError,
                       match="argument 1 is a int32 array, the kernel takes a pointer to float32"):
        be._launch("gelu_forward", (1,), (32,), (out, be.zeros(8, np.int32), np.int32(8)))
    with pytest.raises(KernelArgumentError, match="argument 0 must be a float32 device array"):
        be._launch("gelu_forward", (1,), (32,), (1.0, x, np.int32(8)))
    with pytest.raises(KernelArgumentError, match="takes 3 arguments, got 2"):
        be._launch("gelu_forward", (1,), (32,), (out, x))
    with pytest.raises(KernelArgumentError, match="not C-contiguous"):
        be._launch("gelu_forward", (1,), (32,), (be.zeros(16)[::2], x, np.int32(8)))


def test_cupy_runtime_launch_refuses_python_scalars():
    rt = CupyRuntime(cupy=FakeCupy(), cublas=FakeCublas())
    calls = []
    rt.launch(lambda *a, **k: calls.append(a), (1,), (32,), (np.int32(1), np.float32(2)))
    from gpt2np.backends.cuda.backend import NULL
    # -w 0's null master pointer passes
    rt.launch(lambda *a, **k: calls.append(a), (1,), (32,), (NULL,))
    with pytest.raises(TypeError, match="argument 1 is float 2.0: kernel scalars must be "
                                        "np.int32 or np.float32"):
        rt.launch(lambda *a, **k: calls.append(a), (1,), (32,), (np.int32(1), 2.0))
    assert len(calls) == 2


@pytest.mark.parametrize("setting, bad", [
    ("row_warps", 0), ("row_warps", 33), ("row_warps", 2.0), ("classifier_threads", 1056),
    ("classifier_threads", 48), ("norm_threads", 2048), ("norm_threads", 100),
    ("elementwise_threads", 16), ("reduce_warps", 64), ("reduce_rows_per_chunk", 0),
    ("norm_max_blocks", -1), ("encoder_token_blocks", 65536), ("classifier_threads", True),])
def test_launch_settings_are_validated(setting, bad):
    be = CudaBackend(EmuRuntime())
    before = getattr(be, setting)
    with pytest.raises(KernelArgumentError,
                       match=rf"CudaBackend\.{setting} = {re.escape(repr(bad))}: the .* must be"):
        setattr(be, setting, bad)
    assert getattr(be, setting) == before


def test_good_launch_settings_are_taken():
    be = CudaBackend(EmuRuntime())
    for setting, (low, high, _, _) in LAUNCH_SETTINGS.items():
        for value in (low, high, np.int32(low)):
            setattr(be, setting, value)
            assert getattr(be, setting) == value and type(getattr(be, setting)) is int
    be.row_warps, be.classifier_threads, be.norm_threads = 32, 1024, 1024      # the largest blocks


# ---- memory --------------------------------------------------------------------------------------

class CountingRuntime(EmuRuntime):
    """The emulator, adding up every device allocation's bytes (zeros, empty, from_host)."""

    def __init__(self, free=None):
        super().__init__(guard="off")
        self.allocated, self.free = 0, free

    def zeros(self, shape, dtype):
        out = super().zeros(shape, dtype)
        self.allocated += out.nbytes
        return out

    def empty(self, shape, dtype):
        out = super().empty(shape, dtype)
        self.allocated += out.nbytes
        return out

    def from_host(self, array):
        out = super().from_host(array)
        self.allocated += out.nbytes
        return out

    def free_memory(self):
        return self.free


@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_memory_needed_covers_every_allocation_of_a_training_step(attention):
    """GPT2 + one train_step (forward, backward, AdamW, grad norm) allocate what memory_needed says,
    to within the per-step uploads (which the allocator reuses) and cuBLAS's (and cuBLASLt's)
    workspace allowance."""
    B, T = 3, 16
    # flash: head size 64
    cfg = SMALL if attention == "naive" else GPT2Config(32, 100, 128, 2, 2, 128)
    be = CudaBackend(CountingRuntime())
    be.elementwise_threads = 64
    need = be.memory_needed(cfg, B, T, attention=attention)
    model = GPT2(cfg, be, B, T, seed=0, attention=attention)
    upload = 4 * model.num_parameters                      # init_random's weights, copied up once
    assert (be.rt.allocated == need["parameters and gradients"] + need["activations"]
            + need["backward scratch"] + upload)
    adamw = need[next(k for k in need if k.startswith("AdamW"))]
    # ... which the estimate's optimizer part covers
    assert upload <= adamw
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    train_step(model, lambda: (tokens[:, :-1], tokens[:, 1:]), step=0, lr=1e-3)
    assert model.m.nbytes + model.v.nbytes + (model.master.nbytes if model.master is not None
                                              else 0) <= adamw
    scratch = sum(buf.nbytes for buf in be._scratch.values())
    from gpt2np.backends.cuda.backend import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE
    # the libraries' workspaces
    allowance = CUBLAS_WORKSPACE + (CUBLASLT_WORKSPACE if be.rt.epilogues else 0)
    assert scratch <= need["kernel scratch"] - allowance
    # no gross overestimate either (the estimate covers the scratch of the fused and of the unfused
    # kernels: the column sums' partials that the fused step leaves to the GEMM epilogues make it
    # 2x at this toy size)
    assert scratch >= 0.4 * (need["kernel scratch"] - allowance)


def largest_b(be, cfg, T, budget):
    return max(b for b in range(1, 200) if sum(be.memory_needed(cfg, b, T).values()) <= budget)


def test_a_batch_that_does_not_fit_is_one_line_naming_the_largest_b():
    """d12, T=1024, fp32 with stored attention on an 80 GB H100: B around 50 is the limit."""
    from gpt2np.backends.cuda.backend import MEMORY_HEADROOM
    free = 79 * 2 ** 30
    be = CudaBackend(CountingRuntime(free=free))
    d12 = preset("d12")
    fits = largest_b(be, d12, 1024, free - MEMORY_HEADROOM)
    assert 45 <= fits <= 55
    assert be.check_memory_fits(d12, fits, 1024) <= free
    with pytest.raises(DeviceMemoryError) as e:
        be.check_memory_fits(d12, 64, 1024, model_name="-e d12")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("-b 64 -t 1024: -e d12 needs 10") and "GB on cpu (activations" in line
    assert line.endswith(f"84.8 GB is free: the largest B that fits at T=1024 is {fits} (-b "
                         # and nothing after it
                         f"{fits}; keep the tokens per step with -d, gradient accumulation)"), line


def test_the_line_names_the_recompute_that_keeps_the_batch():
    """A B just past what fits keeping every activation fits with -r 1 (or -r 2): the
    line says so too."""
    free = 79 * 2 ** 30
    be, d12 = CudaBackend(CountingRuntime(free=free)), preset("d12")
    from gpt2np.backends.cuda.backend import MEMORY_HEADROOM
    budget = free - MEMORY_HEADROOM
    fits = largest_b(be, d12, 1024, budget)
    with_r = {r: sum(be.memory_needed(d12, fits + 1, 1024, recompute=r).values())
              for r in (0, 1, 2)}
    assert with_r[0] > budget and with_r[0] > with_r[1] > with_r[2]
    with pytest.raises(DeviceMemoryError) as e:
        be.check_memory_fits(d12, fits + 1, 1024)
    r = 1 if with_r[1] <= budget else 2
    assert str(e.value).endswith(f", or -b {fits + 1} with -r {r} (the "
                                 f"GELU{'' if r == 1 else ' and LayerNorm'} "
                                 f"outputs recomputed in backward instead of keeping them)")
    # far past: no -r keeps it, nothing said of -r
    with pytest.raises(DeviceMemoryError) as e:
        be.check_memory_fits(d12, 4 * fits, 1024)
    assert "-r " not in str(e.value) and "not even" not in str(e.value)
    need = {r: sum(be.memory_needed(d12, 1, 1024, recompute=r).values()) for r in (0, 2)}
    # B=1 fits only with -r 2
    be1 = CudaBackend(CountingRuntime(free=need[2] + MEMORY_HEADROOM + 2 ** 20))
    assert need[2] + 2 ** 20 < need[0]
    with pytest.raises(DeviceMemoryError) as e:
        be1.check_memory_fits(d12, 1, 1024)
    assert re.search(r"GB is free: -b 1 with -r [12] \(the GELU.* outputs recomputed in backward "
                     r"instead of keeping them\) fits$", str(e.value)), str(e.value)


def test_ranks_sharing_a_gpu_split_its_memory():
    be, d12 = CudaBackend(CountingRuntime(free=79 * 2 ** 30)), preset("d12")
    alone = sum(be.memory_needed(d12, 24, 1024).values())
    assert be.check_memory_fits(d12, 24, 1024) == alone
    with pytest.raises(DeviceMemoryError,
                       match=r"GB is free for 2 ranks sharing the GPU: the largest B that fits"):
        be.check_memory_fits(d12, 40, 1024, sharers=2)


def test_when_not_even_b1_fits_the_line_names_the_longest_t():
    be = CudaBackend(CountingRuntime(free=3 * 2 ** 30))
    with pytest.raises(DeviceMemoryError, match=r"not even -b 1 fits at T=1024; the longest T that "
                                                r"fits at B=1 is \d+ \(-b 1 -t \d+\)"):
        be.check_memory_fits(preset("d12"), 1, 1024)


def test_zero1_shards_count_and_the_emulator_has_no_limit():
    be = CudaBackend(CountingRuntime())
    full, sharded = (sum(be.memory_needed(preset("d12"), 4, 1024, o).values())
                     for o in (None, 10 ** 7))
    assert full > sharded
    # no free_memory: nothing to check
    assert be.check_memory_fits(preset("d12"), 4096, 1024) is None
    assert CudaBackend(EmuRuntime()).free_memory() is None


def test_cupy_runtime_free_memory_counts_the_pool():
    rt = CupyRuntime(cupy=FakeCupy(free=10 << 30, pool_free=1 << 30), cublas=FakeCublas())
    assert rt.free_memory() == 11 << 30 and rt.total_memory() == 80 << 30


def test_train_py_says_what_fits_instead_of_a_traceback(monkeypatch, data_dir, capsys):
    from gpt2np.train import setup
    monkeypatch.setattr(setup, "get_backend",
                        lambda name, precision="fp32", **_: CudaBackend(CountingRuntime(4 << 30)))
    code = train.main(["--device", "cpu", "-e", "d12", "-b", "16", "-t", "256", "-x", "1", "-v",
                       "0", "-s", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert re.fullmatch(r"error: -b 16 -t 256: -e d12 needs .* GB is free: the largest B that fits "
                        r"at T=256 is \d+ .*",
                        err[0]), err


def test_an_out_of_memory_error_during_the_run_is_one_line(monkeypatch, data_dir, capsys):
    from gpt2np.train import setup

    class OutOfMemoryError(MemoryError):           # what cupy.cuda.memory raises
        pass

    def no_memory(*args, **kwargs):
        raise OutOfMemoryError("Out of memory allocating 1,073,741,824 bytes (allocated "
                               "so far: 0 bytes).")

    monkeypatch.setattr(setup, "GPT2", no_memory)
    code = train.main(["--device", "cpu", "-e", "d12", "-b", "1", "-t", "8", "-x", "1", "-v", "0",
                       "-s", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["error: out of memory (Out of memory allocating 1,073,741,824 "
                                 "bytes (allocated so far: 0 bytes).): the model's parameters, "
                                 "gradients and AdamW moments (16 bytes a parameter in fp32) and "
                                 "the activations of -b x -t must fit; use a smaller -e, or a "
                                 "smaller -b (or -t) and -d to keep the tokens per step"]


# ---- packaging and docs/gpu.md's GPU commands ----------------------------------------------------

def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements(extra=None):
    project = pyproject()["project"]
    listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {re.match(r"[A-Za-z0-9_.\-\[\]]+", r)[0].lower(): r for r in listed}


def test_nvtx_is_pinned_where_its_domain_api_exists():
    """gpt2np/ranges.py uses nvtx.get_domain and nvtx.Domain, added in nvtx 0.2.12; with an older
    nvtx it would swallow the AttributeError and NVTX would be silently off."""
    pin = requirements()["nvtx"]
    low = tuple(int(p) for p in re.search(r">=\s*([\d.]+)", pin)[1].split("."))
    assert low >= (0, 2, 12), pin
    nvtx = pytest.importorskip("nvtx")
    assert callable(nvtx.get_domain) and isinstance(nvtx.Domain, type)


def test_cuda_extra_is_a_whole_gpu_install():
    cuda = requirements("cuda")
    for package in ("cupy-cuda13x", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc",
                    "nvidia-nccl-cu13"):
        assert package in cuda, package
    for package in ("nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc"):
        assert ">=13" in cuda[package] and "<14" in cuda[package], cuda[package]


def test_test_extra_runs_the_gpu_tests():
    test = requirements("test")
    assert "gpt2np[cuda]" in test and "pytest" in test


def gpu_section_commands():
    page = (REPO / "docs" / "gpu.md").read_text()
    section = page[page.index("## Install and run"):]
    section = section[:section.index("\n## ", 3)]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_gpu_page_commands_work_as_written():
    commands = gpu_section_commands()
    install = next(c for c in commands if c.startswith("pip install"))
    extras = re.search(r'"\.\[([\w,]+)\]"', install)[1].split(",")
    project = pyproject()["project"]
    assert set(extras) <= set(project["optional-dependencies"]), extras
    installed = set().union(*(requirements(e) for e in extras))
    for command in commands:
        if "pytest" in command:
            assert "pytest" in installed, f"{command}: pytest is not in the extras of {install}"
            assert "-m gpu" in command
        if command.startswith("python train.py"):
            argv = [a for a in command.split()[2:] if a != "..."]
            # every flag as written parses and is allowed
            train.parse_config(argv).validate()
    assert any("--precision fp32" in c for c in commands)
