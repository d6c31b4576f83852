"""CPU emulator for gpt2np's hand-written CUDA kernels, so every kernel runs in CI without a GPU.

g++ compiles the SAME kernels/*.cu source that NVRTC compiles for the GPU, with a shim header
(gpt2np/backends/cuda/emu/cuda_emu.h, force-included) that provides the CUDA built-ins, and a fiber
runtime (gpt2np/backends/cuda/emu/emu_runtime.h) that runs every CUDA thread of a block as a fiber
(user-level context switch, 64 KiB stack each). The API mirrors cupy.RawModule / cupy.RawKernel, so
the CUDA backend can take either runtime; NumPy arrays (guarded ones from device_array) stand in for
device memory:

    mod = EmuModule(code, options=("-I/path/to/kernels",), schedule="forward")
    fn = mod.get_function("layernorm_forward")
    fn(grid, block, (out, mean, rstd, inp, w, b, np.int32(N), np.int32(C)), shared_mem=0)
    mod.schedule = "reverse"        # or fn(..., schedule="reverse")

Supported CUDA subset (details at the top of emu/cuda_emu.h):
  * qualifiers __global__ __device__ __host__ __forceinline__ __noinline__ __restrict__
    __launch_bounds__ __align__ __constant__; built-ins threadIdx blockIdx blockDim gridDim
    warpSize; vector types (float2, float4, int4, ... with make_*); C math + fast-math
    intrinsics (__expf, __logf, rsqrtf, __fdividef, __ldg, ...); printf; assert.
  * static and `extern __shared__` (dynamic) shared memory, 0xFF-filled (NaN as float) at every
    block start, so a read-before-write shows up as NaN.
  * __syncthreads (+ _count/_and/_or), __syncwarp, warp shuffles (__shfl_sync/_up/_down/_xor),
    votes (__all_sync, __any_sync, __ballot_sync), __reduce_*_sync, __match_*_sync,
    atomics via std::atomic_ref, and a cooperative_groups subset (thread_block,
    tiled_partition<N>, tile shuffles/votes, cg::reduce with cg::plus/less/greater, scans).
  * <mma.h>: nvcuda::wmma m16n16k8 TF32 and m16n16k16 __nv_bfloat16 fragments (load/store/mma_sync
    as warp collectives, fill_fragment, __float_to_tf32), TF32 or bf16 inputs and fp32
    accumulation (emu/include/mma.h). The
    element layout of fragments is picked per launch (wmma_layout: 0 natural, else a seeded
    permutation; GPT2NP_EMU_WMMA_LAYOUT), so comparing two layouts catches a kernel that
    depends on the layout, which CUDA leaves unspecified.
  * <cuda_bf16.h>: __nv_bfloat16 as storage with its two conversions (emu/include/cuda_bf16.h).
  * Not emulated: half, bf16 arithmetic operators, textures, grid-wide sync,
    memcpy_async, inline PTX.

Semantics and checks:
  * Blocks run one after another; a block's threads run round-robin and switch only at barriers
    and warp collectives. Schedule "forward" runs threads (and blocks) first to last, "reverse"
    last to first, so a missing barrier gives a different (often NaN) result under one of them.
    GPT2NP_EMU_SCHEDULE sets the default schedule (e.g. to run a whole test suite reversed).
  * A __syncthreads or warp collective reached by only part of the block/warp (the rest returned
    or wait elsewhere), a failing assert, __trap, an invalid memory access, or a fiber stack
    overflow raises EmuKernelError naming the kernel, block and thread -- never a hang or crash.
  * Kernel entry points must be `extern "C" __global__ void name(...)` (non-template). Their
    signatures are parsed from the preprocessed source; the argument types are resolved by the
    C++ compiler (typedefs included) and every launch is checked: wrong argument count, a
    scalar of the wrong type (float vs int, Python int/float instead of np.int32/np.float32 --
    CuPy would pass those as 64-bit), or an array whose dtype does not match the pointer's
    element type (float* <- float32, int* <- int32, float4* <- float32 ...) raise TypeError.
    Pointer arguments are C-contiguous NumPy arrays (writeable unless the pointee is const) or
    the integer 0 for a null pointer (None is rejected: CuPy does not turn it into NULL).
  * Guard pages (compute-sanitizer memcheck's job): device_array(shape, dtype, guard) -- what
    EmuRuntime allocates (GPT2NP_EMU_GUARD / EmuRuntime(guard=...): "after" (default), "before",
    "off") -- puts each allocation in its own mapping between two PROT_NONE pages, its last byte
    against the second one ("after"; the start stays 16-byte aligned, so a size that is not a
    multiple of 16 leaves a pad of 1-15 bytes) or its first byte right after the first one
    ("before", page-aligned). An access to a guard page faults inside the kernel; the error names
    kernel, block, thread, read/write and the buffer: the argument whose guard page it is (or the
    nearest argument buffer), with its number, dtype, shape, the element index and the distance
    past its end / before its start. The bytes between the data and the guard-free side of its
    pages (and the alignment pad) hold canary bytes, checked after each launch for the launch's
    buffers: a write there is reported (without block and thread), a read is not.
  * Dynamic shared memory is limited to 48 KiB unless fn.max_dynamic_shared_size_bytes is raised
    (at most 227 KiB), as on the GPU. It ends on a PROT_NONE page at the launch's shared_mem rounded
    up to 128 bytes, so a kernel that uses more than its launch gave faults (the error says so); a
    write into the rounding is found after the block by the canary bytes there.

Compilation: `g++ -E` with the shim (extern "C" kernels found, __shared__/__global__ rewritten),
then `g++ -O2 -std=c++20 -fPIC -shared` into a .so cached under GPT2NP_EMU_CACHE (default
~/.cache/gpt2np/emu), keyed by a hash of the source, the files it includes with "...", the shim,
the options and the compiler version. NVRTC options -I/--include-path, -D/--define-macro and
-U/--undefine-macro are honoured; all other options (-arch, --use_fast_math, -std, ...) are
ignored. g++ (GNU, >= 10) is required; GPT2NP_EMU_CXX names another g++ binary;
GPT2NP_EMU_KEEP=1 keeps the build folder (preprocessed and rewritten source) for debugging.

Known limits: fibers are not preempted, so a thread that spins waiting for a value another
thread or block writes (without a barrier in the loop) hangs. Out-of-bounds accesses are caught
only for guarded allocations and only at their ends: not an overrun of a view inside a larger
allocation (the model's tensors in its flat buffers, a reused scratch buffer), not a read of the
canary pads, not an access more than a page away that lands in another mapping (plain NumPy
arrays passed directly, as in most emulator tests, have no guards at all).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from gpt2np.paths import EMU_HEADERS_DIR

EMU_DIR = EMU_HEADERS_DIR
SHIM_HEADER = EMU_DIR / "cuda_emu.h"
SHIM_INCLUDE_DIR = EMU_DIR / "include"
EMULATOR_VERSION = "2"          # bump to invalidate every cached module

SCHEDULES = {"forward": 0, "reverse": 1}
DEFAULT_DYNAMIC_SHARED = 48 * 1024      # as CUDA, without cudaFuncSetAttribute
MAX_DYNAMIC_SHARED = 232448             # 227 KiB (kMaxDynSmem in emu_runtime.h)
MAX_THREADS_PER_BLOCK = 1024
_SLOT = 16                              # bytes of argument storage per kernel parameter

_CODE_DTYPES = {
    "f4": np.dtype(np.float32), "f8": np.dtype(np.float64),
    "i1": np.dtype(np.int8), "u1": np.dtype(np.uint8),
    "i2": np.dtype(np.int16), "u2": np.dtype(np.uint16),
    "i4": np.dtype(np.int32), "u4": np.dtype(np.uint32),
    "i8": np.dtype(np.int64), "u8": np.dtype(np.uint64),
    "b1": np.dtype(np.bool_),
}


class CompilerNotFoundError(FileNotFoundError):
    """g++ is missing (or is not GNU g++ >= 10)."""


class EmuCompileError(RuntimeError):
    """g++ rejected the kernel source; the message holds the compiler's diagnostics."""


class EmuKernelError(RuntimeError):
    """A launch failed inside the kernel: partial barrier, divergent warp collective, assert,
    invalid memory access, stack overflow. The message names kernel, block and thread."""


# ---------------------------------------------------------------------------- compiler ------

def _compiler_name() -> str:
    return os.environ.get("GPT2NP_EMU_CXX", "g++")


@functools.cache
def _compiler_info(name: str) -> tuple[str, str]:
    path = shutil.which(name)
    if path is None:
        raise CompilerNotFoundError(
            f"CUDA emulator: C++ compiler '{name}' not found on PATH; the emulator compiles "
            f"kernels with GNU g++ >= 10 (C++20): install g++ (e.g. apt-get install g++) or set "
            f"GPT2NP_EMU_CXX to a g++ binary")
    probe = subprocess.run([path, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                           text=True)
    macros = dict(line.split(" ", 2)[1:3] for line in probe.stdout.splitlines()
                  if line.startswith("#define ") and line.count(" ") >= 2)
    if probe.returncode != 0 or "__GNUC__" not in macros or "__clang__" in macros:
        raise CompilerNotFoundError(
            f"CUDA emulator: '{path}' is not GNU g++ (the emulator needs g++ >= 10; clang is not "
            f"supported); set GPT2NP_EMU_CXX to a g++ binary")
    if int(macros["__GNUC__"]) < 10:
        raise CompilerNotFoundError(
            f"CUDA emulator: '{path}' is g++ {macros['__GNUC__']}; g++ >= 10 is needed "
            f"(C++20 std::atomic_ref)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return path, version.splitlines()[0] if version else f"g++ {macros['__GNUC__']}"


def compiler() -> tuple[str, str]:
    """(path, first line of --version) of the g++ the emulator uses; CompilerNotFoundError if
    it is missing or is not GNU g++ >= 10."""
    return _compiler_info(_compiler_name())


def cache_dir() -> Path:
    """Where compiled modules are kept: $GPT2NP_EMU_CACHE or ~/.cache/gpt2np/emu."""
    env = os.environ.get("GPT2NP_EMU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gpt2np" / "emu"


# ---------------------------------------------------------------------------- source -------

def _split_options(options) -> tuple[list[str], list[str], list[str]]:
    """NVRTC-style options -> (include dirs, -D/-U flags for g++, ignored options)."""
    includes, macros, ignored = [], [], []
    opts = list(options)
    i = 0
    while i < len(opts):
        o = str(opts[i])
        nxt = str(opts[i + 1]) if i + 1 < len(opts) else None
        if o in ("-I", "--include-path") and nxt is not None:
            includes.append(nxt)
            i += 2
            continue
        if o in ("-D", "--define-macro") and nxt is not None:
            macros.append("-D" + nxt)
            i += 2
            continue
        if o in ("-U", "--undefine-macro") and nxt is not None:
            macros.append("-U" + nxt)
            i += 2
            continue
        if o.startswith("--include-path="):
            includes.append(o.split("=", 1)[1])
        elif o.startswith("-I"):
            includes.append(o[2:])
        elif o.startswith("--define-macro="):
            macros.append("-D" + o.split("=", 1)[1])
        elif o.startswith("-D"):
            macros.append(o)
        elif o.startswith("--undefine-macro="):
            macros.append("-U" + o.split("=", 1)[1])
        elif o.startswith("-U"):
            macros.append(o)
        else:
            ignored.append(o)
        i += 1
    return includes, macros, ignored


_QUOTE_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _quoted_includes(code: str, here: Path | None, dirs: list[Path], seen: dict) -> None:
    """Collect (recursively) the files reached through #include "..." for the cache key."""
    for name in _QUOTE_INCLUDE.findall(code):
        candidates = ([here / name] if here else []) + [d / name for d in dirs]
        for c in candidates:
            if c.is_file():
                key = str(c.resolve())
                if key not in seen:
                    text = c.read_text(errors="replace")
                    seen[key] = text
                    _quoted_includes(text, c.parent, dirs, seen)
                break
        else:
            seen.setdefault("missing:" + name, "")


def _shim_files_text() -> str:
    parts = []
    for p in sorted(EMU_DIR.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            parts.append(f"{p.relative_to(EMU_DIR)}\n{p.read_text(errors='replace')}")
    return "\n".join(parts)


_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)\s*)*'
    r'void\s+([A-Za-z_]\w*)\s*\(')
_EXTERN_SHARED = re.compile(
    r'\bextern\s+(volatile\s+)?__shared__\s+([^;{}]*?)\b([A-Za-z_]\w*)\s*\[\s*\]\s*;')
_ATTRIBUTE = re.compile(r'__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)|\balignas\s*\([^()]*\)')
_STATIC_SHARED = re.compile(r'(?:\bstatic\s+)?\b__shared__\b')
_NOT_A_NAME = {"int", "float", "double", "char", "short", "long", "unsigned", "signed", "bool",
               "void", "const", "volatile", "__restrict__", "__restrict", "restrict", "size_t"}


def _split_params(text: str) -> list[str]:
    params, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(text[start:i])
            start = i + 1
    params.append(text[start:])
    params = [" ".join(p.split()) for p in params]
    return [] if params == [""] or params == ["void"] else params


def _find_kernels(text: str) -> dict[str, list[tuple[str, str]]]:
    """extern "C" __global__ kernels defined in preprocessed source -> [(param name, decl)]."""
    kernels: dict[str, list[tuple[str, str]]] = {}
    for m in _KERNEL.finditer(text):
        name, depth, i = m.group(1), 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        rest = text[i:i + 200].lstrip()
        if not rest.startswith("{"):
            continue                      # a declaration; the definition comes elsewhere
        params = []
        for k, p in enumerate(_split_params(text[m.end():i - 1])):
            nm = re.search(r"([A-Za-z_]\w*)\s*(\[[^\]]*\])?\s*$", p)
            if nm and nm.group(1) not in _NOT_A_NAME and p[:nm.start()].strip():
                pname, decl = nm.group(1), p[:nm.start()] + ("*" if nm.group(2) else "")
            else:
                pname, decl = f"arg{k}", p
            decl = " ".join(decl.replace("__restrict__", "").split()).replace(" *", "*")
            params.append((pname, decl))
        kernels[name] = params
    return kernels


def _rewrite(text: str) -> str:
    """__shared__ and __global__ -> plain C++ (see cuda_emu.h)."""
    def dynamic(m):
        vol = m.group(1) or ""
        typ = " ".join(_ATTRIBUTE.sub(" ", m.group(2)).split())
        return (f"{vol}{typ}* const {m.group(3)} = "
                f"({vol}{typ}*)(void*)::__emu::g_dyn_smem;")
    text = _EXTERN_SHARED.sub(dynamic, text)
    text = _STATIC_SHARED.sub('static __attribute__((section("emu_shared")))', text)
    return re.sub(r"\b__global__\b", "", text)


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stubs(kernels: dict) -> str:
    out = ["\n// ---- generated by gpt2np/backends/cuda/emulator.py ----"]
    export = 'extern "C" __attribute__((visibility("default")))'
    for name in kernels:
        out.append(f"{export} int gpt2np_emu_launch_{name}(const __emu::LaunchConfig* c, void** a) "
                   f"{{ return __emu::launch(&{name}, \"{name}\", c, a); }}")
        out.append(f"{export} const char* gpt2np_emu_sig_{name}() {{ return "
                   f"__emu::signature(&{name}); }}")
    info = json.dumps({k: [list(p) for p in v] for k, v in kernels.items()})
    out.append(f"{export} const char* gpt2np_emu_module_info() {{ return {_c_string(info)}; }}")
    return "\n".join(out) + "\n"


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log = proc.stderr.strip()
        if len(log) > 12000:
            log = log[:12000] + "\n... (truncated)"
        raise EmuCompileError(f"CUDA emulator: g++ failed to {what}:\n{log}")


def _build(code: str, name: str, includes: list[str], macros: list[str], so_path: Path) -> None:
    cxx, _ = compiler()
    so_path.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=so_path.parent))
    try:
        src = build / name
        src.write_text(code)
        pre = build / "preprocessed.ii"
        _run([cxx, "-std=c++20", "-E", "-x", "c++", f"-ffile-prefix-map={build}/=",
              "-include", str(SHIM_HEADER),
              f"-I{SHIM_INCLUDE_DIR}", *[f"-I{d}" for d in includes], *macros, str(src),
              "-o", str(pre)], f"preprocess {name}")
        text = pre.read_text()
        kernels = _find_kernels(text)
        final = build / "emulated.ii"
        final.write_text(_rewrite(text) + _stubs(kernels))
        tmp_so = build / "module.so"
        _run([cxx, "-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-weak",
              "-fno-strict-aliasing", "-fno-math-errno", "-x", "c++-cpp-output", str(final),
              "-o", str(tmp_so)], f"compile {name}")
        os.replace(tmp_so, so_path)
    finally:
        if not os.environ.get("GPT2NP_EMU_KEEP"):
            shutil.rmtree(build, ignore_errors=True)


class _Launcher(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_ulonglong), ("schedule", ctypes.c_int),
                ("wmma_layout", ctypes.c_uint), ("wmma_tf32", ctypes.c_int)]


_LOADED: dict[str, ctypes.CDLL] = {}
_LOADED_LOCK = threading.Lock()
# One launch at a time in the whole process: a launch swaps the process-wide fault handlers.
_LAUNCH_LOCK = threading.Lock()


def _load(so_path: Path) -> ctypes.CDLL:
    with _LOADED_LOCK:
        key = str(so_path)
        if key not in _LOADED:
            lib = ctypes.CDLL(key)
            lib.gpt2np_emu_last_error.restype = ctypes.c_char_p
            lib.gpt2np_emu_last_fault.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.gpt2np_emu_last_fault.restype = ctypes.c_int
            lib.gpt2np_emu_module_info.restype = ctypes.c_char_p
            _LOADED[key] = lib
        return _LOADED[key]


def resolve_wmma_layout(value=None) -> int:
    """The WMMA fragment element layout: `value`, else $GPT2NP_EMU_WMMA_LAYOUT, else 0 (the natural
    one); any other integer in [0, 2^32) seeds a permutation (see emu/include/mma.h)."""
    if value is None:
        value = os.environ.get("GPT2NP_EMU_WMMA_LAYOUT") or 0
    try:
        layout = int(value)
    except (TypeError, ValueError):
        layout = -1
    if not 0 <= layout < 2 ** 32 or isinstance(value, bool):
        raise ValueError("CUDA emulator: WMMA layout must be an integer in [0, 2^32), got "
                         f"{value!r} (GPT2NP_EMU_WMMA_LAYOUT or wmma_layout=...)")
    return layout


def _check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"CUDA emulator: unknown schedule {schedule!r} "
                         f"(choose from {', '.join(SCHEDULES)})")
    return schedule


# ---------------------------------------------------------------------------- device memory --
# Guarded allocations, the emulator's compute-sanitizer memcheck. Each device array of the
# emulator runtime gets its own anonymous mapping:
#
#     [guard page][pad_lo | data | pad_hi][guard page]        guard pages are PROT_NONE
#
# mode "after" (default): the data ends at the second guard page, so the first byte past the end
#   faults. The start is kept 16-byte aligned (kernels load float4; more when nbytes is a multiple
#   of a larger power of two), so when nbytes is not a multiple of 16, pad_hi holds 1-15 bytes.
# mode "before": the data starts right after the first guard page (page-aligned, so 256-byte
#   aligned like cudaMalloc): the first byte before the start faults.
# The pads are filled with a canary byte and checked after every launch for the buffers it was
# given, so a WRITE into a pad (the other side, within the page) is reported too, after the launch;
# reads of a pad are not. Accesses beyond the pad hit the other guard page (up to one page away).

GUARD_MODES = ("after", "before", "off")
ALLOC_ALIGN = 16                        # start alignment of a guarded allocation in mode "after"
_PAGE = mmap.PAGESIZE
_CANARY = 0xA5
_ACCESS = {1: "read", 2: "write", 3: "access"}
_BUFFER_NUMBERS = itertools.count(1)
# number -> DeviceBuffer
_LIVE_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def guard_mode(value: str | None = None) -> str:
    """The guard mode: `value`, else $GPT2NP_EMU_GUARD, else "after". One of GUARD_MODES."""
    mode = value if value is not None else (os.environ.get("GPT2NP_EMU_GUARD") or "after")
    if mode not in GUARD_MODES:
        raise ValueError(f"CUDA emulator: unknown guard mode {mode!r} (choose from "
                         f"{', '.join(GUARD_MODES)}; GPT2NP_EMU_GUARD or EmuRuntime(guard=...))")
    return mode


@functools.cache
def _mprotect():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mprotect
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class DeviceBuffer(mmap.mmap):
    """The mapping behind one guarded device array (the array's base; unmapped when the last
    array or view of it is garbage collected). Addresses are absolute: data..end is the array's
    memory, guards the two PROT_NONE ranges, pads the canary-filled (start, end) ranges."""

    number: int
    dtype: np.dtype
    shape: tuple
    guard: str
    data: int
    end: int
    guards: tuple
    pads: tuple

    @property
    def nbytes(self) -> int:
        return self.end - self.data

    def describe(self) -> str:
        return f"buffer #{self.number} ({self.dtype}, shape {self.shape}, {self.nbytes} bytes)"

    def guard_side(self, addr: int) -> str | None:
        """"before"/"after" when addr lies on the guard page before/after the data, else None."""
        for side, (lo, hi) in zip(("before", "after"), self.guards):
            if lo <= addr < hi:
                return side
        return None

    def damaged_pads(self) -> list[tuple[str, int, int]]:
        """[(side, first, last+1 absolute address)] of pad bytes that no longer hold the canary."""
        out = []
        base = self.guards[0][0]
        for side, (lo, hi) in zip(("before", "after"), self.pads):
            if hi > lo:
                got = self[lo - base:hi - base]
                if got.count(_CANARY) != len(got):
                    bad = [i for i, b in enumerate(got) if b != _CANARY]
                    out.append((side, lo + bad[0], lo + bad[-1] + 1))
        return out

    def restore_pads(self) -> None:
        base = self.guards[0][0]
        for lo, hi in self.pads:
            if hi > lo:
                self[lo - base:hi - base] = bytes([_CANARY]) * (hi - lo)


def device_array(shape, dtype, guard: str = "after") -> np.ndarray:
    """A zero-filled C-contiguous array in its own guarded mapping (see above); guard "after" or
    "before". Slices and reshapes of it are ordinary views; buffer_of() finds its DeviceBuffer."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if guard not in ("after", "before"):
        raise ValueError(f"device_array: guard must be 'after' or 'before', got {guard!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    span = -(-nbytes // _PAGE) * _PAGE
    buf = DeviceBuffer(-1, span + 2 * _PAGE, flags=mmap.MAP_PRIVATE)
    view = ctypes.c_char.from_buffer(buf)
    base = ctypes.addressof(view)
    del view
    offset = _PAGE if guard == "before" else (_PAGE + span - nbytes) & ~(ALLOC_ALIGN - 1)
    buf.number = next(_BUFFER_NUMBERS)
    buf.dtype, buf.shape, buf.guard = dtype, shape, guard
    buf.data, buf.end = base + offset, base + offset + nbytes
    buf.guards = ((base, base + _PAGE), (base + _PAGE + span, base + 2 * _PAGE + span))
    buf.pads = ((base + _PAGE, buf.data), (buf.end, base + _PAGE + span))
    buf.restore_pads()
    for lo, hi in buf.guards:
        if _mprotect()(lo, hi - lo, 0) != 0:            # PROT_NONE
            err = ctypes.get_errno()
            raise OSError(err,
                          f"CUDA emulator: mprotect of a guard page failed: {os.strerror(err)}")
    _LIVE_BUFFERS[buf.number] = buf
    return np.frombuffer(buf, dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(shape)


def buffer_of(array) -> DeviceBuffer | None:
    """The DeviceBuffer a (view of a) guarded device array lives in, else None."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, DeviceBuffer) else None


def _named(buf: DeviceBuffer, params: list[str]) -> str:
    """"parameter 'out' = buffer #12 (float32, shape (768,), 3072 bytes)"."""
    if not params:
        return buf.describe()
    quoted = ", ".join(f"'{p}'" for p in params)
    return f"parameter{'s' if len(params) > 1 else ''} {quoted} = {buf.describe()}"


def _where(buf: DeviceBuffer, addr: int, params: list[str]) -> str:
    """"past the end of parameter 'out' = buffer #12 (...): element 768, byte offset 3072 (0 bytes
    past the end)"."""
    off = addr - buf.data
    if addr >= buf.end:
        side, rel = "past the end of", f"{addr - buf.end} bytes past the end"
    else:
        side, rel = "before the start of", f"{buf.data - addr} bytes before the start"
    return (f"{side} {_named(buf, params)}: element {off // buf.dtype.itemsize}, byte offset {off} "
            f"({rel})")


def _explain_fault(kernel: str, message: str, access: int, addr: int,
                   args: list[tuple[str, DeviceBuffer]]) -> str:
    """The C runtime's fault message, rewritten to name the device buffer the address is next to:
    the argument whose guard page it hit, else the nearest argument buffer."""
    m = re.match(r"(kernel '[^']*' block \([^)]*\) thread \([^)]*\)): ", message)
    prefix = m.group(1) if m else f"kernel '{kernel}'"
    what = _ACCESS.get(access, "access")
    given: dict[int, tuple[DeviceBuffer, list[str]]] = {}
    for pname, buf in args:
        given.setdefault(buf.number, (buf, []))[1].append(pname)
    owner = side = None
    for buf in list(_LIVE_BUFFERS.values()):
        side = buf.guard_side(addr)
        if side:
            owner = buf
            break
    if owner is not None and owner.number in given:
        buf, params = given[owner.number]
        return (f"{prefix}: out-of-bounds {what} {_where(buf, addr, params)}; address {addr:#x} is "
                f"on the guard page {side} the buffer (GPT2NP_EMU_GUARD={buf.guard})")
    if given and addr >= 1 << 16:
        def distance(b):
            return b.data - addr if addr < b.data else max(0, addr - b.end + 1)
        buf, params = min(given.values(), key=lambda bp: distance(bp[0]))
        note = (f"; the address is on the guard page {side} {owner.describe()}, which this launch "
                f"was not given" if owner is not None else "")
        return (f"{prefix}: out-of-bounds {what} at address {addr:#x}, nearest buffer of the "
                f"launch: {_where(buf, addr, params)}{note}")
    if owner is not None:
        return (f"{message}; the address is on the guard page {side} {owner.describe()}, which "
                "this launch was not given")
    return message


def _pad_error(kernel: str, args: list[tuple[str, DeviceBuffer]]) -> str | None:
    """Checks (and restores) the canary pads of the launch's buffers; a message
    if one was written."""
    problems, seen = [], set()
    for _, buf in args:
        if buf.number in seen:
            continue
        seen.add(buf.number)
        damaged = buf.damaged_pads()
        for side, lo, hi in damaged:
            params = [p for p, b in args if b is buf]
            item = buf.dtype.itemsize
            first, last = lo - buf.data, hi - 1 - buf.data
            rel = "past the end of" if side == "after" else "before the start of"
            elems = (f"element {first // item}" if first // item == last // item
                     else f"elements {first // item}..{last // item}")
            pad = buf.pads[side == "after"]
            what = ("alignment pad between it and its guard page" if side == buf.guard
                    else f"pad {side} it, the rest of its page")
            problems.append(f"out-of-bounds write {rel} {_named(buf, params)}: {elems} (byte "
                            f"offsets {first}..{last}) in the {pad[1] - pad[0]}-byte {what}")
        if damaged:
            buf.restore_pads()
    if not problems:
        return None
    return (f"kernel '{kernel}': " + "; ".join(problems) +
            " (found after the launch from the pad's canary bytes; block and thread unknown)")


# ---------------------------------------------------------------------------- module -------

class EmuModule:
    """A compiled .cu source, like cupy.RawModule(code=..., options=...).

    code: the CUDA source text. options: NVRTC-style options (-I, -D, -U used; others ignored
    and listed in .ignored_options). include_dirs: more -I directories. schedule: "forward" or
    "reverse" (default $GPT2NP_EMU_SCHEDULE or "forward"); settable later. wmma_layout: the element
    layout of WMMA fragments, 0 natural, any other integer a seeded permutation (default
    $GPT2NP_EMU_WMMA_LAYOUT or 0; settable later; see emu/include/mma.h). wmma_tf32: WMMA inputs are
    TF32 as on the hardware (default); False computes them in fp32, a test aid. name: file name the
    source is compiled under, shown in compiler errors and assert messages.
    Attributes: kernels ({name: [(param name, declared type)]}), path (the cached .so).
    """

    def __init__(self, code: str, options: tuple = (), include_dirs=(), schedule: str | None = None,
                 name: str = "kernel.cu", wmma_layout: int | None = None, wmma_tf32: bool = True):
        includes, macros, self.ignored_options = _split_options(options)
        includes = [str(Path(d).resolve()) for d in [*includes, *include_dirs]]
        self.schedule = schedule or os.environ.get("GPT2NP_EMU_SCHEDULE", "forward")
        self.wmma_layout = wmma_layout
        self.wmma_tf32 = bool(wmma_tf32)
        found: dict[str, str] = {}
        _quoted_includes(code, None, [Path(d) for d in includes], found)
        key = hashlib.sha256("\0".join([
            EMULATOR_VERSION, compiler()[1], _shim_files_text(), code, name,
            *includes, *macros, *sorted(f"{k}\n{v}" for k, v in found.items())]).encode())
        self.path = cache_dir() / f"{key.hexdigest()[:40]}.so"
        if not self.path.exists():
            _build(code, Path(name).name, includes, macros, self.path)
        self._lib = _load(self.path)
        self.kernels: dict[str, list[tuple[str, str]]] = {
            k: [tuple(p)
                for p in v] for k, v in json.loads(self._lib.gpt2np_emu_module_info()).items()}
        self._functions: dict[str, EmuFunction] = {}

    @property
    def schedule(self) -> str:
        return self._schedule

    @schedule.setter
    def schedule(self, value: str) -> None:
        self._schedule = _check_schedule(value)

    @property
    def wmma_layout(self) -> int:
        return self._wmma_layout

    @wmma_layout.setter
    def wmma_layout(self, value) -> None:
        self._wmma_layout = resolve_wmma_layout(value)

    def get_function(self, name: str) -> EmuFunction:
        if name not in self.kernels:
            raise ValueError(f"CUDA emulator: no extern \"C\" __global__ kernel named {name!r} in "
                             f"this module (found: {', '.join(sorted(self.kernels)) or 'none'})")
        if name not in self._functions:
            self._functions[name] = EmuFunction(self, name)
        return self._functions[name]


def _dims(value, what: str, kernel: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer))
                                          and not isinstance(d, bool) for d in dims):
        raise ValueError(f"kernel '{kernel}': {what} must be an int or a tuple of 1-3 ints, "
                         f"got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    if min(dims) < 1:
        raise ValueError(f"kernel '{kernel}': {what} {dims} has a dimension < 1")
    return dims


def _describe(arg) -> str:
    if isinstance(arg, np.ndarray):
        return f"{arg.dtype} array"
    if isinstance(arg, np.generic):
        return f"numpy.{arg.dtype} scalar"
    return f"Python {type(arg).__name__}"


class EmuFunction:
    """One kernel of an EmuModule, called like cupy.RawKernel: fn(grid, block,
    args, shared_mem=0)."""

    def __init__(self, module: EmuModule, name: str):
        self.module, self.name = module, name
        lib = module._lib
        self._launch = getattr(lib, f"gpt2np_emu_launch_{name}")
        self._launch.argtypes = [ctypes.POINTER(_Launcher), ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        sig = getattr(lib, f"gpt2np_emu_sig_{name}")
        sig.restype = ctypes.c_char_p
        codes = sig().decode()
        self.codes = codes.split(",") if codes else []
        params = module.kernels[name]
        if len(params) != len(self.codes):   # the parser lost track: fall back to positions
            params = [(f"arg{k}", c) for k, c in enumerate(self.codes)]
        self.params = params
        self.max_dynamic_shared_size_bytes = DEFAULT_DYNAMIC_SHARED
        self.max_threads_per_block = MAX_THREADS_PER_BLOCK

    def __repr__(self) -> str:
        args = ", ".join(f"{d} {n}" for n, d in self.params)
        return f"<EmuFunction {self.name}({args})>"

    def _arg_error(self, k: int, msg: str) -> TypeError:
        pname, decl = self.params[k]
        return TypeError(f"kernel '{self.name}' parameter {k} '{pname}' ({decl}): {msg}")

    def _pack(self, args) -> tuple[ctypes.Array, list, list[tuple[str, DeviceBuffer]]]:
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel '{self.name}': args must be a tuple, got "
                            f"{type(args).__name__}")
        if len(args) != len(self.codes):
            names = ", ".join(n for n, _ in self.params)
            raise TypeError(f"kernel '{self.name}' takes {len(self.codes)} arguments ({names}), "
                            f"got {len(args)}")
        storage = ctypes.create_string_buffer(_SLOT * max(1, len(args)))
        buffers = []
        for k, (code, arg) in enumerate(zip(self.codes, args)):
            kind, elem = code.split(":")
            if kind.startswith("P"):
                value = self._pointer(k, kind == "Pc", elem, arg)
                struct.pack_into("<Q", storage, _SLOT * k, value)
                buf = buffer_of(arg) if value else None
                if buf is not None:
                    buffers.append((self.params[k][0], buf))
            else:
                raw = self._scalar(k, elem, arg)
                storage[_SLOT * k:_SLOT * k + len(raw)] = raw
        base = ctypes.addressof(storage)
        pointers = (ctypes.c_void_p * max(1, len(args)))(*[base + _SLOT * k
                                                           for k in range(len(args))])
        return pointers, [storage, args], buffers

    def _pointer(self, k: int, const: bool, elem: str, arg) -> int:
        if arg is None:
            raise self._arg_error(k, "got None; CuPy passes None as 0xffffffff, not NULL -- pass 0 "
                                     "for a null pointer")
        if isinstance(arg, (int, np.integer)) and not isinstance(arg, bool) and int(arg) == 0:
            return 0
        if not isinstance(arg, np.ndarray):
            raise self._arg_error(k,
                                  f"expected a NumPy array (device memory), got {_describe(arg)}")
        if not arg.flags.c_contiguous:
            raise self._arg_error(k, "array is not C-contiguous (kernels index flat memory)")
        if not const and not arg.flags.writeable and arg.size:
            raise self._arg_error(k, "array is read-only but the pointer is not const")
        if elem in _CODE_DTYPES:
            want = _CODE_DTYPES[elem]
            if arg.dtype != want:
                raise self._arg_error(k, f"expected a {want} array, got {arg.dtype}")
        elif elem.startswith("V"):
            base_code, n = elem[1:].split("x")
            want, n = _CODE_DTYPES[base_code], int(n)
            align = want.itemsize * (1 if n in (1, 3) else min(n, 16 // want.itemsize))
            if arg.dtype != want:
                raise self._arg_error(k,
                                      f"expected a {want} array (vector of {n}), got {arg.dtype}")
            if arg.nbytes % (want.itemsize * n):
                raise self._arg_error(k, f"array of {arg.size} elements is not a whole number of "
                                         f"{n}-vectors")
            if arg.size and arg.ctypes.data % align:
                raise self._arg_error(k, f"array data is not {align}-byte aligned")
        elif elem.startswith("o"):
            if arg.dtype.itemsize != int(elem[1:]):
                raise self._arg_error(k, f"expected elements of {elem[1:]} bytes, got {arg.dtype}")
        return arg.ctypes.data

    def _scalar(self, k: int, elem: str, arg) -> bytes:
        want = _CODE_DTYPES.get(elem)
        if want is None:                      # a struct or vector passed by value
            size = int(elem[1:]) if elem.startswith("o") else None
            if isinstance(arg, np.generic) and (size is None or arg.dtype.itemsize == size):
                return arg.tobytes()
            raise self._arg_error(k, f"expected a NumPy scalar of the parameter's size, got "
                                     f"{_describe(arg)}")
        if isinstance(arg, np.generic) and arg.dtype == want:
            return arg.tobytes()
        hint = f"pass numpy.{want}(...)"
        if isinstance(arg, (bool, int, float)):
            hint += " (CuPy would pass a Python int as int64 and a float as double)"
        raise self._arg_error(k, f"expected a numpy.{want} scalar, got {_describe(arg)}; {hint}")

    def __call__(self, grid, block, args, *, shared_mem: int = 0, schedule: str | None = None,
                 wmma_layout: int | None = None):
        grid = _dims(grid, "grid", self.name)
        block = _dims(block, "block", self.name)
        if (block[0] > 1024 or block[1] > 1024 or block[2] > 64
            or block[0] * block[1] * block[2] > 1024):
            raise ValueError(f"kernel '{self.name}': block {block} exceeds CUDA's limits "
                             f"(x, y <= 1024, z <= 64, at most 1024 threads)")
        if grid[0] > 2**31 - 1 or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"kernel '{self.name}': grid {grid} exceeds CUDA's limits "
                             f"(x < 2^31, y, z <= 65535)")
        shared_mem = int(shared_mem)
        limit = min(int(self.max_dynamic_shared_size_bytes), MAX_DYNAMIC_SHARED)
        if not 0 <= shared_mem <= limit:
            raise ValueError(f"kernel '{self.name}': shared_mem={shared_mem} bytes exceeds the "
                             f"{limit}-byte limit (raise max_dynamic_shared_size_bytes, at most "
                             f"{MAX_DYNAMIC_SHARED})")
        sched = _check_schedule(schedule) if schedule is not None else self.module.schedule
        pointers, keep, buffers = self._pack(args)
        layout = (self.module.wmma_layout if wmma_layout is None
                  else resolve_wmma_layout(wmma_layout))
        cfg = _Launcher((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                        SCHEDULES[sched], layout, int(self.module.wmma_tf32))
        lib = self.module._lib
        with _LAUNCH_LOCK:
            rc = self._launch(ctypes.byref(cfg), pointers)
            message = ""
            if rc:
                message = lib.gpt2np_emu_last_error().decode(errors="replace")
                addr = ctypes.c_void_p()
                access = lib.gpt2np_emu_last_fault(ctypes.byref(addr))
                if access:
                    message = _explain_fault(self.name, message, access, addr.value or 0, buffers)
            pads = _pad_error(self.name, buffers) if buffers else None
        del keep
        if rc:
            raise EmuKernelError(f"{message}; and {pads}" if pads else message)
        if pads:
            raise EmuKernelError(pads)
