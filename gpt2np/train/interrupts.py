"""SIGINT (Ctrl-C) and SIGTERM (`kill`, Slurm's preemption): finish, checkpoint, exit 130 / 143.

    with StopSignals() as signals:
        for step in ...:
            if signals.signum: ... write a checkpoint ...; raise Stopped(signals.exit_code)

The first signal only records itself; the trainer looks between steps, and between the pieces of an
evaluation (which then ends early, without its numbers), so a step and a checkpoint are never cut in
half; signal_received makes the ranks of an mpiexec job look together. A second signal ends the
process at once (one line, exit 128 + its number) for a user who will not wait; a temporary file
that leaves behind is removed by the next run in that folder (gpt2np.train.rundir). Work with
nothing to save (-x 0's evaluation) runs inside `with signals.at_once():`, where the first signal
raises Stopped wherever the main thread is.
"""
import contextlib
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """The run stopped on a signal, after its checkpoint; the exit code is 128 + the signal's
    number, as a shell reports a process the signal ended (130 for SIGINT, 143 for SIGTERM). A
    SystemExit: no traceback."""


class StopSignals:
    """Catches SIGINT and SIGTERM while in the `with` block (main thread only; elsewhere it does
    nothing)."""

    def __init__(self):
        self.signum = None                        # the first signal received, None until then
        self._previous = {}
        self._at_once = False                     # in at_once(): the first signal raises Stopped
        self._arrivals = None                     # (read end, write end, the wakeup fd before ours)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            # Python runs a handler once for signals that arrive while the main thread is inside one
            # C call (a checkpoint's write): the wakeup fd gets a byte per arrival, so _handle can
            # count a quick second Ctrl-C
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._arrivals = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
            for signum in STOP_SIGNALS:
                # ignored by who started us (`cmd &`): stays so
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._arrivals:
            r, w, before = self._arrivals
            signal.set_wakeup_fd(before)
            os.close(r)
            os.close(w)
            self._arrivals = None

    def _arrived(self, signum) -> int:
        """How many of `signum` arrived since the last look (the wakeup fd's bytes; 1 where it is
        not ours). Ctrl-C only: a SIGTERM comes twice at once where mpiexec passes on the one a
        scheduler sent the whole job, and that is one stop, with its checkpoint."""
        if not self._arrivals or signum != signal.SIGINT:
            return 1
        data = b""
        try:
            while chunk := os.read(self._arrivals[0], 512):
                data += chunk
        except BlockingIOError:
            pass
        return max(1, data.count(bytes([signal.SIGINT])))

    @contextlib.contextmanager
    def at_once(self):
        """Inside: the first signal raises Stopped(exit code) in the main thread, wherever it is,
        instead of waiting for a look between steps: for work that has nothing to save (-x 0's
        evaluation). A signal received before raises it on entering. The caller catches Stopped
        around the `with` to say so in its one line."""
        self._at_once = True                      # first: a signal from here on raises in _handle
        try:
            if self.signum is not None:
                raise Stopped(self.exit_code)
            yield self
        finally:
            self._at_once = False

    def _handle(self, signum, frame):
        if self.signum is None and self._arrived(signum) < 2:
            self.signum = signum
            if self._at_once:
                raise Stopped(self.exit_code)
            return
        # os.write, not print: a handler runs between any two bytecodes, maybe inside a print to
        # stderr
        line = f"error: {signal.Signals(signum).name} again: exiting now, without a checkpoint\n"
        os.write(2, line.encode())
        os._exit(128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_received(signals: StopSignals, dist) -> bool:
    """Whether any process got SIGINT/SIGTERM: under mpiexec all ranks must stop at the same point
    (a scalar all-reduce per look; a rank that got none stops as if by SIGTERM)."""
    if dist.world_size == 1:
        return signals.signum is not None
    anyone = dist.average(0.0 if signals.signum is None else 1.0) > 0
    if anyone and signals.signum is None:
        signals.signum = signal.SIGTERM
    return anyone
