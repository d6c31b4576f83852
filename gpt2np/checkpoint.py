"""llm.c model files (read and write, fp32 v3 and bf16 v5) and gpt2np's training state files.

Model file: a 256 x int32 header [magic 20240326, version, maxT, V, L, NH, C, Vp], then all 16
parameter tensors in llm.c's order (wte padded to Vp rows), float32 (v3) or bfloat16 (v5).
State file: what a resumed run needs beside the model: step, AdamW m and v, the data loaders'
positions and the sampling RNG (a small JSON header, then m and v as float32). A bf16 run's state also holds
its fp32 master weights after v (the JSON's "master_weights": true), so that a resume is bitwise.
bf16 model files load without an fp32 round trip when asked (load_model(keep_bf16=True): ml_dtypes bfloat16),
and bf16 parameters are written as they are.
Every write goes to a temporary file in the same folder and is renamed into place.
Rotation (-nk/-nm, llm.c's rule): checkpoint_to_delete says which older checkpoint a new one replaces,
delete_checkpoint removes one process's files of it (DONE marker first, so it is never seen as complete again).
Reading checks everything that can be checked cheaply: magic, version, sizes against the file size, the
state's required keys, and that a model's weights are all finite; the message names the file and the problem.
"""
import glob
import json
import os
import re
import struct

import numpy as np

from .config import GPT2Config
from .fileio import atomic_write  # noqa: F401  (re-exported)
from .tensors import num_parameters, offsets, param_shapes

MODEL_MAGIC = 20240326
VERSION_FP32, VERSION_BF16 = 3, 5
HEADER_INTS = 256
STATE_MAGIC = b"GPT2NPST"
STATE_VERSION = 1
# keys every state file's JSON header holds (the trainer's save_checkpoint writes more)
STATE_REQUIRED_KEYS = ("step", "train_loader", "rng")


class CheckpointError(ValueError):
    """A model or state file that cannot be used; the message names the file and the problem."""


def _read_header(path, f):
    raw = f.read(HEADER_INTS * 4)
    if len(raw) < HEADER_INTS * 4:
        raise CheckpointError(f"{path}: truncated: {len(raw)} bytes, shorter than the {HEADER_INTS * 4}-byte header")
    return np.frombuffer(raw, dtype="<i4")


def read_model_header(path):
    """(GPT2Config, version) from a model file's header, with its sizes checked against the file size."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such model file")
    with open(path, "rb") as f:
        header = _read_header(path, f)
    if header[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {header[0]} (expected {MODEL_MAGIC}): not an llm.c model file")
    version = int(header[1])
    if version not in (VERSION_FP32, VERSION_BF16):
        raise CheckpointError(f"{path}: unsupported version {version} (expected 3 = fp32 or 5 = bf16)")
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    try:
        cfg = GPT2Config(maxT, V, Vp, L, NH, C)
    except ValueError as e:
        raise CheckpointError(f"{path}: header describes an impossible model: {e}") from None
    itemsize = 4 if version == VERSION_FP32 else 2
    expected = HEADER_INTS * 4 + num_parameters(cfg) * itemsize
    actual = os.path.getsize(path)
    if actual < expected:
        raise CheckpointError(f"{path}: truncated: {actual} bytes, the header's model needs {expected}")
    if actual > expected:
        raise CheckpointError(f"{path}: {actual - expected} bytes more than the header's model needs ({expected})")
    return cfg, version


def load_model(path, keep_bf16=False):
    """(GPT2Config, flat parameters) from an llm.c model file: float32; a bf16 (v5) file is upcast, or with
    keep_bf16 returned as it is stored (ml_dtypes bfloat16, no conversion)."""
    cfg, version = read_model_header(path)
    n = num_parameters(cfg)
    with open(path, "rb") as f:
        f.seek(HEADER_INTS * 4)
        if version == VERSION_FP32:
            params = np.fromfile(f, dtype="<f4", count=n).astype(np.float32, copy=False)
        elif keep_bf16:
            from .backends.bf16 import BF16
            params = np.fromfile(f, dtype="<u2", count=n).view(BF16)
        else:
            params = bf16_to_fp32(np.fromfile(f, dtype="<u2", count=n))
    check_finite_params(path, cfg, params)
    return cfg, params


def check_finite_params(path, cfg: GPT2Config, params):
    """Raise CheckpointError naming the first NaN or infinite weight (its tensor's llm.c name, PARAM_NAMES, and
    its index in that tensor's shape): a model with one cannot train or sample, only fail later with a NaN loss."""
    chunk = 1 << 24                          # a bounded temporary, also for 1.5B parameters
    starts = [lo for lo in range(0, params.size, chunk) if not np.isfinite(params[lo:lo + chunk]).all()]
    if not starts:
        return
    bad = starts[0] + np.flatnonzero(~np.isfinite(params[starts[0]:]))
    first = int(bad[0])
    shapes = param_shapes(cfg)
    name = next(n for n, (off, size) in offsets(shapes).items() if off <= first < off + size)
    index = np.unravel_index(first - offsets(shapes)[name][0], shapes[name])
    more = f" (and {bad.size - 1} more non-finite weights)" if bad.size > 1 else ""
    raise CheckpointError(f"{path}: weight {name}[{', '.join(str(int(i)) for i in index)}] is {params[first]} "
                          f"(parameter {first} of {params.size}){more}: not a usable model")


def save_model(path, cfg: GPT2Config, params, dtype="fp32"):
    """Write an llm.c model file (dtype 'fp32' -> version 3, 'bf16' -> version 5), atomically. float32 params
    are rounded to nearest even for bf16; bf16 params (ml_dtypes) are written bit for bit."""
    params = np.asarray(params).reshape(-1)
    if params.dtype.name == "bfloat16" and dtype == "bf16":
        bits = params.view("<u2")
    else:
        params, bits = params.astype(np.float32, copy=False), None
    if params.size != num_parameters(cfg):
        raise ValueError(f"{path}: {params.size} parameters do not match the config ({num_parameters(cfg)})")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r} (fp32 or bf16)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, VERSION_FP32 if dtype == "fp32" else VERSION_BF16, cfg.max_seq_len,
                  cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.channels, cfg.padded_vocab_size]
    body = params.astype("<f4", copy=False) if dtype == "fp32" else bits if bits is not None else fp32_to_bf16(params)
    with atomic_write(path) as f:
        f.write(header.tobytes())
        body.tofile(f)


def bf16_to_fp32(bits):
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16(x):
    """float32 -> uint16 bfloat16 bit patterns, rounding to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


# ---- training state -----------------------------------------------------------------------
def save_state(path, info: dict, m, v, master=None):
    """A resumable training state: JSON `info` (step, loaders, rng...) then AdamW m, v (float32) and, for a
    bf16 run, its fp32 master weights (info gets "master_weights": true)."""
    if master is not None:
        info = dict(info, master_weights=True)
    blob = json.dumps(info, sort_keys=True).encode()
    arrays = [np.asarray(a, np.float32).reshape(-1) for a in (m, v) + (() if master is None else (master,))]
    if any(a.size != arrays[0].size for a in arrays):
        raise ValueError(f"{path}: m, v and the master weights differ in size")
    with atomic_write(path) as f:
        f.write(STATE_MAGIC + struct.pack("<iqq", STATE_VERSION, len(blob), arrays[0].size))
        f.write(blob)
        for a in arrays:
            a.tofile(f)


def read_state_header(path, num_params=None):
    """(info, n) of a state file without reading m and v: magic, version, size, JSON and required keys checked."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such state file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(STATE_MAGIC) + 20)
        if len(head) < len(STATE_MAGIC) + 20 or head[:len(STATE_MAGIC)] != STATE_MAGIC:
            raise CheckpointError(f"{path}: not a gpt2np state file (bad magic or truncated header)")
        version, blob_len, n = struct.unpack("<iqq", head[len(STATE_MAGIC):])
        if version != STATE_VERSION:
            raise CheckpointError(f"{path}: unsupported state version {version} (expected {STATE_VERSION})")
        if blob_len < 0 or n < 0 or size < len(head) + blob_len + 8 * n:
            raise CheckpointError(f"{path}: {size} bytes, the header says at least {len(head) + blob_len + 8 * n}: "
                                  f"truncated or corrupt")
        try:
            info = json.loads(f.read(blob_len))
        except ValueError:
            raise CheckpointError(f"{path}: corrupt JSON header") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: corrupt JSON header (not an object)")
    expected = len(head) + blob_len + 4 * n * state_arrays(info)
    if size != expected:
        raise CheckpointError(f"{path}: {size} bytes, the header says {expected}: truncated or corrupt")
    if num_params is not None and n != num_params:
        raise CheckpointError(f"{path}: optimizer state for {n} parameters, the model has {num_params}")
    missing = [key for key in STATE_REQUIRED_KEYS if key not in info]
    if missing:
        raise CheckpointError(f"{path}: the state lacks the key {missing[0]!r}: not written by gpt2np's trainer, "
                              f"or damaged")
    return info, n


def state_arrays(info) -> int:
    """How many float32 arrays of n follow a state's JSON: m, v, and the master weights of a bf16 run."""
    return 3 if info.get("master_weights") else 2


def load_state(path, num_params=None, with_master=False):
    """(info, m, v) from a state file; checks magic, version, sizes and the required keys (read_state_header).
    with_master: (info, m, v, master), master None when the file has no master weights (an fp32 run's)."""
    info, n = read_state_header(path, num_params)
    count = state_arrays(info)
    with open(path, "rb") as f:
        f.seek(os.path.getsize(path) - 4 * n * count)
        m = np.fromfile(f, dtype="<f4", count=n)
        v = np.fromfile(f, dtype="<f4", count=n)
        master = np.fromfile(f, dtype="<f4", count=n) if count == 3 else None
    return (info, m, v, master) if with_master else (info, m, v)


def model_path(out_dir, step):
    return os.path.join(out_dir, f"model_{step:08d}.bin")


def state_path(out_dir, step, rank=0):
    return os.path.join(out_dir, f"state_{step:08d}_{rank:05d}.bin")


def done_path(out_dir, step):
    return os.path.join(out_dir, f"DONE_{step:08d}")


def latest_checkpoint_step(out_dir):
    """The highest step with a DONE_ marker in out_dir (written after model and states), or None."""
    steps = [int(m.group(1)) for p in glob.glob(os.path.join(out_dir, "DONE_*"))
             if (m := re.fullmatch(r"DONE_(\d+)", os.path.basename(p)))]
    return max(steps) if steps else None


def checkpoint_to_delete(step, checkpoint_every, keep, major_every=0):
    """llm.c's -nk/-nm rule: once the checkpoint of `step` is complete, the step whose checkpoint goes
    (step - keep * checkpoint_every), or None: keep 0 (all kept), no such step (<= 0), or a major one (a
    multiple of major_every, -nm). A step where no checkpoint was written (a stop or the last step off the -n
    grid) names one that does not exist: nothing is deleted then, as in llm.c."""
    if keep <= 0 or checkpoint_every <= 0:
        return None
    old = step - keep * checkpoint_every
    if old <= 0 or (major_every > 0 and old % major_every == 0):
        return None
    return old


def delete_checkpoint(out_dir, step, rank=0):
    """Remove this process's files of the checkpoint of `step` in out_dir and only those names: rank 0 its
    DONE_ marker (first: a checkpoint partly deleted by a crash is then never taken for a complete one) and the
    model file, every rank its own state file (as llm.c's delete_checkpoint). Returns the paths removed; a file
    already gone is skipped, one that cannot be removed raises OSError."""
    paths = ([done_path(out_dir, step), model_path(out_dir, step)] if rank == 0 else []) + \
        [state_path(out_dir, step, rank)]
    removed = []
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
