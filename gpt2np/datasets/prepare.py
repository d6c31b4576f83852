"""A text file -> llm.c token shards: <name>_val.bin (the first val_tokens), <name>_train.bin.
The command is gpt2np.cli.prepare (`gpt2np prepare`); FineWeb is corpora.py's, TinyStories is
tinystories.py's.

As llm.c does for tinyshakespeare, the text is cut at blank lines ("\\n\\n") into documents, each
document is preceded by <|endoftext|>, and every document but the last keeps its trailing "\\n\\n".
The GPT-2 tokenizer file gpt2_tokenizer.bin is written next to the shards if it is not there yet.

The val split is llm.c's first 32,768 tokens. A text too short to leave a training split after
them gets the first VAL_FRACTION (10%) of its tokens as val instead, with a note; an explicit
val_tokens is kept.
"""
import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gpt2np.datasets.data import DataError, write_shard
from gpt2np.datasets.fetch import TINYSHAKESPEARE_URL, download
from gpt2np.formats.tokenizer import TOKENIZER_BIN, get_encoding, write_tokenizer_bin
from gpt2np.paths import DATA_DIR, data_search_dirs
from gpt2np.progress import progress

TINYSHAKESPEARE_NAME = "tiny_shakespeare"   # llm.c's shard names: tiny_shakespeare_{val,train}.bin
DEFAULT_VAL_TOKENS = 32768
VAL_FRACTION = 0.1                # the val split of a text too short for DEFAULT_VAL_TOKENS
DOCS_PER_BATCH = 4096             # documents tokenized per call (the progress bar moves between)


class Shards(NamedTuple):
    """Paths written by prepare_text."""
    val: Path
    train: Path
    tokenizer: Path


def tokenize_documents(text, encoding):
    """1-D uint16 tokens: eot + tokens of each blank-line-separated document (llm.c's layout)."""
    sections = text.split("\n\n")
    docs = [s + "\n\n" for s in sections[:-1]] + sections[-1:]
    eot = encoding.eot_token
    tokens = []
    with progress(total=len(text), desc="tokenizing", unit="char", unit_scale=True) as bar:
        for lo in range(0, len(docs), DOCS_PER_BATCH):
            batch = docs[lo:lo + DOCS_PER_BATCH]
            threads = os.cpu_count() or 1
            for doc_tokens in encoding.encode_ordinary_batch(batch, num_threads=threads):
                tokens.append(eot)
                tokens.extend(doc_tokens)
            bar.update(sum(map(len, batch)))
    return np.array(tokens, dtype=np.uint16)


def val_split(text_path, num_tokens, val_tokens=None) -> int:
    """The val split's token count: val_tokens as given, else DEFAULT_VAL_TOKENS, or for a text too
    short to leave a training split after those, VAL_FRACTION of its tokens (with a note). DataError
    when no training split is left."""
    if val_tokens is None and num_tokens <= DEFAULT_VAL_TOKENS + 1:
        val_tokens = int(num_tokens * VAL_FRACTION)
        if val_tokens < 1:
            raise DataError(f"{text_path}: only {num_tokens} token(s): too few to split into val "
                            f"({VAL_FRACTION:.0%}) and train; give a longer text")
        print(f"note: {text_path}: {num_tokens:,} tokens, too few for the default "
              f"{DEFAULT_VAL_TOKENS:,}-token val split; val is the first {VAL_FRACTION:.0%} "
              f"({val_tokens:,} tokens), train the other {num_tokens - val_tokens:,} "
              f"(--val-tokens N sets val)", file=sys.stderr, flush=True)
        return val_tokens
    val_tokens = DEFAULT_VAL_TOKENS if val_tokens is None else val_tokens
    if num_tokens <= val_tokens + 1:
        raise DataError(f"{text_path}: only {num_tokens} tokens, need more than val_tokens+1 = "
                        f"{val_tokens + 1} to leave a training split (a smaller --val-tokens?)")
    return val_tokens


def read_text(text_path) -> tuple:
    """(raw bytes, text) of a utf-8 text file, its newlines as text mode reads them; DataError
    naming the file."""
    try:
        raw = Path(text_path).read_bytes()
        return raw, raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except FileNotFoundError:
        raise DataError(f"{text_path}: text file not found") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{text_path}: not utf-8 text ({e.reason} at byte {e.start})") from None


def prepare_text(text_path, out_dir, name, val_tokens=None, encoding=None) -> Shards:
    """Write out_dir/<name>_val.bin and <name>_train.bin from a utf-8 text file; their paths.
    val_tokens None: the default split (see the module docstring)."""
    text_path, out_dir = Path(text_path), Path(out_dir)
    encoding = encoding or get_encoding()
    raw, text = read_text(text_path)
    if not text.strip():
        what = "empty" if not raw else "only whitespace"
        raise DataError(f"{text_path}: {what}: no text to tokenize")
    # a token is at least one byte, plus an <|endoftext|> a document: a text too short for
    # val_tokens is refused before tokenizing
    most = len(raw) + text.count("\n\n") + 1
    if val_tokens is not None and most <= val_tokens + 1:
        raise DataError(f"{text_path}: {len(raw):,} bytes, at most {most:,} tokens; need more than "
                        f"val_tokens+1 = {val_tokens + 1} to leave a training split (a smaller "
                        f"--val-tokens?)")
    tokens = tokenize_documents(text, encoding)
    val_tokens = val_split(text_path, len(tokens), val_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = Shards(out_dir / f"{name}_val.bin", out_dir / f"{name}_train.bin",
                    out_dir / TOKENIZER_BIN)
    write_shard(shards.val, tokens[:val_tokens])
    write_shard(shards.train, tokens[val_tokens:])
    if not shards.tokenizer.exists():
        write_tokenizer_bin(shards.tokenizer, encoding)
    return shards


def find_tinyshakespeare():
    """A local tinyshakespeare.txt, or None."""
    for d, _ in data_search_dirs():
        if (d / "tinyshakespeare.txt").is_file():
            return d / "tinyshakespeare.txt"
    return None


def prepare_tinyshakespeare(out_dir=DATA_DIR, val_tokens=None, encoding=None, timeout=10) -> Shards:
    """tiny_shakespeare_{val,train}.bin in out_dir, from a local copy or downloaded into out_dir."""
    text_path = find_tinyshakespeare()
    if text_path is None:
        text_path = download(TINYSHAKESPEARE_URL, Path(out_dir) / "tinyshakespeare.txt",
                             timeout=timeout)
    return prepare_text(text_path, out_dir, TINYSHAKESPEARE_NAME, val_tokens, encoding)
