"""The whole model in bf16 on the emulated CUDA path (the kernels' bf16 build, bf16 GEMMs, flash
attention on bf16 WMMA, device AdamW with master weights and stochastic rounding, CUDA graphs)
against the NumPy bf16 reference and against fp32.

Both bf16 paths follow llm.c's scheme but round at slightly different points (the CUDA GEMMs round
their outputs before a separate bias kernel where a step is unfused, the flash kernels feed bf16
probabilities to P @ V, the naive kernels store bf16 scores), so they are not bitwise equal. What is
asserted: each one's error against fp32 (the same model and weights, computed in fp32 NumPy) is of
the same size, the emulated path's at most 2x the reference's on every gradient (measured:
0.93-1.10x with flash and fusion, 1.01-1.35x naive and unfused; at most 0.7% relative L2) and on the
loss; and the emulated path is deterministic (bitwise the same under the reverse thread schedule and
another WMMA fragment layout), and a replayed CUDA graph step is bitwise the eager one."""
import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.bf16 import BF16
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.tensors import PARAM_NAMES
from gpt2np.train_step import AdamW, train_step

CFG = GPT2Config(max_seq_len=48, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                 channels=128)
# head size 64 (the flash kernels'), two query tiles, the second partial
B, T = 2, 40


def batch(seed=3):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def weights():
    """fp32 weights that are bf16-representable, so every path starts from the same values."""
    params = GPT2(CFG, get_backend("numpy"), B, T, seed=0).params_host()
    return params.astype(BF16).astype(np.float32)


def loss_and_grads(backend, attention, fuse=True):
    model = GPT2(CFG, backend, B, T, attention=attention, fuse=fuse)
    model.load_params(weights())
    x, y = batch()
    model.zero_grad()
    loss = model.forward(x, y, for_backward=True)
    model.backward()
    return float(loss), {name: np.asarray(g, np.float32) for name, g in model.grads_host().items()}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def fp32():
    return loss_and_grads(get_backend("numpy"), "naive")


@pytest.mark.parametrize("attention,fuse", [("flash", True), ("naive", False)])
def test_emulated_bf16_model_errs_like_the_reference(fp32, attention, fuse):
    ref_loss, ref = fp32
    emu_loss, emu = loss_and_grads(get_backend("emu", "bf16"), attention, fuse)
    np_loss, npb = loss_and_grads(get_backend("numpy", "bf16"), attention, fuse)
    assert abs(emu_loss - ref_loss) <= max(2 * abs(np_loss - ref_loss), 2e-3), (emu_loss, np_loss,
                                                                                ref_loss)
    for name in PARAM_NAMES:
        assert emu[name].dtype == np.float32 and np.isfinite(emu[name]).all()
        ours, reference = rel(emu[name], ref[name]), rel(npb[name], ref[name])
        assert ours <= 2 * reference + 1e-3, (name, ours, reference)
        assert ours < 0.05, (name, ours)


def test_emulated_bf16_model_is_bitwise_deterministic():
    runs = [loss_and_grads(get_backend("emu", "bf16", **options), "flash")
            for options in ({}, {"schedule": "reverse", "wmma_layout": 0xB16})]
    (loss, grads), (other_loss, other_grads) = runs
    assert other_loss == loss
    for name in PARAM_NAMES:
        np.testing.assert_array_equal(other_grads[name], grads[name])


def test_bf16_training_steps_replay_bitwise_as_cuda_graphs():
    """Three AdamW steps (changing lr, so the device step scalars and t change) eager and as a
    replayed graph: the bf16 parameters, the fp32 master weights and the moments
    bitwise the same."""
    def run(graphs):
        model = GPT2(CFG, get_backend("emu", "bf16"), B, T, attention="flash")
        model.load_params(weights())
        model.rounding_seed = 7
        for step in range(3):
            train_step(model, lambda s=step: batch(10 + s), step=step, lr=1e-3 * (step + 1),
                       cuda_graphs=graphs, adamw=AdamW(weight_decay=0.1, grad_clip=0.5)).resolve()
        be = model.backend
        # the replayed steps did run as a graph
        assert (be.rt.graph_launches >= 1) == graphs
        return [be.to_host(x) for x in (model.params, model.master, model.m, model.v)]

    eager, replayed = run(False), run(True)
    assert eager[0].dtype == BF16 and eager[1].dtype == np.float32
    for a, b in zip(eager, replayed):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_profiled_bf16_step_names_the_bf16_gemms():
    """Under the profiler a bf16 step's GEMMs are cuBLAS's mixed-precision calls (cublasGemmEx, and
    cublasGemmStridedBatchedEx for the naive attention's per-head GEMMs), its kernels carry
    bf16 byte counts."""
    from gpt2np.profiling.profiler import Profiler
    be = get_backend("emu", "bf16")
    model = GPT2(CFG, be, B, T, attention="naive", fuse=False)
    model.load_params(weights())
    with Profiler(be) as prof:
        train_step(model, batch, step=0, lr=1e-3).resolve()
    gemms = [r for r in prof.records if r.is_gemm]
    assert gemms and all(r.kernel.startswith("cublasGemmEx (") for r in gemms)
    api = {a.name for a in prof.api}
    assert {"cublasGemmEx", "cublasGemmStridedBatchedEx"} <= api and "cublasSgemm_v2" not in api
    residual = next(r for r in prof.records if r.kernel == "residual_forward")
    # two bf16 reads and a bf16 write per element
    assert residual.bytes == 2 * 3 * B * T * CFG.channels
