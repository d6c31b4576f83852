"""Multi-GPU code paths without GPUs: gpt2np.dist's NCCL collectives driven through a fake NCCL
communicator (tests/fake_gpu.py: cupy.cuda.nccl's interface, reductions over in-process thread
ranks) on the CUDA backend's CPU emulator; the host-staged collectives used when ranks share a GPU;
select_gpu's choice of device for one GPU per rank, ranks that each see only their own GPU (Slurm
--gpus-per-task=1), and more ranks than GPUs.

N thread ranks with micro-batch b must train like one process with N*b: same losses and parameters
after a few AdamW steps (ZeRO-0 and ZeRO-1, including 3 ranks whose shards leave a tail)."""
import inspect
import re

import numpy as np
import pytest
from fake_gpu import FakeCupy, FakeNccl, Group, ThreadComm, host_view

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.config import GPT2Config
from gpt2np.dist import (
    DistError,
    MpiProcessGroup,
    NcclCollectives,
    StagedCollectives,
    select_gpu,
    shard_bounds,
)
from gpt2np.model import GPT2, STATS
from gpt2np.tensors import num_parameters
from gpt2np.train_step import AdamW, train_step

# maxT=17: num_parameters = 34208, a multiple of 2 but not of 3 (the 3-rank ZeRO-1
# shards leave a tail of 2)
TINY = GPT2Config(max_seq_len=17, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=2,
                  channels=32)
T, STEPS, B_PER_RANK = 8, 3, 2
ADAMW = AdamW(eps=1e-4, weight_decay=0.1, grad_clip=1.0)   # eps: no sign flips of ~0 gradients


def emu_backend():
    be = CudaBackend(EmuRuntime())
    be.elementwise_threads = 64
    return be


def batches(ranks, steps=STEPS):
    """(x, y) (steps, ranks * B_PER_RANK, T) int32: each step's global batch of TINY's tokens."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, TINY.vocab_size, (steps, ranks * B_PER_RANK, T + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def train(model, x, y, dist=None, rows=slice(None), adamw=ADAMW, cuda_graphs=False, launches=None):
    """One step per batch of x, y on this rank's rows of it (lr 1e-3); returns the losses and the
    final parameters. launches: a list to append each step's count of CUDA graph launches to."""
    losses = []
    for step in range(len(x)):
        batch = (np.ascontiguousarray(x[step, rows]), np.ascontiguousarray(y[step, rows]))
        before = launches is not None and model.backend.rt.graph_launches
        loss, _ = train_step(model, lambda b=batch: b, step=step, lr=1e-3, adamw=adamw, dist=dist,
                             cuda_graphs=cuda_graphs)
        losses.append(float(loss))
        if launches is not None:
            launches.append(model.backend.rt.graph_launches - before)
    return losses, model.params_host()


def single_process(ranks):
    x, y = batches(ranks)
    return train(GPT2(TINY, emu_backend(), ranks * B_PER_RANK, T, seed=3), x, y)


def nccl_factory(nccl):
    return lambda comm: (lambda backend, buf: NcclCollectives(comm, backend.rt, nccl=nccl,
                                                              stream_ptr=lambda: 0))


def thread_ranks(ranks, zero, make_collectives, steps=STEPS, cuda_graphs=False, launches=None):
    """Train on `ranks` thread ranks with MpiProcessGroup over a ThreadComm; make_collectives(comm)
    gives the group's collectives factory. launches: a dict to put each rank's graph
    launches per step in."""
    group, (x, y) = Group(ranks), batches(ranks, steps)

    def rank_main(rank):
        comm = ThreadComm(group, rank)
        dist = MpiProcessGroup(comm, zero_stage=zero, timeout=0, collectives=make_collectives(comm))
        model = GPT2(TINY, emu_backend(), B_PER_RANK, T, seed=3)
        mine = None if launches is None else launches.setdefault(rank, [])
        return train(model, x, y, dist, rows=slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK),
                     cuda_graphs=cuda_graphs, launches=mine)

    return group.run(rank_main)


@pytest.fixture(scope="module")
def reference():
    return {ranks: single_process(ranks) for ranks in (2, 3)}


@pytest.mark.parametrize("ranks, zero", [(2, 0), (2, 1), (3, 1)])
def test_nccl_path_on_the_emulator_trains_like_one_process(reference, ranks, zero):
    nccl = FakeNccl()
    results = thread_ranks(ranks, zero, nccl_factory(nccl))
    ref_losses, ref_params = reference[ranks]
    for losses, params in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
        np.testing.assert_allclose(params, ref_params, rtol=0, atol=2e-6)
    for params in results[1:]:                   # every rank holds the same model
        np.testing.assert_array_equal(params[1], results[0][1])
    calls = {name for _, name, _, _ in nccl.log}
    tail = num_parameters(TINY) % ranks
    if zero == 0:
        assert calls == {"allReduce"}
    else:
        assert {"reduceScatter", "allGather"} <= calls
        # the last rank's tail goes through its own calls
        assert ("broadcast" in calls) == bool(tail)
        # (the device step's all-reduce of its STATS statistics stands alone)
        assert all(grouped for _, name, count, grouped in nccl.log
                   if name != "allReduce" or tail and count != STATS)


@pytest.mark.parametrize("ranks, zero, staged",
                         [(1, 0, False), (2, 0, False), (3, 1, False), (2, 1, True)])
def test_data_parallel_steps_replay_as_cuda_graphs_bitwise_the_eager_steps(ranks, zero, staged):
    """Under MPI the step is three graphs (forward and backward, the norm, AdamW) with the
    collectives between them, on the host: NCCL's (each waits for the stream) or the host-staged
    ones of ranks sharing a GPU. One rank (mpiexec -n 1) too: before, its collectives were captured
    inside the one graph, and their wait failed there."""
    if staged:
        def collectives(comm):
            return lambda backend, buf: StagedCollectives(comm, backend.rt)
    else:
        collectives = nccl_factory(FakeNccl())
    eager = thread_ranks(ranks, zero, collectives, steps=4)
    launches = {}
    graphed = thread_ranks(ranks, zero, collectives, steps=4, cuda_graphs=True, launches=launches)
    for (eager_losses, eager_params), (losses, params) in zip(eager, graphed):
        assert losses == eager_losses
        np.testing.assert_array_equal(params, eager_params)
    # each rank: an eager warm-up step, then three graphs captured and launched, then replayed
    assert launches == {rank: [0, 3, 3, 3] for rank in range(ranks)}


def test_one_model_graphed_alone_then_under_mpi_keeps_the_graphs_apart():
    """A single process's step is one graph (the whole step), a rank's first graph only forward and
    backward: the same model stepped both ways (a script reusing it) must not replay the
    one for the other."""
    x, y = batches(1, steps=6)
    results, launches = [], []
    for graphs in (False, True):
        model = GPT2(TINY, emu_backend(), B_PER_RANK, T, seed=3)
        first = train(model, x[:3], y[:3], cuda_graphs=graphs, launches=launches)[0]
        group = Group(1)

        def rank_main(rank, model=model, graphs=graphs, group=group):
            comm = ThreadComm(group, rank)
            dist = MpiProcessGroup(comm, timeout=0, collectives=nccl_factory(FakeNccl())(comm))
            out = []
            for s in range(3, 6):
                before = model.backend.rt.graph_launches
                out.append(float(train_step(model, lambda b=(x[s], y[s]): b, step=s, lr=1e-3,
                                            adamw=ADAMW, dist=dist, cuda_graphs=graphs)[0]))
                launches.append(model.backend.rt.graph_launches - before)
            return out

        (later,) = group.run(rank_main)
        results.append((first + later, model.params_host()))
    assert results[1][0] == results[0][0]
    np.testing.assert_array_equal(results[1][1], results[0][1])
    # eager: none; graphed: alone warm-up, capture, replay; under MPI its own warm-up,
    # capture, replay of three
    assert launches == [0] * 6 + [0, 1, 1] + [0, 3, 3]


@pytest.mark.parametrize("zero", [0, 1])
def test_a_collectives_range_holds_the_collective_not_the_backward_before_it(zero):
    """On a GPU the host reaches a collective while the device still runs the backward (queued, or a
    graph): the device's work is waited for before the collective's range opens, so its NVTX range
    and the profiler's communication time hold the collective alone (the collective waited for that
    work inside its range before)."""
    from gpt2np import ranges
    events = []

    class Listener:
        def on_push(self, name, detail):
            events.append(name)

        def on_pop(self, name):
            pass

    x, y = batches(1, steps=2)
    group = Group(1)

    def rank_main(rank):
        comm = ThreadComm(group, rank)
        dist = MpiProcessGroup(comm, zero_stage=zero, timeout=0,
                               collectives=nccl_factory(FakeNccl())(comm))
        model = GPT2(TINY, emu_backend(), B_PER_RANK, T, seed=3)
        real = model.backend.synchronize
        model.backend.synchronize = lambda: (events.append("wait for the device"), real())
        return train(model, x, y, dist)

    listener = Listener()
    ranges.add_listener(listener)
    try:
        group.run(rank_main)
    finally:
        ranges.remove_listener(listener)
    names = {"allreduce_grads", "reduce_scatter_grads", "allreduce_stats", "allgather_params"}
    opened = [i for i, name in enumerate(events) if name in names]
    assert len(opened) == 2 * (3 if zero else 2)
    assert all(events[i - 1] == "wait for the device" for i in opened), events


@pytest.mark.parametrize("zero", [0, 1])
def test_ranks_sharing_a_gpu_average_through_mpi_on_host_copies(reference, zero):
    results = thread_ranks(3, zero,
                           lambda comm: (lambda backend, buf: StagedCollectives(comm, backend.rt)))
    ref_losses, ref_params = reference[3]
    for losses, params in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
        np.testing.assert_allclose(params, ref_params, rtol=0, atol=2e-6)


def test_the_default_choice_of_collectives(monkeypatch):
    """Device buffers: NCCL, or host-staged MPI when ranks share a GPU; host buffers: MPI."""
    import gpt2np.dist as dist_module
    made = []
    monkeypatch.setattr(dist_module, "NcclCollectives",
                        lambda comm, rt: made.append("nccl") or "nccl")
    monkeypatch.setattr(dist_module, "StagedCollectives",
                        lambda comm, rt: made.append("staged") or "staged")
    comm = ThreadComm(Group(1), 0)
    backend = emu_backend()
    # not a NumPy array: stands for a device array
    device_buf = memoryview(b"")
    for shared, expected in ((False, "nccl"), (True, "staged")):
        group = MpiProcessGroup(comm, timeout=0)
        group.shared_gpu = shared
        assert group._device_collectives(backend, device_buf) == expected
    host = MpiProcessGroup(comm, timeout=0)._device_collectives(backend, np.zeros(4, np.float32))
    assert type(host).__name__ == "HostCollectives"
    assert made == ["nccl", "staged"]


def test_fake_collectives_act_on_the_memory_behind_the_pointers():
    nccl, group = FakeNccl(), Group(2)
    uid = nccl.get_unique_id()

    def rank_main(rank):
        comm = nccl.NcclCommunicator(2, uid, rank)
        buf = np.arange(6, dtype=np.float32) * (rank + 1)
        ptr = buf.__array_interface__["data"][0]
        comm.allReduce(ptr, ptr, 6, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
        sums = buf.copy()
        out = np.zeros(3, np.float32)
        comm.reduceScatter(ptr, out.__array_interface__["data"][0], 3, nccl.NCCL_FLOAT32,
                           nccl.NCCL_SUM, 0)
        with pytest.raises(TypeError, match="sendbuf must be an int"):
            comm.allReduce(buf, ptr, 6, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
        return sums, out

    (s0, o0), (s1, o1) = group.run(rank_main)
    np.testing.assert_array_equal(s0, np.arange(6) * 3)
    np.testing.assert_array_equal(s1, s0)
    np.testing.assert_array_equal(o0, s0[:3] * 2)
    np.testing.assert_array_equal(o1, s0[3:] * 2)
    assert host_view(0, 0, np.float32).size == 0


def test_nccl_collectives_without_nccl_say_what_to_install():
    class NoNccl:
        available = False
    with pytest.raises(DistError, match="pip install 'nvidia-nccl-cu13"):
        NcclCollectives(ThreadComm(Group(1), 0), EmuRuntime(), nccl=NoNccl())


# ---- the fake's interface is CuPy's --------------------------------------------------------------

def cython_parameters(function):
    """Parameter names from a Cython function's embedded signature: 'allReduce(self,
    intptr_t sendbuf, ...)'."""
    match = re.match(r"[\w.]+\(([^)]*)\)", (function.__doc__ or "").strip())
    if not match:
        pytest.skip(f"{function.__qualname__} has no embedded signature")
    return [p.split()[-1].split("=")[0] for p in match[1].split(",") if p.strip()]


def test_fake_nccl_has_cupys_interface():
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy is not installed")
    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library (pip install 'nvidia-nccl-cu13>=2.27.7,<3')")
    fake = FakeNccl()
    for name in ("NCCL_FLOAT32", "NCCL_FLOAT16", "NCCL_BFLOAT16", "NCCL_SUM", "NCCL_AVG"):
        assert getattr(fake, name) == getattr(nccl, name), name
    for name in ("get_unique_id", "groupStart", "groupEnd", "NcclCommunicator"):
        assert callable(getattr(nccl, name)), name
    for name in ("allReduce", "reduceScatter", "allGather", "broadcast", "bcast", "reduce",
                 "destroy", "abort", "device_id", "rank_id", "size"):
        real = getattr(nccl.NcclCommunicator, name)
        mine = list(inspect.signature(getattr(fake.NcclCommunicator, name)).parameters)
        assert cython_parameters(real) == mine, name


# ---- select_gpu ----------------------------------------------------------------------------------

def select_on(ranks, cupy_of_rank, nodes=None):
    """select_gpu on thread ranks; nodes: rank -> node index (default: all on one node)."""
    nodes = nodes or [0] * ranks
    world = Group(ranks)
    node_groups = {n: Group(nodes.count(n)) for n in set(nodes)}

    def rank_main(rank):
        n = nodes[rank]
        local = [r for r in range(ranks) if nodes[r] == n].index(rank)
        comm = ThreadComm(world, rank, node=ThreadComm(node_groups[n], local))
        return select_gpu(comm, cupy=cupy_of_rank(rank))

    return world.run(rank_main)


def gpus(n, prefix="0000:"):
    return [(f"NVIDIA H100 80GB HBM3 #{i}", 90, f"{prefix}{i + 1:02x}:00.0") for i in range(n)]


def test_one_gpu_per_rank():
    cupys = [FakeCupy(devices=gpus(4)) for _ in range(4)]
    assert select_on(4, lambda r: cupys[r]) == [(r, False, 1) for r in range(4)]
    assert [c.used for c in cupys] == [[0], [1], [2], [3]]


def test_ranks_that_each_see_one_gpu_use_device_0():
    """Slurm --gpus-per-task=1: every rank's device 0 is a different GPU; NCCL can run."""
    cupys = [FakeCupy(devices=[(f"GPU {r}", 80, f"0000:{r + 1:02x}:00.0")]) for r in range(4)]
    assert select_on(4, lambda r: cupys[r]) == [(0, False, 1)] * 4


def test_two_ranks_on_one_gpu_share_it():
    """mpiexec -n 2 on a machine with one GPU: both on GPU 0, and every rank knows they share it."""
    assert select_on(2, lambda r: FakeCupy(devices=gpus(1))) == [(0, True, 2), (0, True, 2)]


def test_sharing_on_one_node_is_known_on_every_node():
    # node 0: 2 ranks on 2 GPUs; node 1: 2 ranks on 1 GPU -> all 4 ranks must use
    # the staged collectives
    cupys = [FakeCupy(devices=gpus(2)), FakeCupy(devices=gpus(2)),
             FakeCupy(devices=gpus(1, "0001:")), FakeCupy(devices=gpus(1, "0001:"))]
    assert select_on(4, lambda r: cupys[r], nodes=[0, 0, 1, 1]) == [(0, True, 1), (1, True, 1),
                                                                    (0, True, 2), (0, True, 2)]


def test_more_ranks_than_gpus_go_round_robin():
    assert ([(c.device, c.sharers) for c in select_on(4, lambda r: FakeCupy(devices=gpus(2)))]
            == [(0, 2), (1, 2)] * 2)


def test_no_gpu_is_a_clear_error():
    with pytest.raises(DistError, match="no GPU visible"):
        select_on(1, lambda r: FakeCupy(devices=[]))


def test_shards_used_here_leave_a_tail():
    assert (num_parameters(TINY) % 3 == 2
            and shard_bounds(num_parameters(TINY), 3)[-1][1] == num_parameters(TINY))
