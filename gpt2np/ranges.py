"""Named, nested code ranges ("encoder_forward", "Layer 3", "gpt2_backward", ...) for profilers.

    with ranges.range("layernorm_forward"):
        backend.layernorm_forward(...)

Each range goes to two places:
  * NVTX, so Nsight Systems shows the range tree on its timeline (`nsys profile python train.py`).
    Emitted on NVTX's default domain through the `nvtx` package, imported on first use. Nothing is
    emitted when the package is missing, when no NVTX tool is attached to the process (nvtx then
    hands out a dummy domain and we stop calling it), or when turned off with enable(False) or the
    env var GPT2NP_NVTX=0.
  * Listeners registered with add_listener(): objects with on_push(name, detail) and on_pop(name)
    methods, called on the thread that opens/closes the range. `detail` is what the code that opened
    the range passed along (None for most; the model passes (module, op arguments, op keywords) for
    each op, which is how the built-in profiler attributes work without the model knowing it).
    current_stack() gives the names open on the calling thread.

Listeners do not depend on the NVTX switch: they are called whenever any are registered. With NVTX
off and no listeners, range() costs one boolean check and returns a shared do-nothing context.
"""
import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """The `detail` of a communication range (dist.py opens one around each collective): the
    collective ("all_reduce", "reduce_scatter", "all_gather", "broadcast"), the bytes of the buffer
    it works on (the whole buffer, as nccl-tests' size) and the number of ranks. The profiler turns
    it into a communication row with algorithm and bus bandwidth."""
    op: str
    nbytes: int
    ranks: int


_nvtx_on = os.environ.get("GPT2NP_NVTX", "1") != "0"
_listeners = ()             # tuple: iterated on every push/pop, replaced (never mutated) on change
_active = _nvtx_on          # the one flag range() checks: _nvtx_on or any listener
_domain = None              # nvtx default domain once resolved; False when NVTX cannot be used
_attributes = {}            # name -> cached nvtx EventAttributes (holds the registered string)
_local = threading.local()  # .stack: list of names open on this thread


def _refresh():
    global _active
    _active = _nvtx_on or bool(_listeners)


def enable(flag: bool) -> None:
    """Turn NVTX emission on or off (the default comes from env GPT2NP_NVTX; "0" means off).

    Ranges already open when this is called still close correctly."""
    global _nvtx_on
    _nvtx_on = bool(flag)
    _refresh()


def enabled() -> bool:
    """Whether ranges are sent to NVTX (when the nvtx package and an NVTX tool are present)."""
    return _nvtx_on


def add_listener(listener) -> None:
    """Register an object with on_push(name, detail) and on_pop(name) methods;
    called for every range.

    on_push runs after the name is on current_stack(); on_pop runs before it is removed."""
    global _listeners
    if listener not in _listeners:
        _listeners = _listeners + (listener,)
    _refresh()


def remove_listener(listener) -> None:
    """Unregister a listener added with add_listener (no error if it is not registered)."""
    global _listeners
    _listeners = tuple(item for item in _listeners if item is not listener)
    _refresh()


def current_stack() -> tuple:
    """Names of the ranges open on the calling thread, outermost first (empty when inactive)."""
    return tuple(getattr(_local, "stack", ()))


def _resolve_domain():
    """The nvtx default domain, or False when the package is missing or no tool is attached."""
    global _domain
    try:
        import nvtx
        domain = nvtx.get_domain(None)
        _domain = domain if isinstance(domain, nvtx.Domain) else False
    except Exception:  # ImportError, or a broken nvtx install: profiling must never stop training
        _domain = False
    return _domain


class _NullRange:
    """The shared context returned while everything is off."""
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False


_NULL_RANGE = _NullRange()


class _Range:
    """One open range. Remembers where its push went (NVTX domain, listeners at the time, this
    thread's stack) so that the pop goes to the same places even if settings change meanwhile."""
    __slots__ = ("name", "detail", "domain", "listeners", "stack")

    def __init__(self, name, detail):
        self.name = name
        self.detail = detail
        self.domain = None
        self.listeners = _listeners
        self.stack = None

    def __enter__(self):
        name = self.name
        try:
            stack = _local.stack
        except AttributeError:
            stack = _local.stack = []
        stack.append(name)
        self.stack = stack
        try:
            if _nvtx_on:
                domain = _domain if _domain is not None else _resolve_domain()
                if domain:
                    attributes = _attributes.get(name)
                    if attributes is None:
                        attributes = _attributes.setdefault(
                            name, domain.get_event_attributes(message=name))
                    domain.push_range(attributes)
                    self.domain = domain
            for listener in self.listeners:
                listener.on_push(name, self.detail)
        except BaseException:  # a failing listener must not leave the range open
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        name = self.name
        try:
            for listener in self.listeners:
                listener.on_pop(name)
        finally:
            if self.domain is not None:
                self.domain.pop_range()
            self.stack.pop()
        return False


def range(name: str, detail=None):  # noqa: A001 (read as ranges.range, like torch.cuda.nvtx)
    """Context manager: a range called `name` around the body (one boolean check when off). `detail`
    goes to the listeners only (NVTX gets the name)."""
    if not _active:
        return _NULL_RANGE
    return _Range(name, detail)
