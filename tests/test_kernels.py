"""Each CUDA kernel (CudaBackend on the CPU emulator) against the NumPy backend's op on
small random shapes.

Both emulator schedules run (threads/blocks first-to-last and last-to-first), which exposes kernels
that read another thread's write without a barrier, each with both guard-page modes (every device
buffer ends at a PROT_NONE page, or starts right after one), which exposes out-of-bounds accesses.
Shapes are odd on purpose: T not a power of 2 (and above 32, so softmax rows span several lanes), V
not a multiple of 32, C=48. The launch tuning is shrunk (few threads, many blocks, many reduction
chunks) so that every grid/chunk loop runs more than once on these tiny shapes. test_gpu.py reruns
these tests on CuPy by overriding the `cuda` fixture.
"""
import zlib

import numpy as np
import pytest

from gpt2np.backends.cuda.backend import CudaBackend, KernelArgumentError
from gpt2np.backends.numpy.backend import NumpyBackend

# (B, T, C, NH, V, Vp, maxT)
SHAPES = {
    "odd": (2, 5, 48, 3, 37, 64, 7),
    "long": (1, 35, 8, 2, 70, 128, 40),
}

REF = NumpyBackend(threads=1)


def small_launches(be):
    """Tiny blocks and chunks so the emulator exercises multi-block / multi-chunk paths quickly."""
    be.elementwise_threads = 64
    be.row_warps = 2
    be.classifier_threads = 64
    be.reduce_warps = 2
    be.reduce_rows_per_chunk = 3
    be.norm_threads = 64
    be.norm_max_blocks = 3
    be.encoder_token_blocks = 2
    be.layernorm_rows_per_block = 3
    return be


@pytest.fixture(scope="module", params=[(schedule, guard) for guard in ("after", "before")
                                        for schedule in ("forward", "reverse")],
                ids=lambda p: "-".join(p))
def cuda(request):
    """Every kernel under both schedules and both guard-page modes (each device buffer's last byte
    touches a PROT_NONE page, or its first byte follows one), so an overrun or underrun faults with
    the buffer's name."""
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    schedule, guard = request.param
    return small_launches(CudaBackend(EmuRuntime(schedule=schedule, guard=guard)))


@pytest.fixture(params=sorted(SHAPES))
def shape(request):
    return SHAPES[request.param]


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def dev(be, a):
    return be.from_host(a)


def host(be, a):
    return be.to_host(a)


def close(actual, expected, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# ---- encoder ---------------------------------------------------------------------------------
def test_encoder(cuda, shape):
    B, T, C, NH, V, Vp, maxT = shape
    rng = rng_for("encoder", shape)
    wte, wpe = randn(rng, Vp, C), randn(rng, maxT, C)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp[0, :3] = 5                                          # repeated tokens: grouped rows
    out_ref = np.zeros((B, T, C), np.float32)
    REF.encoder_forward(out_ref, inp, wte, wpe)
    out = cuda.zeros((B, T, C))
    cuda.encoder_forward(out, dev(cuda, inp), dev(cuda, wte), dev(cuda, wpe))
    close(host(cuda, out), out_ref, rtol=0, atol=0)

    dout = randn(rng, B, T, C)
    dwte0, dwpe0 = randn(rng, Vp, C), randn(rng, maxT, C)  # accumulate onto existing grads
    dwte_ref, dwpe_ref = dwte0.copy(), dwpe0.copy()
    REF.encoder_backward(dwte_ref, dwpe_ref, dout, inp)
    dwte, dwpe = dev(cuda, dwte0), dev(cuda, dwpe0)
    cuda.encoder_backward(dwte, dwpe, dev(cuda, dout), dev(cuda, inp))
    close(host(cuda, dwte), dwte_ref)
    close(host(cuda, dwpe), dwpe_ref)

    # accumulate=False: dwpe's old contents are garbage (NaN) and must be ignored, rows T.. become
    # 0; dwte still accumulates (the tied lm_head wrote it first). Reference: the
    # "+=" result from zeros.
    dwte_ref, dwpe_ref = dwte0.copy(), np.zeros((maxT, C), np.float32)
    REF.encoder_backward(dwte_ref, dwpe_ref, dout, inp)
    close(dwpe_ref[:T], dout.sum(axis=0), atol=1e-5)
    dwte, dwpe = dev(cuda, dwte0), cuda.from_host(np.full((maxT, C), np.nan, np.float32))
    cuda.encoder_backward(dwte, dwpe, dev(cuda, dout), dev(cuda, inp), accumulate=False)
    close(host(cuda, dwte), dwte_ref)
    got = host(cuda, dwpe)
    close(got, dwpe_ref)
    assert np.all(got[T:] == 0.0)


def _repeated_token_case(C):
    """B=3, T=7 with only 3 distinct ids (one row of dwte gets most positions), odd C."""
    B, T, Vp, maxT = 3, 7, 11, 9
    rng = rng_for("encoder_repeated", C)
    inp = rng.choice(np.array([2, 7, 9], np.int32), size=(B, T), p=[0.6, 0.3, 0.1]).astype(np.int32)
    inp[0, 0], inp[1, 3], inp[2, 6] = 2, 7, 9                # all three ids occur
    return inp, randn(rng, B, T, C), randn(rng, Vp, C), randn(rng, maxT, C)


def _dwte_in_order(dwte0, dout, inp):
    """float32 dwte: each token's rows added one by one in ascending (b, t) order
    onto its prior value."""
    dwte = dwte0.copy()
    B, T, C = dout.shape
    for b in range(B):
        for t in range(T):
            row = dwte[inp[b, t]]
            for c in range(C):
                row[c] = np.float32(row[c] + dout[b, t, c])
    return dwte


def _encoder_backward_on(be, inp, dout, dwte0, dwpe0, accumulate):
    dwte, dwpe = dev(be, dwte0), dev(be, dwpe0)
    be.encoder_backward(dwte, dwpe, dev(be, dout), dev(be, inp), accumulate=accumulate)
    return host(be, dwte), host(be, dwpe)


@pytest.mark.parametrize("C", [13, 67])                      # one / two blocks of channels
@pytest.mark.parametrize("accumulate", [True, False])
def test_encoder_backward_repeated_tokens_exact(cuda, C, accumulate):
    """dwte is the in-order float32 sum, bitwise (no atomics), on either
    schedule; dwpe as numpy's."""
    inp, dout, dwte0, dwpe0 = _repeated_token_case(C)
    dwte_ref, dwpe_ref = dwte0.copy(), dwpe0.copy()
    REF.encoder_backward(dwte_ref, dwpe_ref, dout, inp, accumulate=accumulate)
    dwte, dwpe = _encoder_backward_on(cuda, inp, dout, dwte0, dwpe0, accumulate)
    close(dwte, dwte_ref)
    close(dwpe, dwpe_ref)
    assert np.array_equal(dwte, _dwte_in_order(dwte0, dout, inp))
    untouched = np.setdiff1d(np.arange(dwte0.shape[0]), inp)
    assert np.array_equal(dwte[untouched], dwte0[untouched])


@pytest.mark.parametrize("C", [13, 67])
def test_encoder_backward_dwte_is_bitwise_the_same_on_both_schedules(C):
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    inp, dout, dwte0, dwpe0 = _repeated_token_case(C)
    got = [_encoder_backward_on(small_launches(CudaBackend(EmuRuntime(schedule=s))), inp,
                                dout, dwte0, dwpe0, True)
           for s in ("forward", "reverse")]
    assert np.array_equal(got[0][0], got[1][0])               # dwte, bitwise
    assert np.array_equal(got[0][1], got[1][1])               # dwpe, bitwise
    assert np.array_equal(got[0][0], _dwte_in_order(dwte0, dout, inp))
    dwte_ref, dwpe_ref = dwte0.copy(), dwpe0.copy()
    REF.encoder_backward(dwte_ref, dwpe_ref, dout, inp)
    close(got[0][0], dwte_ref)


def test_encoder_backward_checks_token_ids_and_dwte(cuda):
    B, T, C, Vp, maxT = 1, 3, 8, 5, 4
    dout, dwpe = cuda.zeros((B, T, C)), cuda.zeros((maxT, C))
    for bad in (Vp, -1):
        inp = dev(cuda, np.array([[0, bad, 1]], np.int32))
        with pytest.raises(KernelArgumentError, match=rf"token id {bad}, outside \[0, {Vp}\)"):
            cuda.encoder_backward(cuda.zeros((Vp, C)), dwpe, dout, inp)
    with pytest.raises(KernelArgumentError, match=r"dwte has shape \(5, 4\), expected \(Vp, 8\)"):
        cuda.encoder_backward(cuda.zeros((Vp, 4)), dwpe, dout, cuda.zeros((B, T), np.int32))


def test_encoder_needs_c_multiple_of_4(cuda):
    B, T, C, Vp = 1, 3, 6, 8
    with pytest.raises(KernelArgumentError, match=r"C=6 must be a multiple of 4.*encoder\.cu"):
        cuda.encoder_forward(cuda.zeros((B, T, C)), cuda.zeros((B, T), np.int32),
                             cuda.zeros((Vp, C)), cuda.zeros((4, C)))


def test_encoder_needs_16_byte_alignment(cuda):
    B, T, C, Vp = 1, 3, 8, 8
    flat = cuda.zeros(Vp * C + 1)
    misaligned_wte = flat[1:].reshape(Vp, C)
    with pytest.raises(KernelArgumentError, match=r"wte is not 16-byte aligned"):
        cuda.encoder_forward(cuda.zeros((B, T, C)), cuda.zeros((B, T), np.int32), misaligned_wte,
                             cuda.zeros((4, C)))


def test_shape_mismatch_is_one_clear_error(cuda):
    with pytest.raises(KernelArgumentError,
                       match=r"residual_forward: inp2 has shape \(3,\), expected \(4,\)"):
        cuda.residual_forward(cuda.zeros(4), cuda.zeros(4), cuda.zeros(3))


def test_non_contiguous_arguments_are_refused(cuda):
    x = cuda.zeros((4, 6))
    with pytest.raises(KernelArgumentError, match="C-contiguous"):
        cuda.gelu_forward(cuda.zeros((4, 3)), x[:, ::2])


# ---- layernorm -------------------------------------------------------------------------------
def test_layernorm(cuda, shape):
    B, T, C, *_ = shape
    rng = rng_for("layernorm", shape)
    x, w, b = randn(rng, B, T, C, scale=2.0) + 0.5, randn(rng, C), randn(rng, C)
    out_ref = np.zeros((B, T, C), np.float32)
    mean_ref, rstd_ref = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
    REF.layernorm_forward(out_ref, mean_ref, rstd_ref, x, w, b)
    out, mean, rstd = cuda.zeros((B, T, C)), cuda.zeros((B, T)), cuda.zeros((B, T))
    X, W = dev(cuda, x), dev(cuda, w)
    cuda.layernorm_forward(out, mean, rstd, X, W, dev(cuda, b))
    close(host(cuda, out), out_ref, atol=1e-5)
    close(host(cuda, mean), mean_ref)
    close(host(cuda, rstd), rstd_ref)

    dout = randn(rng, B, T, C)
    dinp0, dw0, db0 = randn(rng, B, T, C), randn(rng, C), randn(rng, C)
    dinp_ref, dw_ref, db_ref = dinp0.copy(), dw0.copy(), db0.copy()
    REF.layernorm_backward(dinp_ref, dw_ref, db_ref, dout, x, w, mean_ref, rstd_ref)
    dinp, dw, db = dev(cuda, dinp0), dev(cuda, dw0), dev(cuda, db0)
    cuda.layernorm_backward(dinp, dw, db, dev(cuda, dout), X, W, mean, rstd)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref, atol=1e-4)

    # accumulate=False: dweight/dbias start as garbage (NaN) and are overwritten;
    # dinp still accumulates.
    dinp_ref, dw_ref, db_ref = dinp0.copy(), np.zeros(C, np.float32), np.zeros(C, np.float32)
    REF.layernorm_backward(dinp_ref, dw_ref, db_ref, dout, x, w, mean_ref, rstd_ref)
    close(db_ref, dout.reshape(-1, C).sum(axis=0), atol=1e-4)
    dinp, dw, db = dev(cuda, dinp0), cuda.from_host(np.full(C, np.nan, np.float32)), \
        cuda.from_host(np.full(C, np.nan, np.float32))
    cuda.layernorm_backward(dinp, dw, db, dev(cuda, dout), X, W, mean, rstd, accumulate=False)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref, atol=1e-4)


def test_fused_residual_layernorm_forward(cuda, shape):
    """residual + LayerNorm in one kernel: NumPy's residual_forward then layernorm_forward, and
    bitwise the two CUDA kernels it replaces (the same arithmetic in the same order)."""
    B, T, C, *_ = shape
    rng = rng_for("fused_residual_layernorm", shape)
    a, b, w, bias = (randn(rng, B, T, C, scale=2.0) + 0.5, randn(rng, B, T, C), randn(rng, C),
                     randn(rng, C))
    res_ref, out_ref = np.zeros((B, T, C), np.float32), np.zeros((B, T, C), np.float32)
    mean_ref, rstd_ref = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
    REF.fused_residual_layernorm_forward(res_ref, out_ref, mean_ref, rstd_ref, a, b, w, bias)
    args = dev(cuda, a), dev(cuda, b), dev(cuda, w), dev(cuda, bias)
    res, out, mean, rstd = (cuda.zeros((B, T, C)), cuda.zeros((B, T, C)), cuda.zeros((B, T)),
                            cuda.zeros((B, T)))
    cuda.fused_residual_layernorm_forward(res, out, mean, rstd, *args)
    close(host(cuda, res), a + b, rtol=0, atol=0)
    close(host(cuda, out), out_ref, atol=1e-5)
    close(host(cuda, mean), mean_ref)
    close(host(cuda, rstd), rstd_ref)
    res2, out2, mean2, rstd2 = (cuda.zeros((B, T, C)), cuda.zeros((B, T, C)), cuda.zeros((B, T)),
                                cuda.zeros((B, T)))
    cuda.residual_forward(res2, args[0], args[1])
    cuda.layernorm_forward(out2, mean2, rstd2, res2, args[2], args[3])
    for fused, unfused in ((res, res2), (out, out2), (mean, mean2), (rstd, rstd2)):
        assert np.array_equal(host(cuda, fused), host(cuda, unfused))


@pytest.mark.parametrize("accumulate", [True, False])
def test_layernorm_backward_fused(cuda, shape, accumulate):
    """The one-pass backward (dinp and per-block partial sums, then the fixed-order finish) against
    NumPy; without accumulate dweight/dbias start as NaN and are overwritten, dinp
    always accumulates."""
    B, T, C, *_ = shape
    rng = rng_for("layernorm_backward_fused", shape, accumulate)
    x, w, b = randn(rng, B, T, C, scale=2.0) + 0.5, randn(rng, C), randn(rng, C)
    out, mean, rstd = (np.zeros((B, T, C), np.float32), np.zeros((B, T), np.float32),
                       np.zeros((B, T), np.float32))
    REF.layernorm_forward(out, mean, rstd, x, w, b)
    dout, dinp0 = randn(rng, B, T, C), randn(rng, B, T, C)
    dw0, db0 = ((randn(rng, C), randn(rng, C)) if accumulate
                else (np.full(C, np.nan, np.float32),) * 2)
    dinp_ref, dw_ref, db_ref = dinp0.copy(), dw0.copy(), db0.copy()
    REF.layernorm_backward(dinp_ref, dw_ref, db_ref, dout, x, w, mean, rstd, accumulate)
    dinp, dw, db = dev(cuda, dinp0), dev(cuda, dw0), dev(cuda, db0)
    cuda.layernorm_backward(dinp, dw, db, dev(cuda, dout), dev(cuda, x), dev(cuda, w),
                            dev(cuda, mean), dev(cuda, rstd), accumulate, fused=True)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref, atol=1e-4)


def test_layernorm_backward_fused_is_bitwise_the_same_on_both_schedules():
    """No atomics: the parameter gradients' order of additions is fixed by the launch shape,
    not the schedule."""
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    B, T, C = 3, 7, 40
    rng = rng_for("layernorm_backward_fused_determinism")
    x, w, dout = randn(rng, B, T, C), randn(rng, C), randn(rng, B, T, C)
    mean, rstd = x.mean(-1), (1 / np.sqrt(x.var(-1) + 1e-5)).astype(np.float32)
    results = []
    for schedule in ("forward", "reverse"):
        be = small_launches(CudaBackend(EmuRuntime(schedule=schedule)))
        dinp, dw, db = be.zeros((B, T, C)), be.zeros(C), be.zeros(C)
        be.layernorm_backward(dinp, dw, db, dev(be, dout), dev(be, x), dev(be, w), dev(be, mean),
                              dev(be, rstd), accumulate=False, fused=True)
        results.append([host(be, a) for a in (dinp, dw, db)])
    for first, second in zip(*results):
        assert np.array_equal(first, second)


@pytest.mark.parametrize("Y", [1, 3, 8, 32])
def test_layernorm_params_finish_adds_in_its_documented_order(cuda, Y):
    """Block (32, Y): thread y of a column adds chunks y, y+Y, ... in order, then the column's first
    thread adds the Y sums in y order; bitwise that order in float32 (Y = 1: every chunk in order,
    as the one-thread finish did), on the emulator and, through test_gpu.py, on a GPU. Partial sums
    of mixed magnitudes, so that the orders differ."""
    from gpt2np.backends.cuda.backend import _i32
    chunks, C = 75, 70                                    # Y = 32: two or three chunks a thread
    rng = rng_for("layernorm_params_finish", Y)
    partial = (rng.standard_normal((chunks, 2, C))
               * 10.0 ** rng.integers(-4, 5, (chunks, 2, C))).astype(np.float32)
    old = randn(rng, 2, C)
    lanes = []
    for y in range(Y):
        lane = np.zeros((2, C), np.float32)
        for k in range(y, chunks, Y):
            lane = lane + partial[k]
        lanes.append(lane)
    total = lanes[0]
    for lane in lanes[1:]:
        total = total + lane
    sequential = np.zeros((2, C), np.float32)
    for k in range(chunks):
        sequential = sequential + partial[k]
    # the check below can tell the orders apart
    assert np.array_equal(total, sequential) == (Y == 1)
    for accumulate in (False, True):
        dw, db = dev(cuda, old[0]), dev(cuda, old[1])
        cuda._launch("layernorm_backward_params_finish", (-(-C // 32),), (32, Y),
                     (dw, db, dev(cuda, partial), _i32(chunks), _i32(C), _i32(accumulate)),
                     shared_mem=4 * 2 * 32 * Y)
        expected = old + total if accumulate else total
        assert (np.array_equal(host(cuda, dw), expected[0])
                and np.array_equal(host(cuda, db), expected[1]))


def test_layernorm_backward_takes_more_rows_a_block_past_its_most_blocks(cuda):
    """A batch whose rows would need more than layernorm_max_blocks blocks gets ceil(N / most) rows
    a block: the same chunks, so bitwise the same results, as asking for those rows; within the
    NumPy reference's tolerance."""
    B, T, C = 3, 7, 40                                     # N = 21 rows
    rng = rng_for("layernorm_backward_max_blocks")
    x, w, dout, dinp0 = randn(rng, B, T, C), randn(rng, C), randn(rng, B, T, C), randn(rng, B, T, C)
    mean, rstd = x.mean(-1), (1 / np.sqrt(x.var(-1) + 1e-5)).astype(np.float32)
    dinp_ref, dw_ref, db_ref = dinp0.copy(), np.zeros(C, np.float32), np.zeros(C, np.float32)
    REF.layernorm_backward(dinp_ref, dw_ref, db_ref, dout, x, w, mean, rstd, False)
    saved = cuda.layernorm_rows_per_block, cuda.layernorm_max_blocks
    results = []
    try:
        for rows, most in ((4, 2), (11, 512)):
            cuda.layernorm_rows_per_block, cuda.layernorm_max_blocks = rows, most
            assert cuda._layernorm_chunks(B * T) == (11, 2)
            dinp, dw, db = dev(cuda, dinp0), cuda.zeros(C), cuda.zeros(C)
            cuda.layernorm_backward(dinp, dw, db, dev(cuda, dout), dev(cuda, x), dev(cuda, w),
                                    dev(cuda, mean), dev(cuda, rstd), accumulate=False, fused=True)
            results.append([host(cuda, a) for a in (dinp, dw, db)])
            for got, want in zip(results[-1], (dinp_ref, dw_ref, db_ref)):
                close(got, want, atol=1e-4)
    finally:
        cuda.layernorm_rows_per_block, cuda.layernorm_max_blocks = saved
    assert all(np.array_equal(a, b) for a, b in zip(*results))


# ---- matmul ----------------------------------------------------------------------------------
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul(cuda, shape, with_bias):
    B, T, C, *_ = shape
    OC = 3 * C + 5
    rng = rng_for("matmul", shape, with_bias)
    x, w, b = randn(rng, B, T, C), randn(rng, OC, C), randn(rng, OC)
    out_ref = np.zeros((B, T, OC), np.float32)
    REF.matmul_forward(out_ref, x, w, b if with_bias else None)
    out = cuda.zeros((B, T, OC))
    X, Wt = dev(cuda, x), dev(cuda, w)
    cuda.matmul_forward(out, X, Wt, dev(cuda, b) if with_bias else None)
    close(host(cuda, out), out_ref, atol=1e-4)

    dout = randn(rng, B, T, OC)
    dw0, db0 = randn(rng, OC, C), randn(rng, OC)
    dinp_ref, dw_ref, db_ref = np.full((B, T, C), 7.0, np.float32), dw0.copy(), db0.copy()
    REF.matmul_backward(dinp_ref, dw_ref, db_ref if with_bias else None, dout, x, w)
    dinp, dw, db = (cuda.from_host(np.full((B, T, C), 7.0, np.float32)), dev(cuda, dw0),
                    dev(cuda, db0))
    cuda.matmul_backward(dinp, dw, db if with_bias else None, dev(cuda, dout), X, Wt)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref if with_bias else db0, atol=1e-4)

    # accumulate=False: dweight and dbias start as garbage (NaN) and are overwritten.
    dinp_ref, dw_ref, db_ref = (np.zeros((B, T, C), np.float32), np.zeros((OC, C), np.float32),
                                np.zeros(OC, np.float32))
    REF.matmul_backward(dinp_ref, dw_ref, db_ref if with_bias else None, dout, x, w)
    if with_bias:
        # the reference itself, directly
        close(db_ref, dout.reshape(-1, OC).sum(axis=0), atol=1e-4)
    dinp = cuda.from_host(np.full((B, T, C), 7.0, np.float32))
    dw, db = (cuda.from_host(np.full((OC, C), np.nan, np.float32)),
              cuda.from_host(np.full(OC, np.nan, np.float32)))
    cuda.matmul_backward(dinp, dw, db if with_bias else None, dev(cuda, dout), X, Wt,
                         accumulate=False)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    if with_bias:
        close(host(cuda, db), db_ref, atol=1e-4)
    else:
        assert np.all(np.isnan(host(cuda, db)))                  # no bias: dbias untouched


@pytest.mark.parametrize("accumulate", [True, False])
def test_matmul_fused_epilogues(cuda, shape, accumulate):
    """fused=True: the bias in the forward GEMM's epilogue, dbias from the dweight GEMM's
    bias-gradient epilogue (written, then added when accumulating; overwritten
    from NaN otherwise)."""
    B, T, C, *_ = shape
    OC = 3 * C + 5
    rng = rng_for("matmul_fused", shape, accumulate)
    x, w, b, dout = randn(rng, B, T, C), randn(rng, OC, C), randn(rng, OC), randn(rng, B, T, OC)
    out_ref = np.zeros((B, T, OC), np.float32)
    REF.matmul_forward(out_ref, x, w, b)
    out, X, Wt = cuda.zeros((B, T, OC)), dev(cuda, x), dev(cuda, w)
    cuda.matmul_forward(out, X, Wt, dev(cuda, b), fused=True)
    close(host(cuda, out), out_ref, atol=1e-4)

    dw0, db0 = (randn(rng, OC, C), randn(rng, OC)) if accumulate else (
        np.full((OC, C), np.nan, np.float32), np.full(OC, np.nan, np.float32))
    dinp_ref, dw_ref, db_ref = np.zeros((B, T, C), np.float32), dw0.copy(), db0.copy()
    REF.matmul_backward(dinp_ref, dw_ref, db_ref, dout, x, w, accumulate)
    dinp, dw, db = (cuda.from_host(np.full((B, T, C), 7.0, np.float32)), dev(cuda, dw0),
                    dev(cuda, db0))
    cuda.matmul_backward(dinp, dw, db, dev(cuda, dout), X, Wt, accumulate, fused=True)
    close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref, atol=1e-4)


@pytest.mark.parametrize("accumulate", [True, False])
def test_matmul_gelu_and_gelu_matmul_backward(cuda, shape, accumulate):
    """c_fc's GEMM with the bias + GELU epilogue (pre kept as aux), c_proj's backward with the dGELU
    epilogue, against NumPy's matmul + gelu sequences."""
    B, T, C, *_ = shape
    H = 4 * C
    rng = rng_for("matmul_gelu", shape, accumulate)
    x, w, b = randn(rng, B, T, C), randn(rng, H, C, scale=0.5), randn(rng, H)
    out_ref, pre_ref = np.zeros((B, T, H), np.float32), np.zeros((B, T, H), np.float32)
    REF.matmul_gelu_forward(out_ref, pre_ref, x, w, b)
    out, pre = cuda.zeros((B, T, H)), cuda.zeros((B, T, H))
    cuda.matmul_gelu_forward(out, pre, dev(cuda, x), dev(cuda, w), dev(cuda, b))
    close(host(cuda, pre), pre_ref, atol=1e-4)
    close(host(cuda, out), out_ref, atol=1e-4)

    # c_proj: (B,T,H) -> (B,T,C); its backward's dinp is multiplied by gelu'(pre)
    wp, dout = randn(rng, C, H), randn(rng, B, T, C)
    dw0, db0 = (randn(rng, C, H), randn(rng, C)) if accumulate else (
        np.full((C, H), np.nan, np.float32), np.full(C, np.nan, np.float32))
    dinp_ref, dw_ref, db_ref = np.zeros((B, T, H), np.float32), dw0.copy(), db0.copy()
    REF.gelu_matmul_backward(dinp_ref, dw_ref, db_ref, dout, out_ref, wp, pre_ref, accumulate)
    dinp, dw, db = (cuda.from_host(np.full((B, T, H), 7.0, np.float32)), dev(cuda, dw0),
                    dev(cuda, db0))
    cuda.gelu_matmul_backward(dinp, dw, db, dev(cuda, dout), out, dev(cuda, wp), pre, accumulate)
    if cuda.rt.name == "cupy":
        # On a GPU, cuBLASLt's dGELU epilogue computes gelu'(pre) with the hardware tanh
        # approximation: seen on an H100, gelu' off by up to 3.5e-5 (0.7% of dinp where gelu' nearly
        # cancels). The bound: 1e-4 plus 2e-4 of the GEMM's own |dout @ wp| (the factor gelu'
        # multiplies), so an epilogue that got gelu' wrong still fails.
        grad = np.abs(dout.reshape(-1, C) @ wp).reshape(B, T, H)
        assert np.all(np.abs(host(cuda, dinp) - dinp_ref) <= 1e-4 + 2e-4 * grad)
    else:
        close(host(cuda, dinp), dinp_ref, atol=1e-4)
    close(host(cuda, dw), dw_ref, atol=1e-4)
    close(host(cuda, db), db_ref, atol=1e-4)


# ---- attention -------------------------------------------------------------------------------
def test_attention(cuda, shape):
    B, T, C, NH, *_ = shape
    HS = C // NH
    rng = rng_for("attention", shape)
    inp = randn(rng, B, T, 3 * C)
    out_ref, qkvr_ref, att_ref = (np.zeros((B, T, C), np.float32),
                                  np.zeros((3, B, NH, T, HS), np.float32),
                                  np.zeros((B, NH, T, T), np.float32))
    REF.attention_forward(out_ref, qkvr_ref, att_ref, inp)
    out, qkvr = cuda.zeros((B, T, C)), cuda.zeros((3, B, NH, T, HS))
    # stale values must vanish
    att = cuda.from_host(np.full((B, NH, T, T), 9.0, np.float32))
    cuda.attention_forward(out, qkvr, att, dev(cuda, inp))
    close(host(cuda, qkvr), qkvr_ref, rtol=0, atol=0)
    att_host = host(cuda, att)
    close(att_host, att_ref, atol=1e-6)
    # exact zeros above the diagonal
    assert np.all(att_host[..., np.triu(np.ones((T, T), bool), k=1)] == 0.0)
    close(att_host.sum(-1), np.ones((B, NH, T)), atol=1e-5)
    close(host(cuda, out), out_ref, atol=1e-5)

    dout = randn(rng, B, T, C)
    dinp_ref = np.zeros((B, T, 3 * C), np.float32)
    REF.attention_backward(dinp_ref, dout, qkvr_ref, att_ref)
    # "=": old contents vanish
    dinp = cuda.from_host(np.full((B, T, 3 * C), 3.0, np.float32))
    cuda.attention_backward(dinp, dev(cuda, dout), qkvr, att)
    close(host(cuda, dinp), dinp_ref, atol=1e-5)


# ---- flash attention (kernels/flash_attention.cu: WMMA TF32) ----------------------------------
# (B, T, NH) with HS = 64 (a block owns 64 rows and walks the other side 32 at a time): a partial
# step, two blocks and three steps, exactly one step, a single row, three blocks (the last
# partial) over five steps
FLASH_SHAPES = {"partial": (2, 45, 2), "three_tiles": (1, 70, 1), "one_tile": (3, 32, 1),
                "one_row": (1, 1, 2), "three_blocks": (2, 150, 2)}
# TF32 tolerance, relative to the largest reference value: u = 2^-11 is TF32's unit roundoff (inputs
# rounded to nearest, 10 explicit mantissa bits). Every result chains up to four rounded factors (q
# and k inside the exponent, then P and v; backward: dout and v in dP, then dS and q/k), each off by
# at most u relative; products of random signs partly cancel over the HS = 64 and T terms. Measured
# on these shapes: out 0.5 u, lse 0.2 u, dinp 0.8 u (of the largest value); 8 u leaves a 10x margin
# and stays far below a real bug (errors of order 1).
TF32_TOL = 8 * 2.0 ** -11
# a second WMMA fragment layout (the fixture's runtime uses the natural one, 0)
FLASH_LAYOUT = 0x5EED


def tf32_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=0,
                               atol=TF32_TOL * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("flash_shape", sorted(FLASH_SHAPES))
def test_flash_attention(cuda, flash_shape):
    """The three kernels against the NumPy op within TF32 rounding, and bitwise the same under a
    second WMMA fragment layout (a kernel that depended on the opaque layout would differ)
    and on a second run."""
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    B, T, NH = FLASH_SHAPES[flash_shape]
    C = 64 * NH
    rng = rng_for("flash", flash_shape)
    inp, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    out_ref, lse_ref, dinp_ref = (np.zeros(s, np.float32)
                                  for s in ((B, T, C), (B, NH, T), (B, T, 3 * C)))
    REF.flash_attention_forward(out_ref, lse_ref, inp)
    REF.flash_attention_backward(dinp_ref, dout, inp, out_ref, lse_ref)
    capability = getattr(cuda.rt, "compute_capability", None)
    if capability is not None and capability() < 80:
        pytest.skip("the flash attention kernels need sm_80+ (TF32 tensor cores)")
    if cuda.rt.name == "emulator":
        other = small_launches(CudaBackend(
            EmuRuntime(schedule=cuda.rt.schedule, guard=cuda.rt.guard, wmma_layout=FLASH_LAYOUT)))
    else:
        # on a GPU (tests/test_gpu.py): the hardware's one layout, run twice
        other = cuda
    results = []
    for be in (cuda, other, cuda):
        # stale values must vanish
        out = be.from_host(np.full((B, T, C), 5.0, np.float32))
        lse = be.from_host(np.full((B, NH, T), 7.0, np.float32))
        be.flash_attention_forward(out, lse, dev(be, inp))
        dinp = be.from_host(np.full((B, T, 3 * C), 3.0, np.float32))
        be.flash_attention_backward(dinp, dev(be, dout), dev(be, inp), out, lse)
        results.append([host(be, x) for x in (out, lse, dinp)])
    out, lse, dinp = results[0]
    tf32_close(out, out_ref)
    tf32_close(lse, lse_ref)
    tf32_close(dinp, dinp_ref)
    for again in results[1:]:
        for a, b in zip(again, results[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("slope", [0.4, 1.0, 5.0, -0.4])
def test_flash_attention_rescales_when_the_row_max_grows(slope):
    """Scores that grow along the keys (q = 8 e0, k_t = slope t e0: a row's score at key t is slope
    t) move the forward's reference max by more than its 2^12 margin again and again, so O and l are
    rescaled through shared memory many times; random N(0, 1) inputs never do (slope -0.4: the first
    key stays the max, no rescale). With fp32 WMMA (TF32 would round scores of up to 750 by 2^-11 of
    themselves, inside the exponent) the kernels agree with the NumPy op to fp32 rounding, relative
    to each output's largest value: measured 4e-5 at most (dinp at slope 5, scores near 750 rounded
    in fp32 inside the exponent); with the rescale skipped, 2e-3 to 9."""
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    B, T, NH, C = 1, 150, 1, 64
    rng = rng_for("flash_rescale", slope)
    inp = randn(rng, B, T, 3 * C, scale=0.1)
    inp[0, :, 0] = 8.0
    inp[0, :, C] = slope * np.arange(T, dtype=np.float32)
    dout = randn(rng, B, T, C)
    out_ref, lse_ref, dinp_ref = (np.zeros(s, np.float32)
                                  for s in ((B, T, C), (B, NH, T), (B, T, 3 * C)))
    REF.flash_attention_forward(out_ref, lse_ref, inp)
    REF.flash_attention_backward(dinp_ref, dout, inp, out_ref, lse_ref)
    be = CudaBackend(EmuRuntime(wmma_tf32=False, schedule="reverse", wmma_layout=FLASH_LAYOUT))
    out, lse = be.zeros((B, T, C)), be.zeros((B, NH, T))
    be.flash_attention_forward(out, lse, dev(be, inp))
    dinp = be.zeros((B, T, 3 * C))
    be.flash_attention_backward(dinp, dev(be, dout), dev(be, inp), out, lse)
    for got, want in ((out, out_ref), (lse, lse_ref), (dinp, dinp_ref)):
        np.testing.assert_allclose(host(be, got), want, rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(want).max()))


def test_flash_attention_needs_head_size_64(cuda):
    B, T, NH, C = 1, 4, 2, 96                                                   # HS = 48
    with pytest.raises(KernelArgumentError, match="head size 64.*HS=48.*--attention naive"):
        cuda.flash_attention_forward(cuda.zeros((B, T, C)), cuda.zeros((B, NH, T)),
                                     cuda.zeros((B, T, 3 * C)))
    with pytest.raises(KernelArgumentError, match="lse has shape"):
        cuda.flash_attention_forward(cuda.zeros((B, T, 128)), cuda.zeros((B, T)),
                                     cuda.zeros((B, T, 384)))


def test_flash_attention_refuses_gpus_without_tf32_tensor_cores():
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime

    class Turing(EmuRuntime):
        def compute_capability(self):
            return 75

    be = CudaBackend(Turing())
    with pytest.raises(KernelArgumentError, match="sm_80 or newer.*sm_75.*--attention naive"):
        be.flash_attention_forward(be.zeros((1, 4, 64)), be.zeros((1, 1, 4)), be.zeros((1, 4, 192)))


# ---- gelu, residual --------------------------------------------------------------------------
def test_gelu(cuda, shape):
    B, T, C, *_ = shape
    rng = rng_for("gelu", shape)
    x = randn(rng, B, T, 4 * C, scale=3.0)
    out_ref = np.zeros_like(x)
    REF.gelu_forward(out_ref, x)
    out, X = cuda.zeros(x.shape), dev(cuda, x)
    cuda.gelu_forward(out, X)
    # 0.5 x (1 + tanh) cancels for x << 0: ulps of |x|
    close(host(cuda, out), out_ref, atol=1e-5)

    dout = randn(rng, *x.shape)
    dinp_ref = np.zeros_like(x)
    REF.gelu_backward(dinp_ref, x, dout)
    d = dev(cuda, dout)
    cuda.gelu_backward(d, X, d)                                   # in place, as the model calls it
    close(host(cuda, d), dinp_ref, atol=1e-5)


def test_residual(cuda, shape):
    B, T, C, *_ = shape
    rng = rng_for("residual", shape)
    a, b, g = randn(rng, B, T, C), randn(rng, B, T, C), randn(rng, B, T, C)
    out = cuda.zeros((B, T, C))
    cuda.residual_forward(out, dev(cuda, a), dev(cuda, b))
    close(host(cuda, out), a + b, rtol=0, atol=0)

    d1_ref, d2_ref = a.copy(), b.copy()
    REF.residual_backward(d1_ref, d2_ref, g)
    d1, d2 = dev(cuda, a), dev(cuda, b)
    cuda.residual_backward(d1, d2, dev(cuda, g))
    close(host(cuda, d1), d1_ref, rtol=0, atol=0)
    close(host(cuda, d2), d2_ref, rtol=0, atol=0)
    same = dev(cuda, a)
    cuda.residual_backward(same, same, dev(cuda, g))            # aliased: gains 2 * dout
    close(host(cuda, same), a + g + g, rtol=0, atol=0)


# ---- classifier ------------------------------------------------------------------------------
@pytest.mark.parametrize("write_dlogits", [False, True])
def test_fused_classifier(cuda, shape, write_dlogits):
    B, T, C, NH, V, Vp, _ = shape
    rng = rng_for("classifier", shape, write_dlogits)
    logits = randn(rng, B, T, Vp, scale=4.0)
    logits[..., V:] = 123.0                                       # padding must be ignored
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 0] = V - 1
    dloss = 1.0 / (B * T)
    logits_ref, losses_ref = logits.copy(), np.zeros((B, T), np.float32)
    REF.fused_classifier(logits_ref, losses_ref, targets, V, dloss, write_dlogits)
    lg, losses = dev(cuda, logits), cuda.zeros((B, T))
    cuda.fused_classifier(lg, losses, dev(cuda, targets), V, dloss, write_dlogits)
    close(host(cuda, losses), losses_ref, atol=1e-5)
    got = host(cuda, lg)
    if write_dlogits:
        close(got, logits_ref, atol=1e-7)
        assert np.all(got[..., V:] == 0.0)
        close(got[..., :V].sum(-1), np.zeros((B, T)), atol=1e-6)
    else:
        close(got, logits, rtol=0, atol=0)                       # untouched


# ---- optimizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("t, weight_decay, grad_scale", [(1, 0.0, 1.0), (3, 0.1, 0.5)])
def test_adamw(cuda, t, weight_decay, grad_scale):
    n = 203
    rng = rng_for("adamw", t)
    p, g = randn(rng, n), randn(rng, n)
    m0, v0 = randn(rng, n, scale=0.1), np.abs(randn(rng, n, scale=0.1))
    p_ref, m_ref, v_ref = p.copy(), m0.copy(), v0.copy()
    # an unaligned segment of flat buffers
    lo = 3
    REF.adamw_update(p_ref[lo:], g[lo:], m_ref[lo:], v_ref[lo:], 1e-3, 0.9, 0.95, 1e-8,
                     weight_decay, t, grad_scale)
    P, G, M, Vv = dev(cuda, p), dev(cuda, g), dev(cuda, m0), dev(cuda, v0)
    cuda.adamw_update(P[lo:], G[lo:], M[lo:], Vv[lo:], 1e-3, 0.9, 0.95, 1e-8, weight_decay, t,
                      grad_scale)
    close(host(cuda, M), m_ref, rtol=1e-6, atol=1e-7)
    close(host(cuda, Vv), v_ref, rtol=1e-6, atol=1e-7)
    close(host(cuda, P), p_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 100, 1000])
def test_global_norm_squared(cuda, n):
    g = randn(rng_for("norm", n), n)
    got = cuda.global_norm_squared(dev(cuda, g))
    assert isinstance(got, float)
    assert got == pytest.approx(REF.global_norm_squared(g), rel=1e-5)


# ---- backend plumbing ------------------------------------------------------------------------
def test_every_launch_and_gemm_goes_through_on_launch(cuda):
    B, T, C, OC = 2, 3, 8, 12
    seen = []

    def hook(name, kind, term, run):
        seen.append((name, kind, term))
        run()

    cuda.on_launch = hook
    try:
        out = cuda.zeros((B, T, OC))
        cuda.matmul_forward(out, cuda.zeros((B, T, C)), cuda.zeros((OC, C)), cuda.zeros(OC))
    finally:
        cuda.on_launch = None
    # each launch names the term of matmul_forward's cost (backends.contract) that it carries
    assert seen == [("gemm_matmul_forward", "gemm", "gemm"), ("add_bias", "kernel", "bias")]
    seen.clear()
    cuda.on_launch = hook
    try:                                   # fused: the bias is the GEMM's epilogue, one launch
        cuda.matmul_forward(out, cuda.zeros((B, T, C)), cuda.zeros((OC, C)), cuda.zeros(OC),
                            fused=True)
    finally:
        cuda.on_launch = None
    assert seen == [("gemm_matmul_forward", "gemm", "gemm")]
