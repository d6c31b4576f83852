"""bf16 data parallelism (--precision bf16 under mpiexec), as llm.c does it, without
GPUs or a real NCCL.

The ranks are threads of this process (tests/fake_gpu.py: Group, ThreadComm, FakeNccl):
  * the numpy bf16 reference with MPI's host collectives (HostCollectives: fp32 sums of the upcast
    bf16 values, the mean rounded once);
  * the CUDA backend's bf16 build on the emulator with the fake NCCL (ncclBfloat16, ncclAvg), and
    with the host-staged collectives used when ranks share a GPU.
The last test runs train.py under a real mpiexec (MPICH from pip) on the CPU, checkpoints
and resume included.

What "trains like one process" means in bf16: N ranks with micro-batch b are compared to
one process with N*b.
They cannot agree bit for bit: one process rounds each parameter gradient to bf16 once, from the
fp32 sum over all N*b sequences; N ranks round each rank's partial gradient to bf16, then the mean
of those once more. So the gradients differ by about one bf16 rounding (2^-8 relative), and AdamW's
update with them. The bound used (measured on this tiny model, 4 AdamW steps at lr 1e-3, 2 and 3
ranks, both backends, llm.c's init): the losses agree to rtol 1e-3 (measured <= 3.5e-5 with NumPy's
earlier init); all but 0.1% of the parameters are within 2 bf16 ulps of their magnitude or 2^-12
absolute (measured: all but 1 of 34144 with 2 ranks, all but 7 with 3); the rest within 2 ulps plus
4 lr, as far as 4 Adam updates can differ (near-zero gradients, where Adam's m / sqrt(v) is
sensitive: measured at most 1.15e-3); the key biases, whose gradient is round-off
(tests/noise_params.py), within twice that (their updates can take either sign) and left out of
these counts; fewer than 30% of the parameters differ at all (measured 13% with 2 ranks, 21% with 3;
with the earlier init bf16 against fp32 on the same run: 43%).
"""
import re
import subprocess
import sys

import numpy as np
import pytest
from fake_gpu import FakeNccl, Group, ThreadComm
from noise_params import key_bias_mask

# the fixture mpiexec, probed with 2 ranks
from test_dist import REPO, clean_env, mpiexec  # noqa: F401
from test_dist_fake_nccl import batches as fake_nccl_batches
from test_dist_fake_nccl import train

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.bf16 import BF16, round_nearest
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.dist import (
    DistError,
    HostCollectives,
    MpiProcessGroup,
    NcclCollectives,
    StagedCollectives,
    shard_bounds,
)
from gpt2np.formats.checkpoint import load_model, load_state, model_path, save_model, state_path
from gpt2np.model import GPT2
from gpt2np.tensors import num_parameters

# maxT=17: num_parameters = 34208, a multiple of 2 but not of 3 (3 ZeRO-1 shards leave a tail of 2)
TINY = GPT2Config(max_seq_len=17, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=2,
                  channels=32)
T, STEPS, B_PER_RANK = 8, 4, 2
LR = 1e-3          # test_dist_fake_nccl.train's, with its AdamW (eps 1e-4, wd 0.1, clip 1)
N = num_parameters(TINY)


def numpy_bf16():
    return Bf16NumpyBackend()


def emu_bf16():
    be = CudaBackend(EmuRuntime(), dtype=BF16)
    be.elementwise_threads = 64
    return be


BACKENDS = {"numpy": numpy_bf16, "emu": emu_bf16}


def batches(ranks):
    return fake_nccl_batches(ranks, STEPS)


def single_process(backend, ranks):
    x, y = batches(ranks)
    return train(GPT2(TINY, BACKENDS[backend](), ranks * B_PER_RANK, T, seed=3), x, y)


def nccl_collectives(nccl):
    return lambda comm: (lambda backend, buf: NcclCollectives(comm, backend.rt, nccl=nccl,
                                                              stream_ptr=lambda: 0))


def staged_collectives(comm):
    return lambda backend, buf: StagedCollectives(comm, backend.rt)


def thread_ranks(backend, ranks, zero, make_collectives=None, cuda_graphs=False, launches=None):
    """[(losses, params)] of each thread rank; make_collectives(comm): the collectives factory
    (None: the default, MPI on host buffers). launches: a dict to put each rank's CUDA graph
    launches per step in."""
    group, (x, y) = Group(ranks), batches(ranks)

    def rank_main(rank):
        comm = ThreadComm(group, rank)
        dist = MpiProcessGroup(comm, zero_stage=zero, timeout=0,
                               collectives=make_collectives(comm) if make_collectives else None)
        model = GPT2(TINY, BACKENDS[backend](), B_PER_RANK, T, seed=3)
        assert model.has_master_weights
        return train(model, x, y, dist, rows=slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK),
                     cuda_graphs=cuda_graphs,
                     launches=None if launches is None else launches.setdefault(rank, []))

    return group.run(rank_main)


def bits(params):
    return np.asarray(params).view(np.uint16)


def close_to_one_process(params, reference, lr, steps=4):
    """The parameters' bound of the module docstring (the key biases, whose gradient is round-off:
    within 2 ulps plus 2 x steps x lr; noise_params)."""
    ref = reference.astype(np.float32)
    # bf16's ulp at |w| (fp32's has 16 more bits)
    ulp = np.spacing(np.abs(ref)) * 2.0 ** 16
    diff = np.abs(params.astype(np.float32) - ref)
    noise = key_bias_mask(TINY)
    assert np.all(diff[noise] <= 2 * ulp[noise] + 2 * steps * lr)
    ref, ulp, diff = ref[~noise], ulp[~noise], diff[~noise]
    # the ranks' roundings do differ from one process's
    assert np.any(diff > 0)
    assert np.all(diff <= 2 * ulp + steps * lr), np.max(diff - 2 * ulp)
    assert np.mean(diff > 2 * ulp + 2.0 ** -12) < 1e-3, np.sum(diff > 2 * ulp + 2.0 ** -12)
    assert np.mean(diff > 0) < 0.3, np.mean(diff > 0)


def assert_trains_like_one_process(results, reference):
    """The bound of the module docstring; and every rank holds the same bf16
    parameters, bit for bit."""
    ref_losses, ref_params = reference
    ref = ref_params.astype(np.float32)
    for losses, params in results:
        assert params.dtype == BF16
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
        close_to_one_process(params, ref_params, LR)
    for _, params in results[1:]:
        np.testing.assert_array_equal(bits(params), bits(results[0][1]))
    assert np.abs(ref - GPT2(TINY, numpy_bf16(), 1, T,
                             seed=3).params_host().astype(np.float32)).max() > 1e-3


@pytest.fixture(scope="module")
def reference():
    return {(backend, ranks): single_process(backend, ranks) for backend in BACKENDS
            for ranks in (2, 3)}


# ---- (a) the numpy bf16 reference, MPI host collectives ------------------------------------------

@pytest.mark.parametrize("ranks, zero", [(2, 0), (2, 1), (3, 1)])
def test_host_collectives_bf16_train_like_one_process(reference, ranks, zero):
    results = thread_ranks("numpy", ranks, zero)
    assert_trains_like_one_process(results, reference["numpy", ranks])


# ---- (b) the CUDA backend's bf16 build on the emulator, fake NCCL --------------------------------

@pytest.mark.parametrize("ranks, zero", [(2, 0), (2, 1), (3, 1)])
def test_nccl_bf16_on_the_emulator_trains_like_one_process(reference, ranks, zero):
    nccl = FakeNccl()
    results = thread_ranks("emu", ranks, zero, nccl_collectives(nccl))
    assert_trains_like_one_process(results, reference["emu", ranks])
    # the gradients: ncclBfloat16 averaged by ncclAvg; the step's statistics: fp32 sums;
    # the gather: bf16 bytes
    grads = [(name, dtype, op) for _, name, dtype, op in nccl.types
             if name in ("allReduce", "reduceScatter") and dtype == nccl.NCCL_BFLOAT16]
    assert grads and all(op == nccl.NCCL_AVG for _, _, op in grads)
    stats = [(dtype, op) for _, name, dtype, op in nccl.types if dtype == nccl.NCCL_FLOAT32]
    assert stats and all(op == nccl.NCCL_SUM for _, op in stats)
    gathers = {dtype for _, name, dtype, _ in nccl.types if name in ("allGather", "broadcast")}
    assert gathers == ({nccl.NCCL_BFLOAT16} if zero else set())


@pytest.mark.parametrize("zero", [0, 1])
def test_nccl_bf16_steps_replay_as_cuda_graphs_bitwise_the_eager_steps(zero):
    """bf16 data parallel with CUDA graphs (three a step, the collectives between them): the master
    weights, stochastic rounding's per-step seed and the bf16 gradients' ncclAvg give the
    eager steps' bits."""
    eager = thread_ranks("emu", 2, zero, nccl_collectives(FakeNccl()))
    launches = {}
    graphed = thread_ranks("emu", 2, zero, nccl_collectives(FakeNccl()), cuda_graphs=True,
                           launches=launches)
    for (eager_losses, eager_params), (losses, params) in zip(eager, graphed):
        assert losses == eager_losses
        np.testing.assert_array_equal(bits(params), bits(eager_params))
    assert launches == {rank: [0] + [3] * (STEPS - 1) for rank in range(2)}


@pytest.mark.parametrize("zero", [0, 1])
def test_staged_collectives_bf16_equal_the_fake_nccl_bitwise(zero):
    """Ranks sharing a GPU average through host copies and MPI: the same fp32 sum rounded once as
    the fake NCCL's ncclAvg, so the same bits (real NCCL's bf16 ring sums would differ
    in the last bits)."""
    staged = thread_ranks("emu", 2, zero, staged_collectives)
    nccl = thread_ranks("emu", 2, zero, nccl_collectives(FakeNccl()))
    for (ls, ps), (ln, pn) in zip(staged, nccl):
        assert ls == ln
        np.testing.assert_array_equal(bits(ps), bits(pn))


def test_nccl_without_bf16_says_what_is_needed():
    class OldNccl(FakeNccl):
        def get_version(self):
            # NCCL 2.9.3: neither ncclBfloat16 nor ncclAvg
            return 2903
    group = Group(1)
    coll = NcclCollectives(ThreadComm(group, 0), EmuRuntime(), nccl=OldNccl(), stream_ptr=lambda: 0)
    with pytest.raises(DistError, match=r"bf16 across GPUs needs NCCL >= 2\.10"):
        coll.all_reduce_mean(np.zeros(4, BF16))


# ---- (c) stochastic rounding is the same whatever the shard split --------------------------------

def one_update(backend, ranks, zero, grads, make_collectives=None):
    """Params after 2 AdamW steps on `grads` (the same on every rank, so their average is exactly
    them): on `ranks` thread ranks with ZeRO `zero`, or in one process (ranks=None). No clipping:
    the norm, summed per shard under ZeRO-1, does not enter."""

    def run(dist):
        model = GPT2(TINY, BACKENDS[backend](), 1, T, seed=3)
        model.rounding_seed = 1234
        for step in (1, 2):
            model.backend.copy_(model.grads, model.backend.from_host(grads))
            if dist is not None:
                dist.average_grads(model)
            model.update(1e-3, eps=1e-8, weight_decay=0.1, step=step, grad_clip=0.0, grad_norm=0.0,
                         shard=dist.shard(N) if dist else None)
            if dist is not None:
                dist.gather_params(model)
        return model.params_host(), model.master_weights_host(dist.shard(N) if dist else None)

    if ranks is None:
        return [run(None)]
    group = Group(ranks)

    def rank_main(rank):
        comm = ThreadComm(group, rank)
        return run(MpiProcessGroup(comm, zero_stage=zero, timeout=0,
                                   collectives=make_collectives(comm) if make_collectives
                                   else None))

    return group.run(rank_main)


@pytest.mark.parametrize("backend, ranks", [("numpy", 2), ("numpy", 3), ("emu", 2), ("emu", 3)])
def test_stochastic_rounding_does_not_depend_on_the_shard_split(backend, ranks):
    grads = round_nearest(np.random.default_rng(1).standard_normal(N).astype(np.float32) * 0.01)
    [(params, master)] = one_update(backend, None, 0, grads)
    make = nccl_collectives(FakeNccl()) if backend == "emu" else None
    results = one_update(backend, ranks, 1, grads, make)
    for (lo, hi), (p, m) in zip(shard_bounds(N, ranks), results):
        # the masters are equal ...
        np.testing.assert_array_equal(m, master[lo:hi])
        # ... so are the parameters
        np.testing.assert_array_equal(bits(p), bits(params))
    # and the rounding is stochastic: not every parameter is its master rounded to nearest
    assert np.mean(bits(params) != bits(round_nearest(master))) > 0.05


# ---- (d) the host collectives round once ---------------------------------------------------------

def run_collective(ranks, make, values, call):
    """call(collectives, buf) on each thread rank with buf = a copy of values[rank];
    the bufs afterwards."""
    group = Group(ranks)

    def rank_main(rank):
        coll, buf = make(ThreadComm(group, rank)), values[rank].copy()
        call(coll, buf)
        return buf

    return group.run(rank_main)


def bf16_values(ranks, n=4099):
    rng = np.random.default_rng(11)
    scale = np.exp(rng.uniform(-20, 20, n)).astype(np.float32)        # magnitudes over 17 octaves
    return [round_nearest(rng.standard_normal(n).astype(np.float32) * scale) for _ in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_host_bf16_mean_is_the_fp32_mean_rounded_once(ranks):
    values = bf16_values(ranks)
    fp32 = np.stack([v.astype(np.float32) for v in values])
    total = fp32[0].copy()
    for v in fp32[1:]:
        # rank order, as the fake MPI sums
        total += v
    mean = round_nearest(total / np.float32(ranks))
    for buf in run_collective(ranks, HostCollectives, values, lambda c, b: c.all_reduce_mean(b)):
        assert buf.dtype == BF16
        np.testing.assert_array_equal(bits(buf), bits(mean))
    for buf in run_collective(ranks, HostCollectives, values, lambda c, b: c.all_reduce_sum(b)):
        np.testing.assert_array_equal(bits(buf), bits(round_nearest(total)))
    bounds = shard_bounds(values[0].size, ranks)
    scattered = run_collective(ranks, HostCollectives, values,
                               lambda c, b: c.reduce_scatter_mean(b, bounds))
    for (lo, hi), buf in zip(bounds, scattered):
        np.testing.assert_array_equal(bits(buf[lo:hi]), bits(mean[lo:hi]))
    # rounding each partial sum to bf16 (as a bf16 reduction would) gives other
    # bits: the test can tell
    chained = values[0].astype(np.float32)
    for v in values[1:]:
        chained = round_nearest(chained + v.astype(np.float32)).astype(np.float32)
    # (with 2 ranks they agree: halving is exact, so rounding the sum rounds the mean)
    assert np.any(bits(round_nearest(chained / np.float32(ranks))) != bits(mean)) == (ranks > 2)


@pytest.mark.parametrize("ranks", [2, 3])
def test_bf16_all_gather_moves_the_bits(ranks):
    n = 4099
    bounds = shard_bounds(n, ranks)
    full = round_nearest(np.random.default_rng(2).standard_normal(n).astype(np.float32))
    # a NaN payload, -inf, -0, a subnormal
    full.view(np.uint16)[:4] = [0x7FC1, 0xFF80, 0x8000, 0x0001]
    values = []
    for lo, hi in bounds:
        mine = np.full(n, np.nan, BF16)
        mine[lo:hi] = full[lo:hi]
        values.append(mine)
    for buf in run_collective(ranks, HostCollectives, values, lambda c, b: c.all_gather(b, bounds)):
        np.testing.assert_array_equal(bits(buf), bits(full))
    nccl, rt = FakeNccl(), EmuRuntime(guard="off")

    def make(comm):
        return NcclCollectives(comm, rt, nccl=nccl, stream_ptr=lambda: 0)

    for buf in run_collective(ranks, make, values, lambda c, b: c.all_gather(b, bounds)):
        np.testing.assert_array_equal(bits(buf), bits(full))
    assert {dtype for _, _, dtype, _ in nccl.types} == {nccl.NCCL_BFLOAT16}


# ---- (e) train.py under mpiexec: bf16, 2 ranks, ZeRO-1, checkpoints and resume -------------------

RUN_TIMEOUT = 90
GLOBAL_B, TT, TRAIN_STEPS = 4, 16, 4


def train_argv(folder, out, ranks, *extra):
    return [sys.executable, str(REPO / "train.py"), "-e", folder / "tiny.bin", "-i",
            folder / "train.bin", "-j", folder / "val.bin", "-b", GLOBAL_B // ranks, "-t", TT, "-x",
            TRAIN_STEPS, "-v", TRAIN_STEPS, "-m", 2, "-s", 0, "-l", 3e-3, "-u", 2, "-q", 0.1, "-c",
            0.1, "--device", "cpu", "--precision", "bf16",
            "--shuffle", 0,          # file order: llm.c's shuffle gives each rank its own order
            "-n", 2, "-o", out, *extra]


def launch(mpiexec, ranks, argv):
    cmd = [str(a) for a in argv]
    if ranks is not None:
        cmd = [mpiexec, "-n", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=clean_env())
    return proc.returncode, proc.stdout, proc.stderr


def step_losses(text):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+)", text)]


def test_train_py_bf16_under_mpiexec(mpiexec, tmp_path):
    model = GPT2(TINY, numpy_bf16(), 1, TT, seed=5)
    save_model(tmp_path / "tiny.bin", TINY, model.params_host(), dtype="bf16")
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "train.bin", rng.integers(0, TINY.vocab_size, 6000))
    write_shard(tmp_path / "val.bin", rng.integers(0, TINY.vocab_size, 1000))
    one, two = tmp_path / "one", tmp_path / "two"
    code, out1, err = launch(mpiexec, None, train_argv(tmp_path, one, 1))
    assert code == 0, err
    code, out2, err = launch(mpiexec, 2, train_argv(tmp_path, two, 2, "-z", 1))
    assert code == 0, err
    assert "precision" in out2 and "bf16" in out2 and "num_processes=2" in out2
    assert len(step_losses(out2)) == TRAIN_STEPS
    np.testing.assert_allclose(step_losses(out2), step_losses(out1), rtol=1e-3)
    # rank 0 wrote the bf16 (v5) model file; each rank its state with its shard of
    # the fp32 master weights
    cfg, params = load_model(model_path(two, TRAIN_STEPS), keep_bf16=True)
    assert cfg == TINY and params.dtype == BF16
    # 4 steps at lr 3e-3 move near-zero-gradient parameters apart by up to a few lr (Adam's m /
    # sqrt(v) there): the bound is on the whole: the 2-rank parameters' distance from the 1-process
    # ones is under 5% of how far training moved them (measured 3.0%; an fp32 run is 5.2% away from
    # the 1-process bf16 one)
    _, ref = load_model(model_path(one, TRAIN_STEPS), keep_bf16=True)
    ref, init = ref.astype(np.float32), model.params_host().astype(np.float32)
    assert np.linalg.norm(params.astype(np.float32) - ref) < 0.05 * np.linalg.norm(ref - init)
    masters = []
    for rank, (lo, hi) in enumerate(shard_bounds(N, 2)):
        info, m, v, master = load_state(state_path(two, TRAIN_STEPS, rank), with_master=True)
        assert info["rank"] == rank and tuple(info["shard"]) == (lo, hi)
        assert m.size == v.size == master.size == hi - lo and master.dtype == np.float32
        masters.append(master)
    # the bf16 parameters are the masters stochastically rounded: within one bf16 ulp of them
    master = np.concatenate(masters)
    assert np.all(np.abs(params.astype(np.float32) - master)
                  <= np.spacing(np.abs(master)) * 2.0 ** 16)
    # resume from step 2 on 2 ranks: the same bytes at step 4
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for name in ("model_00000002.bin", "state_00000002_00000.bin", "state_00000002_00001.bin",
                 "DONE_00000002"):
        (resumed / name).write_bytes((two / name).read_bytes())
    code, out, err = launch(mpiexec, 2, train_argv(tmp_path, resumed, 2, "-z", 1, "-y", 1))
    assert code == 0, err
    assert "resuming from step 2" in out and len(step_losses(out)) == TRAIN_STEPS - 2
    assert read(model_path(resumed, TRAIN_STEPS)) == read(model_path(two, TRAIN_STEPS))
    for rank in (0, 1):
        assert (read(state_path(resumed, TRAIN_STEPS, rank))
                == read(state_path(two, TRAIN_STEPS, rank)))


def read(path):
    with open(path, "rb") as f:
        return f.read()
