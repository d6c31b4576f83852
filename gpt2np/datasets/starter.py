"""What the main job trains on when the user names nothing: model, data and decoder,
with offline fallbacks.

Online, `python train.py` fetches llm.c's gpt2_124M.bin and tinyshakespeare (with timeouts). Offline
it says in one line what it could not fetch and still trains: d12 from random init, on
tinyshakespeare if a local copy exists, else on a corpus every machine with Python has (the standard
library's own source), tokenized with GPT-2 BPE when the BPE files are found, else byte by byte.
"""
import os
import re
import sys
from pathlib import Path

import numpy as np

from gpt2np.config import DESCRIPTORS, descriptor, preset
from gpt2np.datasets.data import write_shard
from gpt2np.datasets.fetch import KNOWN_FILES, FetchError, ensure
from gpt2np.datasets.prepare import TINYSHAKESPEARE_NAME, prepare_text, prepare_tinyshakespeare
from gpt2np.fileio import atomic_write
from gpt2np.formats.checkpoint import load_model
from gpt2np.formats.hf import PYTORCH_BIN, HubError, is_hub_id, load_hf
from gpt2np.formats.tokenizer import (
    TOKENIZER_BIN,
    TokenizerError,
    TokenizerNotFoundError,
    get_encoding,
    load_tokenizer_bin,
)
from gpt2np.init import llmc_init
from gpt2np.paths import CHECKPOINTS_DIR, DATA_DIR

CHECKPOINTS = CHECKPOINTS_DIR
DEFAULT_MODEL = "gpt2_124M.bin"
# llm.c's starter pack's model files (fetched for -e)
STARTER_MODELS = (DEFAULT_MODEL, "gpt2_124M_bf16.bin")
FALLBACK_PRESET = "d12"
STDLIB_NAME = "python_stdlib"
STDLIB_BYTES = 1_200_000          # about tinyshakespeare's size
BYTE_EOT = 256


def note(msg):
    print(msg, file=sys.stderr, flush=True)


def resolve_model(spec, timeout=10, keep_bf16=False):
    """(cfg, params or None, description) for -e: a preset name (random init), an llm.c file, the
    default, or a transformers GPT-2 folder or Hugging Face Hub id
    (gpt2np.formats.hf; the hf extra).

    A missing starter-pack model (gpt2_124M.bin, gpt2_124M_bf16.bin) is fetched; if that fails for
    the default (gpt2_124M.bin), d12 from random init is used with one line saying why. Any other
    missing file is an error. keep_bf16: a bf16 (v5) file's parameters as stored (ml_dtypes
    bfloat16; a bf16 run loads them without an fp32 round trip).
    """
    path = Path(spec)
    try:
        # llm.c's d12, gpt2:d24, gpt3:c768 (random init)
        cfg = None if path.is_file() else descriptor(spec)
    except ValueError as e:
        raise ValueError(f"-e {e}") from None
    if cfg is not None:
        return cfg, None, f"{spec} (random init)"
    if not path.is_file() and path.name == spec and (CHECKPOINTS / spec).is_file():
        path = CHECKPOINTS / spec
    if not path.is_file() and path.name == spec and spec in STARTER_MODELS:
        try:
            path = ensure(spec, CHECKPOINTS, timeout=timeout)
        except FetchError as e:
            if spec != DEFAULT_MODEL:            # asked for by name: no stand-in
                raise
            note(f"note: {e}; training {FALLBACK_PRESET} from random init instead")
            return (preset(FALLBACK_PRESET), None,
                    f"{FALLBACK_PRESET} (random init; {spec} unavailable)")
    if not path.is_file():
        # a transformers GPT-2 folder, or a Hugging Face Hub id (gpt2, ...)
        if path.is_dir() or is_hub_id(spec):
            cfg, params, _ = load_hf_model(spec)
            return cfg, params, f"{spec} (Hugging Face)"
        raise FileNotFoundError(f"{spec}: no such model file (give an llm.c model file, or llm.c's "
                                f"model descriptor for random init: {DESCRIPTORS})")
    cfg, params = load_model(path, keep_bf16=keep_bf16)
    return cfg, params, str(path)


def resolve_data(train_pattern, val_pattern, timeout=10):
    """(train_pattern, val_pattern) to read; None for both means "the default
    dataset", prepared here."""
    if train_pattern:
        return train_pattern, val_pattern
    val, train = (DATA_DIR / f"{TINYSHAKESPEARE_NAME}_val.bin",
                  DATA_DIR / f"{TINYSHAKESPEARE_NAME}_train.bin")
    if not (val.is_file() and train.is_file()):
        try:
            shards = prepare_tinyshakespeare(DATA_DIR, encoding=_encoding_or_fetch(timeout),
                                             timeout=timeout)
            val, train = shards.val, shards.train
        except (FetchError, TokenizerNotFoundError) as e:
            note(f"note: {e}; training on the Python standard library's source instead")
            val, train = prepare_stdlib_corpus(timeout)
    return str(train), val_pattern or str(val)


def _encoding_or_fetch(timeout):
    """GPT-2 BPE from local files, else fetched into checkpoints/ (raises if neither works)."""
    try:
        return get_encoding()
    except TokenizerNotFoundError:
        for name in ("gpt2_vocab.bpe", "gpt2_encoder.json"):
            ensure(name, CHECKPOINTS, timeout=timeout, progress=False)
        return get_encoding(CHECKPOINTS)


def stdlib_text(limit=STDLIB_BYTES):
    """Deterministic text from the running Python's standard library sources (present
    wherever Python is)."""
    root = Path(os.__file__).parent
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "\n\n".join(parts)[:limit]


def prepare_stdlib_corpus(timeout=10):
    """(val, train) shards of the stdlib corpus: GPT-2 BPE if available, else bytes (ids
    0..255, eot 256)."""
    val, train = DATA_DIR / f"{STDLIB_NAME}_val.bin", DATA_DIR / f"{STDLIB_NAME}_train.bin"
    if val.is_file() and train.is_file():
        return val, train
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    text_path = DATA_DIR / f"{STDLIB_NAME}.txt"
    text_path.write_text(stdlib_text(), encoding="utf-8")
    try:
        shards = prepare_text(text_path, DATA_DIR, STDLIB_NAME, encoding=get_encoding())
        return shards.val, shards.train
    except TokenizerNotFoundError:
        note("note: GPT-2 BPE files not found; tokenizing the fallback corpus byte by "
             "byte (ids 0..255)")
    tokens = np.frombuffer(text_path.read_bytes(), np.uint8).astype(np.uint16)
    tokens = np.concatenate([[BYTE_EOT], tokens]).astype(np.uint16)
    write_shard(val, tokens[:32768])
    write_shard(train, tokens[32768:])
    write_byte_tokenizer(DATA_DIR / f"{STDLIB_NAME}_{TOKENIZER_BIN}")
    return val, train


def write_byte_tokenizer(path):
    """An llm.c tokenizer file for the byte-level fallback: 256 single bytes + <|endoftext|>."""
    header = np.zeros(256, "<u4")
    header[:4] = [20240328, 2, 257, BYTE_EOT]
    body = b"".join(bytes([1, b]) for b in range(256)) + bytes([13]) + b"<|endoftext|>"
    with atomic_write(path) as f:
        f.write(header.tobytes() + body)


class Decoder:
    """Token ids -> text for samples: llm.c's tokenizer file beside the data, else
    GPT-2 BPE, else ids."""

    def __init__(self, train_pattern):
        self.table, self.encoding = None, None
        folder = Path(train_pattern).parent
        candidates = [folder / f"{Path(train_pattern).name.split('_train')[0]}_{TOKENIZER_BIN}",
                      folder / TOKENIZER_BIN, CHECKPOINTS / TOKENIZER_BIN]
        for path in candidates:
            if path.is_file():
                try:
                    self.table = load_tokenizer_bin(path)
                    break
                except TokenizerError as e:
                    note(f"note: {e}")
        if self.table is None:
            try:
                self.encoding = get_encoding()
            except TokenizerNotFoundError:
                pass

    @property
    def eot_token(self):
        if self.table is not None:
            return self.table.eot_token
        return 50256

    def decode(self, ids):
        if self.table is not None:
            known = [i for i in ids if 0 <= i < self.table.vocab_size]
            return self.table.decode(known)
        if self.encoding is not None:
            return self.encoding.decode([i for i in ids if i < self.encoding.n_vocab])
        return " ".join(str(i) for i in ids)


# ---- -e: any model a command can read ------------------------------------------------------------
def load_hf_model(spec) -> tuple:
    """load_hf for a -e: a Hub id that reads as a mistyped llm.c descriptor (d6x, d12b) also says
    what the descriptors are."""
    try:
        return load_hf(spec)
    except HubError as e:
        if re.match(r"d\d", spec):
            raise HubError(f"{e}; as llm.c's model descriptor it is none "
                           f"of {DESCRIPTORS}") from None
        raise


def load_any_model(spec) -> tuple:
    """(GPT2Config, params, description) for a command's -e: an llm.c model file (also a name in
    checkpoints/; gpt2_124M.bin is fetched there when missing),
    llm.c's model descriptors d6..d84, gpt2:dL, gpt3:cC (llm.c's random init, bit for bit:
    gpt2np.init), a transformers GPT-2 folder, or a
    Hugging Face Hub id (downloaded when online)."""
    path = Path(spec)
    if not path.exists() and path.name == spec and (CHECKPOINTS / spec).is_file():
        path = CHECKPOINTS / spec                   # as train's -e: gpt2_124M.bin in checkpoints/
    elif not path.exists() and path.name == spec and spec.endswith(".bin") and spec in KNOWN_FILES:
        # as train's -e: gpt2_124M.bin is fetched (offline: 1 line)
        path = ensure(spec, CHECKPOINTS)
    if path.is_file() and path.suffix not in (".safetensors", ".json") and path.name != PYTORCH_BIN:
        cfg, params = load_model(path)
        return cfg, params, str(path)
    try:
        # as train's -e: llm.c's descriptors, random init
        cfg = None if path.is_file() else descriptor(spec)
    except ValueError as e:
        raise ValueError(f"-e {e}") from None
    if cfg is not None:
        return cfg, llmc_init(cfg), f"{spec} (random init)"
    if path.is_dir() or path.is_file() or is_hub_id(spec):
        cfg, params, folder = load_hf_model(spec)
        return (cfg, params, f"{spec} (Hugging Face, {folder})" if str(folder) != spec
                else f"{spec} (Hugging Face)")
    raise FileNotFoundError(f"{spec}: no such model file (an llm.c .bin, a transformers "
                            "folder or a Hub id)")
