"""The linear layers: a GEMM and a bias (kernels/matmul.cu)."""
import numpy as np


def matmul_forward(out, inp, weight, bias):
    """out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC); bias may be None. Rows may be (B,T)."""
    OC, C = weight.shape
    np.matmul(inp.reshape(-1, C), weight.T, out=out.reshape(-1, OC))
    if bias is not None:
        out += bias


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, accumulate=True):
    """dinp (N,C) = dout (N,OC) @ weight (OC,C);  dweight (OC,C) += dout^T @ inp;
    dbias (OC) += sum of dout over the rows (dbias may be None). accumulate=False: = for +=."""
    OC, C = weight.shape
    dout, inp = dout.reshape(-1, OC), inp.reshape(-1, C)
    if dbias is not None:
        matmul_backward_bias(dbias, dout, accumulate)
    np.matmul(dout, weight, out=dinp.reshape(-1, C))
    if accumulate:
        dweight += np.matmul(dout.T, inp)
    else:
        np.matmul(dout.T, inp, out=dweight)


def matmul_backward_bias(dbias, dout, accumulate=True):
    """dbias (OC) += sum of dout (N,OC) over its rows (= without accumulate)."""
    sums = dout.reshape(-1, dbias.shape[0]).sum(axis=0)
    if accumulate:
        dbias += sums
    else:
        dbias[...] = sums
