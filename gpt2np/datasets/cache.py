"""The download cache: where downloaded datasets go, and when a cached file counts as done.

    cache_dir()                    --dir if given, else $GPT2NP_CACHE, else the user cache dir
                                   (platformdirs: ~/.cache/gpt2np on Linux; ~/.cache/gpt2np without
                                   platformdirs)
    checked_cache_dir()            the same, refused in one line (naming --dir) when a file is in
                                   the way
    cached(name, url, dir=None)    the path of a verified copy of url in the cache, downloading it
                                   first if needed

A file counts as done only when its size and SHA-256 match: the ones given (CachedFile.size/.sha256,
when known), and the ones recorded in `<name>.done.json` next to it after a complete download. A
partial download never lands at the file's name (fetch.download writes a temporary file and renames
it only when complete, and a read shorter than Content-Length fails), and a file without its record,
or one that no longer matches it, is downloaded again.
"""
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpt2np.datasets import fetch
from gpt2np.fileio import atomic_write, check_folder

CACHE_ENV = "GPT2NP_CACHE"
APP = "gpt2np"


def cache_dir(override=None) -> Path:
    """The cache folder: override (a --dir flag), else $GPT2NP_CACHE, else the user cache dir."""
    if override:
        return Path(override)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        from platformdirs import user_cache_dir
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / APP
    return Path(user_cache_dir(APP, appauthor=False))


def checked_cache_dir(override=None) -> Path:
    """cache_dir(override), refused in one line (BadInput naming --dir, or $GPT2NP_CACHE) when it or
    a parent of it is a file: checked before anything is downloaded or read."""
    flag = ("--dir" if override else f"${CACHE_ENV}" if os.environ.get(CACHE_ENV)
            else "the cache folder")
    return check_folder(flag, cache_dir(override))


@dataclass(frozen=True)
class CachedFile:
    """A file the cache can hold: its name in the cache, its URL, and (when known) its
    size and SHA-256."""
    name: str
    url: str
    size: int | None = None
    sha256: str | None = None


def sha256_of(path, chunk=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def record_path(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".done.json")


def is_done(path, size=None, sha256=None) -> bool:
    """Whether `path` is a complete download: present, with a record of its size and hash that it
    matches, and matching the expected size/sha256 where given."""
    path = Path(path)
    try:
        record = json.loads(record_path(path).read_text())
        actual_size = path.stat().st_size
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("size") != actual_size:
        return False
    if size is not None and actual_size != size:
        return False
    digest = sha256_of(path)
    return digest == record.get("sha256") and (sha256 is None or digest == sha256)


def mark_done(path) -> dict:
    """Write the record that makes `path` count as done (after a complete download
    or a local copy)."""
    path = Path(path)
    record = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    with atomic_write(record_path(path), "w") as f:
        json.dump(record, f)
    return record


def cached(entry: CachedFile, directory=None, timeout=10, progress=True, opener=None) -> Path:
    """The path of a verified copy of entry in the cache (cache_dir(directory)), downloading it if
    it is missing, partial or does not match. A download that does not match entry.size/.sha256 is
    removed: FetchError."""
    path = checked_cache_dir(directory) / entry.name
    if is_done(path, entry.size, entry.sha256):
        return path
    # from here on the file is not done until it is re-recorded
    record_path(path).unlink(missing_ok=True)
    fetch.download(entry.url, path, timeout=timeout, progress=progress, opener=opener)
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        path.unlink(missing_ok=True)
        raise fetch.FetchError(f"could not download {entry.url}: {size} bytes, expected "
                               f"{entry.size}")
    if entry.sha256 is not None and sha256_of(path) != entry.sha256:
        path.unlink(missing_ok=True)
        raise fetch.FetchError(f"could not download {entry.url}: its SHA-256 is not the expected "
                               f"{entry.sha256[:12]}...")
    mark_done(path)
    return path
