"""`gpt2np prepare`: a text file, tinyshakespeare, FineWeb(-Edu) or TinyStories -> llm.c shards.

    gpt2np prepare [--input FILE | tinyshakespeare] [--output-dir DIR] [--val-tokens 32768]
    gpt2np prepare fineweb --shards N     # FineWeb-Edu sample-10BT (-t classic, -v 100B), val first
    gpt2np prepare tinystories            # TinyStories_val.bin, TinyStories_train.bin

The shards go to checkpoints/data in the current folder (--output-dir), where `gpt2np train` run
from the same folder finds them. The library code is in gpt2np/datasets/: prepare.py (a text),
corpora.py (FineWeb), tinystories.py.
"""
import sys
from pathlib import Path

from gpt2np.datasets.cache import checked_cache_dir
from gpt2np.datasets.corpora import (
    FINEWEB_DEFAULT,
    FINEWEB_TYPES,
    FINEWEB_VERSIONS,
    SHARD_SIZE,
    prepare_corpus,
    source_files,
)
from gpt2np.datasets.prepare import DEFAULT_VAL_TOKENS, prepare_text, prepare_tinyshakespeare
from gpt2np.datasets.tinystories import prepare_tinystories
from gpt2np.errors import ArgumentParser, BadInput, integer, tool
from gpt2np.fileio import check_folder, removing_new_folders
from gpt2np.formats.tokenizer import get_encoding
from gpt2np.paths import DATA_DIR

# the corpora of corpora.py and tinystories.py, and the flags only they take
LARGE = ("fineweb", "tinystories")
LARGE_ONLY = ("--source", "--shards", "--shard-size", "--workers", "--dir")
FINEWEB_ONLY = ("--shards", "--shard-size")  # TinyStories is llm.c's two files, not shards


def parser_of_prepare() -> ArgumentParser:
    """gpt2np prepare's flags."""
    parser = ArgumentParser(prog="gpt2np prepare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "dataset", nargs="?", choices=["tinyshakespeare", "fineweb", "tinystories"],
        help="a known dataset (default when --input is not given: tinyshakespeare); fineweb "
             "(FineWeb-Edu sample-10BT by default, see -t/-v; streamed from the Hugging Face Hub: "
             "pip install 'gpt2np[data]') and tinystories (llm.c's: TinyStories_all_data.tar.gz, "
             "downloaded) or read from --source")
    parser.add_argument(
        "-t", "--type", choices=list(FINEWEB_TYPES),
        help="fineweb: edu (FineWeb-Edu, shards edu_fineweb_*) or classic (FineWeb, shards "
             "fineweb_*), llm.c's fineweb.py -t (default: edu, the data of llm.c's GPT-2 runs; "
             "llm.c's script defaults to classic); with --source it only names the shards")
    parser.add_argument(
        "-v", "--version", choices=list(FINEWEB_VERSIONS),
        help="fineweb: the sample on the Hub, 10B (sample-10BT) or 100B (sample-100BT) tokens, "
             "llm.c's fineweb.py -v (default: 10B)")
    parser.add_argument("--shards", type=int, help="fineweb: shards to write in all, the "
                        "val shard included (default -1: all the data)")
    parser.add_argument("--shard-size", type=int, help="fineweb: tokens per "
                        "shard (default 100000000, llm.c's)")
    parser.add_argument("--source", metavar="FILES",
                        help="fineweb: local parquet/jsonl files (glob) with a `text` field "
                             "instead of the Hub; tinystories: the json files of "
                             "TinyStories_all_data (glob)")
    parser.add_argument("--workers", type=int,
                        help="fineweb/tinystories: tokenizing processes (default: half the CPUs)")
    parser.add_argument("--dir", help="fineweb/tinystories: download cache (default: "
                        "$GPT2NP_CACHE, else the user cache dir)")
    parser.add_argument("--input", help="utf-8 text file to tokenize; shards are named after it")
    parser.add_argument("--output-dir", default=str(DATA_DIR),
                        help=f"default: {DATA_DIR} in the current folder")
    parser.add_argument("--val-tokens", type=int,
                        help=f"text/tinyshakespeare: tokens in the val split (default "
                             f"{DEFAULT_VAL_TOKENS}, or 10%% of a text too short for that; "
                             f"fineweb: the val split is shard 0; tinystories: the first file)")
    parser.add_argument("--bpe-dir", help="folder with gpt2_vocab.bpe + gpt2_encoder.json or "
                        "gpt2_tokenizer.bin")
    return parser


@tool
def main(argv=None):
    """Tokenize tinyshakespeare, --input, fineweb or tinystories into shards; bad flags and files:
    one line, exit 2; Ctrl-C: one line, exit 130 (a rerun resumes fineweb)."""
    parser = parser_of_prepare()
    args = parser.parse_args(argv)
    if args.input and args.dataset:
        parser.error("give either --input FILE or a dataset name, not both")
    check_flags_apply(args)
    # the paths first: a folder as --input or a file as --output-dir fails only after tokenizing
    if args.input and Path(args.input).is_dir():
        raise BadInput(f"--input {args.input}: is a folder; expected a UTF-8 text file")
    check_folder("--output-dir", args.output_dir)
    cache = None
    if args.dataset in LARGE and not args.source:
        cache = checked_cache_dir(args.dir)     # a file in the way: said before the Hub is asked
    # a failed run leaves no empty folder behind that it made (shards stay: a large corpus resumes)
    with removing_new_folders(args.output_dir, cache):
        if args.dataset == "fineweb":
            return prepare_fineweb(args, cache)
        if args.dataset == "tinystories":
            return prepare_stories(args, cache)
        encoding = get_encoding(args.bpe_dir)
        if args.input:
            shards = prepare_text(args.input, args.output_dir, Path(args.input).stem,
                                  args.val_tokens, encoding)
        else:
            shards = prepare_tinyshakespeare(args.output_dir, args.val_tokens, encoding)
    print_written([shards.val, shards.train])
    return 0


def print_written(paths):
    """`wrote PATH (N tokens)` for each shard, PATH as it works from the user's folder."""
    for path in paths:
        print(f"wrote {path} ({(path.stat().st_size - 1024) // 2:,} tokens)")


def check_flags_apply(args):
    """BadInput for a flag that means nothing for what is prepared (else ignored silently)."""
    for flag, value in (("-t", args.type), ("-v", args.version)):
        if value is not None and args.dataset != "fineweb":
            what = args.dataset or (f"--input {args.input}" if args.input else "tinyshakespeare")
            raise BadInput(f"{flag} {value}: only for fineweb (FineWeb's type and sample), "
                           f"not {what}")
    if args.version is not None and args.source:
        raise BadInput(f"-v {args.version}: the sample to download, not used with --source "
                       f"{args.source} (nothing is downloaded); give one or the other")
    if args.dataset in LARGE:
        if args.val_tokens is not None:
            split = ("shard 0 (--shard-size tokens)" if args.dataset == "fineweb"
                     else "first json file")
            raise BadInput(f"--val-tokens {args.val_tokens}: only for a text file (--input) or "
                           f"tinyshakespeare; {args.dataset}'s val split is its {split}")
        if args.dataset == "tinystories":
            for flag in FINEWEB_ONLY:
                value = getattr(args, flag[2:].replace("-", "_"))
                if value is not None:
                    raise BadInput(f"{flag} {value}: only for fineweb; tinystories writes llm.c's "
                                   f"two files, TinyStories_val.bin and TinyStories_train.bin")
        if args.source and args.dir:
            raise BadInput(f"--dir {args.dir}: the download cache, not used with --source "
                           f"{args.source} (nothing is downloaded); give one or the other")
        return
    what = f"--input {args.input}" if args.input else "tinyshakespeare"
    for flag in LARGE_ONLY:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            source_only = flag == "--source" and not args.input
            hint = "; a text file to tokenize is --input FILE" if source_only else ""
            raise BadInput(f"{flag} {value}: only for fineweb or tinystories, not {what}{hint}")
    if args.val_tokens is not None:
        integer(0).check("--val-tokens", args.val_tokens, "the val split's tokens")


def prepare_fineweb(args, cache=None):
    """gpt2np prepare fineweb (cache: the download cache, None with --source): corpora.py."""
    shards = -1 if args.shards is None else args.shards
    shard_size = SHARD_SIZE if args.shard_size is None else args.shard_size
    all_or_count = integer(1, also=(-1,), words="-1 (all) or an integer >= 1")
    all_or_count.check("--shards", shards, "the shard count")
    integer(1).check("--shard-size", shard_size, "the tokens per shard")
    if shard_size >= 2**31:
        raise BadInput(f"--shard-size {shard_size}: a shard holds fewer than 2**31 tokens")
    check_source_and_workers(args)
    kind, version = args.type or FINEWEB_DEFAULT[0], args.version or FINEWEB_DEFAULT[1]
    written = prepare_corpus(args.dataset, args.output_dir, shards, shard_size, args.source,
                             args.workers, args.bpe_dir, cache=cache, kind=kind, version=version)
    what = f"{args.source}, as {kind}" if args.source else f"{kind} {FINEWEB_VERSIONS[version]}"
    print(f"{args.dataset} ({what}): {len(written)} shard(s) written into {args.output_dir}")
    return 0


def prepare_stories(args, cache=None):
    """gpt2np prepare tinystories: llm.c's TinyStories_val.bin and TinyStories_train.bin."""
    check_source_and_workers(args)
    print_written(prepare_tinystories(args.output_dir, args.source, args.workers, args.bpe_dir,
                                      cache=cache))
    return 0


def check_source_and_workers(args):
    """--workers, the files of --source and the tokenizer's files: checked before any folder is
    made or anything downloaded."""
    if args.workers is not None:
        integer(1).check("--workers", args.workers, "the tokenizing processes")
    if args.source:
        source_files(args.source)
    get_encoding(args.bpe_dir)


if __name__ == "__main__":
    sys.exit(main())
