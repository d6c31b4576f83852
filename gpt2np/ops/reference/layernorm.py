"""LayerNorm over the channels of each row (kernels/layernorm.cu)."""
import numpy as np

EPS = 1e-5


def layernorm_forward(out, mean, rstd, inp, weight, bias):
    """out (N,C) = (inp - mean) * rstd * weight (C) + bias (C); saves mean, rstd (N).
    Rows may be (B,T)."""
    C = inp.shape[-1]
    x, out, mean, rstd = inp.reshape(-1, C), out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    np.mean(x, axis=-1, out=mean)
    np.subtract(x, mean[:, None], out=out)                    # out holds x - mean
    var = np.einsum("nc,nc->n", out, out) / C
    np.divide(1.0, np.sqrt(var + EPS), out=rstd, casting="unsafe")
    out *= rstd[:, None]
    out *= weight
    out += bias


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
    """dinp (N,C) += d inp;  dweight, dbias (C) += (= with accumulate=False);
    from dout (N,C), inp (N,C), weight (C) and the saved mean, rstd (N)."""
    x_hat = np.empty(dout.shape, dout.dtype)
    layernorm_backward_rows(dinp, x_hat, dout, inp, weight, mean, rstd)
    layernorm_backward_params(dweight, dbias, dout, x_hat, accumulate)


def layernorm_backward_rows(dinp, x_hat, dout, inp, weight, mean, rstd):
    """dinp (N,C) += (g - mean(g) - x_hat mean(g x_hat)) rstd, with g = dout * weight, each row
    alone; x_hat (N,C) = (inp - mean) * rstd is written too (the parameter gradients need it)."""
    C = inp.shape[-1]
    dinp, x_hat, dout, inp = (a.reshape(-1, C) for a in (dinp, x_hat, dout, inp))
    mean, rstd = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    np.multiply(inp - mean, rstd, out=x_hat)
    g = dout * weight                                          # d x_hat
    g_mean = g.mean(axis=-1, keepdims=True)
    g_x_hat_mean = np.einsum("nc,nc->n", g, x_hat)[:, None] / C
    dinp += (g - g_mean - x_hat * g_x_hat_mean) * rstd


def layernorm_backward_params(dweight, dbias, dout, x_hat, accumulate=True):
    """dbias (C) += sum over rows of dout;  dweight (C) += sum over rows of dout * x_hat (= without
    accumulate). Sums over all rows at once (NumPy adds along the rows in order)."""
    C = dout.shape[-1]
    dout, x_hat = dout.reshape(-1, C), x_hat.reshape(-1, C)
    sums, dots = dout.sum(axis=0), np.einsum("nc,nc->c", dout, x_hat)
    if accumulate:
        dbias += sums
        dweight += dots
    else:
        dbias[...] = sums
        dweight[...] = dots
