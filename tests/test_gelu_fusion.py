"""-ge 0|1|2 (llm.c's gelu_fusion, with --fuse 1): where the GELU is computed.

0: the fc GEMM (bias epilogue) then gelu_forward, and in backward c_proj's GEMMs then gelu_backward;
1: the fc GEMM's epilogue adds the bias and applies the GELU (matmul_gelu_forward), the backward as
0; 2: also c_proj's dinp GEMM applies gelu' in its epilogue (gelu_matmul_backward). --fuse 0 has no
epilogues: -ge must be 0 there.
"""
import numpy as np
import pytest
from test_emulator import needs_gpp
from test_recompute import CFG, B, T, assert_bitwise, batches, train
from test_train import base_args, run, tiny_model, tiny_shards  # noqa: F401  (fixtures)

from gpt2np.backends import device_traits, get_backend
from gpt2np.cli.profile import main as profiler_main
from gpt2np.config import TrainConfig
from gpt2np.errors import BadInput
from gpt2np.model import GPT2
from gpt2np.profiling import plan as P


def test_gelu_fusion_defaults_to_2_with_fuse_and_needs_fuse():
    be = get_backend("numpy")
    assert GPT2(CFG, be, B, T, fuse=True).gelu_fusion == 2 and GPT2(CFG, be, B, T).gelu_fusion == 0
    for ge in (1, 2):
        with pytest.raises(ValueError, match="0 without fuse"):
            GPT2(CFG, be, B, T, fuse=False, gelu_fusion=ge)
    with pytest.raises(BadInput, match=r"^-ge 2 with --fuse 0: "):
        TrainConfig(gelu_fusion=2, fuse=0).validate()
    # --fuse not known yet: checked on the device's defaults
    TrainConfig(gelu_fusion=2).validate()
    with pytest.raises(BadInput, match=r"^-ge 1 with --fuse 0: "):
        TrainConfig(gelu_fusion=1).with_device_defaults(device_traits("numpy")).validate()
    assert (TrainConfig(gelu_fusion=1).with_device_defaults(device_traits("emu")).validate().fuse
            == 1)


def test_train_py_ge_without_fuse_is_one_error_line(tiny_model, tiny_shards, capsys):  # noqa: F811
    code, out, err = (run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-ge", 2, "--fuse", 0],
                          capsys))
    assert (code == 2 and err.count("\n") == 1
            and err.startswith("error: -ge 2 with --fuse 0: ")), err
    # the CPU: --fuse 0
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-ge", 1], capsys)
    assert (code != 0 and err.count("\n") == 1
            and err.startswith("error: -ge 1 with --fuse 0: ")), err
    assert profiler_main(["--plan", "-e", "d12", "-ge", "2", "--fuse", "0", "-t", "64"]) == 2
    assert "error: -ge 2 with --fuse 0" in capsys.readouterr().err


def test_numpy_gelu_fusion_is_bitwise_the_unfused_sequence():
    """On the NumPy backend the fused ops compose the same ops: every -ge trains the same bits."""
    be = get_backend("numpy")
    runs = [train(be, 0, fuse=True, gelu_fusion=ge) for ge in (0, 1, 2)]
    assert_bitwise(runs[1], runs[0])
    assert_bitwise(runs[2], runs[0])


def kernels(plan, direction):
    return [(x.record.op, x.record.kernel.split(" (")[-1].rstrip(")")) for x in plan.kernels
            if x.record.direction == direction]


def test_the_launch_list_follows_gelu_fusion():
    """The planned step (the launches the CUDA backend makes) at -ge 0, 1, 2, with -r 0."""
    L = CFG.num_layers
    plans = {ge: P.plan_step(CFG, B, T, "H100", "tf32", recompute=0, gelu_fusion=ge)
             for ge in (0, 1, 2)}
    assert [p.gelu_fusion for p in plans.values()] == [0, 1, 2]
    fwd = {ge: kernels(p, "fprop") for ge, p in plans.items()}
    bwd = {ge: kernels(p, "bprop") for ge, p in plans.items()}
    assert (fwd[0].count(("gelu_forward", "gelu_forward")) == L
            and ("matmul_gelu_forward", "gemm_matmul_gelu_forward") not in fwd[0])
    assert (fwd[1] == fwd[2]
            and fwd[1].count(("matmul_gelu_forward", "gemm_matmul_gelu_forward")) == L)
    assert not any(op == "gelu_forward" for op, _ in fwd[1])
    assert bwd[0] == bwd[1] and bwd[0].count(("gelu_backward", "gelu_backward")) == L
    assert not any(op == "gelu_matmul_backward" for op, _ in bwd[0])
    assert not any(op == "gelu_backward" for op, _ in bwd[2])
    # its dinp and dweight GEMMs
    assert sum(op == "gelu_matmul_backward" for op, _ in bwd[2]) == 2 * L
    launches = [len(p.kernels) for p in plans.values()]
    assert launches[0] == launches[1] + L == launches[2] + 2 * L
    assert plans[0].flops == plans[1].flops == plans[2].flops
    assert plans[0].bytes > plans[1].bytes > plans[2].bytes


@needs_gpp
def test_emulated_gelu_fusion_trains_alike():
    """The emulated CUDA path at -ge 0, 1, 2 (flash attention, --fuse 1, -r 0): the epilogues' GELU
    and gelu' round otherwise than the kernels', so the losses agree within fp32 rounding
    (test_cuda_model's fused-ops tolerance), and the launch list of a real emulated step
    is the planned one."""
    be = get_backend("emu")
    runs = {ge: train(be, 0, attention="flash", fuse=True, gelu_fusion=ge) for ge in (0, 1, 2)}
    for ge in (1, 2):
        np.testing.assert_allclose(runs[ge][0], runs[0][0], rtol=1e-6)
        assert np.linalg.norm(runs[ge][2] - runs[0][2]) <= 1e-4 * np.linalg.norm(runs[0][2])
    model = GPT2(CFG, be, B, T, seed=0, attention="flash", fuse=True, gelu_fusion=1)
    prof, _ = P.profiled_step(model, batches())
    plan = P.plan_step(CFG, B, T, "H100", "tf32", attention="flash", recompute=0, gelu_fusion=1)
    assert [(r.op, r.kernel) for r in prof.records] == [(x.record.op, x.record.kernel)
                                                        for x in plan.launches]
