"""Tokenize a text file into llm.c token shards: <name>_val.bin (the first val_tokens tokens) and <name>_train.bin.

    gpt2np prepare [--input FILE | tinyshakespeare] [--output-dir DIR] [--val-tokens 32768] [--bpe-dir DIR]
    gpt2np prepare fineweb --shards N          # FineWeb-Edu sample-10BT (llm.c's -t classic, -v 100B too), val first
    gpt2np prepare tinystories                 # TinyStories_val.bin, TinyStories_train.bin (tinystories.py)

As llm.c does for tinyshakespeare, the text is cut at blank lines ("\\n\\n") into documents, each document
is preceded by <|endoftext|>, and every document but the last keeps its trailing "\\n\\n". The GPT-2
tokenizer file gpt2_tokenizer.bin is written next to the shards if it is not there yet.
"""
import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gpt2np.datasets.corpora import (
    FINEWEB_DEFAULT,
    FINEWEB_TYPES,
    FINEWEB_VERSIONS,
    SHARD_SIZE,
    prepare_corpus,
    source_files,
)
from gpt2np.datasets.data import DataError, write_shard
from gpt2np.datasets.fetch import TINYSHAKESPEARE_URL, download
from gpt2np.errors import ArgumentParser, BadInput, integer, tool
from gpt2np.fileio import check_folder, removing_new_folders
from gpt2np.formats.tokenizer import TOKENIZER_BIN, get_encoding, write_tokenizer_bin
from gpt2np.paths import DATA_DIR, data_search_dirs
from gpt2np.progress import progress

DEFAULT_OUTPUT_DIR = DATA_DIR
TINYSHAKESPEARE_NAME = "tiny_shakespeare"   # llm.c's shard names: tiny_shakespeare_{val,train}.bin
DEFAULT_VAL_TOKENS = 32768
LARGE = ("fineweb", "tinystories")          # the corpora of corpora.py and tinystories.py, and the flags they take
LARGE_ONLY = ("--source", "--shards", "--shard-size", "--workers", "--dir")
FINEWEB_ONLY = ("--shards", "--shard-size")  # TinyStories is llm.c's two files, not shards of a size
DOCS_PER_BATCH = 4096                       # documents tokenized per call (the progress bar moves between calls)


class Shards(NamedTuple):
    """Paths written by prepare_text."""
    val: Path
    train: Path
    tokenizer: Path


def tokenize_documents(text, encoding):
    """1-D uint16 token array: eot + tokens of each blank-line-separated document (llm.c's layout)."""
    sections = text.split("\n\n")
    docs = [s + "\n\n" for s in sections[:-1]] + sections[-1:]
    eot = encoding.eot_token
    tokens = []
    with progress(total=len(text), desc="tokenizing", unit="char", unit_scale=True) as bar:
        for lo in range(0, len(docs), DOCS_PER_BATCH):
            batch = docs[lo:lo + DOCS_PER_BATCH]
            for doc_tokens in encoding.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1):
                tokens.append(eot)
                tokens.extend(doc_tokens)
            bar.update(sum(map(len, batch)))
    return np.array(tokens, dtype=np.uint16)


def prepare_text(text_path, out_dir, name, val_tokens=DEFAULT_VAL_TOKENS, encoding=None) -> Shards:
    """Write out_dir/<name>_val.bin and <name>_train.bin from a utf-8 text file; returns their paths."""
    text_path, out_dir = Path(text_path), Path(out_dir)
    encoding = encoding or get_encoding()
    try:
        raw = text_path.read_bytes()
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")   # text mode's newlines, as read_text
    except FileNotFoundError:
        raise DataError(f"{text_path}: text file not found") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{text_path}: not utf-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise DataError(f"{text_path}: {'empty' if not raw else 'only whitespace'}: no text to tokenize")
    # a token is at least one byte, plus an <|endoftext|> a document: too short a text is refused before tokenizing
    most = len(raw) + text.count("\n\n") + 1
    if most <= val_tokens + 1:
        raise DataError(f"{text_path}: {len(raw):,} bytes, at most {most:,} tokens; need more than val_tokens+1 = "
                        f"{val_tokens + 1} to leave a training split (a smaller --val-tokens?)")
    tokens = tokenize_documents(text, encoding)
    if len(tokens) <= val_tokens + 1:
        raise DataError(f"{text_path}: only {len(tokens)} tokens, need more than val_tokens+1 = "
                        f"{val_tokens + 1} to leave a training split")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = Shards(out_dir / f"{name}_val.bin", out_dir / f"{name}_train.bin", out_dir / TOKENIZER_BIN)
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


def prepare_tinyshakespeare(out_dir=DEFAULT_OUTPUT_DIR, val_tokens=DEFAULT_VAL_TOKENS, encoding=None,
                            timeout=10) -> Shards:
    """tiny_shakespeare_{val,train}.bin in out_dir, from a local copy or downloaded into out_dir."""
    text_path = find_tinyshakespeare()
    if text_path is None:
        text_path = download(TINYSHAKESPEARE_URL, Path(out_dir) / "tinyshakespeare.txt", timeout=timeout)
    return prepare_text(text_path, out_dir, TINYSHAKESPEARE_NAME, val_tokens, encoding)


@tool
def main(argv=None):
    """Tokenize tinyshakespeare or --input into shards; bad flags and files: one line, exit 2."""
    parser = ArgumentParser(prog="python -m gpt2np.datasets.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", choices=["tinyshakespeare", "fineweb", "tinystories"],
                        help="a known dataset (default when --input is not given: tinyshakespeare); fineweb "
                             "(FineWeb-Edu sample-10BT by default, see -t/-v; streamed from the Hugging Face Hub: "
                             "pip install 'gpt2np[data]') and tinystories (llm.c's: TinyStories_all_data.tar.gz, "
                             "downloaded) or read from --source")
    parser.add_argument("-t", "--type", choices=list(FINEWEB_TYPES), help="fineweb: edu (FineWeb-Edu, shards "
                        "edu_fineweb_*) or classic (FineWeb, shards fineweb_*), llm.c's fineweb.py -t (default: edu, "
                        "the data of llm.c's GPT-2 runs; llm.c's script defaults to classic); with --source it only "
                        "names the shards")
    parser.add_argument("-v", "--version", choices=list(FINEWEB_VERSIONS), help="fineweb: the sample on the Hub, "
                        "10B (sample-10BT) or 100B (sample-100BT) tokens, llm.c's fineweb.py -v (default: 10B)")
    parser.add_argument("--shards", type=int, help="fineweb: shards to write in all, the "
                        "val shard included (default -1: all the data)")
    parser.add_argument("--shard-size", type=int, help="fineweb: tokens per "
                        "shard (default 100000000, llm.c's)")
    parser.add_argument("--source", metavar="FILES", help="fineweb: local parquet/jsonl files (glob) with a `text` "
                        "field instead of the Hub; tinystories: the json files of TinyStories_all_data (glob)")
    parser.add_argument("--workers", type=int, help="fineweb/tinystories: tokenizing processes (default: half "
                        "the CPUs)")
    parser.add_argument("--dir", help="fineweb/tinystories: download cache (default: $GPT2NP_CACHE, else the user "
                        "cache dir)")
    parser.add_argument("--input", help="utf-8 text file to tokenize; shards are named after it")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="default: <repo>/checkpoints/data")
    parser.add_argument("--val-tokens", type=int, help=f"text/tinyshakespeare: tokens in the val split (default "
                        f"{DEFAULT_VAL_TOKENS}; fineweb: the val split is shard 0; tinystories: the first file)")
    parser.add_argument("--bpe-dir", help="folder with gpt2_vocab.bpe + gpt2_encoder.json or gpt2_tokenizer.bin")
    args = parser.parse_args(argv)
    if args.input and args.dataset:
        parser.error("give either --input FILE or a dataset name, not both")
    check_flags_apply(args)
    # the paths first: a folder as --input or a file as --output-dir would fail only after tokenizing
    if args.input and Path(args.input).is_dir():
        raise BadInput(f"--input {args.input}: is a folder; expected a UTF-8 text file")
    check_folder("--output-dir", args.output_dir)
    cache = None
    if args.dataset in LARGE and not args.source:
        from gpt2np.datasets.cache import checked_cache_dir
        cache = checked_cache_dir(args.dir)         # --dir: a file in the way is said before the Hub is asked
    # a failed run leaves no empty folder behind that it made (shards written stay: a large corpus resumes)
    with removing_new_folders(args.output_dir, cache):
        if args.dataset in LARGE:
            return prepare_large(args, cache)
        val_tokens = DEFAULT_VAL_TOKENS if args.val_tokens is None else args.val_tokens
        encoding = get_encoding(args.bpe_dir)
        if args.input:
            shards = prepare_text(args.input, args.output_dir, Path(args.input).stem, val_tokens, encoding)
        else:
            shards = prepare_tinyshakespeare(args.output_dir, val_tokens, encoding)
    for path in (shards.val, shards.train):
        print(f"wrote {path} ({(path.stat().st_size - 1024) // 2:,} tokens)")
    return 0


def check_flags_apply(args):
    """BadInput for a flag that means nothing for what is prepared (it would be ignored silently)."""
    for flag, value in (("-t", args.type), ("-v", args.version)):
        if value is not None and args.dataset != "fineweb":
            what = args.dataset or (f"--input {args.input}" if args.input else "tinyshakespeare")
            raise BadInput(f"{flag} {value}: only for fineweb (FineWeb's type and sample), not {what}")
    if args.version is not None and args.source:
        raise BadInput(f"-v {args.version}: the sample to download, not used with --source {args.source} (nothing "
                       f"is downloaded); give one or the other")
    if args.dataset in LARGE:
        if args.val_tokens is not None:
            split = "shard 0 (--shard-size tokens)" if args.dataset == "fineweb" else "first json file"
            raise BadInput(f"--val-tokens {args.val_tokens}: only for a text file (--input) or tinyshakespeare; "
                           f"{args.dataset}'s val split is its {split}")
        if args.dataset == "tinystories":
            for flag in FINEWEB_ONLY:
                value = getattr(args, flag[2:].replace("-", "_"))
                if value is not None:
                    raise BadInput(f"{flag} {value}: only for fineweb; tinystories writes llm.c's two files, "
                                   f"TinyStories_val.bin and TinyStories_train.bin")
        if args.source and args.dir:
            raise BadInput(f"--dir {args.dir}: the download cache, not used with --source {args.source} (nothing "
                           f"is downloaded); give one or the other")
        return
    what = f"--input {args.input}" if args.input else "tinyshakespeare"
    for flag in LARGE_ONLY:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            hint = "; a text file to tokenize is --input FILE" if flag == "--source" and not args.input else ""
            raise BadInput(f"{flag} {value}: only for fineweb or tinystories, not {what}{hint}")
    if args.val_tokens is not None:
        integer(0).check("--val-tokens", args.val_tokens, "the val split's tokens")


def prepare_large(args, cache=None):
    """gpt2np prepare fineweb|tinystories (cache: the download cache, None with --source): see datasets/corpora.py
    and gpt2np/datasets/tinystories.py."""
    if args.dataset == "tinystories":
        return prepare_stories(args, cache)
    shards = -1 if args.shards is None else args.shards
    shard_size = SHARD_SIZE if args.shard_size is None else args.shard_size
    integer(1, also=(-1,), words="-1 (all) or an integer >= 1").check("--shards", shards, "the shard count")
    integer(1).check("--shard-size", shard_size, "the tokens per shard")
    if shard_size >= 2**31:
        raise BadInput(f"--shard-size {shard_size}: a shard holds fewer than 2**31 tokens")
    if args.workers is not None:
        integer(1).check("--workers", args.workers, "the tokenizing processes")
    # the local files and the tokenizer's files, before any folder is made or anything downloaded
    if args.source:
        source_files(args.source)
    get_encoding(args.bpe_dir)
    kind, version = args.type or FINEWEB_DEFAULT[0], args.version or FINEWEB_DEFAULT[1]
    written = prepare_corpus(args.dataset, args.output_dir, shards, shard_size, args.source,
                             args.workers, args.bpe_dir, cache=cache, kind=kind, version=version)
    what = f"{args.source}, as {kind}" if args.source else f"{kind} {FINEWEB_VERSIONS[version]}"
    print(f"{args.dataset} ({what}): {len(written)} shard(s) written into {args.output_dir}")
    return 0


def prepare_stories(args, cache=None):
    """gpt2np prepare tinystories: llm.c's TinyStories_val.bin and TinyStories_train.bin (datasets/tinystories.py)."""
    from gpt2np.datasets.tinystories import prepare_tinystories
    if args.workers is not None:
        integer(1).check("--workers", args.workers, "the tokenizing processes")
    if args.source:
        source_files(args.source)
    get_encoding(args.bpe_dir)
    for path in prepare_tinystories(args.output_dir, args.source, args.workers, args.bpe_dir, cache=cache):
        print(f"wrote {path} ({(path.stat().st_size - 1024) // 2:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
