"""Data parallelism on GPUs: NCCL collectives and train.py under mpiexec with --device
cuda (run with -m gpu).

One GPU is enough: a single rank under mpiexec still goes through NCCL (communicator set up from a
unique id broadcast over MPI, all-reduce, reduce-scatter, all-gather) and must train exactly like a
plain process. With two or more GPUs, 2 ranks x B must also equal 1 rank x 2B, as on
the CPU (test_dist.py).
"""
import sys

import numpy as np
import pytest
from test_dist import (  # noqa: F401 (fixtures)
    COLLECTIVES_CHECK,
    GLOBAL_B,
    STEPS,
    files,
    launch,
    mpiexec,
    step_losses,
    train_argv,
)

from gpt2np.backends import cuda_problem, gpu_available
from gpt2np.formats.checkpoint import load_model, load_state, model_path, state_path

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus():
    if not gpu_available():
        pytest.skip(f"needs a usable CUDA GPU: {cuda_problem()}")
    import cupy
    from cupy.cuda import nccl
    if not nccl.available:
        pytest.skip("NCCL not available to CuPy (pip install nvidia-nccl-cu13)")
    return cupy.cuda.runtime.getDeviceCount()


def cuda_argv(files, out, ranks, *extra):
    argv = [str(a) for a in train_argv(files, out, ranks, *extra)]
    argv[argv.index("cpu")] = "cuda"
    return argv


@pytest.fixture(scope="module")
def single(gpus, mpiexec, files):
    """The reference: one plain process (no MPI) on the GPU."""
    out = files / "cuda_single"
    code, stdout, stderr, _ = launch(mpiexec, None, cuda_argv(files, out, 1))
    assert code == 0, stderr
    return out, stdout


def test_nccl_collectives(gpus, mpiexec):
    ranks = min(gpus, 2)
    code, out, err, _ = launch(mpiexec, ranks, [sys.executable, "-c", COLLECTIVES_CHECK, "cuda"])
    assert code == 0, out + err
    assert out.count("collectives ok") == ranks


@pytest.mark.parametrize("zero", [0, 1])
def test_one_rank_through_nccl_trains_like_a_plain_process(gpus, mpiexec, files, single, zero):
    ref_out, ref_text = single
    out = files / f"cuda_mpi1_z{zero}"
    code, text, err, _ = launch(mpiexec, 1, cuda_argv(files, out, 1, "-z", zero))
    assert code == 0, err
    np.testing.assert_allclose(step_losses(text), step_losses(ref_text), rtol=1e-6)
    np.testing.assert_allclose(load_model(model_path(out, STEPS))[1],
                               load_model(model_path(ref_out, STEPS))[1], rtol=0, atol=1e-6)
    info, m, _ = load_state(state_path(out, STEPS, 0))
    assert info["zero_stage"] == zero and info["world_size"] == 1
    # one rank's shard is everything
    assert m.size == load_model(model_path(out, STEPS))[1].size


@pytest.mark.parametrize("zero", [0, 1])
def test_two_gpus_equal_one_gpu_with_twice_the_batch(gpus, mpiexec, files, single, zero):
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    ref_out, ref_text = single
    out = files / f"cuda_mpi2_z{zero}"
    code, text, err, _ = launch(mpiexec, 2, cuda_argv(files, out, 2, "-z", zero))
    assert code == 0, err
    assert f"{GLOBAL_B // 2} x 16 x 2 processes" in text
    np.testing.assert_allclose(step_losses(text), step_losses(ref_text), rtol=1e-5)
    np.testing.assert_allclose(load_model(model_path(out, STEPS))[1],
                               load_model(model_path(ref_out, STEPS))[1], rtol=0, atol=5e-5)
