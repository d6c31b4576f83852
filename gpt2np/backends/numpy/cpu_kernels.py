"""Builds and loads the numpy backend's C loops (csrc/*.c), one library compiled on first use.

csrc/fast.c         the fast path (--cpu-math fast): whole ops in one loop each, not bitwise the
                    reference (FAST_FLAGS: FMA contraction allowed)
csrc/bitwise.c      the fast path's loops that are bitwise the NumPy reference: AdamW, the column
                    sums of the bias gradient, the token embedding gradient, bf16's stochastic
                    rounding (EXACT_FLAGS)
csrc/llmc_normal.c  llm.c's random init draws in the C library's logf, cosf, sinf (gpt2np.init;
                    EXACT_FLAGS)

The library is built with the system C compiler ($CC, else cc, gcc) into $GPT2NP_CPU_CACHE (default
~/.cache/gpt2np/cpu), keyed by the sources, the flags, the compiler and the CPU; when no compiler
works, load() returns None and the backend runs the NumPy reference.
"""
import ctypes
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

CSRC = Path(str(importlib.resources.files("gpt2np.backends.numpy") / "csrc"))   # package data
# No -ffast-math, no FMA contraction: every operation rounds to float32 as NumPy's does.
# -fno-math-errno only lets sqrtf become one instruction (it is correctly rounded either way).
EXACT_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c99", "-fPIC"]
# The fast set: a*b+c may become one FMA; -fno-trapping-math lets the selects (x < lo ? lo : x,
# NaN-preserving, unlike fminf) vectorize. Still no -ffast-math: NaN and infinities keep their
# meaning.
FAST_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
              "-std=c99", "-fPIC"]
SOURCES = {"bitwise.c": EXACT_FLAGS, "llmc_normal.c": EXACT_FLAGS, "fast.c": FAST_FLAGS}

_P, _N, _F, _I = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "adamw": [_P, _P, _P, _P, _N, _F, _F, _F, _F, _F, _F, _F, _I],
    "col_sums": [_P, _P, _N, _N, _N, _N],
    "rows_add_at": [_P, _P, _P, _N, _N],
    "round_stochastic": [_P, _P, _N, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ushort],
    "llmc_normal": [_P, _P, _N, _F, _F],
    "gelu_forward_fast": [_P, _P, _N, _F, _F],
    "gelu_backward_fast": [_P, _P, _P, _N, _F, _F],
    "layernorm_forward_fast": [_P, _P, _P, _P, _P, _P, _N, _N, _F],
    "layernorm_backward_fast": [_P, _P, _P, _P, _P, _P, _P, _P, _N, _N, _N],
    "attention_forward_fast": [_P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _F, _P],
    "attention_backward_fast": [_P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _F, _P],
    "classifier_fast": [_P, _P, _P, _N, _N, _N, _F, _I],
    "sum_squares_fast": [_P, _N],
    "sum_squares_chunks": [_P, _N, _N, _P],
    "exp_fast_array": [_P, _P, _N],
}
RESTYPES = {"sum_squares_fast": ctypes.c_double}

_lock = threading.Lock()
_loaded = {}            # so path -> CDLL, or None when building failed


def cache_dir() -> Path:
    """Where the built library is kept: $GPT2NP_CPU_CACHE or ~/.cache/gpt2np/cpu."""
    env = os.environ.get("GPT2NP_CPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gpt2np" / "cpu"


def compiler():
    """The C compiler's path: $CC, else cc, else gcc; None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What names this CPU's instruction set (the library is built with -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor() + platform.machine()


def _build(cc: str, so_path: Path) -> None:
    """Compile every csrc file with its flags and link them into so_path (atomically)."""
    so_path.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=so_path.parent))
    try:
        objects = []
        for name, flags in SOURCES.items():
            objects.append(str(build / Path(name).with_suffix(".o")))
            _run([cc, *flags, "-c", str(CSRC / name), "-o", objects[-1]], cc)
        out = build / "cpu_kernels.so"
        _run([cc, "-shared", *objects, "-o", str(out), "-lm"], cc)
        os.replace(out, so_path)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _run(command, cc):
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")


def _key(cc: str, version: str) -> str:
    """The cache key: the sources, their flags, the compiler and the CPU."""
    parts = [f"{name}\0{(CSRC / name).read_text()}\0{' '.join(flags)}"
             for name, flags in SOURCES.items()]
    return hashlib.sha256("\0".join([*parts, cc, version, _cpu_id()]).encode()).hexdigest()[:16]


def load():
    """The built library (a ctypes CDLL with SIGNATURES set), or None when it cannot be built here.
    """
    cc = compiler()
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        so_path = cache_dir() / f"cpu_kernels-{_key(cc, version)}.so"
    except OSError:
        return None
    with _lock:
        if str(so_path) not in _loaded:
            lib = None
            try:
                if not so_path.is_file():
                    _build(cc, so_path)
                lib = ctypes.CDLL(str(so_path))
                for name, argtypes in SIGNATURES.items():
                    getattr(lib, name).argtypes = argtypes
                    getattr(lib, name).restype = RESTYPES.get(name)
            except (OSError, RuntimeError):
                lib = None
            _loaded[str(so_path)] = lib
        return _loaded[str(so_path)]
