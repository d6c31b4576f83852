"""llm.c's debug state file: one batch (x, y) with reference logits, loss and parameter gradients.

Written by llm.c's train_gpt2.py (write_state) and read by its test_gpt2 programs. Little-endian:
  header  256 int32: [0]=20240327 magic, [1]=version, [2]=B, [3]=T, rest 0
  x       B*T int32 token ids          y  B*T int32 targets
  logits  B*T*V float32 over the real vocabulary V (not padded)
  loss    1 float32, the mean cross-entropy
  grads   float32, the 16 tensors in llm.c's order, layer tensors stacked (L, ...);
          version 2 pads the wte gradient to Vp rows with zeros, version 1 (read only) has V rows.
The header does not hold the model's shape, so reading needs the GPT2Config of the model file.
"""
import os
from dataclasses import dataclass

import numpy as np

from gpt2np.config import GPT2Config
from gpt2np.fileio import atomic_write
from gpt2np.tensors import PARAM_NAMES, layout_size, param_shapes

MAGIC = 20240327
VERSION = 2
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS


class DebugStateError(ValueError):
    """A debug state file that cannot be used; the message names the file and the problem."""


@dataclass
class DebugState:
    """x, y (B,T) int32; logits (B,T,V) float32; loss; grads {name: llm.c shape, wte padded}."""
    x: np.ndarray
    y: np.ndarray
    logits: np.ndarray
    loss: float
    grads: dict

    @property
    def B(self) -> int:
        return self.x.shape[0]

    @property
    def T(self) -> int:
        return self.x.shape[1]


def _grad_shapes(cfg: GPT2Config, version: int):
    shapes = param_shapes(cfg)
    if version == 1:
        shapes["wte"] = (cfg.vocab_size, cfg.channels)
    return shapes


def expected_size(cfg: GPT2Config, B: int, T: int, version: int = VERSION) -> int:
    """Bytes in a debug state file for this model and batch."""
    return (HEADER_BYTES + 4 * (2 * B * T + B * T * cfg.vocab_size + 1)
            + 4 * layout_size(_grad_shapes(cfg, version)))


def read_debug_state(path, cfg: GPT2Config) -> DebugState:
    """Read a debug state written for the model `cfg`; raise DebugStateError naming the problem."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"debug state {path}: no such file")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise DebugStateError(f"debug state {path}: truncated, {size} bytes is shorter than the "
                              f"{HEADER_BYTES}-byte header")
    with open(path, "rb") as f:
        header = np.fromfile(f, dtype="<i4", count=HEADER_INTS)
        magic, version, B, T = (int(v) for v in header[:4])
        if magic != MAGIC:
            raise DebugStateError(f"debug state {path}: bad magic {magic}, expected {MAGIC} "
                                  f"(not an llm.c debug state file)")
        if version not in (1, 2):
            raise DebugStateError(f"debug state {path}: unsupported version {version}, "
                                  "expected 2 (or 1)")
        if B <= 0 or T <= 0:
            raise DebugStateError(f"debug state {path}: bad batch shape B={B}, T={T} in the header")
        if T > cfg.max_seq_len:
            raise DebugStateError(f"debug state {path}: T={T} exceeds the model's max_seq_len "
                                  f"{cfg.max_seq_len} (written for a different model?)")
        want = expected_size(cfg, B, T, version)
        if size != want:
            kind = "truncated" if size < want else "too long"
            raise DebugStateError(
                f"debug state {path}: {kind}, {size} bytes but B={B}, T={T} with the model's "
                f"V={cfg.vocab_size}, {layout_size(_grad_shapes(cfg, version))} gradients need "
                f"{want} (truncated file, or written for a different model)")
        x = np.fromfile(f, dtype="<i4", count=B * T).astype(np.int32).reshape(B, T)
        y = np.fromfile(f, dtype="<i4", count=B * T).astype(np.int32).reshape(B, T)
        logits = np.fromfile(f, dtype="<f4", count=B * T * cfg.vocab_size).astype(np.float32)
        loss = float(np.fromfile(f, dtype="<f4", count=1)[0])
        grads = {}
        for name, shape in _grad_shapes(cfg, version).items():
            grads[name] = np.fromfile(f, dtype="<f4", count=int(np.prod(shape))).astype(
                np.float32).reshape(shape)
    for what, ids in (("x", x), ("y", y)):
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise DebugStateError(f"debug state {path}: {what} holds token ids outside "
                                  f"[0, {cfg.vocab_size}) (written for a different vocabulary?)")
    if version == 1:    # pad the wte gradient to Vp rows, as version 2 stores it
        wte = np.zeros((cfg.padded_vocab_size, cfg.channels), np.float32)
        wte[:cfg.vocab_size] = grads["wte"]
        grads["wte"] = wte
    return DebugState(x, y, logits.reshape(B, T, cfg.vocab_size), loss, grads)


def write_debug_state(path, state: DebugState, cfg: GPT2Config):
    """Write `state` as a version 2 debug state, atomically (temp file + rename)."""
    path = os.fspath(path)
    B, T = state.x.shape
    shapes = param_shapes(cfg)
    checks = [(state.y.shape == (B, T), f"y has shape {state.y.shape}, x has {(B, T)}"),
              (state.logits.shape == (B, T, cfg.vocab_size),
               f"logits have shape {state.logits.shape}, expected {(B, T, cfg.vocab_size)}"),
              (set(state.grads) == set(PARAM_NAMES),
               "grads must hold exactly the 16 llm.c tensors")]
    checks += [(tuple(np.shape(state.grads[n])) == shapes[n],
                f"grad {n} has shape {np.shape(state.grads[n])}, expected {shapes[n]}")
               for n in PARAM_NAMES if n in state.grads]
    for ok, msg in checks:
        if not ok:
            raise DebugStateError(f"debug state {path}: cannot write: {msg}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (MAGIC, VERSION, B, T)
    with atomic_write(path) as f:
        f.write(header.tobytes())
        f.write(np.ascontiguousarray(state.x, dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(state.y, dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(state.logits, dtype="<f4").tobytes())
        f.write(np.asarray([state.loss], dtype="<f4").tobytes())
        for name in PARAM_NAMES:
            f.write(np.ascontiguousarray(state.grads[name], dtype="<f4").tobytes())
