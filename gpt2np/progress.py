"""Progress of long jobs (prepare, fetch, eval): a bar redrawn in place on a terminal,
plain lines in logs.

    with progress(total=n, desc="val", unit="batch") as bar:
        for ...:
            bar.update(1)

On a terminal (stderr is a TTY) one line is redrawn in place (at most 10 times a second) and kept
when the job ends. Elsewhere (CI, `2> log`, pipes) it writes plain lines to stderr: one every
`every` seconds while the job runs and a last one when it ends, so logs stay readable.
GPT2NP_PROGRESS=bar|plain|off overrides the choice (auto by default).
"""
import os
import sys
import time

MODES = ("auto", "bar", "plain", "off")


def mode() -> str:
    """bar, plain or off: GPT2NP_PROGRESS, else a bar when stderr is a terminal."""
    chosen = os.environ.get("GPT2NP_PROGRESS", "auto").strip().lower() or "auto"
    if chosen not in MODES:
        chosen = "auto"
    if chosen == "auto":
        chosen = "bar" if sys.stderr.isatty() else "plain"
    return chosen


def _number(n, scale):
    """1234 -> '1,234'; with scale 1.5e7 -> '15.0 M' (the unit follows)."""
    if scale and n >= 1000:
        for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if n >= factor:
                return f"{n / factor:.1f} {prefix}"
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


class Progress:
    """tqdm's calls (update, set_postfix_str, close, iteration, with): occasional plain lines on
    stderr, or (live) a line with a bar redrawn in place."""

    BAR = 24

    def __init__(self, iterable=None, total=None, desc="", unit="it", unit_scale=False, every=10.0,
                 file=None, quiet=False, live=False):
        self.iterable, self.total, self.desc, self.unit, self.unit_scale = (iterable, total, desc,
                                                                            unit, unit_scale)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)
        self.every, self.file, self.quiet, self.live = (0.1 if live else every), file, quiet, live
        self.n, self.postfix, self.closed, self.shown_state = 0, "", False, None
        self.started = self.shown = time.monotonic()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        sep = "" if self.unit_scale else " "
        text = f"{_number(self.n, self.unit_scale)}"
        if self.total:
            if self.unit_scale:
                text += self.unit
            text += (f"/{_number(self.total, self.unit_scale)}{sep}{self.unit} "
                     f"({100 * self.n / self.total:.0f}%)")
            if self.live:
                filled = min(self.BAR, int(self.BAR * self.n / self.total))
                text = f"[{'#' * filled}{'.' * (self.BAR - filled)}] " + text
        else:
            text += f"{sep}{self.unit}"
        rate = self.n / elapsed if elapsed > 0 else 0.0
        text += f", {elapsed:.1f} s, {_number(rate, self.unit_scale)}{sep}{self.unit}/s"
        if self.postfix:
            text += f", {self.postfix}"
        return f"{self.desc}: {text}" if self.desc else text

    def _print(self, last=False):
        if self.quiet:
            return
        file = self.file or sys.stderr
        state = (self.n, self.postfix)
        if last and self.shown_state == state:    # on screen already: only end its line
            if self.live:
                file.write("\n")
                file.flush()
            return
        self.shown_state = state
        if self.live:           # redraw in place; the last drawing stays, with its line end
            file.write("\r" + self.line() + "\x1b[K" + ("\n" if last else ""))
            file.flush()
        else:
            print(self.line(), file=file, flush=True)

    def update(self, n=1):
        self.n += n
        now = time.monotonic()
        if now - self.shown >= self.every:
            self.shown = now
            self._print()

    def set_postfix_str(self, text, refresh=True):
        """Text after the counts (`loss 8.8978`): in the next line drawn, and in the last one."""
        del refresh
        self.postfix = text

    def close(self):
        if not self.closed:
            self.closed = True
            self._print(last=True)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif not self.closed:
            self.closed = True
            if self.live and self.shown_state is not None and not self.quiet:
                # end the bar's line: the error gets its own
                (self.file or sys.stderr).write("\n")
        return False


def progress(iterable=None, *, total=None, desc="", unit="it", unit_scale=False, every=10.0,
             file=None, quiet=False):
    """Progress over `iterable`, or of `total` units counted with update(n): a bar redrawn in place
    on a terminal, else plain lines on stderr (one every `every` seconds and the last when it
    closes); nothing under GPT2NP_PROGRESS=off or quiet. A job that fails inside `with` leaves no
    last line (its error is the news)."""
    chosen = mode()
    return Progress(iterable, total, desc, unit, unit_scale, every, file,
                    quiet=quiet or chosen == "off", live=chosen == "bar")
