"""How train.py and every `python -m gpt2np...` tool fail: one line on stderr, a
meaningful exit code.

    @tool
    def main(argv=None): ...          # bad input: `error: ...` and exit 2, never a traceback

Bad input (a flag's value, a missing or malformed file) ends in one line, `error: ...`, and exit
code 2 (argparse's own); a run that fails (a device, a kernel compiler, a write: disk full) in one
line and exit 1; Ctrl-C in one line and exit 130. Output piped into a reader that stops early
(`gpt2np sample ... | head`) ends quietly with exit 141, the status a shell reports for a Unix
filter that SIGPIPE ended (`yes | head`). With GPT2NP_DEBUG=1 in the environment the error is
re-raised instead, traceback and all.

Allowed words a flag's rule, so every message reads the same: `error: -l nan: the learning rate must
be a finite number > 0`.
"""
import argparse
import functools
import math
import os
import re
import select
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


class WriteError(OSError):
    """Writing `path` failed. errno and strerror are those of the underlying OSError
    (None if it had none)."""

    def __init__(self, path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path = self.filename = os.fspath(path)

    def __str__(self):
        reason = (f"[Errno {self.errno}] {self.strerror}" if self.errno is not None
                  else self.strerror)
        return f"writing {self.path}: {reason}"


# 130 = 128 + SIGINT, what shells report for Ctrl-C
BAD_INPUT, RUN_FAILED, INTERRUPTED = 2, 1, 130
READER_GONE = 141               # 128 + SIGPIPE: a filter whose reader closed the pipe
# What bad flags and files raise: the loaders' own errors derive from ValueError or OSError;
# KeyError, TypeError and IndexError come from files with fields missing or of the wrong type;
# ImportError from an optional dependency that a flag asked for.
BAD_INPUT_ERRORS = (ValueError, OSError, KeyError, TypeError, IndexError, ImportError)
# a device, a kernel compiler or a collective failed; or writing an output did (disk full, no
# permission: the machine, not the flags)
RUN_ERRORS = (RuntimeError, WriteError)


class BadInput(ValueError):
    """A flag's value is not allowed, or flags contradict each other; the message names them."""


def debugging() -> bool:
    """Whether GPT2NP_DEBUG asks for tracebacks (any value but empty or 0)."""
    return os.environ.get("GPT2NP_DEBUG", "") not in ("", "0")


def gone_streams() -> list:
    """The file descriptors of stdout and stderr where they are pipes (or sockets) whose reader has
    closed its end (`| head` exited)."""
    gone = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):      # a stand-in without a file
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            gone.append(fd)
    return gone


def reader_gone() -> bool:
    """Whether stdout or stderr lost its reader; those that did now write to /dev/null, so that
    the interpreter's last flush does not fail again. False for a broken pipe elsewhere (a worker
    process that died)."""
    gone = gone_streams()
    for fd in gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return bool(gone)


def one_line(error: BaseException) -> str:
    """The error's message on one line; the type leads where the message alone says too little
    (str(KeyError('records')) is just "'records'")."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if not text or isinstance(error, (KeyError, TypeError, IndexError)):
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text


@contextmanager
def one_line_errors(code: int | None = None, then: Callable[[int], None] | None = None):
    """Inside: an expected error prints `error: ...` (one line) and raises SystemExit.

    code None: exit 2 for bad input, 1 for a RuntimeError (the run failed); an
    int: that code for both.
    then(code) runs before the exit (train.py: end the other MPI ranks).
    KeyboardInterrupt: exit 130.
    stdout or stderr closed by its reader (`| head`): no line, exit 141. Under GPT2NP_DEBUG=1 the
    error propagates unchanged, with its traceback.
    """
    try:
        yield
    except KeyboardInterrupt:
        if debugging():
            raise
        print("error: interrupted", file=sys.stderr, flush=True)
        exit_code = INTERRUPTED
    except BAD_INPUT_ERRORS + RUN_ERRORS as error:
        if debugging():
            raise
        if isinstance(error, BrokenPipeError) and reader_gone():    # `| head` has read enough
            exit_code = READER_GONE
        else:
            print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
            exit_code = (code if code is not None else RUN_FAILED if isinstance(error, RUN_ERRORS)
                         else BAD_INPUT)
    except MemoryError as error:
        # the machine's limit (a model, batch or context too large for it)
        if debugging():
            raise
        detail = " ".join(str(error).split())
        print(f"error: out of memory{f' ({detail})' if detail else ''}: give a smaller "
              "model, batch or context",
              file=sys.stderr, flush=True)
        exit_code = code if code is not None else RUN_FAILED
    else:
        return
    if then is not None:
        then(exit_code)
    raise SystemExit(exit_code)


def tool(main: Callable) -> Callable:
    """Decorate a tool's main(argv) -> exit code: it runs inside one_line_errors, and the code of
    any exit (a failure, an argparse error, --help) is returned, so in-process callers get codes
    like a shell does."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            with one_line_errors():
                code = main(argv)
                sys.stdout.flush()      # a closed pipe shows here, not at the interpreter's exit
                return code
        except SystemExit as done:
            return done.code
    return run


# [[name, the tool's own prog]]: set by program_name() while a command runs a tool
_program_names = []


@contextmanager
def program_name(name: str):
    """Inside: the first parser a tool makes is called `name` in its usage and errors (`gpt2np
    train` runs the parser that `python train.py` calls train.py); its subcommands' parsers
    follow."""
    _program_names.append([name, None])
    try:
        yield
    finally:
        _program_names.pop()


NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: argument -b: invalid int value: 'x'`,
    exit 2 (no usage)."""

    def __init__(self, *args, **kwargs):
        if _program_names and not args:
            alias = _program_names[-1]
            prog = kwargs.get("prog")
            if alias[1] is None:                    # the tool's own parser
                alias[1] = prog or ""
                kwargs["prog"] = alias[0]
            elif alias[1] and prog and prog.startswith(alias[1] + " "):
                # one of its subcommands' parsers
                kwargs["prog"] = alias[0] + prog[len(alias[1]):]
        super().__init__(*args, **kwargs)
        # a flag's value may be any negative number (-1e-8), so that validate names what is wrong
        # with it; argparse's own pattern takes only -1 and -1.5 and reads -1e-8 as an unknown flag
        # ("expected one argument")
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message):
        self.exit(BAD_INPUT, f"error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, then an empty text given for a flag or argument (-o '': a path no tool can
        use; some took it for the current folder or for the flag's default) is
        BadInput naming it."""
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = (getattr(namespace, action.dest, None) if action.dest != argparse.SUPPRESS
                     else None)
            values = value if isinstance(value, list) else [value]
            if action.default != "" and any(v == "" for v in values):
                name = "/".join(action.option_strings) or action.metavar or action.dest
                raise BadInput(f"{name} '': must be {TEXT.words}")
        return namespace, extras


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, not a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
    """An int or float, not a bool, not nan or ±inf."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def shown(value) -> str:
    """A value as a flag writes it: 3e-4 -> 0.0003, -2.0 -> -2, nan; text quoted, so '' shows."""
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Allowed:
    """The values a flag accepts: a test, and its words in the error message ('a
    finite number > 0')."""
    test: Callable[[object], bool]
    words: str

    def check(self, flag: str, value, what: str = "") -> None:
        """Raise BadInput('FLAG VALUE: WHAT must be WORDS') unless the value passes."""
        if not self.test(value):
            raise BadInput(f"{flag} {shown(value)}: "
                           f"{what + ' ' if what else ''}must be {self.words}")


def integer(low: int, *, also: tuple = (), words: str = "") -> Allowed:
    """Integers >= low, and the special values in `also` (-1 = all)."""
    return Allowed(lambda v: is_int(v) and (v >= low or v in also), words or f"an integer >= {low}")


def number(low: float, high: float | None = None, *, low_open=False, high_open=False,
           words: str = "") -> Allowed:
    """Finite numbers from low (excluded if low_open) up to high (excluded if
    high_open; None: no limit)."""
    def test(v):
        return (is_finite(v) and (v > low if low_open else v >= low)
                and (high is None or (v < high if high_open else v <= high)))
    if not words and high is None:
        words = f"a finite number {'>' if low_open else '>='} {low}"
    elif not words:
        words = f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Allowed(test, words)


def one_of(choices) -> Allowed:
    """Exactly these values (1 is not 1.0 or True)."""
    return Allowed(lambda v: any(type(v) is type(c) and v == c for c in choices),
                   "one of " + ", ".join(map(str, choices)))


TEXT = Allowed(lambda v: isinstance(v, str) and v != "",
               "a non-empty text (a path, a pattern, a name)")
SWITCH = Allowed(lambda v: isinstance(v, bool), "True or False")
