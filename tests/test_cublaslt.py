"""CupyRuntime's GEMM epilogues through cuBLASLt, on a fake nvmath.bindings.cublasLt
(tests/fake_gpu.py): the call sequence, argument order and enum values that reach cuBLASLt, checked
without a GPU; the fallback without cuBLASLt; the fake against the real bindings where
nvmath-python is installed."""
import re
import types

import numpy as np
import pytest
from fake_gpu import FakeCublas, FakeCublasLt, FakeCupy

from gpt2np.backends.cuda import runtime_cupy
from gpt2np.backends.cuda.runtime_cupy import CupyRuntime


class DeviceArray:
    """A float32 (or bf16) device array as CupyRuntime.gemm reads it: data.ptr, size, dtype."""

    def __init__(self, ptr, *shape, dtype=np.float32):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.shape, self.size, self.dtype = shape, int(np.prod(shape)), np.dtype(dtype)


def runtime(tf32=True, **fake):
    lt = FakeCublasLt(**fake)
    return CupyRuntime(tf32=tf32, cupy=FakeCupy(stream=0x5000), cublas=FakeCublas(),
                       cublaslt=lt), lt


N, C, OC = 64, 32, 128          # c_fc's shapes: (N,C) @ (OC,C)^T -> (N,OC)


def forward_gelu(rt, inp, w, out, bias, pre):
    rt.gemm(False, True, N, OC, C, 1.0, inp, C, 0, w, C, 0, 0.0, out, OC, 0, 1,
            epilogue="gelu_bias", bias=bias, aux=pre, ld_aux=OC)


def test_forward_gelu_epilogue_reaches_cublaslt_as_the_column_major_transpose():
    rt, lt = runtime(tf32=True)
    assert rt.epilogues and rt.lt_handle in lt.live
    inp, w, out = (DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                   DeviceArray(0x30000, N, OC))
    bias, pre = DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC)
    forward_gelu(rt, inp, w, out, bias, pre)
    # cuBLASLt's A is our weight (stored (OC,C) row-major = column-major (C,OC), transposed), its B
    # our input (column-major (C,N)), D our out (column-major (OC,N)); fp32
    # everywhere (CUDA_R_32F = 0)
    assert [c[1:] for c in lt.of("matrix_layout_create")] == [(0, C, OC, C), (0, C, N, C),
                                                              (0, OC, N, OC)]
    # CUBLAS_COMPUTE_32F_FAST_TF32, fp32
    assert lt.of("matmul_desc_create") == [("matmul_desc_create", 77, 0)]
    (call,) = lt.of("matmul")
    (handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_size, stream,
     seen) = call[1:]
    assert (handle, a, b, c, d, stream) == (rt.lt_handle, w.data.ptr, inp.data.ptr, out.data.ptr,
                                            out.data.ptr, 0x5000)
    assert cdesc == ddesc and ws_size == runtime_cupy.LT_WORKSPACE and ws == rt._workspace.data.ptr
    assert seen["alpha"] == 1.0 and seen["beta"] == 0.0
    # TRANSA (3) = CUBLAS_OP_T, TRANSB (4) = N, EPILOGUE (7) = GELU_AUX_BIAS (164), BIAS_POINTER
    # (8), EPILOGUE_AUX_POINTER (11) = pre, EPILOGUE_AUX_LD (12) = OC
    assert seen["desc"] == {3: 1, 4: 0, 7: 164, 12: OC, 8: bias.data.ptr, 11: pre.data.ptr}
    # the heuristic: one algorithm, our workspace (less a margin), the operands'
    # alignments (256 here)
    (heuristic,) = lt.of("matmul_algo_get_heuristic")
    assert (heuristic[1:8] == (rt.lt_handle, desc, adesc, bdesc, cdesc, ddesc, heuristic[7])
            and heuristic[8] == 1)
    assert heuristic[-1] == {1: runtime_cupy.LT_WORKSPACE - 256, 5: 256, 6: 256, 7: 256, 8: 256}
    # the algo struct the heuristic filled
    assert algo == heuristic[9]


def test_the_weight_gradient_epilogue_is_bgradb_with_beta_and_plans_are_reused():
    rt, lt = runtime(tf32=False)
    dout, inp, dw, dbias = (DeviceArray(0x10000, N, OC), DeviceArray(0x20000, N, C),
                            DeviceArray(0x30000, OC, C), DeviceArray(0x40000, OC))
    for _ in range(2):       # dweight (OC,C) += dout^T @ inp, dbias = column sums of dout
        rt.gemm(True, False, OC, C, N, 1.0, dout, OC, 0, inp, C, 0, 1.0, dw, C, 0, 1,
                epilogue="bgrad", bias=dbias)
    # CUBLAS_COMPUTE_32F: exact fp32
    assert lt.of("matmul_desc_create") == [("matmul_desc_create", 68, 0)]
    assert [c[1:] for c in lt.of("matrix_layout_create")] == [(0, C, N, C), (0, OC, N, OC),
                                                              (0, C, OC, C)]
    first, second = lt.of("matmul")
    assert first[-1] == second[-1]
    assert first[-1]["beta"] == 1.0 and first[-1]["desc"] == {3: 0, 4: 1, 7: 512, 8: dbias.data.ptr}
    # cuBLASLt's A = inp, B = dout
    assert first[4] == inp.data.ptr and first[6] == dout.data.ptr
    # the plan is cached per shape
    assert len(lt.of("matmul_algo_get_heuristic")) == 1


def test_dgelu_and_bias_epilogues():
    rt, lt = runtime()
    dout, w, dinp, pre = (DeviceArray(0x10000, N, C), DeviceArray(0x20000, C, OC),
                          DeviceArray(0x30000, N, OC), DeviceArray(0x40000, N, OC))
    rt.gemm(False, False, N, OC, C, 1.0, dout, C, 0, w, OC, 0, 0.0, dinp, OC, 0, 1,
            epilogue="dgelu", aux=pre, ld_aux=OC)
    assert lt.of("matmul")[-1][-1]["desc"] == {3: 0, 4: 0, 7: 192, 12: OC, 11: pre.data.ptr}
    out, bias = DeviceArray(0x50000, N, OC), DeviceArray(0x60000, OC)
    rt.gemm(False, True, N, OC, C, 1.0, dout, C, 0, DeviceArray(0x70000, OC, C), C, 0, 0.0, out, OC,
            0, 1, epilogue="bias", bias=bias)
    assert lt.of("matmul")[-1][-1]["desc"] == {3: 1, 4: 0, 7: 4, 8: bias.data.ptr}


def test_unaligned_operands_are_declared_to_the_heuristic():
    rt, lt = runtime()
    inp, w, out = (DeviceArray(0x10004, N, C), DeviceArray(0x20010, OC, C),
                   DeviceArray(0x30000, N, OC))
    forward_gelu(rt, inp, w, out, DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC))
    # cuBLASLt's A is our w (16-byte aligned), its B our inp (4), C and D our out (256)
    assert lt.of("matmul_algo_get_heuristic")[0][-1] == {1: runtime_cupy.LT_WORKSPACE - 256, 5: 16,
                                                         6: 4, 7: 256, 8: 256}


def test_no_algorithm_is_one_clear_error():
    rt, lt = runtime(algorithms=0)
    with pytest.raises(RuntimeError, match="no algorithm .* --fuse 0"):
        forward_gelu(rt, DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                     DeviceArray(0x30000, N, OC),
                     DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC))
    # the plan's layouts and descriptor destroyed
    assert not lt.of("matmul") and lt.live == {rt.lt_handle}


def test_a_heuristic_that_raises_is_the_same_clear_error():
    """cuBLASLt may answer NOT_SUPPORTED (nvmath raises) instead of a count of 0: the same
    line, nothing leaked."""
    rt, lt = runtime()

    def not_supported(*args):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    lt.matmul_algo_get_heuristic = not_supported
    with pytest.raises(RuntimeError, match="no algorithm .* --fuse 0"):
        forward_gelu(rt, DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                     DeviceArray(0x30000, N, OC),
                     DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC))
    assert lt.live == {rt.lt_handle}


def test_pointer_alignment_is_the_largest_power_of_two_up_to_256():
    assert ([runtime_cupy.pointer_alignment(p)
             for p in (0x10000, 0x10100, 0x10080, 0x10004, 0x10002, 0x10001)]
            == [256, 256, 128, 4, 2, 1])


def test_bad_epilogue_arguments_are_refused_before_cublaslt():
    rt, lt = runtime()
    inp, w, out = (DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                   DeviceArray(0x30000, N, OC))
    with pytest.raises(ValueError, match="bias vector of 128"):
        rt.gemm(False, True, N, OC, C, 1.0, inp, C, 0, w, C, 0, 0.0, out, OC, 0, 1, epilogue="bias",
                bias=DeviceArray(0x40000, OC - 1))
    with pytest.raises(ValueError, match="unknown epilogue"):
        rt.gemm(False, True, N, OC, C, 1.0, inp, C, 0, w, C, 0, 0.0, out, OC, 0, 1, epilogue="relu")
    assert not lt.of("matmul")


def test_close_destroys_the_cublaslt_objects():
    rt, lt = runtime()
    forward_gelu(rt, DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                 DeviceArray(0x30000, N, OC), DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC))
    rt.close()
    assert not lt.live                  # handle, descriptor, layouts, preference


def test_without_cublaslt_one_line_says_so_and_there_are_no_epilogues(monkeypatch, capsys):
    monkeypatch.setattr(runtime_cupy, "_said_no_cublaslt", [])
    rt, _ = runtime(fail_create=RuntimeError("CUDA driver is not found"))
    assert not rt.epilogues and rt.lt is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cuBLASLt unavailable" in err and "separate kernels" in err
    runtime(fail_create=RuntimeError("again"))
    assert capsys.readouterr().err == ""                              # said once per process
    off = CupyRuntime(cupy=FakeCupy(), cublas=FakeCublas(), cublaslt=False)
    assert not off.epilogues
    from gpt2np.backends.cuda.backend import CudaBackend
    # the backend runs separate kernels
    assert not CudaBackend(off)._epilogues_ok()


def test_fake_cublaslt_has_nvmaths_interface_and_values():
    """Where nvmath-python is installed (the cuda extra): the fake's signatures and attribute types
    are the real bindings', and runtime_cupy's enum values are nvmath's."""
    lt = pytest.importorskip("nvmath.bindings.cublasLt")
    import inspect

    from nvmath.bindings import cublas
    fake = FakeCublasLt()
    for name in ("create", "destroy", "matrix_layout_create", "matrix_layout_destroy",
                 "matmul_desc_create", "matmul_desc_destroy", "matmul_desc_set_attribute",
                 "matmul_preference_create", "matmul_preference_destroy",
                 "matmul_preference_set_attribute", "matmul_algo_get_heuristic", "matmul"):
        doc = getattr(lt, name).__doc__.strip()
        real = [p.split()[-1].split("=")[0] for p in re.match(r"\w+\(([^)]*)\)", doc)[1].split(",")
                if p.strip()]
        assert real == list(inspect.signature(getattr(fake, name)).parameters), name
    for attr, dtype in FakeCublasLt.DESC_DTYPES.items():
        assert np.dtype(lt.get_matmul_desc_attribute_dtype(attr)) == np.dtype(dtype), attr
    for attr, dtype in FakeCublasLt.PREF_DTYPES.items():
        assert np.dtype(lt.get_matmul_preference_attribute_dtype(attr)) == np.dtype(dtype), attr
    assert lt.matmul_heuristic_result_dtype == FakeCublasLt.matmul_heuristic_result_dtype
    D, E, P = lt.MatmulDescAttribute, lt.Epilogue, lt.MatmulPreferenceAttribute
    assert (runtime_cupy.MATMUL_DESC_TRANSA, runtime_cupy.MATMUL_DESC_TRANSB,
            runtime_cupy.MATMUL_DESC_EPILOGUE,
            runtime_cupy.MATMUL_DESC_BIAS_POINTER, runtime_cupy.MATMUL_DESC_EPILOGUE_AUX_POINTER,
            runtime_cupy.MATMUL_DESC_EPILOGUE_AUX_LD) == (D.TRANSA, D.TRANSB,
                                                          D.EPILOGUE, D.BIAS_POINTER,
                                                          D.EPILOGUE_AUX_POINTER, D.EPILOGUE_AUX_LD)
    assert runtime_cupy.LT_EPILOGUES == {"bias": E.BIAS, "gelu_bias": E.GELU_AUX_BIAS,
                                         "dgelu": E.DGELU, "bgrad": E.BGRADB}
    assert runtime_cupy.MATMUL_PREF_MAX_WORKSPACE_BYTES == P.MAX_WORKSPACE_BYTES
    assert runtime_cupy.MATMUL_PREF_MIN_ALIGNMENT_BYTES == {"A": P.MIN_ALIGNMENT_A_BYTES,
                                                            "B": P.MIN_ALIGNMENT_B_BYTES,
                                                            "C": P.MIN_ALIGNMENT_C_BYTES,
                                                            "D": P.MIN_ALIGNMENT_D_BYTES}
    assert (runtime_cupy.CUBLAS_COMPUTE_32F, runtime_cupy.CUBLAS_COMPUTE_32F_FAST_TF32) == (
        cublas.ComputeType.COMPUTE_32F, cublas.ComputeType.COMPUTE_32F_FAST_TF32)
    assert runtime_cupy.CUBLAS_GEMM_DEFAULT == cublas.GemmAlgo.DEFAULT


def test_cuda_data_type_values_are_cudas():
    """CUDA_R_32F / CUDA_R_16BF (library_types.h's cudaDataType_t) as CuPy's runtime
    module names them."""
    runtime = pytest.importorskip("cupy.cuda.runtime")
    assert (runtime_cupy.CUDA_R_32F, runtime_cupy.CUDA_R_16BF) == (runtime.CUDA_R_32F,
                                                                   runtime.CUDA_R_16BF)


# ---- bf16 operands -------------------------------------------------------------------------------

def test_bf16_gemms_go_through_gemmex_with_fp32_compute():
    """bf16 operands: cublasGemmEx (and the strided-batched form) with CUDA_R_16BF matrices,
    CUBLAS_COMPUTE_32F and the default algorithm, operands swapped as for sgemm (row-major C^T =
    op(B)^T op(A)^T); no sgemm call."""
    from gpt2np.bf16 import BF16
    rt, _ = runtime(tf32=True)
    a, b, c = DeviceArray(0x1000, N, C, dtype=BF16), DeviceArray(0x2000, OC, C, dtype=BF16), \
        DeviceArray(0x3000, N, OC, dtype=BF16)
    rt.gemm(False, True, N, OC, C, 1.0, a, C, 0, b, C, 0, 0.0, c, OC, 0, 1)
    rt.gemm(False, False, N, OC, C, 1.0, a, C, N * C, b, OC, C * OC, 1.0, c, OC, N * OC, 3)
    (single,) = rt.cublas.of("gemmEx")
    (h, transa, transb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, Cp, ct, ldc, compute,
     algo) = single[1:]
    assert (h, transa, transb, m, n, k) == (rt.handle, 1, 0, OC, N, C)
    assert (A, lda, B, ldb, Cp, ldc) == (b.data.ptr, C, a.data.ptr, C, c.data.ptr, OC)
    assert (at, bt, ct, compute, algo) == (14, 14, 14, 68, -1)
    (batched,) = rt.cublas.of("gemmStridedBatchedEx")
    assert batched[9:12] == (14, OC, C * OC) and batched[12:15] == (a.data.ptr, 14, C)
    assert batched[-4:] == (N * OC, 3, 68, -1)
    assert not rt.cublas.of("sgemm") and not rt.cublas.of("sgemmStridedBatched")
    with pytest.raises(ValueError, match="mixed dtypes"):
        rt.gemm(False, True, N, OC, C, 1.0, a, C, 0, DeviceArray(0x4000, OC, C), C, 0, 0.0, c,
                OC, 0, 1)


def test_bf16_epilogue_plan_has_bf16_layouts_and_exact_fp32_compute():
    """An epilogue GEMM on bf16 operands: CUDA_R_16BF (14) layouts, CUBLAS_COMPUTE_32F (68, not
    TF32's 77) with fp32 scale; a plan of its own (not the fp32 plan of the same shape)."""
    from gpt2np.bf16 import BF16
    rt, lt = runtime(tf32=True)
    inp, w, out = (DeviceArray(0x10000, N, C, dtype=BF16), DeviceArray(0x20000, OC, C, dtype=BF16),
                   DeviceArray(0x30000, N, OC, dtype=BF16))
    bias, pre = DeviceArray(0x40000, OC, dtype=BF16), DeviceArray(0x50000, N, OC, dtype=BF16)
    forward_gelu(rt, inp, w, out, bias, pre)
    assert [c[1:] for c in lt.of("matrix_layout_create")] == [(14, C, OC, C), (14, C, N, C),
                                                              (14, OC, N, OC)]
    assert lt.of("matmul_desc_create") == [("matmul_desc_create", 68, 0)]
    forward_gelu(rt, DeviceArray(0x10000, N, C), DeviceArray(0x20000, OC, C),
                 DeviceArray(0x30000, N, OC), DeviceArray(0x40000, OC), DeviceArray(0x50000, N, OC))
    assert (len(lt.of("matmul_desc_create")) == 2
            and lt.of("matmul_desc_create")[1] == ("matmul_desc_create", 77, 0))
