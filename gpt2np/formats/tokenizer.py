"""GPT-2's byte-level BPE tokenizer, offline: tiktoken built from local files, and
llm.c's gpt2_tokenizer.bin.

Where the tokenizer comes from (in each folder the BPE pair is tried before the .bin):
  1. the `bpe_dir` argument (a folder, or a gpt2_tokenizer.bin file), else
  2. env var GPT2NP_BPE_DIR, else the first of these that has the files:
  3. env var GPT2NP_DATA_DIR,
  4. checkpoints/ and checkpoints/data in the current folder (where `gpt2np fetch` and `prepare`
     write).
An explicit place (1 or 2) is the only one looked in: it does not fall through to 3-4.
A folder may hold OpenAI's BPE pair (gpt2_vocab.bpe + gpt2_encoder.json, or vocab.bpe +
encoder.json) or llm.c's gpt2_tokenizer.bin: for GPT-2 a token's id is also its BPE merge rank, so
the table of token bytes in id order is all tiktoken needs.

gpt2_tokenizer.bin (llm.c): a header of 256 uint32 -- [0] = 20240328 (magic), [1] = version,
[2] = vocab_size, [3] = id of <|endoftext|> (version 2; version 1 files mean 50256) -- then for
every token id in order: one uint8 length and that many bytes.
"""
import functools
import json
import os
from pathlib import Path

import numpy as np
import tiktoken

from gpt2np.fileio import atomic_write
from gpt2np.paths import data_search_dirs

TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
HEADER_INTS = 256
EOT_TEXT = "<|endoftext|>"
GPT2_EOT_TOKEN = 50256
GPT2_VOCAB_SIZE = 50257
TOKENIZER_BIN = "gpt2_tokenizer.bin"
BPE_FILE_PAIRS = (("gpt2_vocab.bpe", "gpt2_encoder.json"), ("vocab.bpe", "encoder.json"))

# GPT-2's pre-tokenizer regex (tiktoken's r50k/gpt2 pat_str).
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")


class TokenizerError(ValueError):
    """A tokenizer file is malformed or inconsistent; the message names the file."""


class TokenizerNotFoundError(FileNotFoundError):
    """No tokenizer files were found; the message lists where we looked and how to provide them."""

    def __str__(self):
        return self.args[0] if self.args else ""


# ----------------------------------------------------------------------------------------------
# locating the files

def search_dirs(bpe_dir=None):
    """[(folder, why_we_look_there, explicit)] in search order. Explicit folders do
    not fall through."""
    if bpe_dir is not None:
        return [(Path(bpe_dir), "bpe_dir argument", True)]
    if os.environ.get("GPT2NP_BPE_DIR"):
        return [(Path(os.environ["GPT2NP_BPE_DIR"]), "GPT2NP_BPE_DIR", True)]
    return [(folder, why, False) for folder, why in data_search_dirs()]


def find_tokenizer_files(bpe_dir=None):
    """("bpe", (vocab_bpe, encoder_json)) or ("bin", tokenizer_bin) for the first
    folder that has one."""
    if bpe_dir is not None and Path(bpe_dir).is_file():
        return "bin", Path(bpe_dir)
    looked = []
    for folder, why, _ in search_dirs(bpe_dir):
        looked.append(f"{folder} ({why})")
        for vocab_name, encoder_name in BPE_FILE_PAIRS:
            if (folder / vocab_name).is_file() and (folder / encoder_name).is_file():
                return "bpe", (folder / vocab_name, folder / encoder_name)
        if (folder / TOKENIZER_BIN).is_file():
            return "bin", folder / TOKENIZER_BIN
    raise TokenizerNotFoundError(
        "GPT-2 tokenizer not found: looked for gpt2_vocab.bpe + gpt2_encoder.json or "
        f"{TOKENIZER_BIN} in {', '.join(looked)}; put them in one of these folders, pass --bpe-dir "
        f"DIR or set GPT2NP_BPE_DIR, or download {TOKENIZER_BIN} with `gpt2np fetch tokenizer`")


# ----------------------------------------------------------------------------------------------
# building a tiktoken Encoding

def _gpt2_char_to_byte():
    """OpenAI's encoder.json/vocab.bpe spell each byte as one printable character: bytes that are
    printable (and not space) as themselves, the other 68 as chr(256), chr(257),
    ... in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    char_to_byte = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in char_to_byte.values()]
    char_to_byte.update({chr(256 + i): b for i, b in enumerate(others)})
    return char_to_byte


def load_bpe_ranks(vocab_bpe, encoder_json):
    """{token bytes: rank} from OpenAI's vocab.bpe + encoder.json, and the <|endoftext|> id.

    Checks that the merges in vocab.bpe produce exactly the ids in encoder.json (tiktoken merges by
    rank, so rank order must be merge order).
    """
    char_to_byte = _gpt2_char_to_byte()

    def to_bytes(spelled, where):
        try:
            return bytes(char_to_byte[c] for c in spelled)
        except KeyError as e:
            raise TokenizerError(f"{where}: character {e.args[0]!r} is not part of "
                                 "GPT-2's byte alphabet") from None

    try:
        encoder = json.loads(Path(encoder_json).read_text(encoding="utf-8"))
        merge_lines = Path(vocab_bpe).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{encoder_json} / {vocab_bpe}: cannot read BPE files ({e})") from None
    if not isinstance(encoder, dict):
        raise TokenizerError(f"{encoder_json}: expected a JSON object mapping tokens to ids")
    eot = encoder.pop(EOT_TEXT, None)
    ranks = {to_bytes(k, encoder_json): v for k, v in encoder.items()}
    for b in range(256):
        if ranks.get(bytes([b]), 256) >= 256:
            raise TokenizerError(f"{encoder_json}: byte {b} lacks a single-byte "
                                 "token with id < 256")
    merges = [line for line in merge_lines[1:] if line]   # line 0 is "#version: 0.2"
    if len(merges) + 256 != len(ranks):
        raise TokenizerError(f"{vocab_bpe}: {len(merges)} merges + 256 bytes != {len(ranks)} "
                             f"tokens in {encoder_json}")
    for i, line in enumerate(merges):
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{vocab_bpe}: line {i + 2} is not a merge 'a b': {line!r}")
        merged = to_bytes(parts[0], vocab_bpe) + to_bytes(parts[1], vocab_bpe)
        if ranks.get(merged) != 256 + i:
            raise TokenizerError(f"{vocab_bpe}: merge on line {i + 2} ({line!r}) does not match "
                                 f"its id in {encoder_json}")
    return ranks, (len(ranks) if eot is None else int(eot))


def _encoding(name, ranks, eot, vocab_size):
    return tiktoken.Encoding(name=name, pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: eot}, explicit_n_vocab=vocab_size)


def encoding_from_bpe_files(vocab_bpe, encoder_json) -> tiktoken.Encoding:
    """A tiktoken Encoding equal to tiktoken's "gpt2", built from local OpenAI BPE files."""
    ranks, eot = load_bpe_ranks(vocab_bpe, encoder_json)
    return _encoding("gpt2", ranks, eot, max(len(ranks), eot) + 1)


def encoding_from_tokenizer_bin(path) -> tiktoken.Encoding:
    """A tiktoken Encoding from llm.c's gpt2_tokenizer.bin (token id = BPE rank, as in GPT-2)."""
    table = load_tokenizer_bin(path)
    ranks = {}
    for i, tok in enumerate(table.token_bytes):
        if i == table.eot_token:
            continue
        if tok in ranks:
            raise TokenizerError(f"{path}: tokens {ranks[tok]} and {i} have the same bytes {tok!r}")
        ranks[tok] = i
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: not a byte-level BPE vocabulary (no token for "
                             f"byte {missing[0]})")
    return _encoding("gpt2", ranks, table.eot_token, table.vocab_size)


@functools.lru_cache(maxsize=4)
def _load_encoding(kind, paths, mtimes):
    del mtimes  # part of the cache key only: edited files are read again
    return (encoding_from_bpe_files(*paths) if kind == "bpe"
            else encoding_from_tokenizer_bin(paths[0]))


def get_encoding(bpe_dir=None) -> tiktoken.Encoding:
    """GPT-2's tiktoken Encoding from local files (see the module docstring for
    the search order)."""
    kind, found = find_tokenizer_files(bpe_dir)
    paths = tuple(str(p) for p in (found if kind == "bpe" else (found,)))
    return _load_encoding(kind, paths, tuple(os.stat(p).st_mtime_ns for p in paths))


def encode(text, encoding=None):
    """Token ids of `text`; "<|endoftext|>" inside text is treated as plain text,
    not the eot token."""
    return (encoding or get_encoding()).encode_ordinary(text)


def decode(ids, encoding=None):
    """Text of token ids (invalid utf-8 becomes U+FFFD)."""
    return (encoding or get_encoding()).decode([int(i) for i in ids], errors="replace")


# ----------------------------------------------------------------------------------------------
# llm.c's gpt2_tokenizer.bin

class TokenTable:
    """Token id -> bytes table, as llm.c's tokenizer.c reads gpt2_tokenizer.bin."""

    def __init__(self, token_bytes, eot_token):
        self.token_bytes = list(token_bytes)
        self.eot_token = int(eot_token)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def decode_bytes(self, ids) -> bytes:
        """The bytes of a token sequence, concatenated."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return b"".join(self.token_bytes[i] for i in ids)

    def decode(self, ids) -> str:
        """Text of a token sequence; a character split across tokens decodes correctly."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def write_tokenizer_bin(path, encoding):
    """Write llm.c's gpt2_tokenizer.bin (version 2) for a tiktoken Encoding, atomically."""
    vocab_size = encoding.n_vocab
    header = np.zeros(HEADER_INTS, dtype="<u4")
    header[0], header[1], header[2], header[3] = (TOKENIZER_MAGIC, TOKENIZER_VERSION, vocab_size,
                                                  encoding.eot_token)
    body = bytearray()
    for i in range(vocab_size):
        tok = encoding.decode_single_token_bytes(i)
        if not 0 < len(tok) < 256:
            raise TokenizerError(f"{path}: token {i} has {len(tok)} bytes; the "
                                 "format allows 1..255")
        body.append(len(tok))
        body += tok
    with atomic_write(path) as f:
        f.write(header.tobytes())
        f.write(bytes(body))


def load_tokenizer_bin(path) -> TokenTable:
    """Read llm.c's gpt2_tokenizer.bin (versions 1 and 2)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerNotFoundError(f"{path}: tokenizer file not found") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read tokenizer file ({e.strerror or e})") from None
    if len(raw) < 4 * HEADER_INTS:
        raise TokenizerError(f"{path}: truncated tokenizer file: {len(raw)} bytes, "
                             f"shorter than the {4 * HEADER_INTS}-byte header")
    header = np.frombuffer(raw, dtype="<u4", count=HEADER_INTS)
    if header[0] != TOKENIZER_MAGIC:
        raise TokenizerError(f"{path}: not an llm.c tokenizer file (magic {header[0]}, expected "
                             f"{TOKENIZER_MAGIC})")
    version, vocab_size = int(header[1]), int(header[2])
    if version not in (1, 2):
        raise TokenizerError(f"{path}: unsupported tokenizer file version {version} "
                             "(expected 1 or 2)")
    eot = GPT2_EOT_TOKEN if version == 1 else int(header[3])
    if vocab_size == 0 or eot >= vocab_size:
        raise TokenizerError(f"{path}: bad header: vocab_size {vocab_size}, eot token {eot}")
    tokens, pos = [], 4 * HEADER_INTS
    for i in range(vocab_size):
        if pos >= len(raw) or pos + 1 + raw[pos] > len(raw):
            raise TokenizerError(f"{path}: truncated tokenizer file: ends inside token "
                                 f"{i} of {vocab_size}")
        n = raw[pos]
        if n == 0:                       # llm.c's tokenizer_init asserts every token has a byte
            raise TokenizerError(f"{path}: token {i} is empty (llm.c's tokenizer files give every "
                                 "token 1-255 bytes)")
        tokens.append(raw[pos + 1:pos + 1 + n])
        pos += 1 + n
    if pos != len(raw):
        raise TokenizerError(f"{path}: {len(raw) - pos} unexpected bytes after the "
                             f"{vocab_size} tokens")
    return TokenTable(tokens, eot)
