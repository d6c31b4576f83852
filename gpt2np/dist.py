"""Data parallelism across processes, as in llm.c's multi-GPU trainer: one process (rank) per GPU,
started by an MPI launcher, every rank holding the whole model.

    mpiexec -n 8 python train.py ...           # 8 ranks on this node, one GPU each
    mpiexec -n 16 -ppn 8 -hosts a,b python train.py ...     # 2 nodes x 8 GPUs

Each rank reads its own slice of every batch (DataLoader's process_rank), runs forward and backward
on it, and then the ranks average their gradients, so every rank takes the same optimizer step:
  * on a GPU (cuda backend) with NCCL on the device buffers (cupy.cuda.nccl; rank 0 makes the NCCL
    unique id and MPI broadcasts it),
  * on the CPU (numpy backend) with MPI Allreduce on the host buffers.
Scalars: the device step's loss and squared grad norm stay on the device (model.stats) and are
reduced by the gradients' collectives (reduce_stats: NCCL on a GPU; MPI through host copies when
ranks share one). Host scalars go through MPI (comm.allreduce): the host step's loss (average) and,
under ZeRO-1, its squared grad norm (grad_norm; under ZeRO-0 each rank has the whole norm of the
averaged gradients), and the val loss.

--precision bf16 (llm.c's mixed precision): the gradients and parameters are bf16 buffers. NCCL
averages them in bf16 with ncclAvg (as llm.c does); MPI, which has no bf16 type, sums an fp32 copy
and the mean is rounded once back into bf16 (HostCollectives). ZeRO-1 gathers the bf16 parameters
bit for bit. The step's statistics (loss, squared norm) stay fp32. Each rank keeps the fp32 master
weights of the parameters it updates (its shard under ZeRO-1), and the stochastic rounding of the
parameters draws its noise from the flat index, so every rank and every shard split rounds a
parameter the same way.

ZeRO stage 1 (train.py -z 1): the AdamW moments m, v are sharded. The flat gradient buffer is
reduce-scattered (rank r receives the average of its shard only), each rank runs AdamW on its shard,
and the parameters are all-gathered. Shards are contiguous: rank r owns [r*S, (r+1)*S) with
S = num_parameters // world_size; the last rank also owns the remainder.

Before the first step the ranks check that they run the same job (check_same_run): rank 0 broadcasts
its fingerprint of the run -- the training settings, the model (config and a hash of the initial
parameters) and the data (shard names, sizes, hashes) -- each rank compares its own, and the ranks
gather what differs. Any difference ends every rank together, with one line from rank 0 naming the
rank and the first difference: `error: rank 1 of 2: -b 2 differs from rank 0's -b 4`.

A rank that dies or hangs must not leave the others waiting forever. Every collective runs under a
watchdog: one that has not finished after `timeout` seconds prints which one, on which rank, and
aborts the whole job (MPI_Abort). An exception on one rank aborts the job too (abort_job, and an
excepthook for uncaught ones) instead of leaving the other ranks blocked in their next collective.

Test hook: env GPT2NP_TEST_FAULT=RANK:STEP:MODE makes rank RANK fail when averaging the gradients
for the STEP-th time (0-based) in this process: MODE exit (os._exit(3), a crash), raise (a
RuntimeError) or hang (sleeps forever).
"""
import hashlib
import math
import os
import sys
import threading
import time
from dataclasses import fields
from typing import NamedTuple

import numpy as np

from gpt2np import ranges
from gpt2np.backends import gpu_available
from gpt2np.bf16 import is_bf16

# set by the launchers we know: MPICH/Intel MPI (hydra), Open MPI, PMIx launchers
# (incl. srun), MVAPICH
LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
DEFAULT_TIMEOUT = 600.0          # seconds a collective may take before the job is aborted
ABORT_GRACE = 0.5                # seconds between printing why and MPI_Abort
FAULT_ENV = "GPT2NP_TEST_FAULT"
# device memory kept free for NCCL's buffers and its CUDA context growth
NCCL_MEMORY_ALLOWANCE = 1 << 30
# NCCL 2.10 (ncclGetVersion's code): the first with ncclBfloat16 and ncclAvg
BF16_NCCL = 21000


class DistError(RuntimeError):
    """Data-parallel training cannot be set up (no MPI, no NCCL, too few GPUs...); the
    message says why."""


class RunMismatch(ValueError):
    """The ranks were started with different settings, models or data; the message names a rank
    and what differs."""


def launched_by_mpi(environ=os.environ) -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, mpirun, srun with PMI/PMIx)."""
    return any(name in environ for name in LAUNCHER_RANK_VARS)


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as its MPI launcher set it (0 when not launched by one), known
    before MPI starts."""
    for name in LAUNCHER_RANK_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launcher_size(environ=os.environ) -> int:
    """How many processes this one's MPI launcher started (1 when not launched by one), known
    before MPI starts."""
    for name in LAUNCHER_SIZE_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 1


def shard_bounds(n, world_size):
    """[(lo, hi)] per rank: contiguous shards of n elements; the last rank also takes
    the n % world rest."""
    size = n // world_size
    return [(r * size, (r + 1) * size if r < world_size - 1 else n) for r in range(world_size)]


class SingleProcess:
    """The data-parallel interface for one process: rank 0 of 1, nothing to communicate."""
    rank, world_size = 0, 1
    gpu_sharers = 1                       # processes on this process's GPU

    def __init__(self, zero_stage=0):
        self.zero_stage = zero_stage

    def shard(self, n):
        """(lo, hi) of the flat parameters this process updates: all of them."""
        return 0, n

    def average_grads(self, model):
        pass

    def grad_norm(self, model):
        return model.grad_norm()

    def gather_params(self, model):
        pass

    def average(self, value):
        return value

    def reduce_stats(self, model):
        pass

    def barrier(self):
        pass

    def broadcast_object(self, obj):
        return obj

    def reserved_device_memory(self):
        """Device bytes the collectives need besides the model (none for one process)."""
        return 0

    def all_gather_object(self, obj):
        return [obj]


class Watchdog:
    """Aborts the job when a guarded section (a collective) outlives `timeout` seconds.

        with watchdog.guard("all-reduce of the gradients"):
            comm.Allreduce(...)

    One daemon thread sleeps until the current deadline; on_expire(what) is called from it, while
    the main thread is still blocked inside the collective (MPI and CUDA calls release the GIL).
    timeout <= 0 or None: no watchdog.
    """

    def __init__(self, timeout, on_expire):
        self.timeout = timeout if timeout and timeout > 0 else None
        self.on_expire = on_expire
        self._cond = threading.Condition()
        self._what = self._deadline = None
        if self.timeout:
            threading.Thread(target=self._watch, name="gpt2np-watchdog", daemon=True).start()

    def guard(self, what):
        return _Guard(self, what)

    def _arm(self, what):
        if self.timeout:
            with self._cond:
                self._what, self._deadline = what, time.monotonic() + self.timeout
                self._cond.notify()

    def _disarm(self):
        if self.timeout:
            with self._cond:
                self._what = self._deadline = None

    def _watch(self):
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                what = self._what
                break
        self.on_expire(what)


class _Guard:
    def __init__(self, watchdog, what):
        self.watchdog, self.what = watchdog, what

    def __enter__(self):
        self.watchdog._arm(self.what)

    def __exit__(self, *exc):
        self.watchdog._disarm()
        return False


class HostCollectives:
    """Averaging and gathering host (NumPy) buffers through MPI: float32, or bfloat16 (the
    --precision bf16 gradients and parameters).

    MPI has no bf16 type, so a bf16 reduction goes through an fp32 work buffer: the bf16 values are
    upcast (exactly), MPI sums them in fp32, the sum is divided by the ranks in fp32 and the result
    rounded once, to nearest even, back into the bf16 buffer. So the mean differs from the exact
    mean of the bf16 values by one bf16 rounding (plus fp32's, whatever order MPI sums in). A bf16
    gather moves the 2-byte values as they are (as uint16, MPI.UNSIGNED_SHORT): the parameters
    arrive bit for bit."""

    def __init__(self, comm):
        self.comm = comm
        self.world_size = comm.Get_size()
        self._recv = None
        self._work = None

    def _fp32(self, buf):
        """An fp32 work copy of the bf16 buf (reused between calls of the same size)."""
        if self._work is None or self._work.size != buf.size:
            self._work = np.empty(buf.size, np.float32)
        # exact: every bf16 value is an fp32 value
        np.copyto(self._work, buf)
        return self._work

    def all_reduce_mean(self, buf):
        """buf (n,) = the mean of buf over the ranks, in place."""
        from mpi4py import MPI
        work = self._fp32(buf) if is_bf16(buf) else buf
        self.comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        work /= self.world_size
        if work is not buf:
            np.copyto(buf, work, casting="unsafe")           # round to nearest even, once

    def all_reduce_sum(self, buf):
        """buf (n,) = the sum of buf over the ranks, in place."""
        from mpi4py import MPI
        work = self._fp32(buf) if is_bf16(buf) else buf
        self.comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        if work is not buf:
            np.copyto(buf, work, casting="unsafe")

    def reduce_scatter_mean(self, buf, bounds):
        """buf[lo:hi] of this rank's shard = the mean of that slice over the ranks (the
        rest is left stale)."""
        from mpi4py import MPI
        lo, hi = bounds[self.comm.Get_rank()]
        if self._recv is None or self._recv.size != hi - lo:
            self._recv = np.empty(hi - lo, np.float32)
        send = self._fp32(buf) if is_bf16(buf) else buf
        self.comm.Reduce_scatter(send, self._recv, [b - a for a, b in bounds], op=MPI.SUM)
        self._recv /= self.world_size
        np.copyto(buf[lo:hi], self._recv, casting="unsafe" if is_bf16(buf) else "same_kind")

    def all_gather(self, buf, bounds):
        """Every rank's shard of buf (n,) from its owner, in place."""
        from mpi4py import MPI
        counts = [b - a for a, b in bounds]
        displs = [a for a, _ in bounds]
        if is_bf16(buf):
            self.comm.Allgatherv(MPI.IN_PLACE,
                                 [buf.view(np.uint16), counts, displs, MPI.UNSIGNED_SHORT])
        else:
            self.comm.Allgatherv(MPI.IN_PLACE, [buf, counts, displs, MPI.FLOAT])


class NcclCollectives:
    """Averaging and gathering device buffers with NCCL, on the runtime's current stream.

    The NCCL communicator spans the MPI ranks: rank 0 makes the unique id, MPI broadcasts it. Each
    call returns after the stream has finished the collective (so the watchdog sees a hang). Buffers
    are passed as the runtime's device pointers (runtime.pointer), as
    cupy.cuda.nccl.NcclCommunicator takes them.

    fp32 buffers: ncclSum, then the result divided by the ranks. bf16 buffers (ncclBfloat16 = 9,
    NCCL >= 2.10): ncclAvg (= 4) inside NCCL, as llm.c averages its gradients, so no CuPy
    elementwise op on a bf16 array is needed. NCCL reduces bf16 in bf16, partial sum by partial sum
    along its ring or tree (on floats its ncclAvg pre-multiplies each input by 1/nranks; its
    symmetric kernels divide the sum), so the mean differs from the fp32 mean rounded once by a few
    bf16 roundings; the ranks still all get the same bits.

    runtime: the backend's runtime (pointer, synchronize; CupyRuntime also gives stream_ptr). nccl:
    the cupy.cuda.nccl module, or a stand-in with the same interface (tests/fake_gpu.py runs this
    class on the CPU emulator with in-process ranks); stream_ptr: the cudaStream_t to run on
    (default: the runtime's).
    """

    def __init__(self, comm, runtime, nccl=None, stream_ptr=None):
        if nccl is None:
            from cupy.cuda import nccl
        if not nccl.available:
            raise DistError("NCCL is not available to CuPy (pip install 'nvidia-nccl-cu13>=2.27.7,"
                            "<3'); it is needed to average gradients across GPUs")
        self.nccl, self.rt = nccl, runtime
        self.stream_ptr = stream_ptr or runtime.stream_ptr
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)

    def _dtype(self, buf):
        types = {np.dtype(np.float32): self.nccl.NCCL_FLOAT32,
                 np.dtype(np.float16): self.nccl.NCCL_FLOAT16}
        if is_bf16(buf):
            return self._bf16_type()
        if buf.dtype not in types:
            raise DistError(f"NCCL collectives: unsupported buffer dtype {buf.dtype}")
        return types[buf.dtype]

    def _bf16_type(self):
        """ncclBfloat16, after checking this NCCL has it and ncclAvg (both NCCL >= 2.10; CuPy names
        them NCCL_BFLOAT16 and NCCL_AVG)."""
        version = self.nccl.get_version()
        if (not (hasattr(self.nccl, "NCCL_BFLOAT16") and hasattr(self.nccl, "NCCL_AVG"))
            or version < BF16_NCCL):
            raise DistError("--precision bf16 across GPUs needs NCCL >= 2.10 (ncclBfloat16, "
                            "ncclAvg); this is "
                            f"{version} (pip install 'nvidia-nccl-cu13>=2.27.7,<3')")
        return self.nccl.NCCL_BFLOAT16

    def _mean_op(self, buf):
        """(op, divide after): bf16 averages in NCCL itself (ncclAvg, as llm.c does), so no
        elementwise op on a bf16 device array is needed; fp32 sums, then divides the
        result by the ranks."""
        return (self.nccl.NCCL_AVG, False) if is_bf16(buf) else (self.nccl.NCCL_SUM, True)

    def all_reduce_mean(self, buf):
        op, divide = self._mean_op(buf)
        self._all_reduce(buf, op)
        if divide:
            buf /= self.world_size
        self.rt.synchronize()

    def all_reduce_sum(self, buf, wait=True):
        self._all_reduce(buf, self.nccl.NCCL_SUM)
        if wait:
            self.rt.synchronize()

    def _all_reduce(self, buf, op):
        ptr = self.rt.pointer(buf)
        self.comm.allReduce(ptr, ptr, buf.size, self._dtype(buf), op, self.stream_ptr())

    def reduce_scatter_mean(self, buf, bounds):
        """In place: NCCL's reduce-scatter takes equal counts, so the ranks' equal parts go through
        it and the last rank's extra tail (< world_size elements) through an all-reduce."""
        stream, dtype = self.stream_ptr(), self._dtype(buf)
        op, divide = self._mean_op(buf)
        ptr, item = self.rt.pointer(buf), buf.dtype.itemsize
        size = bounds[0][1] - bounds[0][0]
        tail = buf.size - size * self.world_size
        self.nccl.groupStart()
        # in place: rank r's result lands at sendbuff + r * recvcount
        self.comm.reduceScatter(ptr, ptr + self.rank * size * item, size, dtype, op, stream)
        if tail:
            end = ptr + size * self.world_size * item
            self.comm.allReduce(end, end, tail, dtype, op, stream)
        self.nccl.groupEnd()
        if divide:
            lo, hi = bounds[self.rank]
            buf[lo:hi] /= self.world_size
        self.rt.synchronize()

    def all_gather(self, buf, bounds):
        stream, dtype = self.stream_ptr(), self._dtype(buf)
        ptr, item = self.rt.pointer(buf), buf.dtype.itemsize
        size = bounds[0][1] - bounds[0][0]
        tail = buf.size - size * self.world_size
        self.nccl.groupStart()
        # in place: rank r sends from recvbuff + r * sendcount
        self.comm.allGather(ptr + self.rank * size * item, ptr, size, dtype, stream)
        if tail:
            end = ptr + size * self.world_size * item
            self.comm.broadcast(end, end, tail, dtype, self.world_size - 1, stream)
        self.nccl.groupEnd()
        self.rt.synchronize()


class StagedCollectives:
    """Device buffers averaged through host copies and MPI: for ranks that share a GPU, which NCCL
    refuses ("Duplicate GPU detected"), e.g. `mpiexec -n 2` on a machine with one GPU. Correct, not
    fast: every collective copies the buffer to the host and back. bf16 buffers: as HostCollectives
    (fp32 sums, one rounding)."""

    def __init__(self, comm, runtime):
        self.host, self.rt = HostCollectives(comm), runtime

    def _through_host(self, buf, collective, *args):
        host = self.rt.to_host(buf)
        collective(host, *args)
        self.rt.copy(buf, self.rt.from_host(host))

    def all_reduce_mean(self, buf):
        self._through_host(buf, self.host.all_reduce_mean)

    def all_reduce_sum(self, buf):
        self._through_host(buf, self.host.all_reduce_sum)

    def reduce_scatter_mean(self, buf, bounds):
        self._through_host(buf, self.host.reduce_scatter_mean, bounds)

    def all_gather(self, buf, bounds):
        self._through_host(buf, self.host.all_gather, bounds)


class MpiProcessGroup:
    """Rank `rank` of `world_size` MPI processes training one model (see the module docstring).

    The trainer calls, every step: average_grads(model); average(loss); grad_norm(model);
    model.update(..., shard=shard(n)); gather_params(model).
    """

    def __init__(self, comm, zero_stage=0, timeout=DEFAULT_TIMEOUT, collectives=None):
        """collectives: collectives(backend, buf) -> the object that averages and gathers the
        model's buffers (default: MPI for host buffers; for device buffers NCCL, or host-staged MPI
        when ranks share a GPU)."""
        if zero_stage not in (0, 1):
            raise DistError(f"ZeRO stage {zero_stage} is not supported (0 or 1)")
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.zero_stage = zero_stage
        self.timeout = timeout
        self.watchdog = Watchdog(timeout, self._expired)
        # set by make_process_group: some ranks share a GPU (no NCCL)
        self.shared_gpu = False
        # ... and how many ranks use this rank's GPU (its memory is split)
        self.gpu_sharers = 1
        self._make_collectives = collectives
        self._collectives = None
        self._grad_steps = 0
        self._fault = _parse_fault(os.environ.get(FAULT_ENV))

    def _expired(self, what):
        _say(f"error: rank {self.rank} of {self.world_size}: {what} did not finish within "
             f"{self.timeout:g} s; another rank has probably died or hangs (raise --dist-timeout "
             "if it is only slow). Aborting all ranks.")
        self.abort(1)

    def abort(self, code=1):
        """End every rank of the job now (MPI_Abort); falls back to ending this process."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # lets the launcher forward our last lines before it kills us all
            time.sleep(ABORT_GRACE)
            self.comm.Abort(code)
        finally:
            os._exit(code)

    def _device_collectives(self, backend, buf):
        """MPI for host buffers; NCCL for device ones (MPI through host copies when ranks share a
        GPU); made on first use (every rank gets here together)."""
        if self._collectives is None:
            if self._make_collectives is not None:
                with self.watchdog.guard("collectives setup"):
                    self._collectives = self._make_collectives(backend, buf)
            elif isinstance(buf, np.ndarray):
                self._collectives = HostCollectives(self.comm)
            elif self.shared_gpu:
                self._collectives = StagedCollectives(self.comm, backend.rt)
            else:
                with self.watchdog.guard("NCCL communicator setup"), ranges.range("nccl_init"):
                    self._collectives = NcclCollectives(self.comm, backend.rt)
        return self._collectives

    def reserved_device_memory(self):
        """Device bytes the collectives need besides the model: an allowance for NCCL's buffers
        (none when the ranks share a GPU and average through MPI)."""
        return 0 if self.shared_gpu else NCCL_MEMORY_ALLOWANCE

    def shard(self, n):
        """(lo, hi) of the flat parameters this rank updates: its ZeRO-1 shard, or all of them."""
        return shard_bounds(n, self.world_size)[self.rank] if self.zero_stage == 1 else (0, n)

    def _device_done(self, model):
        """Wait for the device work queued before a collective (a backend that launches kernels; the
        numpy backend's work is done when it returns), so that the collective's range (its NVTX
        range, the profiler's communication time) holds the collective alone, not the backward the
        device was still running; the collective waits for that work anyway."""
        if getattr(model.backend, "launches_kernels", False):
            model.backend.synchronize()

    def average_grads(self, model):
        """Average model.grads over the ranks: all of them (ZeRO-0) or this
        rank's shard (ZeRO-1)."""
        self._inject_fault()
        coll = self._device_collectives(model.backend, model.grads)
        if self.zero_stage == 1:
            with self.watchdog.guard("reduce-scatter of the gradients"):
                self._device_done(model)
                with ranges.range("reduce_scatter_grads",
                                  ranges.Collective("reduce_scatter", model.grads.nbytes,
                                                    self.world_size)):
                    coll.reduce_scatter_mean(model.grads,
                                             shard_bounds(model.num_parameters, self.world_size))
        else:
            with self.watchdog.guard("all-reduce of the gradients"):
                self._device_done(model)
                with ranges.range("allreduce_grads",
                                  ranges.Collective("all_reduce", model.grads.nbytes,
                                                    self.world_size)):
                    coll.all_reduce_mean(model.grads)
        self._grad_steps += 1

    def grad_norm(self, model):
        """Global L2 norm of the averaged gradients (under ZeRO-1: from each rank's shard)."""
        if self.zero_stage == 0:
            return model.grad_norm()
        lo, hi = self.shard(model.num_parameters)
        with ranges.range("gpt2_calculate_grad_norm"):
            local = model.backend.global_norm_squared(model.grads[lo:hi])
        with self.watchdog.guard("all-reduce of the grad norm"), ranges.range(
                "allreduce_grad_norm", ranges.Collective("all_reduce", 8, self.world_size)):
            total = self.comm.allreduce(float(local))
        return math.sqrt(total)

    def gather_params(self, model):
        """ZeRO-1: every rank's updated shard of the parameters to all ranks."""
        if self.zero_stage == 1:
            coll = self._device_collectives(model.backend, model.params)
            with self.watchdog.guard("all-gather of the parameters"):
                self._device_done(model)
                with ranges.range("allgather_params",
                                  ranges.Collective("all_gather", model.params.nbytes,
                                                    self.world_size)):
                    coll.all_gather(model.params,
                                    shard_bounds(model.num_parameters, self.world_size))

    def reduce_stats(self, model):
        """The device step's statistics over the ranks (model.stats: [loss, squared grad norm]): the
        loss averaged; under ZeRO-1 the squared norms of the shards summed (under ZeRO-0 every rank
        has the whole norm already). One all-reduce of the two floats: the loss is divided by the
        ranks first, so a sum averages it. On NCCL this waits for the stream (the watchdog's guard,
        as every collective here), after waiting for the work before it (_device_done): the
        multi-rank step's host syncs are these and the gradient collectives'."""
        coll = self._device_collectives(model.backend, model.stats)
        with self.watchdog.guard("all-reduce of the step's loss and grad norm"):
            self._device_done(model)
            with ranges.range("allreduce_stats",
                              ranges.Collective("all_reduce", model.stats.nbytes, self.world_size)):
                if self.zero_stage == 1:
                    model.stats[:1] /= self.world_size
                    coll.all_reduce_sum(model.stats)
                else:
                    coll.all_reduce_mean(model.stats[:1])

    def average(self, value):
        """The mean of a host scalar over the ranks."""
        with self.watchdog.guard("all-reduce of a scalar (loss)"), ranges.range(
                "allreduce_scalar", ranges.Collective("all_reduce", 8, self.world_size)):
            return self.comm.allreduce(float(value)) / self.world_size

    def barrier(self):
        with self.watchdog.guard("barrier"), ranges.range("barrier"):
            self.comm.Barrier()

    def broadcast_object(self, obj):
        """Rank 0's obj (any picklable value), on every rank."""
        with self.watchdog.guard("broadcast of the run's fingerprint"):
            return self.comm.bcast(obj, root=0)

    def all_gather_object(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        with self.watchdog.guard("all-gather of the ranks' differences"):
            return self.comm.allgather(obj)

    def _inject_fault(self):
        if self._fault and self._fault[:2] == (self.rank, self._grad_steps):
            mode = self._fault[2]
            _say(f"{FAULT_ENV}: rank {self.rank} fails ({mode}) at gradient averaging "
                 f"{self._grad_steps}")
            if mode == "exit":
                os._exit(3)
            if mode == "raise":
                raise RuntimeError(f"{FAULT_ENV}: simulated failure on rank {self.rank}")
            while True:
                time.sleep(3600)


def _parse_fault(spec):
    if not spec:
        return None
    try:
        rank, step, mode = spec.split(":")
        if mode not in ("exit", "raise", "hang"):
            raise ValueError
        return int(rank), int(step), mode
    except ValueError:
        raise DistError(f"{FAULT_ENV}={spec!r}: expected RANK:STEP:exit|raise|hang") from None


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


# TrainConfig settings a rank may set on its own: they change nothing the ranks share (sampling and
# profiling happen on rank 0 alone; the timeout is each rank's own watchdog). -e, -i, -j and
# --device are compared by what they resolve to: the model, the shards, the backend.
PER_RANK_SETTINGS = ("dist_timeout", "nvtx", "profile_steps", "sample_every", "gen_tokens",
                     "temperature", "top_k")
COMPARED_BY_CONTENT = ("model", "train_data", "val_data", "device")
LISTED_AT_MOST = 4           # names of further differences / ranks in the mismatch line


def run_fingerprint(cfg, backend, model_cfg, params, train_loader, val_loader=None) -> dict:
    """{what: value as text} of everything the ranks of one job must agree on, in the order
    differences are reported: the training settings by llm.c flag (cfg: a TrainConfig), the backend,
    the model's config and initial weights (params: the loaded ones, None for a random init from
    --init-seed), the shards of each loader."""
    fingerprint = {f.metadata["flag"]: _shown(getattr(cfg, f.name)) for f in fields(cfg)
                   if f.name not in PER_RANK_SETTINGS + COMPARED_BY_CONTENT}
    # the CPU's math as it runs (exact where the C loops did not build)
    math = getattr(backend, "math", None)
    fingerprint["--device"] = (f"{backend.name} "
                               f"({backend.precision}{', ' + math + ' math' if math else ''})")
    c = model_cfg
    fingerprint["-e model"] = (f"maxT={c.max_seq_len} V={c.vocab_size} Vp={c.padded_vocab_size} "
                               f"L={c.num_layers} NH={c.num_heads} C={c.channels}")
    fingerprint["-e weights"] = (f"sha256 {params_hash(params)}" if params is not None
                                 else f"random init (--init-seed {cfg.init_seed})")
    for flag, loader in (("-i", train_loader), ("-j", val_loader)):
        shards = loader.signature() if loader is not None else []
        fingerprint[f"{flag} shards"] = str(len(shards)) if loader is not None else "none"
        for i, (name, tokens, digest) in enumerate(shards):
            fingerprint[f"{flag} shard {i}"] = f"{name} ({tokens} tokens, sha256 {digest})"
    return fingerprint


def params_hash(params) -> str:
    """A short sha256 of float32 parameters (about 0.3 s per 124M parameters)."""
    return hashlib.sha256(np.ascontiguousarray(params, dtype=np.float32)).hexdigest()[:16]


def _shown(value) -> str:
    """A setting as the mismatch line shows it: floats exactly (repr), switches
    on/off, None as none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else repr(value) if isinstance(value, float) else str(value)


def fingerprint_differences(mine: dict, reference: dict) -> list:
    """[(what, my value, the reference's value)] for every entry that differs, in the
    reference's order."""
    keys = list(reference) + [k for k in mine if k not in reference]
    return [(k, mine.get(k, "(none)"), reference.get(k, "(none)")) for k in keys
            if mine.get(k) != reference.get(k)]


def mismatch_line(differences_per_rank: list) -> str | None:
    """One line for the first rank that differs from rank 0 and its first difference (naming the
    rest), or None when every rank agrees."""
    world_size = len(differences_per_rank)
    ranks = [r for r, diffs in enumerate(differences_per_rank) if diffs]
    if not ranks:
        return None
    rank, diffs = ranks[0], differences_per_rank[ranks[0]]
    what, mine, theirs = diffs[0]
    line = f"rank {rank} of {world_size}: {what} {mine} differs from rank 0's {what} {theirs}"
    if len(diffs) > 1:
        line += (f"; its {_listed([d[0] for d in diffs[1:]])} "
                 f"differ{'s' if len(diffs) == 2 else ''} too")
    if len(ranks) > 1:
        several = len(ranks) > 2
        line += (f"; rank{'s' if several else ''} {_listed(ranks[1:])} "
                 f"differ{'' if several else 's'} from rank 0 too")
    return line


def _listed(items) -> str:
    shown = ", ".join(str(x) for x in items[:LISTED_AT_MOST])
    return shown + (f" and {len(items) - LISTED_AT_MOST} more" if len(items) > LISTED_AT_MOST
                    else "")


def check_same_run(dist, fingerprint):
    """Make sure every rank runs the same job (see the module docstring); call it
    once, on every rank.

    fingerprint: a dict such as run_fingerprint's, or a function returning it, called only when
    there are ranks to compare (hashing a big model's weights takes a moment). When a rank differs,
    every rank learns it in the same two collectives and all of them stop: rank 0 raises RunMismatch
    with the one line (train.py prints it), the others exit with status 1 without a word -- the same
    line from every rank would help no one.
    """
    if dist.world_size == 1:
        return
    if callable(fingerprint):
        fingerprint = fingerprint()
    reference = dist.broadcast_object(fingerprint if dist.rank == 0 else None)
    line = mismatch_line(dist.all_gather_object(fingerprint_differences(fingerprint, reference)))
    if line is None:
        return
    stop_together(dist)
    raise RunMismatch(line)


def stop_together(dist, code=1, speaks=None):
    """Every rank has met the same reason to stop at the same point (check_same_run's verdict; a NaN
    loss or grad norm, which every rank sees alike after the all-reduce): no rank is left waiting in
    a collective, so abort_job has nothing to do, and rank 0 alone says why (the caller raises its
    error after this); the other ranks exit with status `code` (1: the run failed, 2: bad input)
    here, without a word: the same line from every rank would help no one. speaks: whether this rank
    is one that says why (None: rank 0 alone)."""
    global _ranks_stopping
    if dist.world_size > 1:
        _ranks_stopping = True
        if not (dist.rank == 0 if speaks is None else speaks):
            raise SystemExit(code)


def stop_on_problem(dist, problem):
    """Raise `problem` (an exception, or None), stopping every rank when any found one: one
    collective tells them.
    The ranks that found it say why (rank 0 alone when every rank did), the others exit 2 quietly;
    nobody is left waiting, so there is no abort and no line from MPI (was: each rank's error,
    then the abort's)."""
    if dist.world_size > 1:
        found = dist.average(1.0 if problem is not None else 0.0)
        if found > 0:
            stop_together(dist, 2, speaks=None if found == 1.0 else problem is not None)
    if problem is not None:
        raise problem


_group = None       # the MPI group of this process, once made (for abort_job and the excepthook)
# every rank knows the job is ending (check_same_run): abort_job has nothing to do
_ranks_stopping = False


def make_process_group(device="auto", zero_stage=0, timeout=DEFAULT_TIMEOUT):
    """SingleProcess when not started by an MPI launcher, else this process's MpiProcessGroup.

    device: the trainer's --device; when it is (or 'auto' resolves to) cuda, each rank selects its
    GPU (its rank among the ranks on its node) before any CUDA work, so call this
    before get_backend().
    """
    global _group
    if not launched_by_mpi():
        return SingleProcess(zero_stage)
    try:
        from mpi4py import MPI
    except ImportError:
        raise (DistError("started by an MPI launcher but mpi4py is not installed (pip "
                         "install 'gpt2np[dist]')")) from None
    first = _group is None
    _group = MpiProcessGroup(MPI.COMM_WORLD, zero_stage, timeout)
    if first:
        _install_excepthook()
        if _wants_cuda(device):
            _, _group.shared_gpu, _group.gpu_sharers = select_gpu(MPI.COMM_WORLD)
            if _group.shared_gpu and _group.rank == 0:
                _say("note: some ranks share a GPU (more ranks than GPUs on a node); NCCL needs "
                     "one GPU per rank, so "
                     "the gradients are averaged through MPI on host copies: correct, but slow")
    return _group


def _wants_cuda(device):
    if device == "cuda":
        return True
    if device == "auto":
        return gpu_available()
    return False


class GpuChoice(NamedTuple):
    device: int         # the CUDA device index this rank uses
    # some ranks of the job share a physical GPU (every rank gets the same answer)
    shared: bool
    sharers: int        # ranks on this rank's GPU, itself included


def select_gpu(comm, cupy=None):
    """Make this rank's GPU current; returns GpuChoice(device, shared, sharers).

    device: the rank's index among this node's ranks, modulo the GPUs it sees. So 8 ranks on 8 GPUs
    take one each; ranks that each see only their own GPU (Slurm's --gpus-per-task=1, a per-rank
    CUDA_VISIBLE_DEVICES) all use device 0; `mpiexec -n 2` on a machine with one GPU runs both ranks
    on GPU 0. shared: whether any two ranks of the job (on any node) ended up on the same physical
    GPU (same PCI bus id); NCCL refuses that, so the gradients then go through MPI
    (StagedCollectives). Every rank gets the same answer. sharers: how many ranks use this rank's
    GPU (the memory check gives each its share). cupy: a stand-in for tests."""
    if cupy is None:
        import cupy
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = node.Get_rank()
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:
            raise DistError(f"rank {comm.Get_rank()}: no GPU visible ({e})") from None
        if count < 1:
            raise DistError(f"rank {comm.Get_rank()}: no GPU visible (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        device = local_rank % count
        cupy.cuda.Device(device).use()
        mine = str(cupy.cuda.Device(device).pci_bus_id)
        bus_ids = node.allgather(mine)
    finally:
        node.Free()
    shared = any(comm.allgather(len(set(bus_ids)) < len(bus_ids)))
    return GpuChoice(device, shared, bus_ids.count(mine))


def abort_job(code=1):
    """Under MPI with several ranks: end all of them now (after this rank printed
    its error); else no-op.

    Without it, the other ranks would wait for this one in their next collective. After
    check_same_run found a difference every rank is ending already, and this does nothing."""
    if _group is not None and _group.world_size > 1 and not _ranks_stopping:
        _say(f"rank {_group.rank} of {_group.world_size} failed; aborting all ranks")
        _group.abort(code)


def _install_excepthook():
    """An uncaught exception on one rank ends the job (the other ranks would
    wait for it forever)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _group is not None and _group.world_size > 1:
            _say(f"rank {_group.rank} of {_group.world_size}: uncaught {kind.__name__}; "
                 "aborting all ranks")
            _group.abort(1)

    sys.excepthook = hook
