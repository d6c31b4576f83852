"""Disk full and other write errors: one line naming the file and the errno, no partial or temporary
file left, the state in memory intact (a later write gives exactly the expected bytes), and a run
stops with that one line.

ENOSPC is injected (at fsync, at the file's write, at os.write) so these tests run anywhere; where
this process may mount a tmpfs (root outside a locked-down container), a really full disk is tested
too, through train.py.
"""
import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

import train
from gpt2np import fileio
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.errors import WriteError
from gpt2np.fileio import append_line, atomic_write
from gpt2np.formats.checkpoint import model_path, save_model
from gpt2np.model import GPT2

# 34,208 parameters: its checkpoint (137 kB) does not fit the 96 kB tmpfs below
TINY = GPT2Config(max_seq_len=17, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=2,
                  channels=32)
T = 16
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def disk_full_line(path):
    return f"writing {path}: [Errno 28] No space left on device"


def leftovers(folder):
    """Files in folder other than those a test put there on purpose: temp files, partial files."""
    return sorted(p.name for p in Path(folder).iterdir())


@pytest.fixture
def model():
    return GPT2(TINY, NumpyBackend(), 1, T, seed=5)


def fail_once(monkeypatch, module, name, error=ENOSPC):
    """The next call of module.name raises error; later calls work (the disk has room again)."""
    real = getattr(module, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, failing)
    return calls


def test_checkpoint_on_full_disk(tmp_path, monkeypatch, model):
    expected = tmp_path / "expected.bin"
    save_model(expected, TINY, model.params_host())
    params_before = model.params_host().copy()
    out = tmp_path / "log"
    path = Path(model_path(out, 10))
    # where NFS and ext4 report a full disk at the latest
    fail_once(monkeypatch, os, "fsync")
    with pytest.raises(OSError) as e:
        save_model(path, TINY, model.params_host())
    assert isinstance(e.value, WriteError) and e.value.errno == errno.ENOSPC
    assert str(e.value) == disk_full_line(path)
    assert leftovers(out) == []                        # neither the checkpoint nor its temp file
    assert np.array_equal(model.params_host(), params_before)
    # room again: the same bytes as if nothing had happened
    save_model(path, TINY, model.params_host())
    assert path.read_bytes() == expected.read_bytes() and leftovers(out) == [path.name]


def test_failed_checkpoint_keeps_the_old_file(tmp_path, monkeypatch, model):
    path = tmp_path / "model.bin"
    save_model(path, TINY, model.params_host())
    old = path.read_bytes()
    fail_once(monkeypatch, os, "fsync")
    with pytest.raises(WriteError):
        save_model(path, TINY, model.params_host() + 1)
    assert path.read_bytes() == old and leftovers(tmp_path) == ["model.bin"]


class FullAfter:
    """A file whose writes fail with ENOSPC once `room` bytes are in it (the bytes that
    fit are written)."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.file.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_shard_on_full_disk(tmp_path, monkeypatch):
    tokens = np.arange(5000) % 200
    expected = tmp_path / "expected.bin"
    write_shard(expected, tokens)
    out = tmp_path / "data"
    out.mkdir()
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullAfter(real_fdopen(fd, mode), room=3000))
    with pytest.raises(WriteError) as e:
        write_shard(out / "train.bin", tokens)
    assert str(e.value) == disk_full_line(out / "train.bin")
    assert leftovers(out) == []
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    write_shard(out / "train.bin", tokens)
    assert (out / "train.bin").read_bytes() == expected.read_bytes()


def test_a_write_error_without_errno_is_probed(tmp_path, monkeypatch):
    """numpy's tofile says only 'N requested and M written'; one more write to the doomed
    temp file says why."""
    short = OSError("1000 requested and 24 written")
    with pytest.raises(WriteError) as e:
        with atomic_write(tmp_path / "a.bin"):
            # the disk has room again: the probe finds nothing
            raise short
    assert str(e.value) == f"writing {tmp_path / 'a.bin'}: 1000 requested and 24 written"
    fail_once(monkeypatch, os, "write")
    with pytest.raises(WriteError) as e:
        with atomic_write(tmp_path / "a.bin"):
            raise short
    assert str(e.value) == disk_full_line(tmp_path / "a.bin") and e.value.__cause__ is short
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [TimeoutError("timed out"), ConnectionResetError(104, "reset"),
                                   FileNotFoundError(2, "No such file or directory", "input.txt"),
                                   ValueError("x")])
def test_other_errors_in_the_body_pass_through(tmp_path, error):
    """A download timing out while it feeds the file, a missing input...: not errors of
    writing the file."""
    with pytest.raises(type(error)) as e:
        with atomic_write(tmp_path / "a.bin") as f:
            f.write(b"partial")
            raise error
    assert e.value is error and leftovers(tmp_path) == []


def test_ctrl_c_while_the_file_opens_stays_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C inside os.fdopen, after the file object took the descriptor (and closed it on its way
    out): the interrupt passes through, not an EBADF from closing the descriptor again, and no
    temporary file stays."""
    real_fdopen = os.fdopen

    def interrupted_fdopen(fd, mode):
        real_fdopen(fd, mode).close()
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fdopen", interrupted_fdopen)
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(tmp_path / "a.bin"):
            pass
    assert leftovers(tmp_path) == []


def test_atomic_write_refuses_what_it_would_replace_wrongly(tmp_path):
    """A folder, a pipe or a device at the path (as root, /dev/full was replaced by a regular file)
    and a file in the way of the path's folders are refused before anything is written, each naming
    the path and why."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    for target, says in ((tmp_path / "fifo", "not a regular file"),
                         (tmp_path / "folder", "it is a folder"),
                         (tmp_path / "afile" / "out.bin", f"{tmp_path / 'afile'} is a file")):
        with pytest.raises(WriteError) as caught:
            with atomic_write(target) as f:
                f.write(b"data")
        assert str(caught.value).startswith(f"writing {target}: ") and says in str(caught.value)
    assert (stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
            and (tmp_path / "afile").read_text() == "x")
    assert (os.listdir(tmp_path / "folder") == []
            and sorted(os.listdir(tmp_path)) == ["afile", "fifo", "folder"])


def test_log_on_full_disk_keeps_whole_lines(tmp_path, monkeypatch):
    log = tmp_path / "main.log"
    append_line(log, "s:0 trl:5.342460 lr:0.0015 norm:1.6188")
    real_write = os.write

    def short_then_full(fd, data):                   # the first 7 bytes fit, then the disk is full
        if len(data) > 7:
            return real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(WriteError) as e:
        append_line(log, "s:1 trl:5.381507 lr:0.003 norm:1.5092")
    assert str(e.value) == disk_full_line(log)
    # the half line is undone
    assert log.read_text() == "s:0 trl:5.342460 lr:0.0015 norm:1.6188\n"
    monkeypatch.setattr(os, "write", real_write)
    append_line(log, "s:1 trl:5.381507 lr:0.003 norm:1.5092")
    assert log.read_text().splitlines()[-1] == "s:1 trl:5.381507 lr:0.003 norm:1.5092"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    save_model(folder / "tiny.bin", TINY, GPT2(TINY, NumpyBackend(), 1, T, seed=5).params_host())
    rng = np.random.default_rng(0)
    write_shard(folder / "train.bin", rng.integers(0, TINY.vocab_size, 4000))
    write_shard(folder / "val.bin", rng.integers(0, TINY.vocab_size, 1000))
    return folder


def train_args(inputs, out):
    return [str(a) for a in ["-e", inputs / "tiny.bin", "-i", inputs / "train.bin", "-j",
                             inputs / "val.bin", "-b", 2, "-t", T, "-x", 4, "-v", 2, "-m", 1, "-s",
                             0, "-n", 2, "--device", "cpu", "-o", out]]


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_run_stops_with_one_line_when_main_log_cannot_be_written(inputs, tmp_path, monkeypatch,
                                                                 capsys):
    out = tmp_path / "out"
    real_open, real_write = os.open, os.write
    log_fd, lines_tried = [None], [0]

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.fspath(path).endswith("main.log"):
            log_fd[0] = fd
            lines_tried[0] += 1
        return fd

    def write(fd, data):
        if fd == log_fd[0] and lines_tried[0] > 3:     # the fourth line finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(fileio.os, "open", open_)
    monkeypatch.setattr(fileio.os, "write", write)
    code = train.main(train_args(inputs, out))
    err = capsys.readouterr().err
    assert code == 1
    assert error_lines(err) == [f"error: {disk_full_line(out / 'main.log')}"], err
    assert "Traceback" not in err
    lines = (out / "main.log").read_text().splitlines()
    assert len(lines) == 3 and all(line.startswith("s:") for line in lines)


@pytest.fixture
def full_disk(tmp_path):
    """A 96 kB tmpfs (skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_checkpoint_on_a_really_full_disk(inputs, full_disk, capsys):
    """End to end on a full tmpfs: numpy's tofile fails without an errno; the message
    still says ENOSPC."""
    out = full_disk / "log"
    code = train.main(train_args(inputs, out))
    err = capsys.readouterr().err
    assert code == 1
    assert error_lines(err) == [f"error: {disk_full_line(model_path(out, 2))}"], err
    assert "Traceback" not in err
    files = leftovers(out)
    assert not [name for name in files if name.startswith(".") or name.startswith("model_")], files
    lines = (out / "main.log").read_text().splitlines()
    assert lines and all(line.startswith("s:") for line in lines)


def test_atomic_write_syncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """The rename reaches the disk too: the folder is fsynced after os.replace (else a power loss
    can bring back the old file, or none, under a DONE marker written after it). File systems that
    cannot sync a folder (EINVAL) are passed over; a real failure there (EIO) is one
    WriteError naming the file."""
    synced = []
    real_fsync, real_replace = os.fsync, os.replace
    failure = {}

    def fsync(fd):
        info = os.fstat(fd)
        folder = stat.S_ISDIR(info.st_mode)
        synced.append(("folder", info.st_ino) if folder else "file")
        if folder and failure:
            raise OSError(failure["errno"], os.strerror(failure["errno"]))
        real_fsync(fd)

    def replace(src, dst):
        synced.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "sub" / "model.bin"
    with atomic_write(path) as f:
        f.write(b"one")
    assert (synced == ["file", "rename", ("folder", path.parent.stat().st_ino)]
            and path.read_bytes() == b"one")
    failure["errno"] = errno.EINVAL
    with atomic_write(path) as f:
        f.write(b"two")
    assert path.read_bytes() == b"two"
    failure["errno"] = errno.EIO
    with pytest.raises(WriteError) as e:
        with atomic_write(path) as f:
            f.write(b"three")
    assert str(e.value) == f"writing {path}: [Errno 5] Input/output error"
    assert path.read_bytes() == b"three" and leftovers(path.parent) == ["model.bin"]
