"""Progress of long jobs: a bar redrawn in place on a terminal, plain lines elsewhere (a line every
`every` seconds and the last), nothing under GPT2NP_PROGRESS=off, and no line at all for
a job that fails."""
import io
import sys

import pytest

from gpt2np import progress as P


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(P.time, "monotonic", c)
    return c


def test_plain_lines_when_stderr_is_not_a_terminal(clock, monkeypatch):
    monkeypatch.delenv("GPT2NP_PROGRESS", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    out = io.StringIO()
    with P.progress(total=100, desc="val", unit="batch", every=10, file=out) as bar:
        for _ in range(100):
            clock.now += 0.25
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "val: 40/100 batch (40%), 10.0 s, 4 batch/s"
    assert lines[-1] == "val: 100/100 batch (100%), 25.0 s, 4 batch/s"
    assert len(lines) == 3                               # at 10 s, 20 s, and the end (25 s)


def test_a_bar_redrawn_in_place_on_a_terminal(clock, monkeypatch):
    monkeypatch.delenv("GPT2NP_PROGRESS", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = io.StringIO()
    with P.progress(total=4e6, desc="file.bin", unit="B", unit_scale=True, file=out) as bar:
        for _ in range(4):
            clock.now += 0.5
            bar.update(1e6)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") == 4
    assert "\rfile.bin: [" + "#" * 24 + "] 4.0 MB/4.0 MB (100%), 2.0 s, 2.0 MB/s" in text


@pytest.mark.parametrize("terminal", [False, True])
def test_a_failing_job_leaves_no_last_line(clock, monkeypatch, terminal):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    out = io.StringIO()
    with pytest.raises(OSError), P.progress(total=10, desc="x", file=out) as bar:
        bar.update(1)
        raise OSError("disk full")
    assert out.getvalue() == ""


@pytest.mark.parametrize("terminal", [False, True])
def test_the_last_line_shows_the_last_postfix(clock, monkeypatch, terminal):
    """A postfix set after the last update (eval's running mean: update, then the mean over the
    batches so far) is in the last line drawn, although the count was on screen already."""
    monkeypatch.delenv("GPT2NP_PROGRESS", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    out = io.StringIO()
    with P.progress(total=2, desc="val", unit="batch", every=0, file=out) as bar:
        for loss in (9.0, 8.0):
            clock.now += 1
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.4f}")
    last = out.getvalue().replace("\x1b[K", "").replace("\r", "\n").splitlines()[-1]
    drawn = "[" + "#" * 24 + "] " if terminal else ""
    assert last == f"val: {drawn}2/2 batch (100%), 2.0 s, 1 batch/s, loss 8.0000", out.getvalue()
    assert out.getvalue().endswith("\n") and out.getvalue().count("2/2") == 2


def test_off_and_the_environment_override(clock, monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("GPT2NP_PROGRESS", "off")
    for _ in P.progress(range(3), desc="quiet", file=out):
        pass
    assert out.getvalue() == ""
    monkeypatch.setenv("GPT2NP_PROGRESS", "bar")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert P.mode() == "bar"
    monkeypatch.setenv("GPT2NP_PROGRESS", "plain")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert P.mode() == "plain"
    assert list(P.progress(range(3), file=out)) == [0, 1, 2]
    assert out.getvalue() == "3/3 it (100%), 0.0 s, 0 it/s\n"


def test_long_validation_in_training_shows_progress(capsys):
    """The trainer's validation shows progress lines when it is long (LONG_VALIDATION batches or
    more), and says nothing for the usual few batches."""
    from gpt2np.train import evaluate

    class Loader:
        num_batches = evaluate.LONG_VALIDATION

        def eval_batches(self, max_batches):
            return max_batches if max_batches > 0 else self.num_batches

        def reset(self):
            pass

        def next_batch(self):
            return None, None

    class Model:
        def forward(self, x, y):
            return 1.0

    assert evaluate.val_loss(Model(), Loader(), max_batches=-1) == 1.0
    assert (f"val: {evaluate.LONG_VALIDATION}/{evaluate.LONG_VALIDATION} batch"
            in capsys.readouterr().err)
    assert evaluate.val_loss(Model(), Loader(), max_batches=5) == 1.0
    assert evaluate.val_loss(Model(), Loader(), max_batches=-1, show_progress=False) == 1.0
    assert capsys.readouterr().err == ""
