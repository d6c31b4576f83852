"""-r 0|1|2 (llm.c's recompute): fewer activations kept, the same training bit for bit.

-r 1 keeps one GELU output (B,T,4C) for all layers and the backward recomputes each layer's from its
kept fch; -r 2 also keeps no ln1/ln2 (the LayerNorms write into lnf, as llm.c's do) and the backward
recomputes them from the kept residual, rewriting the saved mean and rstd with the same values. The
recomputed values are the kept ones bitwise, so losses, gradients and the AdamW state after a few
steps are bitwise those of -r 0: on the NumPy backend (fp32 and bf16, fused or not) and on the
emulated CUDA path wherever the forward's GELU comes from the gelu_forward kernel (--fuse 0, or
--fuse 1 with -ge 0). With the GELU in the fc GEMM's epilogue (-ge 1, 2: the --fuse 1 default) the
backward recomputes it with the kernel, whose rounding differs from the epilogue's (as in llm.c): -r
1 and -r 2 are then bitwise each other and within float rounding of -r 0.
"""
import numpy as np
import pytest
from test_emulator import needs_gpp
from test_train import base_args, losses, run, tiny_model, tiny_shards  # noqa: F401  (fixtures)

from gpt2np.backends import get_backend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.profiling import plan as P
from gpt2np.profiling.memory import memory_summary
from gpt2np.tensors import activation_shapes, layout_size
from gpt2np.train_step import train_step

CFG = GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                 channels=128)
B, T = 2, 16                      # head size 64: the flash kernels run
STEPS = 2
LN_STATS = ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "lnf_mean", "lnf_rstd")


def batches():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size,
                                               (STEPS, B, T + 1)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(backend, recompute, **options):
    """STEPS training steps from the same init: (losses, params, grads, (m, v)) as host arrays."""
    model = GPT2(CFG, backend, B, T, seed=0, recompute=recompute, **options)
    data = batches()
    got = [float(train_step(model, lambda i=i: data[i], step=i, lr=1e-3).loss)
           for i in range(STEPS)]
    return (got, model.params_host(), model.backend.to_host(model.grads),
            model.optimizer_state_host())


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def assert_bitwise(a, b):
    assert a[0] == b[0]                                           # losses, as floats
    for x, y in zip(a[1:3], b[1:3]):
        np.testing.assert_array_equal(bits(x), bits(y))
    for x, y in zip(a[3], b[3]):
        np.testing.assert_array_equal(bits(x), bits(y))


# ---- memory: exactly the dropped tensors ---------------------------------------------------------

@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_activations_drop_by_exactly_the_dropped_tensors(attention):
    L, C = CFG.num_layers, CFG.channels
    shapes = {r: activation_shapes(CFG, B, T, attention, r) for r in (0, 1, 2)}
    # llm.c's names, in its order
    assert list(shapes[0]) == list(shapes[1]) == list(shapes[2])
    assert (shapes[1]["fch_gelu"] == (B, T, 4 * C)
            and shapes[2]["ln1"] == shapes[2]["ln2"] == (0, B, T, C))
    assert layout_size(shapes[0]) - layout_size(shapes[1]) == (L - 1) * B * T * 4 * C
    assert layout_size(shapes[1]) - layout_size(shapes[2]) == 2 * L * B * T * C
    for precision in ("fp32", "bf16"):
        be = get_backend("numpy", precision)
        for r in (0, 1, 2):
            model = GPT2(CFG, be, B, T, attention=attention, recompute=r)
            fp32 = 0 if model.acts_fp32 is None else model.acts_fp32.nbytes
            summary = memory_summary(model, peak={})
            total = next(b["bytes"] for b in summary["buffers"] if b["buffer"] == "activations")
            assert total == model.acts.nbytes + fp32 == sum(a["bytes"]
                                                            for a in summary["activations"])
    with pytest.raises(ValueError, match="recompute 3"):
        activation_shapes(CFG, B, T, recompute=3)
    with pytest.raises(ValueError, match="recompute 3"):
        GPT2(CFG, get_backend("numpy"), B, T, recompute=3)


@needs_gpp
@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_memory_needed_is_what_the_model_allocates(recompute):
    """The up-front check (CudaBackend.memory_needed) counts the activations the model
    allocates at each -r."""
    be = get_backend("emu")
    need = be.memory_needed(CFG, B, T, attention="flash", recompute=recompute)
    model = GPT2(CFG, be, B, T, attention="flash", recompute=recompute)
    assert need["activations"] == model.acts.nbytes + 4 * 2 * B * T      # + the two token buffers


# ---- the same training, bit for bit --------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fuse", [False, True])
def test_numpy_training_is_bitwise_the_same_at_every_recompute(precision, fuse):
    be = get_backend("numpy", precision)
    runs = [train(be, r, fuse=fuse) for r in (0, 1, 2)]
    assert_bitwise(runs[1], runs[0])
    assert_bitwise(runs[2], runs[0])


@needs_gpp
@pytest.mark.parametrize("precision,attention,fuse",
                         [("fp32", "naive", False), ("fp32", "flash", True),
                          ("bf16", "flash", True), ("bf16", "naive", False)])
def test_emulated_training_is_bitwise_the_same_at_every_recompute(precision, attention, fuse):
    """The CUDA path with the GELU from the gelu_forward kernel (--fuse 0, or --fuse
    1 -ge 0): bitwise."""
    be = get_backend("emu", precision)
    runs = [train(be, r, attention=attention, fuse=fuse, gelu_fusion=0) for r in (0, 1, 2)]
    assert_bitwise(runs[1], runs[0])
    assert_bitwise(runs[2], runs[0])


@needs_gpp
def test_gelu_epilogue_with_recompute_differs_only_by_rounding():
    """--fuse 1 -ge 2 (the GPU default): the forward's GELU comes from the GEMM epilogue, the
    backward's recomputed one from the kernel. -r 1 and -r 2 train bitwise alike (the LayerNorm
    recompute is exact); -r 0's loss is the same (the forward does not change) and its gradients
    differ by float rounding (the fused-ops tolerance of test_cuda_model)."""
    be = get_backend("emu")
    r1, r2 = (train(be, r, attention="flash", fuse=True, gelu_fusion=2) for r in (1, 2))
    assert_bitwise(r2, r1)
    grads = {}
    for r in (0, 1):
        model = GPT2(CFG, be, B, T, seed=0, attention="flash", fuse=True, gelu_fusion=2,
                     recompute=r)
        x, y = batches()[0]
        model.zero_grad()
        loss = model.forward(x, y, for_backward=True)
        model.backward()
        grads[r] = (loss, model.grads_host())
    assert grads[1][0] == grads[0][0]
    for name, g0 in grads[0][1].items():
        scale = max(1e-3, float(np.abs(g0).max()))
        err = float(np.abs(grads[1][1][name] - g0).max()) / scale
        assert err < 2e-5, f"{name}: max error {err:.2e} relative to max |grad| {scale:.2e}"


@needs_gpp
@pytest.mark.parametrize("backend,fuse", [("numpy", False), ("emu", True)])
def test_recompute_rewrites_the_layernorm_statistics_with_the_same_values(backend, fuse):
    """-r 2 reruns layernorm_forward in backward, which rewrites the saved mean and rstd: with the
    same bits (the fused residual + LayerNorm kernel's statistics are layernorm_forward's)."""
    model = GPT2(CFG, get_backend(backend), B, T, seed=0, fuse=fuse, recompute=2)
    x, y = batches()[0]
    model.zero_grad()
    model.forward(x, y, for_backward=True)
    before = {name: model.backend.to_host(model.act[name]).copy() for name in LN_STATS}
    model.backward()
    for name in LN_STATS:
        np.testing.assert_array_equal(bits(model.backend.to_host(model.act[name])),
                                      bits(before[name]), name)


# ---- the recompute launches: backward ops, named as llm.c's profile shows them -------------------

def test_recompute_launches_are_backward_ops_of_their_layer():
    plans = {r: P.plan_step(CFG, B, T, "H100", "tf32", recompute=r) for r in (0, 1, 2)}
    L = CFG.num_layers

    def backward(plan):
        return [x.record for x in plan.kernels if x.record.direction == "bprop"]

    def recomputes(plan):
        return [(r.layer_index, r.op, r.module, r.kernel) for r in backward(plan)
                if r.op in ("gelu_forward", "layernorm_forward")]
    assert recomputes(plans[0]) == []
    assert recomputes(plans[1]) == [(l, "gelu_forward", f"h.{l}.mlp.gelu", "gelu_forward")
                                    for l in reversed(range(L))]
    want = []
    for l in reversed(range(L)):
        want += [(l, "gelu_forward", f"h.{l}.mlp.gelu", "gelu_forward"),
                 (l, "layernorm_forward", f"h.{l}.ln_2", "layernorm_forward"),
                 (l, "layernorm_forward", f"h.{l}.ln_1", "layernorm_forward")]
    assert recomputes(plans[2]) == want
    assert len(plans[2].kernels) == len(plans[0].kernels) + 3 * L
    assert plans[0].memory_bytes > plans[1].memory_bytes > plans[2].memory_bytes


# ---- train.py -r ---------------------------------------------------------------------------------

def test_train_py_r2_trains_the_same_run_as_r0(tiny_model, tiny_shards, capsys):  # noqa: F811
    args = base_args(tiny_model, tiny_shards) + ["-x", 3, "-v", 0]
    outs = {}
    for r in (0, 2):
        code, out, err = run(args + ["-r", r], capsys)
        assert code == 0, err
        outs[r] = out
    assert "| recompute " in outs[2] and any(line.startswith("| recompute ") and "| 2 " in line
                                             for line in outs[2].splitlines())
    assert len(losses(outs[2])) == 3 and losses(outs[2]) == losses(outs[0])


@needs_gpp
def test_train_py_r2_on_the_emulator(tiny_model, tiny_shards, capsys):  # noqa: F811
    args = [a if a != "cpu" else "emu" for a in base_args(tiny_model, tiny_shards)]
    args[args.index("-b") + 1], args[args.index("-t") + 1] = 1, 8
    code, out, err = run(args + ["-x", 2, "-v", 0, "-r", 2, "-ge", 0], capsys)
    assert code == 0, err
    code, ref, err = run(args + ["-x", 2, "-v", 0, "-r", 0, "-ge", 0], capsys)
    assert code == 0, err
    assert len(losses(out)) == 2 and losses(out) == losses(ref)
