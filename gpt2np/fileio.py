"""Atomic file writes: every file gpt2np writes appears whole or not at all."""
import contextlib
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Open a temporary file next to `path`; on success flush, fsync and os.replace() it onto `path`.

    On any exception the temporary file is removed and `path` is left as it was. Missing parent
    folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies, unlike mkstemp's 0600
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
