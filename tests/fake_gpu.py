"""Stand-ins for the GPU libraries, so the code that talks to them runs in CI without a GPU.

* FakeCublas: cupy_backends.cuda.libs.cublas's functions used by CupyRuntime (create, destroy,
  setStream, setPointerMode, setMathMode, sgemm, sgemmStridedBatched, gemmEx, gemmStridedBatchedEx),
  recording every call; like CuPy 14 it defines only CUBLAS_DEFAULT_MATH and CUBLAS_TENSOR_OP_MATH
  (no CUBLAS_TF32_TENSOR_OP_MATH).
* FakeCublasLt: nvmath.bindings.cublasLt's functions used by CupyRuntime's epilogue GEMMs (create,
  layouts, matmul descriptor and preference attributes with the C types nvmath-python 1.0.0 gives
  them, the heuristic, matmul), recording every call with the attribute values read back from the
  buffers passed by address.
* FakeCupy: the parts of cupy that gpt2np's startup check, CupyRuntime and select_gpu read (driver
  and device queries, memGetInfo, the memory pool, streams, devices with PCI bus
  ids, NVRTC's version).
* Group / ThreadComm: in-process "ranks" (threads) and an mpi4py-like communicator over them
  (Get_rank, Get_size, bcast, allreduce, allgather, Barrier, Split_type, and the buffer collectives
  HostCollectives uses).
* FakeNccl: cupy.cuda.nccl's interface (get_unique_id, groupStart/End, NcclCommunicator with
  allReduce, reduceScatter, allGather, broadcast, bcast, reduce ... taking raw pointers), doing the
  reductions over the thread ranks on host memory, so NcclCollectives runs on the CPU emulator's
  arrays (whose pointers are host addresses). It knows ncclBfloat16 and ncclAvg (bf16 sums in fp32,
  rounded once: see _reduce for how real NCCL differs). Signatures follow
  cupy_backends/cuda/libs/nccl.pyx; tests/test_gpu_ready.py compares them with the installed CuPy's.
"""
import ctypes
import operator
import threading
import types

import ml_dtypes
import numpy as np

# ---- cuBLAS --------------------------------------------------------------------------------------


class FakeCublas(types.SimpleNamespace):
    """cupy_backends.cuda.libs.cublas as CuPy 14 has it (the math modes it
    names), recording calls."""

    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
    CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
    CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH = 0, 1

    def __init__(self):
        super().__init__(calls=[], live=set(), _next=0x1000)

    def create(self):
        self._next += 0x10
        self.live.add(self._next)
        self.calls.append(("create", self._next))
        return self._next

    def destroy(self, handle):
        self.live.discard(handle)
        self.calls.append(("destroy", handle))

    def _record(self, name, handle, *args):
        if handle not in self.live:
            raise RuntimeError(f"cublas.{name}: handle {handle:#x} was not created "
                               "by cublas.create()")
        # Cython converts to intptr_t / int: Python ints (or numpy ints) only
        for a in args:
            operator.index(a)
        self.calls.append((name, handle, *args))

    def setStream(self, handle, stream):
        self._record("setStream", handle, stream)

    def setPointerMode(self, handle, mode):
        self._record("setPointerMode", handle, mode)

    def setMathMode(self, handle, mode):
        self._record("setMathMode", handle, mode)

    def sgemm(self, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self._record("sgemm", handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)

    def sgemmStridedBatched(self, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb,
                            strideB, beta, C, ldc, strideC, batchCount):
        self._record("sgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A, lda, strideA,
                     B, ldb, strideB, beta, C, ldc, strideC, batchCount)

    def gemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
               Ctype, ldc, computeType, algo):
        self._record("gemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb,
                     beta, C, Ctype, ldc, computeType, algo)

    def gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda,
                             strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        self._record("gemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype,
                     lda, strideA, B, Btype,
                     ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)

    def of(self, name):
        return [c for c in self.calls if c[0] == name]


class FakeCublasLt(types.SimpleNamespace):
    """nvmath.bindings.cublasLt as CupyRuntime uses it, recording calls. Attribute setters read the
    value from the buffer address with the attribute's C type (get_*_attribute_dtype, as
    nvmath-python 1.0.0 answers), so a wrong size or type shows up as a wrong recorded value.
    algorithms: how many the heuristic finds (0: none)."""

    DESC_DTYPES = {0: np.int32, 1: np.int32, 3: np.int32, 4: np.int32, 7: np.uint32, 8: np.int64,
                   11: np.int64, 12: np.int64}
    PREF_DTYPES = {1: np.uint64, 5: np.uint32, 6: np.uint32, 7: np.uint32, 8: np.uint32}
    matmul_heuristic_result_dtype = np.dtype([("algo", [("data_", "<u8", (8,))]),
                                              ("workspace_size", "<u8"), ("state", "<i4"),
                                              ("waves_count", "<f4"), ("reserved", "<i4", (4,))])

    def __init__(self, algorithms=1, fail_create=None):
        super().__init__(calls=[], live=set(), descs={}, prefs={}, layouts={},
                         algorithms=algorithms, fail_create=fail_create, _next=0x9000)

    def _new(self, kind):
        self._next += 0x10
        self.live.add(self._next)
        self.calls.append((kind, self._next))
        return self._next

    def _record(self, name, *args):
        # Cython converts to intptr_t / int: Python ints (or numpy ints) only
        for a in args:
            operator.index(a)
        self.calls.append((name, *args))

    def _read(self, buf, size, dtype):
        dtype = np.dtype(dtype)
        if size != dtype.itemsize:
            raise ValueError(f"attribute buffer of {size} bytes, the attribute is a {dtype} "
                             f"({dtype.itemsize} bytes)")
        return np.frombuffer(ctypes.string_at(buf, size), dtype)[0].item()

    def create(self):
        if self.fail_create:
            raise self.fail_create
        return self._new("create")

    def destroy(self, light_handle):
        self.live.discard(light_handle)
        self.calls.append(("destroy", light_handle))

    def matrix_layout_create(self, type, rows, cols, ld):
        self._record("matrix_layout_create", type, rows, cols, ld)
        layout = self._new("layout")
        self.layouts[layout] = (type, rows, cols, ld)
        return layout

    def matrix_layout_destroy(self, mat_layout):
        self.live.discard(mat_layout)
        self.calls.append(("matrix_layout_destroy", mat_layout))

    def matmul_desc_create(self, compute_type, scale_type):
        self._record("matmul_desc_create", compute_type, scale_type)
        desc = self._new("desc")
        self.descs[desc] = {}
        return desc

    def matmul_desc_destroy(self, matmul_desc):
        self.live.discard(matmul_desc)
        self.calls.append(("matmul_desc_destroy", matmul_desc))

    def get_matmul_desc_attribute_dtype(self, attr):
        return self.DESC_DTYPES[attr]

    def matmul_desc_set_attribute(self, matmul_desc, attr, buf, size_in_bytes):
        self._record("matmul_desc_set_attribute", matmul_desc, attr, buf, size_in_bytes)
        self.descs[matmul_desc][attr] = self._read(buf, size_in_bytes, self.DESC_DTYPES[attr])

    def matmul_preference_create(self):
        pref = self._new("preference")
        self.prefs[pref] = {}
        return pref

    def matmul_preference_destroy(self, pref):
        self.live.discard(pref)
        self.calls.append(("matmul_preference_destroy", pref))

    def get_matmul_preference_attribute_dtype(self, attr):
        return self.PREF_DTYPES[attr]

    def matmul_preference_set_attribute(self, pref, attr, buf, size_in_bytes):
        self._record("matmul_preference_set_attribute", pref, attr, buf, size_in_bytes)
        self.prefs[pref][attr] = self._read(buf, size_in_bytes, self.PREF_DTYPES[attr])

    def matmul_algo_get_heuristic(self, light_handle, operation_desc, adesc, bdesc,
                                  cdesc, ddesc, preference,
                                  requested_algo_count, heuristic_results_array, return_algo_count):
        self._record("matmul_algo_get_heuristic", light_handle, operation_desc, adesc, bdesc,
                     cdesc, ddesc, preference,
                     requested_algo_count, heuristic_results_array, return_algo_count)
        self.calls[-1] += (dict(self.prefs[preference]),)
        ctypes.c_int32.from_address(return_algo_count).value = min(self.algorithms,
                                                                   requested_algo_count)

    def matmul(self, light_handle, compute_desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d,
               ddesc, algo, workspace, workspace_size_in_bytes, stream):
        self._record("matmul", light_handle, compute_desc, alpha, a, adesc, b, bdesc, beta, c,
                     cdesc, d, ddesc, algo, workspace, workspace_size_in_bytes, stream)
        if light_handle not in self.live:
            raise RuntimeError("cublasLt.matmul: handle was not created by cublasLt.create()")
        # what cuBLASLt reads at the call: alpha, beta (host float32), the descriptor's
        # attributes, the layouts
        self.calls[-1] += ({"alpha": ctypes.c_float.from_address(alpha).value,
                            "beta": ctypes.c_float.from_address(beta).value,
                            "desc": dict(self.descs[compute_desc]),
                            "layouts": [self.layouts[x] for x in (adesc, bdesc, cdesc, ddesc)]},)

    def of(self, name):
        return [c for c in self.calls if c[0] == name]


# ---- CuPy ----------------------------------------------------------------------------------------


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr

    def synchronize(self):
        pass


class FakeCupy:
    """The parts of cupy gpt2np reads. driver: cudaDriverGetVersion's answer (0 = no driver);
    devices: one (name, compute capability, PCI bus id) per visible GPU; free/total: memGetInfo;
    pool_free: what CuPy's pool holds unused; nvrtc: NVRTC's (major, minor), or an
    exception to raise."""

    def __init__(self, driver=13000, devices=(("NVIDIA H100 80GB HBM3", 90, "0000:01:00.0"),),
                 free=80 << 30, total=80 << 30, pool_free=0, nvrtc=(13, 0), stream=0):
        fake = self
        self.driver, self.devices, self.free, self.total = driver, list(devices), free, total
        self.pool_free, self.nvrtc_version, self.current, self.used = pool_free, nvrtc, 0, []
        self.stream = FakeStream(stream)

        class Runtime:
            @staticmethod
            def driverGetVersion():
                return fake.driver

            @staticmethod
            def getDeviceCount():
                if fake.driver <= 0:
                    raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                                       "insufficient for CUDA runtime version")
                return len(fake.devices)

            @staticmethod
            def getDevice():
                return fake.current

            @staticmethod
            def getDeviceProperties(i):
                name, cc, _ = fake.devices[i]
                return {"name": name.encode(), "major": cc // 10, "minor": cc % 10}

            @staticmethod
            def memGetInfo():
                return fake.free, fake.total

        class Device:
            def __init__(self, i=None):
                self.id = fake.current if i is None else i

            def use(self):
                fake.current = self.id
                fake.used.append(self.id)

            @property
            def pci_bus_id(self):
                return fake.devices[self.id][2]

            @property
            def compute_capability(self):
                return "90"

            def __enter__(self):
                self._previous, fake.current = fake.current, self.id
                return self

            def __exit__(self, *exc):
                fake.current = self._previous

        class Nvrtc:
            @staticmethod
            def getVersion():
                if isinstance(fake.nvrtc_version, Exception):
                    raise fake.nvrtc_version
                return fake.nvrtc_version

        class Pool:
            @staticmethod
            def free_bytes():
                return fake.pool_free

        device = types.SimpleNamespace(get_cublas_handle=self._shared_handle)
        self.cuda = types.SimpleNamespace(runtime=Runtime, Device=Device, nvrtc=Nvrtc,
                                          get_current_stream=lambda: fake.stream, device=device)
        self.get_default_memory_pool = Pool
        self._next_address = 0x7000_0000

    def empty(self, shape, dtype):
        """A device allocation stand-in: its address (data.ptr) only (CupyRuntime's
        cuBLASLt workspace)."""
        self._next_address += 1 << 26
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=self._next_address),
                                     shape=shape, dtype=np.dtype(dtype))

    @staticmethod
    def _shared_handle():
        raise AssertionError("CupyRuntime must not use CuPy's shared cuBLAS handle")


# ---- in-process ranks and an MPI-like communicator -----------------------------------------------


class Group:
    """`size` ranks that are threads of this process; exchange() is the one rendezvous
    everything is built on."""

    def __init__(self, size, timeout=60):
        self.size, self.timeout = size, timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots = [None] * size

    def exchange(self, rank, value):
        """[value of rank 0, value of rank 1, ...] on every rank."""
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        # nobody overwrites a slot before everyone has read them all
        self._barrier.wait()
        return values

    def run(self, target, *args):
        """target(rank, *args) on every rank (a thread each); returns the results in rank order,
        re-raises the first rank's exception."""
        results, errors = [None] * self.size, [None] * self.size

        def one(rank):
            try:
                results[rank] = target(rank, *args)
            except BaseException as e:        # noqa: BLE001 - handed to the caller
                errors[rank] = e
                self._barrier.abort()        # the other ranks stop waiting for this one

        threads = [threading.Thread(target=one, args=(r,), name=f"rank{r}")
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"ranks still running after {self.timeout * 4} s")
        # the rank that failed first, not the ones it left waiting at a broken barrier
        errors = sorted((e for e in errors if e is not None),
                        key=lambda e: isinstance(e, threading.BrokenBarrierError))
        if errors:
            raise errors[0]
        return results


class ThreadComm:
    """What gpt2np.dist asks of an mpi4py communicator, over a Group's thread ranks."""

    def __init__(self, group, rank, node=None):
        self.group, self.rank = group, rank
        # the communicator Split_type returns (default: this one)
        self._node = node

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.group.size

    def bcast(self, obj, root=0):
        return self.group.exchange(self.rank, obj)[root]

    def allgather(self, obj):
        return self.group.exchange(self.rank, obj)

    def allreduce(self, value, op=None):
        return sum(self.group.exchange(self.rank, value))

    def Barrier(self):
        self.group.exchange(self.rank, None)

    def Split_type(self, kind):
        return self._node or ThreadComm(self.group, self.rank)

    def Free(self):
        pass

    def Abort(self, code=1):
        raise SystemExit(code)

    # buffer collectives, as HostCollectives calls them (MPI.IN_PLACE, MPI.SUM); like mpi4py they
    # refuse bf16 arrays (mpi4py 4.1: "BufferError: DLPack only supports signed/unsigned integers,
    # float and complex dtypes")
    def Allreduce(self, sendbuf, recvbuf, op=None):
        from mpi4py import MPI
        _mpi_buffer(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf, recvbuf)
        data = np.array(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf, copy=True)
        recvbuf[...] = np.sum(self.group.exchange(self.rank, data), axis=0, dtype=data.dtype)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op=None):
        _mpi_buffer(sendbuf, recvbuf)
        total = np.sum(self.group.exchange(self.rank, np.array(sendbuf, copy=True)), axis=0,
                       dtype=sendbuf.dtype)
        lo = sum(recvcounts[:self.rank])
        recvbuf[...] = total[lo:lo + recvcounts[self.rank]]

    def Allgatherv(self, sendbuf, recv):
        buf, counts, displs, _ = recv
        _mpi_buffer(buf)
        mine = np.array(buf[displs[self.rank]:displs[self.rank] + counts[self.rank]], copy=True)
        for r, part in enumerate(self.group.exchange(self.rank, mine)):
            buf[displs[r]:displs[r] + counts[r]] = part


def _mpi_buffer(*buffers):
    for buf in buffers:
        if np.dtype(buf.dtype) == ml_dtypes.bfloat16:
            raise BufferError("DLPack only supports signed/unsigned integers, float "
                              "and complex dtypes.")


# ---- NCCL ----------------------------------------------------------------------------------------

NCCL_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
               # ncclDataType_t (nccl.h)
               6: np.float16, 7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16}
# ncclSum, Prod, Max, Min, Avg
NCCL_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: "avg"}


def host_view(ptr, count, dtype):
    """count elements of dtype at host address ptr, as a writable NumPy array (what NCCL
    reads and writes)."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.zeros(0, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)


class FakeNccl(types.SimpleNamespace):
    """A cupy.cuda.nccl stand-in for thread ranks sharing one address space. Every collective is a
    rendezvous of the communicator's ranks: each posts a copy of what it sends, then each writes its
    own result, so in-place calls (send == recv, or recv inside send) behave as NCCL's do. Calls
    record (rank, name, count, grouped) in `log` and (rank, name, datatype, op) in `types`."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
    NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = (4, 5, 6,
                                                                                        7, 8, 9)
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    available = True

    def __init__(self):
        fake = self
        super().__init__(log=[], types=[], _groups={}, _lock=threading.Lock(),
                         _depth=threading.local(), _ids=0)

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                if not isinstance(commId, tuple) or len(commId) != 128:
                    raise TypeError("commId must be the 128-tuple get_unique_id() returns")
                if not 0 <= rank < ndev:
                    raise ValueError(f"rank {rank} not in 0..{ndev - 1}")
                with fake._lock:
                    self._group = fake._groups.setdefault(commId, Group(ndev))
                if self._group.size != ndev:
                    raise ValueError("ranks disagree on the communicator's size")
                self._rank, self._ndev = rank, ndev

            # the collectives (cupy_backends/cuda/libs/nccl.pyx)
            def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
                dtype = self._check("allReduce", sendbuf, recvbuf, count, datatype, stream, op=op)
                parts = self._group.exchange(self._rank, host_view(sendbuf, count, dtype).copy())
                host_view(recvbuf, count, dtype)[...] = _reduce(parts, op)

            def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
                dtype = self._check("reduce", sendbuf, recvbuf, count, datatype, stream, op=op,
                                    root=root)
                parts = self._group.exchange(self._rank, host_view(sendbuf, count, dtype).copy())
                if self._rank == root:
                    host_view(recvbuf, count, dtype)[...] = _reduce(parts, op)

            def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
                dtype = self._check("reduceScatter", sendbuf, recvbuf, recvcount, datatype,
                                    stream, op=op)
                parts = self._group.exchange(self._rank, host_view(sendbuf, recvcount * self._ndev,
                                                                   dtype).copy())
                mine = slice(self._rank * recvcount, (self._rank + 1) * recvcount)
                host_view(recvbuf, recvcount, dtype)[...] = _reduce([p[mine] for p in parts], op)

            def allGather(self, sendbuf, recvbuf, count, datatype, stream):
                dtype = self._check("allGather", sendbuf, recvbuf, count, datatype, stream)
                parts = self._group.exchange(self._rank, host_view(sendbuf, count, dtype).copy())
                host_view(recvbuf, count * self._ndev, dtype)[...] = np.concatenate(parts)

            def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
                dtype = self._check("broadcast", sendbuff, recvbuff, count, datatype, stream,
                                    root=root)
                mine = host_view(sendbuff, count, dtype).copy() if self._rank == root else None
                host_view(recvbuff, count, dtype)[...] = self._group.exchange(self._rank,
                                                                              mine)[root]

            def bcast(self, buff, count, datatype, root, stream):
                self.broadcast(buff, buff, count, datatype, root, stream)

            def destroy(self):
                pass

            def abort(self):
                pass

            def device_id(self):
                return 0

            def rank_id(self):
                return self._rank

            def size(self):
                return self._ndev

            def _check(self, name, send, recv, count, datatype, stream, op=0, root=0):
                for what, value in (("sendbuf", send), ("recvbuf", recv), ("count", count),
                                    ("datatype", datatype),
                                    ("stream", stream), ("op", op), ("root", root)):
                    try:                      # Cython's intptr_t / size_t / int conversion
                        operator.index(value)
                    except TypeError:
                        raise TypeError(f"NcclCommunicator.{name}: {what} must be an int, got "
                                        f"{type(value).__name__}") from None
                if (count < 0 or datatype not in NCCL_DTYPES or op not in NCCL_OPS
                    or not 0 <= root < self._ndev):
                    raise ValueError(f"NcclCommunicator.{name}: bad count {count}, datatype "
                                     f"{datatype}, op {op} or root {root}")
                fake.log.append((self._rank, name, int(count),
                                 getattr(fake._depth, "value", 0) > 0))
                fake.types.append((self._rank, name, int(datatype), int(op)))
                return NCCL_DTYPES[datatype]

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        with self._lock:
            self._ids += 1
            return tuple([self._ids % 128] + [0] * 127)

    def groupStart(self):
        self._depth.value = getattr(self._depth, "value", 0) + 1

    def groupEnd(self):
        if getattr(self._depth, "value", 0) <= 0:
            raise RuntimeError("groupEnd without groupStart")
        self._depth.value -= 1

    def get_version(self):
        return 22703


def _reduce(parts, op):
    """The reduction of the ranks' parts (in rank order). ncclAvg: the sum divided by the ranks.
    bf16 (ncclSum, ncclAvg): the sum (and the division) in fp32, rounded to nearest even once.

    Real NCCL does not round once: its ring and tree kernels reduce bf16 chunk by chunk as they pass
    between ranks, each partial sum stored in bf16, and its ncclAvg on floats pre-multiplies every
    input by 1/nranks (its newer symmetric kernels sum, then divide). So on GPUs the mean differs
    from this one by up to a few bf16 roundings per element, more with more ranks; nothing here
    checks real NCCL's rounding."""
    if op == 4 or parts[0].dtype == ml_dtypes.bfloat16 and op == 0:
        total = np.sum([p.astype(np.float32) if p.dtype == ml_dtypes.bfloat16 else p
                        for p in parts], axis=0,
                       dtype=np.float32 if parts[0].dtype == ml_dtypes.bfloat16 else parts[0].dtype)
        if op == 4:
            total = total / total.dtype.type(len(parts))
        return total.astype(parts[0].dtype)
    out = parts[0].copy()
    for p in parts[1:]:
        NCCL_OPS[op](out, p, out=out)
    return out
