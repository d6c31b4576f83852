"""`gpt2np fetch`: download tinyshakespeare, llm.c's starter pack, GPT-2's BPE files, HellaSwag.

    gpt2np fetch [tinyshakespeare|model|model-bf16|tokenizer|debug-state|bpe|all ...]
                 [--dir checkpoints]
    gpt2np fetch hellaswag [--dir DIR]     # hellaswag_val.jsonl into the download cache

The files go to checkpoints/ in the current folder (--dir), where `gpt2np train` and `prepare` run
from the same folder look for them; each downloaded file's path is printed as it works from there.
"""
import sys
from pathlib import Path

from gpt2np.datasets.cache import cache_dir, cached, checked_cache_dir, is_done
from gpt2np.datasets.fetch import FetchError, ensure
from gpt2np.datasets.hellaswag import VAL_FILE
from gpt2np.errors import ArgumentParser, number, tool
from gpt2np.fileio import check_folder, missing_folders, remove_empty
from gpt2np.paths import CHECKPOINTS_DIR

# command-line names -> local file names
GROUPS = {
    "tinyshakespeare": ["tinyshakespeare.txt"],
    "model": ["gpt2_124M.bin"],
    "model-bf16": ["gpt2_124M_bf16.bin"],
    "tokenizer": ["gpt2_tokenizer.bin"],
    "debug-state": ["gpt2_124M_debug_state.bin"],
    "bpe": ["gpt2_vocab.bpe", "gpt2_encoder.json"],
}
GROUPS["all"] = [f for files in GROUPS.values() for f in files]
# groups that go to the download cache (gpt2np/datasets/cache.py), not checkpoints/
CACHED = {"hellaswag"}


@tool
def main(argv=None):
    """Download the named groups; bad flags: one line, exit 2; a failed download: one
    line each, exit 1."""
    parser = ArgumentParser(prog="gpt2np fetch", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", metavar="WHAT",
                        help=f"any of {', '.join(sorted(set(GROUPS) | CACHED))} (default: "
                             "tinyshakespeare tokenizer model)")
    parser.add_argument("--dir", help=f"destination folder (default: {CHECKPOINTS_DIR} in the "
                        f"current folder; hellaswag: the download cache, $GPT2NP_CACHE or the user "
                        f"cache dir)")
    parser.add_argument("--timeout", type=float, default=10.0, help="socket timeout in seconds")
    args = parser.parse_args(argv)
    names = sorted(set(GROUPS) | CACHED)
    unknown = [w for w in args.what if w not in names]
    if unknown:
        parser.error(f"unknown WHAT {unknown[0]!r}; choose from {', '.join(names)}")
    number(0, low_open=True).check("--timeout", args.timeout, "the socket timeout in seconds")
    groups = args.what or ["tinyshakespeare", "tokenizer", "model"]
    # the folders first: a file in the way is bad input (one line, exit 2) before any download, not
    # a failed download per file
    folder = check_folder("--dir", args.dir) if args.dir else CHECKPOINTS_DIR
    made = missing_folders(folder)
    if CACHED & set(groups):
        made += missing_folders(checked_cache_dir(args.dir))
    failed = 0
    try:
        for group in groups:
            if group in CACHED:
                failed += fetch_cached(group, args.dir, args.timeout)
                continue
            for filename in GROUPS[group]:
                path = Path(folder) / filename
                if path.is_file():
                    print(f"{path}: already present", file=sys.stderr)
                    continue
                try:
                    path = ensure(filename, folder, timeout=args.timeout)
                    print(f"{path}: downloaded", file=sys.stderr)
                except FetchError as e:
                    print(f"error: {e}", file=sys.stderr)
                    failed += 1
    finally:
        # folders this command made and nothing came into (offline): not left behind
        remove_empty(made)
    return 1 if failed else 0


def fetch_cached(group, directory, timeout) -> int:
    """Fetch a cached group (hellaswag) into the download cache; 0, or 1 after
    printing the failure."""
    path = cache_dir(directory) / VAL_FILE.name
    if is_done(path):
        print(f"{path}: already present", file=sys.stderr)
        return 0
    try:
        print(f"{cached(VAL_FILE, directory, timeout=timeout)}: downloaded", file=sys.stderr)
    except OSError as e:            # FetchError (under `python -m` this module is another copy)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
