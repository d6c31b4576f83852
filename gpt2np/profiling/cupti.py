"""True GPU activity through CUPTI (the `cupti-python` package, in the cuda extra).

CuptiSource collects CUPTI activity records while the profiler is attached: kernels
(CONCURRENT_KERNEL), memcpy, memset, runtime and driver API calls, and EXTERNAL_CORRELATION records.
The profiler pushes an external correlation id (its record's index) around every launch, copy and
memset it issues (cuptiActivityPushExternalCorrelationId, kind CUSTOM0); CUPTI then writes, for
every API call made meanwhile, an EXTERNAL_CORRELATION record tying the call's correlationId to that
index, and the kernel/memcpy/memset records carry the same correlationId. That is how each device
activity, with its device start/end timestamps, finds the op, layer and NVTX range that issued it,
without any event around the launch (which is what the fallback does, and says so).

    source = CuptiSource()        # raises CuptiUnavailable without cupti-python or a GPU
    source.start(); ...; source.push(7); launch(); source.pop(); ...; synchronize()
    activities = source.stop()
    parsed = parse(activities)    # {"kernels", "memcpy", "memset", "api", "external"}: plain dicts

stop() flushes by force, and a forced flush hands over the records of work the device has not
finished with start = end = 0: the caller synchronizes the device first (the profiler does), and
complete() tells such records.

parse() reads the attribute names of cupti-python's activity objects (kind, start, end,
correlation_id, name, grid_x.., block_x.., bytes, copy_kind, cbid, thread_id, external_id); tests
feed it fakes with the same attributes.
"""
from typing import Dict, List

# CUpti_ActivityKind and CUpti_ActivityMemcpyKind values (cupti_activity.h);
# cupti.ActivityKind when installed
KIND_MEMCPY, KIND_MEMSET, KIND_KERNEL, KIND_DRIVER, KIND_RUNTIME = 1, 2, 3, 4, 5
KIND_CONCURRENT_KERNEL, KIND_EXTERNAL_CORRELATION = 10, 39
MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
                8: "DtoD", 9: "HtoH", 10: "PtoP"}
EXTERNAL_KIND_CUSTOM0 = 3       # CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0
BUFFER_BYTES = 8 * 1024 * 1024

TIMING = "CUPTI activity records (device start/end timestamps)"


class CuptiUnavailable(RuntimeError):
    """CUPTI cannot be used here (no cupti-python, no GPU, or CUPTI refused); the
    message says which."""


class CuptiSource:
    """CUPTI's activity API through cupti-python: start(), push(id)/pop() around each issued
    activity, stop() -> the activity objects CUPTI delivered; now() is CUPTI's clock (same
    as the records')."""

    timing = TIMING

    def __init__(self):
        try:
            from cupti import cupti
        except ImportError as e:
            raise CuptiUnavailable(f"cupti-python is not installed ({e}); pip "
                                   "install cupti-python") from None
        self.cupti = cupti
        self.kinds = (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.MEMCPY,
                      cupti.ActivityKind.MEMSET, cupti.ActivityKind.RUNTIME,
                      cupti.ActivityKind.DRIVER, cupti.ActivityKind.EXTERNAL_CORRELATION)
        self.external_kind = cupti.ExternalCorrelationKind.CUSTOM0
        self.activities: List = []
        self._enabled = []

    def _buffer_requested(self):
        # (buffer size, max records: 0 = as many as fit)
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities):
        self.activities.extend(activities)

    def start(self) -> None:
        cupti = self.cupti
        try:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for kind in self.kinds:
                cupti.activity_enable(kind)
                self._enabled.append(kind)
        except Exception as e:
            # cupti.cuptiError: e.g. no GPU, or another CUPTI client (nsys) holds it
            self._disable()
            raise CuptiUnavailable(f"CUPTI refused to record activity ({e})") from None

    def now(self) -> int:
        return int(self.cupti.get_timestamp())

    def push(self, external_id: int) -> None:
        self.cupti.activity_push_external_correlation_id(self.external_kind, int(external_id))

    def pop(self) -> None:
        self.cupti.activity_pop_external_correlation_id(self.external_kind)

    def stop(self) -> List:
        """Flush (forced) and disable; the activity objects collected since start(). Synchronize the
        device before: the records of unfinished work come back incomplete (see complete())."""
        self.cupti.activity_flush_all(1)
        self._disable()
        out, self.activities = self.activities, []
        return out

    def _disable(self):
        for kind in self._enabled:
            try:
                self.cupti.activity_disable(kind)
            except Exception:  # already disabled or CUPTI torn down: nothing left to stop
                pass
        self._enabled = []

    def api_name(self, kind: int, cbid: int) -> str:
        domain = (self.cupti.CallbackDomain.DRIVER_API if kind == KIND_DRIVER
                  else self.cupti.CallbackDomain.RUNTIME_API)
        try:
            return str(self.cupti.get_callback_name(domain, cbid))
        except Exception:
            return f"cbid {cbid}"


def available(backend) -> bool:
    """Whether CUPTI can be tried: a real GPU (the CuPy runtime) and cupti-python importable."""
    if not backend.on_gpu:
        return False
    try:
        import cupti.cupti  # noqa: F401
    except ImportError:
        return False
    return True


def complete(activity: dict) -> bool:
    """Whether a parsed kernel, memcpy or memset record has its device times: a forced flush
    delivers the records of work not finished yet with start = end = 0."""
    return activity["start"] > 0 and activity["end"] >= activity["start"]


def _dims(a, prefix) -> str:
    return (f"({getattr(a, prefix + '_x', 1)},{getattr(a, prefix + '_y', 1)},"
            f"{getattr(a, prefix + '_z', 1)})")


def parse(activities, api_name=None) -> Dict[str, list]:
    """CUPTI activity objects -> {"kernels", "memcpy", "memset", "api", "external"} of dicts.

    kernels: name, start, end, correlation, grid, block; memcpy: direction ("HtoD"...), bytes,
    start, end, correlation; memset: bytes, start, end, correlation; api: name, start, end,
    correlation, thread, driver; external: {correlationId: external id}. api_name(kind, cbid) names
    API records (default 'cbid N')."""
    out = {"kernels": [], "memcpy": [], "memset": [], "api": [], "external": {}}
    for a in activities:
        kind = int(a.kind)
        if kind in (KIND_KERNEL, KIND_CONCURRENT_KERNEL):
            out["kernels"].append({"name": str(a.name), "start": int(a.start), "end": int(a.end),
                                   "correlation": int(a.correlation_id), "grid": _dims(a, "grid"),
                                   "block": _dims(a, "block")})
        elif kind == KIND_MEMCPY:
            out["memcpy"].append({"direction": MEMCPY_KINDS.get(int(a.copy_kind), "unknown"),
                                  "bytes": int(a.bytes), "start": int(a.start), "end": int(a.end),
                                  "correlation": int(a.correlation_id)})
        elif kind == KIND_MEMSET:
            out["memset"].append({"bytes": int(a.bytes), "start": int(a.start), "end": int(a.end),
                                  "correlation": int(a.correlation_id)})
        elif kind in (KIND_RUNTIME, KIND_DRIVER):
            name = api_name(kind, int(a.cbid)) if api_name else f"cbid {int(a.cbid)}"
            out["api"].append({"name": name, "start": int(a.start), "end": int(a.end),
                               "correlation": int(a.correlation_id),
                               "thread": int(getattr(a, "thread_id", 0)),
                               "driver": kind == KIND_DRIVER})
        elif kind == KIND_EXTERNAL_CORRELATION:
            out["external"][int(a.correlation_id)] = int(a.external_id)
    return out
