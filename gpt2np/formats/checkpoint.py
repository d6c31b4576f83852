"""llm.c model files (read and write, fp32 v3 and bf16 v5) and gpt2np's training state files.

Model file: a 256 x int32 header [magic 20240326, version, maxT, V, L, NH, C, Vp], then all 16
parameter tensors in llm.c's order (wte padded to Vp rows), float32 (v3) or bfloat16 (v5).
State file: llm.c's (train_gpt2.cu's save_state: step, AdamW m and v, a bf16 run's fp32 master
weights, the train loader's position and shuffle state), then a footer of gpt2np's own (JSON: the
sampling RNG, the outlier window...) that llm.c does not read: either trainer resumes from the
other's files (see the layout above save_state).
bf16 model files load without an fp32 round trip when asked (load_model(keep_bf16=True): ml_dtypes
bfloat16), and bf16 parameters are written as they are.
Every write goes to a temporary file in the same folder and is renamed into place.
Rotation (-nk/-nm): checkpoints_to_delete says which older checkpoints a new one replaces (llm.c's
rule, checkpoint_to_delete, on the -n grid; the K newest that exist off it), delete_checkpoint
removes one process's files of one (DONE marker first, so it is never seen as complete again). A
checkpoint written again loses its DONE marker before its files are rewritten (remove_done_marker).
Reading checks everything that can be checked cheaply: magic, version, sizes against the file size,
the state's required keys, and that a model's weights are all finite; the message names the
file and the problem.
"""
import json
import math
import os
import re
import struct

import numpy as np

from gpt2np.bf16 import BF16
from gpt2np.config import GPT2Config
from gpt2np.errors import WriteError
from gpt2np.fileio import atomic_write, sync_folder
from gpt2np.tensors import num_parameters, offsets, param_shapes

MODEL_MAGIC = 20240326
VERSION_FP32, VERSION_BF16 = 3, 5
HEADER_INTS = 256
# keys every state file's JSON header holds (the trainer's save_checkpoint writes more)
STATE_REQUIRED_KEYS = ("step", "train_loader")


class CheckpointError(ValueError):
    """A model or state file that cannot be used; the message names the file and the problem."""


def _read_header(path, f):
    raw = f.read(HEADER_INTS * 4)
    if len(raw) < HEADER_INTS * 4:
        raise CheckpointError(f"{path}: truncated: {len(raw)} bytes, shorter than the "
                              f"{HEADER_INTS * 4}-byte header")
    return np.frombuffer(raw, dtype="<i4")


def read_model_header(path):
    """(GPT2Config, version) from a model file's header, with its sizes checked
    against the file size."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such model file")
    with open(path, "rb") as f:
        header = _read_header(path, f)
    if header[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {header[0]} (expected {MODEL_MAGIC}): not an "
                              "llm.c model file")
    version = int(header[1])
    if version not in (VERSION_FP32, VERSION_BF16):
        raise CheckpointError(f"{path}: unsupported version {version} (expected 3 = "
                              "fp32 or 5 = bf16)")
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    try:
        cfg = GPT2Config(maxT, V, Vp, L, NH, C)
    except ValueError as e:
        raise CheckpointError(f"{path}: header describes an impossible model: {e}") from None
    itemsize = 4 if version == VERSION_FP32 else 2
    expected = HEADER_INTS * 4 + num_parameters(cfg) * itemsize
    actual = os.path.getsize(path)
    if actual < expected:
        raise CheckpointError(f"{path}: truncated: {actual} bytes, the header's model "
                              f"needs {expected}")
    if actual > expected:
        raise CheckpointError(f"{path}: {actual - expected} bytes more than the header's model "
                              f"needs ({expected})")
    return cfg, version


def load_model(path, keep_bf16=False):
    """(GPT2Config, flat parameters) from an llm.c model file: float32; a bf16 (v5) file is upcast,
    or with keep_bf16 returned as it is stored (ml_dtypes bfloat16, no conversion)."""
    cfg, version = read_model_header(path)
    n = num_parameters(cfg)
    with open(path, "rb") as f:
        f.seek(HEADER_INTS * 4)
        if version == VERSION_FP32:
            params = np.fromfile(f, dtype="<f4", count=n).astype(np.float32, copy=False)
        elif keep_bf16:
            params = np.fromfile(f, dtype="<u2", count=n).view(BF16)
        else:
            params = bf16_to_fp32(np.fromfile(f, dtype="<u2", count=n))
    check_finite_params(path, cfg, params)
    return cfg, params


def check_finite_params(path, cfg: GPT2Config, params):
    """Raise CheckpointError naming the first NaN or infinite weight (its tensor's llm.c name,
    PARAM_NAMES, and its index in that tensor's shape): a model with one cannot train or sample,
    only fail later with a NaN loss."""
    chunk = 1 << 24                          # a bounded temporary, also for 1.5B parameters
    starts = [lo for lo in range(0, params.size, chunk)
              if not np.isfinite(params[lo:lo + chunk]).all()]
    if not starts:
        return
    bad = starts[0] + np.flatnonzero(~np.isfinite(params[starts[0]:]))
    first = int(bad[0])
    shapes = param_shapes(cfg)
    name = next(n for n, (off, size) in offsets(shapes).items() if off <= first < off + size)
    index = np.unravel_index(first - offsets(shapes)[name][0], shapes[name])
    more = f" (and {bad.size - 1} more non-finite weights)" if bad.size > 1 else ""
    raise CheckpointError(f"{path}: weight {name}[{', '.join(str(int(i)) for i in index)}] "
                          f"is {params[first]} "
                          f"(parameter {first} of {params.size}){more}: not a usable model")


def save_model(path, cfg: GPT2Config, params, dtype="fp32"):
    """Write an llm.c model file (dtype 'fp32' -> version 3, 'bf16' -> version 5), atomically.
    float32 params are rounded to nearest even for bf16; bf16 params (ml_dtypes) are
    written bit for bit."""
    params = np.asarray(params).reshape(-1)
    if params.dtype.name == "bfloat16" and dtype == "bf16":
        bits = params.view("<u2")
    else:
        params, bits = params.astype(np.float32, copy=False), None
    if params.size != num_parameters(cfg):
        raise ValueError(f"{path}: {params.size} parameters do not match the config "
                         f"({num_parameters(cfg)})")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r} (fp32 or bf16)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, VERSION_FP32 if dtype == "fp32" else VERSION_BF16, cfg.max_seq_len,
                  cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.channels,
                  cfg.padded_vocab_size]
    body = (params.astype("<f4", copy=False) if dtype == "fp32" else bits if bits is not None
            else fp32_to_bf16(params))
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


# ---- training state ------------------------------------------------------------------------------
# llm.c's state file (train_gpt2.cu save_state / load_state), so that either trainer
# resumes from the other's:
#   int32[256] header: [0] magic 20240527, [1] version 1, [2] processes, [3] rank, [4] fp32 master
#       weights (0/1), [5] shuffle (0/1), [10] step, u64 at [20] and [22]: llm.c's
#       stochastic-rounding RNG state, u64 at [30] the loader's shard position, at
#       [32] its sample position
#   float32 m, v (this rank's share), then the master weights when [4] is 1
#   with shuffle: u64 shards, int32 shard order, u64 samples, int32 the current shard's sample
#       order, and the shuffle generator as llm.c's mt19937_state struct (u64 seed_, int left_, uint
#       next_, uint state_[624], uint MATRIX_A[2]; 2520 bytes)
# then gpt2np's footer, which llm.c does not read: JSON (the sampling RNG, the outlier window, the
# loader's epoch and settings...), u64 its length, the 8 bytes FOOTER_MAGIC.
LLMC_STATE_MAGIC, LLMC_STATE_VERSION = 20240527, 1
FOOTER_MAGIC = b"GPT2NPFT"
MT_STRUCT = struct.Struct("<QiI624I2I")          # llm.c's mt19937_state, as fwrite writes it
MT_MATRIX_A = 0x9908B0DF
LLMC_RNG_START = 13371337
# header[40] "GTNP": gpt2np wrote it; [42] u64 n, [44] u64 footer bytes
GPT2NP_TAG_AT, GPT2NP_TAG = 40, 0x504E5447


def save_state(path, info: dict, m, v, master=None, loader=None):
    """A resumable training state in llm.c's layout (see above): info's "step", "world_size", "rank"
    fill its header, loader (DataLoader.llmc_state()) its loader fields; the whole `info` goes
    into gpt2np's footer."""
    arrays = [np.asarray(a, np.float32).reshape(-1)
              for a in (m, v) + (() if master is None else (master,))]
    if any(a.size != arrays[0].size for a in arrays):
        raise ValueError(f"{path}: m, v and the master weights differ in size")
    loader = loader or {"shuffle": False, "shard_idx": 0, "sample_idx": 0}
    header = np.zeros(HEADER_INTS, "<i4")
    header[:6] = [LLMC_STATE_MAGIC, LLMC_STATE_VERSION, info.get("world_size", 1),
                  info.get("rank", 0), master is not None, bool(loader["shuffle"])]
    header[10] = info["step"]
    # llm.c's stochastic-rounding RNG (xorshift; 0 would stay 0): gpt2np's own rounding keeps no
    # such state, so llm.c resuming from this file starts it where a fresh llm.c run
    # does, 13371337 + rank
    header[20:24] = np.array([LLMC_RNG_START + info.get("rank", 0)] * 2, "<u8").view("<i4")
    header[30:34] = np.array([loader["shard_idx"], loader["sample_idx"]], "<u8").view("<i4")
    footer = json.dumps(dict(info, n=arrays[0].size, master_weights=master is not None),
                        sort_keys=True).encode()
    # ints llm.c leaves 0: that the footer follows, n, its length
    header[GPT2NP_TAG_AT] = GPT2NP_TAG
    header[GPT2NP_TAG_AT + 2:GPT2NP_TAG_AT + 6] = np.array([arrays[0].size, len(footer)],
                                                           "<u8").view("<i4")
    with atomic_write(path) as f:
        f.write(header.tobytes())
        for a in arrays:
            a.astype("<f4", copy=False).tofile(f)
        if loader["shuffle"]:
            f.write(struct.pack("<Q", len(loader["shard_indices"])))
            f.write(np.asarray(loader["shard_indices"], "<i4").tobytes())
            f.write(struct.pack("<Q", len(loader["sample_indices"])))
            f.write(np.asarray(loader["sample_indices"], "<i4").tobytes())
            # NumPy's words used since the last twist; llm.c counts down left_
            pos = int(loader["mt_pos"])
            f.write(MT_STRUCT.pack(0, 625 - pos, pos,
                                   *np.asarray(loader["mt_key"], np.uint32).tolist(), 0,
                                   MT_MATRIX_A))
        f.write(footer + struct.pack("<Q", len(footer)) + FOOTER_MAGIC)


def read_state_header(path, num_params=None):
    """(info, n) of a state file without reading m and v: magic, version, sizes and keys checked. n
    is the parameters of m (None for an llm.c file with shuffle whose size cannot say it, when
    num_params is not given).
    An llm.c file without gpt2np's footer gets info from its header: step, world_size,
    rank, master_weights."""
    info, n, _ = _parse_state(path, num_params)
    return info, n


def load_state(path, num_params=None, with_master=False):
    """(info, m, v) from a state file; checks magic, version, sizes and keys (read_state_header).
    info["loader"] is the loader position of an llm.c-layout file (DataLoader.load_llmc_state).
    with_master: (info, m, v, master), master None when the file has no master weights (an
    fp32 or -w 0 run's)."""
    info, n, layout = _parse_state(path, num_params)
    if n is None:
        raise CheckpointError(f"{path}: an llm.c state file with a shuffled loader: its size does "
                              "not say how many parameters it holds")
    count = 3 if info.get("master_weights") else 2
    with open(path, "rb") as f:
        f.seek(layout["arrays"])
        m, v = (np.fromfile(f, dtype="<f4", count=n) for _ in range(2))
        master = np.fromfile(f, dtype="<f4", count=n) if count == 3 else None
        if "loader" in layout:
            loader = dict(layout["loader"])
            if loader["shuffle"]:
                f.seek(layout["arrays"] + 4 * n * count)        # _parse_state checked these lengths
                shards = _u64(f.read(8))
                loader["shard_indices"] = np.fromfile(f, "<i4", shards).tolist()
                samples = _u64(f.read(8))
                loader["sample_indices"] = np.fromfile(f, "<i4", samples).tolist()
                mt = MT_STRUCT.unpack(f.read(MT_STRUCT.size))
                left, next_ = mt[1], mt[2]
                loader["mt_key"] = list(mt[3:627])
                # left 1: the next draw twists first
                loader["mt_pos"] = next_ if left > 1 else 624
            info = dict(info, loader=loader)
    return (info, m, v, master) if with_master else (info, m, v)


def _parse_state(path, num_params):
    """(info, n, layout): layout["arrays"] = where m starts, layout["loader"] = the llm.c
    header's loader fields."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such state file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(4 * HEADER_INTS), "<i4")
        if header.size < HEADER_INTS or header[0] != LLMC_STATE_MAGIC:
            raise CheckpointError(f"{path}: not a state file (bad magic or truncated header)")
        if header[1] != LLMC_STATE_VERSION:
            raise CheckpointError(f"{path}: unsupported state version {header[1]} (expected "
                                  f"{LLMC_STATE_VERSION})")
        end, info = size, None
        ours = header[GPT2NP_TAG_AT] == GPT2NP_TAG
        if ours:                                     # gpt2np's: the footer must be there, whole
            n_ours, footer_len = (int(x) for x in header[GPT2NP_TAG_AT + 2:GPT2NP_TAG_AT
                                                         + 6].copy().view("<u8"))
            f.seek(max(size - 16, 0))
            tail = f.read(16)
            if tail[8:] != FOOTER_MAGIC or _u64(tail[:8]) != footer_len:
                raise CheckpointError(f"{path}: {size} bytes, its footer is missing or cut: "
                                      "truncated or corrupt")
        if size >= 4 * HEADER_INTS + 16:
            f.seek(size - 16)
            tail = f.read(16)
            if tail[8:] == FOOTER_MAGIC:
                footer_len = struct.unpack("<Q", tail[:8])[0]
                end = size - 16 - footer_len
                if end < 4 * HEADER_INTS:
                    raise CheckpointError(f"{path}: corrupt footer (its length {footer_len} "
                                          "exceeds the file)")
                f.seek(end)
                info = _read_json(f, footer_len, path, "footer")
                missing = [key for key in STATE_REQUIRED_KEYS + ("n",) if key not in info]
                if missing:
                    raise CheckpointError(f"{path}: the state lacks the key "
                                          f"{missing[0]!r}: damaged")
        shard_idx, sample_idx = (int(x) for x in header[30:34].copy().view("<u8"))
        loader = {"shuffle": bool(header[5]), "shard_idx": shard_idx, "sample_idx": sample_idx}
        master = bool(header[4])
        if info is None:                             # llm.c's own file: what its header says
            info = {"step": int(header[10]), "world_size": int(header[2]), "rank": int(header[3])}
        info["master_weights"] = master
        count = 3 if master else 2
        n = info.get("n", num_params)
        if n is None and not loader["shuffle"]:
            n, rest = divmod(end - 4 * HEADER_INTS, 4 * count)
            n = n if rest == 0 else -1
        if n is not None:
            expected = 4 * HEADER_INTS + 4 * n * count
            # the loader's orders: their lengths say how long they are
            if loader["shuffle"]:
                f.seek(expected)
                shards = _u64(f.read(8))
                f.seek(min(expected + 8 + 4 * shards, size))
                samples = _u64(f.read(8))
                expected += 16 + 4 * (shards + samples) + MT_STRUCT.size
            if n < 0 or end != expected:
                raise CheckpointError(f"{path}: {end} bytes before the footer, the header "
                                      f"says {expected}: "
                                      f"truncated or corrupt" if n >= 0 else
                                      f"{path}: {end} bytes: not a whole number of parameters: "
                                      "truncated or corrupt")
        if ours and n != n_ours:
            raise CheckpointError(f"{path}: the header says {n_ours} parameters, the "
                                  f"footer {n}: corrupt")
        if num_params is not None and n != num_params:
            raise CheckpointError(f"{path}: optimizer state for {n} parameters, the model "
                                  f"has {num_params}")
    return info, n, {"arrays": 4 * HEADER_INTS, "loader": loader}


def _read_json(f, length, path, what):
    """The JSON object of the next `length` bytes of f; CheckpointError naming the file
    and `what` it is."""
    try:
        info = json.loads(f.read(length))
    except ValueError:
        raise CheckpointError(f"{path}: corrupt JSON {what}") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: corrupt JSON {what} (not an object)")
    return info


def _u64(raw):
    """A little-endian u64 of 8 bytes; fewer (a file cut short) read as the largest, which
    no size can match."""
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else (1 << 62)


def model_path(out_dir, step):
    return os.path.join(out_dir, f"model_{step:08d}.bin")


def state_path(out_dir, step, rank=0):
    return os.path.join(out_dir, f"state_{step:08d}_{rank:05d}.bin")


def done_path(out_dir, step):
    return os.path.join(out_dir, f"DONE_{step:08d}")


def checkpoint_to_delete(step, checkpoint_every, keep, major_every=0):
    """llm.c's -nk/-nm rule: once the checkpoint of `step` is complete, the step whose checkpoint
    goes (step - keep * checkpoint_every), or None: keep 0 (all kept), no such step (<= 0), or a
    major one (a multiple of major_every, -nm). A step where no checkpoint was written (a stop or
    the last step off the -n grid) names one that does not exist, and a checkpoint written off the
    grid is never named: the trainer rotates with checkpoints_to_delete, which agrees with this
    rule on the grid."""
    if keep <= 0 or checkpoint_every <= 0:
        return None
    old = step - keep * checkpoint_every
    if old <= 0 or (major_every > 0 and old % major_every == 0):
        return None
    return old


# the names model_path, state_path and done_path give (checkpoint_name checks a name is
# exactly one of them)
CHECKPOINT_NAME = re.compile(r"model_(\d+)\.bin|state_(\d+)_(\d+)\.bin|DONE_(\d+)")


def checkpoint_name(name):
    """(step, is its DONE marker) when `name` is exactly a name model_path, state_path or done_path
    gives; else None (temporary files, copies, other digit counts)."""
    m = CHECKPOINT_NAME.fullmatch(name)
    if not m:
        return None
    model, state, rank, done = m.groups()
    step = int(model or state or done)
    canonical = (model_path("", step) if model else done_path("", step) if done
                 else state_path("", step, int(rank)))
    return (step, done is not None) if canonical == name else None


def checkpoint_files(out_dir) -> dict:
    """{step: complete} for every step with a checkpoint file in out_dir (a model, any process's
    state, or a DONE marker, under the exact names model_path/state_path/done_path give): complete
    is whether its DONE marker is there. Other files are not checkpoint files. No folder: {}. The
    one listing of a run's checkpoints."""
    found = {}
    try:
        entries = list(os.scandir(out_dir))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        named = checkpoint_name(entry.name)
        if named and entry.is_file():
            step, done = named
            found[step] = found.get(step, False) or done
    return found


def checkpoints_to_delete(step, found, keep, major_every=0, reach=0):
    """-nk/-nm once the checkpoint of `step` is complete: the steps (oldest first) of the
    checkpoints to delete.
    found: checkpoint_files of -o ({step: complete}). Kept: the `keep` newest complete checkpoints
    up to `step` (its own the newest of them), every major one (a multiple of major_every, -nm), and
    any newer than `step`; every other checkpoint older than `step` goes, an incomplete one too (it
    can never be resumed), back to step - reach (reach > 0; the trainer's is llm.c's, keep * -n: a
    run that kept everything, resumed with -nk, loses its past one checkpoint at a time as llm.c's
    would, not all at once). keep <= 0: [].

    On the -n grid (every checkpoint at a multiple of -n, and none deleted by hand) this is llm.c's
    rule, checkpoint_to_delete (step - keep * n, unless major), except that a step without a
    checkpoint (the last step off the grid names one) is not named. It differs where llm.c's
    arithmetic misses a checkpoint that exists: one a stop by signal wrote (llm.c writes none), the
    last step's off the grid, a run resumed with another -n or -nk, an earlier deletion that failed.
    llm.c keeps those for good; here they count as the checkpoints they are, so -nk K leaves the K
    newest whatever their steps."""
    if keep <= 0:
        return []
    complete = sorted({s for s, done in found.items() if done and s < step} | {step}, reverse=True)
    kept = set(complete[:keep])
    lowest = step - reach if reach > 0 else -math.inf
    return sorted(s for s in found if lowest <= s < step and s not in kept
                  and not (major_every > 0 and s % major_every == 0))


def remove_done_marker(out_dir, step):
    """Remove the DONE marker of `step` (if there) before its checkpoint is written again: until the
    new DONE marker, a crash must not leave the old marker vouching for a mix of old and new files.
    The folder is synced so that the removal is on disk before the files it guards change. A marker
    that cannot be removed (or its removal synced) raises WriteError naming it."""
    path = done_path(out_dir, step)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise WriteError(path, e) from e
    try:
        # a file system that cannot sync folders: passed over there
        sync_folder(out_dir)
    except OSError as e:
        raise WriteError(path, e) from e
    return True


def delete_checkpoint(out_dir, step, rank=0):
    """Remove this process's files of the checkpoint of `step` in out_dir and only those names: rank
    0 its DONE_ marker (first: a checkpoint partly deleted by a crash is then never taken for a
    complete one) and the model file, every rank its own state file (as llm.c's delete_checkpoint).
    Returns the paths removed; a file already gone is skipped, one that cannot be
    removed raises OSError."""
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
