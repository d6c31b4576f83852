"""Downloading the files gpt2np can use: tinyshakespeare, llm.c's starter pack, GPT-2's BPE files.

    gpt2np fetch [tinyshakespeare|model|model-bf16|tokenizer|debug-state|bpe|all ...] [--dir checkpoints]
    gpt2np fetch hellaswag [--dir DIR]     # hellaswag_val.jsonl into the download cache (gpt2np/datasets/cache.py)

download() never hangs: every connect and read has a socket timeout; any failure (offline, timeout,
HTTP error, short read) raises FetchError with one line. Files are written to a temporary file
next to the destination and renamed into place only when complete.
"""
import http.client
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

from gpt2np.errors import ArgumentParser, number, tool
from gpt2np.fileio import atomic_write, check_folder, missing_folders, remove_empty
from gpt2np.paths import CHECKPOINTS_DIR
from gpt2np.progress import progress as show_progress

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
STARTER_PACK_URL = "https://huggingface.co/datasets/karpathy/llmc-starter-pack/resolve/main/"
GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"

# local file name -> URL
KNOWN_FILES = {
    "tinyshakespeare.txt": TINYSHAKESPEARE_URL,
    "gpt2_124M.bin": STARTER_PACK_URL + "gpt2_124M.bin",
    "gpt2_124M_bf16.bin": STARTER_PACK_URL + "gpt2_124M_bf16.bin",
    "gpt2_tokenizer.bin": STARTER_PACK_URL + "gpt2_tokenizer.bin",
    "gpt2_124M_debug_state.bin": STARTER_PACK_URL + "gpt2_124M_debug_state.bin",
    "gpt2_vocab.bpe": GPT2_BPE_URL + "vocab.bpe",
    "gpt2_encoder.json": GPT2_BPE_URL + "encoder.json",
}
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
CACHED = {"hellaswag"}          # groups that go to the download cache (gpt2np/datasets/cache.py), not checkpoints/
CHUNK_BYTES = 1 << 16


class FetchError(OSError):
    """A download failed; the message is one line naming the URL and the reason."""

    def __str__(self):
        return self.args[0] if self.args else ""


def download(url, dest, timeout=10, progress=True, opener=None):
    """Download `url` to the file `dest` (atomically), with a progress bar on stderr.

    timeout: seconds allowed for the connection and for each read. opener(request, timeout=) -> response
    replaces urllib.request.urlopen (tests). Returns dest as a Path.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:                               # a local folder problem, not a failed download
        raise FetchError(f"{dest.parent}: cannot make the folder for {dest.name} ({e.strerror or e})") from None
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "gpt2np"})
        with (opener or urllib.request.urlopen)(request, timeout=timeout) as response, atomic_write(dest) as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            # a bar redrawn in place on a terminal; in logs a line every 10 s and the last one
            with show_progress(total=total, desc=dest.name, unit="B", unit_scale=True, quiet=not progress) as bar:
                while True:
                    chunk = response.read(CHUNK_BYTES)
                    if not chunk:
                        break
                    out.write(chunk)
                    done += len(chunk)
                    bar.update(len(chunk))
            if total is not None and done != total:
                raise FetchError(f"could not download {url}: connection closed after {done} of {total} bytes")
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        raise FetchError(f"could not download {url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise FetchError(f"could not download {url}: no answer within {timeout} s") from None
        raise FetchError(f"could not download {url}: {reason} (offline?)") from None
    except TimeoutError:
        raise FetchError(f"could not download {url}: no answer within {timeout} s") from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise FetchError(f"could not download {url}: {type(e).__name__}: {e}") from None
    return dest


def ensure(filename, dest_dir="checkpoints", timeout=10, progress=True):
    """Path of dest_dir/filename, downloading it from KNOWN_FILES first if it is missing."""
    path = Path(dest_dir) / filename
    if path.is_file():
        return path
    if filename not in KNOWN_FILES:
        raise FetchError(f"{path}: missing, and no known URL for {filename}")
    return download(KNOWN_FILES[filename], path, timeout=timeout, progress=progress)


@tool
def main(argv=None):
    """Download the named groups; bad flags: one line, exit 2; a failed download: one line each, exit 1."""
    parser = ArgumentParser(prog="python -m gpt2np.datasets.fetch", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", metavar="WHAT",
                        help=f"any of {', '.join(sorted(set(GROUPS) | CACHED))} (default: tinyshakespeare "
                             "tokenizer model)")
    parser.add_argument("--dir", help="destination folder (default: <repo>/checkpoints; hellaswag: the download "
                        "cache, $GPT2NP_CACHE or the user cache dir)")
    parser.add_argument("--timeout", type=float, default=10.0, help="socket timeout in seconds")
    args = parser.parse_args(argv)
    names = sorted(set(GROUPS) | CACHED)
    unknown = [w for w in args.what if w not in names]
    if unknown:
        parser.error(f"unknown WHAT {unknown[0]!r}; choose from {', '.join(names)}")
    number(0, low_open=True).check("--timeout", args.timeout, "the socket timeout in seconds")
    groups = args.what or ["tinyshakespeare", "tokenizer", "model"]
    # the folders first: a file in the way is bad input (one line, exit 2) before any download, not a failed
    # download per file
    folder = check_folder("--dir", args.dir) if args.dir else CHECKPOINTS_DIR
    made = missing_folders(folder)
    if CACHED & set(groups):
        from gpt2np.datasets.cache import checked_cache_dir
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
                    ensure(filename, folder, timeout=args.timeout)
                except FetchError as e:
                    print(f"error: {e}", file=sys.stderr)
                    failed += 1
    finally:
        remove_empty(made)          # folders this command made and nothing came into (offline): not left behind
    return 1 if failed else 0


def fetch_cached(group, directory, timeout) -> int:
    """Fetch a cached group (hellaswag) into the download cache; 0, or 1 after printing the failure."""
    from gpt2np.datasets.cache import cache_dir, cached, is_done
    from gpt2np.datasets.hellaswag import VAL_FILE
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
