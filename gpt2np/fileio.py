"""Writing files so that a failure is one clear line and never a half-written file.

atomic_write: every file gpt2np writes (checkpoints, shards, tokenizer files) appears
whole or not at all.
append_line: main.log grows by whole lines only.
A failed write raises WriteError, an OSError whose message names the file and the errno:
`writing log/model_00000010.bin: [Errno 28] No space left on device`.
"""
import contextlib
import errno as errnos
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from gpt2np.errors import BadInput, WriteError

# at most this much is written to a doomed temp file to learn why a write failed
PROBE_BYTES = 1 << 20


def _is_write_failure(e: BaseException, tmp: Path) -> bool:
    """Whether an exception raised inside the `with atomic_write(...)` body is the write
    to our file failing.

    Disk full, quota, I/O error, file too large... are plain OSError (no subclass) without a
    filename, or with the temp file's name. Subclasses (TimeoutError and ConnectionError while a
    download feeds the file, FileNotFoundError of an input, WriteError of a nested write) are about
    something else and pass unchanged.
    """
    return type(e) is OSError and e.filename in (None, os.fspath(tmp))


def _probe_errno(fd) -> OSError | None:
    """The OSError a further write to fd gives, if any.

    numpy's tofile() reports a failed write as `N requested and M written`, without the errno; the
    temp file is deleted anyway, so writing more to it tells why (ENOSPC, EDQUOT, EIO...)."""
    chunk = bytes(64 << 10)
    try:
        for _ in range(PROBE_BYTES // len(chunk)):
            os.write(fd, chunk)
        os.fsync(fd)
    except OSError as e:
        return e if e.errno is not None else None
    return None


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Open a temporary file next to `path`; on success flush, fsync and os.replace() it onto
    `path`, then fsync the folder (the new name is as durable as the bytes).

    On any exception before the rename the temporary file is removed and `path` is left as it was.
    Missing parent folders are created. A failure of the write itself (see _is_write_failure) or of
    creating, flushing, syncing, closing or renaming the file is raised as WriteError naming `path`;
    other exceptions pass through unchanged. (A failed sync of the folder, after the rename, is
    raised too: the new file is then in place but may not outlive a crash.)
    """
    path = Path(path)
    _check_target(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the umask applies, unlike mkstemp's 0600
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise WriteError(path, e) from e
    try:
        f = os.fdopen(fd, mode)
    except BaseException:        # a bad mode, or Ctrl-C: nothing was written
        # fdopen may already own the descriptor (and have closed it) when an interrupt arrives
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finishing = False            # past the body: every OSError from here on is ours
    try:
        yield f
        finishing = True
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        sync_folder(path.parent)
    except BaseException as e:
        ours = isinstance(e, OSError) and (finishing or _is_write_failure(e, tmp))
        cause = e
        if ours and e.errno is None and not f.closed:
            cause = _probe_errno(fd) or e
        with contextlib.suppress(OSError):
            # flushes what is still buffered, which may fail again: the file is discarded
            f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if ours:
            raise WriteError(path, cause) from e
        raise


# A folder that cannot be opened or synced (Windows, some network and FUSE file systems): its
# rename stands unsynced.
FOLDER_SYNC_UNSUPPORTED = {errnos.EINVAL, errnos.ENOTSUP, errnos.EOPNOTSUPP, errnos.EBADF,
                           errnos.EACCES, errnos.EPERM, errnos.EISDIR}


def sync_folder(folder):
    """fsync a folder after a file was renamed into it, made or removed there, so that the change of
    name survives a power loss as the file's bytes do (without it a crash can bring back the old
    file, or none, under a DONE marker written after). Where folders cannot be synced
    (FOLDER_SYNC_UNSUPPORTED) nothing happens; other errors raise."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as e:
        if e.errno in FOLDER_SYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in FOLDER_SYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _check_target(path: Path):
    """WriteError unless `path` can be replaced by a file: a folder, a device or a pipe there would
    be replaced (as root, /dev/null by a regular file) or refuse only after the work; a file in the
    way of its folders would fail with a bare 'File exists'."""
    if path.is_dir():
        raise WriteError(path, OSError(None, "it is a folder: give a file's path"))
    if path.exists() and not path.is_file():
        raise WriteError(path, OSError(None, "it is not a regular file (a device, pipe or socket): "
                                             "give a file's path"))
    blocking = file_in_the_way(path)
    if blocking is not None:
        raise WriteError(path, OSError(None, f"{blocking} is a file, so the folder cannot be made"))


def file_in_the_way(path) -> Path | None:
    """What stops `path`'s missing folders from being made: its nearest existing ancestor when that
    is not a folder (a file, a broken link), as written in `path` (`x.txt` for
    `x.txt/sub/out.json`); None when they can be made."""
    for parent in Path(path).parents:
        if parent.is_dir():
            return None
        if os.path.lexists(parent):
            return parent
    return None


def append_line(path, line: str):
    """Append `line` and a newline to the text file `path` (created if missing).

    A write that fails part-way (disk full) is undone by truncating the file back to its old length,
    so the file only ever holds whole lines, and raised as WriteError naming `path`.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise WriteError(path, e) from e
    try:
        old_size = os.fstat(fd).st_size
        rest = memoryview((line + "\n").encode())
        try:
            while rest:
                # a short write is followed by one that says why it stopped
                written = os.write(fd, rest)
                if written == 0:
                    raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC))
                rest = rest[written:]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, old_size)
            raise WriteError(path, e) from e
    finally:
        os.close(fd)


# ---- local folders -------------------------------------------------------------------------------
def check_folder(flag, folder) -> Path:
    """`folder` as a Path when it is a folder or can be made one; BadInput naming `flag` when it or
    one of its parents is a file (`--dir x.txt/sub`), so the command stops before any
    download or tokenizing."""
    folder = Path(folder)
    blocking = folder if folder.exists() and not folder.is_dir() else file_in_the_way(folder)
    if blocking is not None:
        where = "is a file" if blocking == folder else f"{blocking} is a file"
        raise BadInput(f"{flag} {folder}: {where}; expected a folder (made if missing)")
    return folder


def missing_folders(folder) -> list:
    """The folders that making `folder` would create, deepest first."""
    folder, missing = Path(folder), []
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    return missing


def remove_empty(folders):
    """Remove those of the folders that are empty, deepest first: a failed command leaves
    none it made behind."""
    for path in sorted(set(map(Path, folders)), key=lambda p: len(p.absolute().parts),
                       reverse=True):
        try:
            path.rmdir()
        except OSError:
            # not empty (something was written into it), or gone already: it stays
            pass


@contextmanager
def removing_new_folders(*folders):
    """Inside: any of `folders` (and their parents) that did not exist and are still empty when the
    body fails are removed again."""
    made = [missing_folders(folder) for folder in folders if folder is not None]
    try:
        yield
    except BaseException:
        for missing in made:
            remove_empty(missing)
        raise
