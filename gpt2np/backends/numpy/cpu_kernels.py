"""The numpy backend's C loops, in two sets (one library, built on first use).

SOURCE, the exact set: small loops that do, in one pass over memory, the element-wise float32 work that NumPy
does in many (AdamW: 13 passes over params, grads and moments; GELU: the arithmetic around np.tanh; LayerNorm and
attention's softmax: the arithmetic around their row sums and np.exp; attention's head split and merge; the
token embedding gradient's np.add.at; bf16's stochastic rounding: its integer hash, bf16.round_stochastic's bit for
bit; llm.c's random init's Box-Muller in the C library's logf/cosf/sinf, gpt2np.init's). Each loop performs exactly
the float32 operations of the NumPy code it stands for, in the same order, each rounded to float32 (no FMA
contraction, no fast-math), so its results are BITWISE those of the NumPy code (tests/test_cpu_kernels.py checks
it, and the golden run pins it). What NumPy computes with its own approximations (tanh, exp) or with its own
summation order (sums, means) stays NumPy.

FAST_SOURCE, the fast set (NumpyBackend(math="fast"), the trainer's default, --cpu-math): whole ops in one loop each,
with their own e^x (exp8, 8 lanes at a time: within 1.02 ulp of the float64 value, where NumPy's float32 exp is within
about 2.5 and, on this kind of CPU, not vectorized: 2.2 ns an element against 0.75; GELU and the softmaxes clamp their
arguments first and skip its selects), every row sum in double (the norm's: float blocks of 1024 added in double), and
FMA contraction allowed: GELU forward and backward (through sigmoid(2u) = (1 + tanh u) / 2, one e^x and no cancellation
near GELU's zero), LayerNorm forward and backward rows, causal attention forward and backward per head (the masked half
of its products skipped), the classifier's softmax + cross-entropy, the sum of squares. They are not bitwise NumPy's;
the documented tolerance is a bound per op on the distance from the float64 value of the same formula
(tests/test_cpu_fast.py lists them), and training runs track the exact path's loss curve. Results do not depend on the
thread count (every row is computed alone), only on the machine's vector width and FMA (the library is built with
-march=native).

Both are built with the system C compiler ($CC, else cc, gcc) into $GPT2NP_CPU_CACHE (default
~/.cache/gpt2np/cpu), keyed by the sources, the flags, the compiler and the CPU; when no compiler works, load()
returns None and the backend runs its NumPy code.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* AdamW, the NumPy sequence of NumpyBackend.adamw_update per element:
   m = m*beta1 + g*c_m;  v = v*beta2 + (g*g)*c_v;  u = (m / (sqrt(v) + eps)) * step;  p = p*decay - u */
void adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, ptrdiff_t n,
           float c_m, float beta1, float c_v, float beta2, float eps, float step, float decay, int decayed)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = m[i] * beta1;
        mi = mi + gi * c_m;
        float g2 = gi * gi;
        g2 = g2 * c_v;
        float vi = v[i] * beta2;
        vi = vi + g2;
        float u = sqrtf(vi);
        u = u + eps;
        u = mi / u;
        u = u * step;
        float pi = p[i];
        if (decayed)
            pi = pi * decay;
        p[i] = pi - u;
        m[i] = mi;
        v[i] = vi;
    }
}

/* GELU's tanh argument: u = ((x*x*cube + 1) * x) * scale */
void gelu_arg(const float *restrict x, float *restrict u, ptrdiff_t n, float cube, float scale)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float xi = x[i];
        float y = xi * xi;
        y = y * cube;
        y = y + 1.0f;
        y = y * xi;
        u[i] = y * scale;
    }
}

/* GELU forward from th = tanh(u) (in out): out = ((th + 1) * x) * 0.5 */
void gelu_out(const float *restrict x, float *restrict out, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float y = out[i] + 1.0f;
        y = y * x[i];
        out[i] = y * 0.5f;
    }
}

/* GELU backward from th = tanh(u): dinp = dout * (((x*x*cube3 + 1) * half_scale) * x * (1 - th*th)
   + (th + 1) * 0.5). dinp may be dout. */
void gelu_grad(const float *restrict x, const float *restrict th, const float *dout, float *dinp, ptrdiff_t n,
               float cube3, float half_scale)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float xi = x[i];
        float d = xi * xi;
        d = d * cube3;
        d = d + 1.0f;
        d = d * half_scale;
        d = d * xi;
        float t = th[i];
        float s = t * t;
        s = 1.0f - s;
        d = d * s;
        t = t + 1.0f;
        t = t * 0.5f;
        d = d + t;
        dinp[i] = dout[i] * d;
    }
}

/* LayerNorm over rows of C: o = x - mean[r] */
void ln_center(const float *restrict x, const float *restrict mean, float *restrict o, ptrdiff_t rows, ptrdiff_t C)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < C; c++)
            o[r * C + c] = x[r * C + c] - mean[r];
}

/* o = ((o * rstd[r]) * weight) + bias */
void ln_scale(float *restrict o, const float *restrict rstd, const float *restrict weight,
              const float *restrict bias, ptrdiff_t rows, ptrdiff_t C)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < C; c++) {
            float y = o[r * C + c] * rstd[r];
            y = y * weight[c];
            o[r * C + c] = y + bias[c];
        }
}

/* x_hat = (x - mean[r]) * rstd[r] */
void ln_xhat(const float *restrict x, const float *restrict mean, const float *restrict rstd,
             float *restrict xh, ptrdiff_t rows, ptrdiff_t C)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < C; c++) {
            float y = x[r * C + c] - mean[r];
            xh[r * C + c] = y * rstd[r];
        }
}

/* dinp += ((dxh - m1[r]) - x_hat * m2[r]) * rstd[r] */
void ln_dinp(const float *restrict dxh, const float *restrict xh, const float *restrict m1,
             const float *restrict m2, const float *restrict rstd, float *restrict dinp, ptrdiff_t rows, ptrdiff_t C)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < C; c++) {
            float d = dxh[r * C + c] - m1[r];
            d = d - xh[r * C + c] * m2[r];
            d = d * rstd[r];
            dinp[r * C + c] = dinp[r * C + c] + d;
        }
}

/* attention, batch entries [0, nb) of pointers already at the first: qkvr[i][b][h][t] = inp[b][t][i][h] (HS floats
   each); `plane` is the distance between qkvr's q, k and v planes */
void att_split(const float *restrict inp, float *restrict qkvr, ptrdiff_t nb, ptrdiff_t T, ptrdiff_t NH,
               ptrdiff_t HS, ptrdiff_t plane)
{
    for (ptrdiff_t b = 0; b < nb; b++)
        for (ptrdiff_t t = 0; t < T; t++)
            for (ptrdiff_t i = 0; i < 3; i++)
                for (ptrdiff_t h = 0; h < NH; h++) {
                    const float *src = inp + (((b * T + t) * 3 + i) * NH + h) * HS;
                    float *dst = qkvr + i * plane + ((b * NH + h) * T + t) * HS;
                    for (ptrdiff_t c = 0; c < HS; c++)
                        dst[c] = src[c];
                }
}

/* the way back, for `parts` planes (1: y (b,NH,T,HS) -> out (b,T,C); 3: dqkvr -> dinp (b,T,3C)) */
void att_merge(const float *restrict src, float *restrict out, ptrdiff_t nb, ptrdiff_t T, ptrdiff_t NH,
               ptrdiff_t HS, ptrdiff_t parts, ptrdiff_t plane)
{
    for (ptrdiff_t b = 0; b < nb; b++)
        for (ptrdiff_t t = 0; t < T; t++)
            for (ptrdiff_t i = 0; i < parts; i++)
                for (ptrdiff_t h = 0; h < NH; h++) {
                    const float *s = src + i * plane + ((b * NH + h) * T + t) * HS;
                    float *d = out + (((b * T + t) * parts + i) * NH + h) * HS;
                    for (ptrdiff_t c = 0; c < HS; c++)
                        d[c] = s[c];
                }
}

/* rows of T scores, row r for query t = r % T: a = a*scale + mask (0 where s <= t, -inf after); a -= max(row)
   (a NaN in the row makes the max NaN, as NumPy's) */
void softmax_shift(float *restrict a, ptrdiff_t rows, ptrdiff_t T, float scale)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        float *x = a + r * T;
        ptrdiff_t t = r % T;
        for (ptrdiff_t s = 0; s <= t; s++)
            x[s] = x[s] * scale + 0.0f;                   /* + 0 as NumPy adds the mask's 0 (-0 becomes +0) */
        for (ptrdiff_t s = t + 1; s < T; s++)
            x[s] = x[s] * scale + -INFINITY;
        float m = x[0];
        int nan = 0;
        for (ptrdiff_t s = 0; s < T; s++) {
            m = x[s] > m ? x[s] : m;
            nan |= x[s] != x[s];
        }
        if (nan)
            for (ptrdiff_t s = 0; s < T; s++)
                if (x[s] != x[s]) {
                    m = x[s];
                    break;
                }
        for (ptrdiff_t s = 0; s < T; s++)
            x[s] = x[s] - m;
    }
}

/* a[r] /= sums[r] over rows of T */
void rows_divide(float *restrict a, const float *restrict sums, ptrdiff_t rows, ptrdiff_t T)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t s = 0; s < T; s++)
            a[r * T + s] = a[r * T + s] / sums[r];
}

/* softmax backward: datt = ((datt - dots[r]) * att) * scale */
void softmax_grad(float *restrict datt, const float *restrict att, const float *restrict dots, ptrdiff_t rows,
                  ptrdiff_t T, float scale)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t s = 0; s < T; s++) {
            float d = datt[r * T + s] - dots[r];
            d = d * att[r * T + s];
            datt[r * T + s] = d * scale;
        }
}

/* bf16 stochastic rounding (gpt2np/bf16.py's round_stochastic, bit for bit): r = the top 16 bits of
   SplitMix64's finalizer of key + (offset + i + 1) * gamma; out = x's top 16 bits, plus 1 when r < its low 16 bits
   (a carry runs into the exponent, as it should); NaN -> the quiet NaN `qnan`. Integer arithmetic only. */
void round_stochastic(const float *restrict x, unsigned short *restrict out, ptrdiff_t n, unsigned long long key,
                      unsigned long long offset, unsigned short qnan)
{
    const unsigned int *u = (const unsigned int *)x;
    for (ptrdiff_t i = 0; i < n; i++) {
        unsigned long long z = key + (offset + (unsigned long long)i + 1ULL) * 0x9E3779B97F4A7C15ULL;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        unsigned int r = (unsigned int)(z >> 48), ui = u[i];
        unsigned short hi = (unsigned short)((ui >> 16) + (r < (ui & 0xFFFFu)));
        out[i] = x[i] != x[i] ? qnan : hi;
    }
}

/* column sums over rows of C, columns [c0, c1), as NumPy's sum(axis=0) and einsum("nc,nc->c") add them:
   from 0, row after row. sums[c] = 0 + x[0][c] + x[1][c] + ...;  dots[c] = 0 + x[0][c]*y[0][c] + ... (y may be
   NULL: no dots) */
void col_sums(const float *restrict x, const float *restrict y, float *restrict sums, float *restrict dots,
              ptrdiff_t rows, ptrdiff_t C, ptrdiff_t c0, ptrdiff_t c1)
{
    for (ptrdiff_t c = c0; c < c1; c++)
        sums[c] = 0.0f;
    if (y)
        for (ptrdiff_t c = c0; c < c1; c++)
            dots[c] = 0.0f;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        for (ptrdiff_t c = c0; c < c1; c++)
            sums[c] = sums[c] + xr[c];
        if (y) {
            const float *yr = y + r * C;
            for (ptrdiff_t c = c0; c < c1; c++)
                dots[c] = dots[c] + xr[c] * yr[c];
        }
    }
}

/* llm.c's normal_ (llmc/rand.h, PyTorch's CPU normal_ for float tensors) from its mt19937 draws, in the C library's
   logf, cosf, sinf and float32 arithmetic as that code compiles without fast-math (what init.llmc_normal says).
   n >= 16: u[t] = (draws[t] & (2^24 - 1)) / 2^24; each block of 16 pairs u[t] with u[t + 8] (Box-Muller,
   radius from 1 - u[t], angle 2 pi u[t + 8]: cos to t, sin to t + 8); when 16 does not divide n, the last 16
   values are redone from draws[n:n+16]. n < 16: two values per two 53-bit doubles (four draws, high word first).
   out: n floats; draws: n (+16) or 4 * ceil(n / 2) values. */
static void box_muller16(float *d, float mean, float std)
{
    for (int t = 0; t < 8; t++) {
        float u1 = 1.0f - d[t];
        float u2 = d[t + 8];
        float radius = sqrtf(-2.0f * logf(u1 + 1e-12f));
        float theta = (float)(6.283185307179586 * (double)u2);
        d[t] = radius * cosf(theta) * std + mean;
        d[t + 8] = radius * sinf(theta) * std + mean;
    }
}

void llmc_normal(float *restrict out, const uint32_t *restrict draws, ptrdiff_t n, float mean, float std)
{
    const float unit = 1.0f / 16777216.0f;
    if (n >= 16) {
        for (ptrdiff_t t = 0; t < n; t++)
            out[t] = (float)(draws[t] & 0xFFFFFFu) * unit;
        for (ptrdiff_t i = 0; i + 16 <= n; i += 16)
            box_muller16(out + i, mean, std);
        if (n % 16) {
            for (int i = 0; i < 16; i++)
                out[n - 16 + i] = (float)(draws[n + i] & 0xFFFFFFu) * unit;
            box_muller16(out + n - 16, mean, std);
        }
        return;
    }
    const double unit53 = 1.0 / 9007199254740992.0;
    for (ptrdiff_t t = 0, k = 0; t < n; t += 2, k += 4) {
        uint64_t a = ((uint64_t)draws[k] << 32) | draws[k + 1], b = ((uint64_t)draws[k + 2] << 32) | draws[k + 3];
        float u1 = (float)((double)(a & ((1ull << 53) - 1)) * unit53);
        float u2 = (float)((double)(b & ((1ull << 53) - 1)) * unit53);
        float radius = sqrtf(-2.0f * logf(1.0f - u2 + 1e-12f));
        float theta = (float)(6.283185307179586 * (double)u1);
        double second = radius * sinf(theta);
        out[t] = radius * cosf(theta) * std + mean;
        if (t + 1 < n)
            out[t + 1] = (float)(second * std + mean);
    }
}

/* np.add.at(dst, idx, src) for rows of C: dst[idx[i]] += src[i] for i = 0, 1, ..., n-1 in that order (a repeated
   index adds in turn, as NumPy does). The caller checks 0 <= idx[i] < dst's rows. */
void rows_add_at(float *restrict dst, const int32_t *restrict idx, const float *restrict src, ptrdiff_t n,
                 ptrdiff_t C)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float *d = dst + (ptrdiff_t)idx[i] * C;
        const float *r = src + i * C;
        for (ptrdiff_t c = 0; c < C; c++)
            d[c] = d[c] + r[c];
    }
}
"""

FAST_SOURCE = r"""
#include <math.h>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Vectors of 8 floats in GCC's vector extension (one AVX register here; the compiler splits or lowers them
   elsewhere), written out where GCC's own vectorization of a scalar loop costs more (GELU's clamps became extra
   divisions) or cannot reach (attention's register blocks). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LOAD8(p) (*(const v8u *)(p))
#define STORE8(p, x) (*(v8u *)(p) = (x))

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 select8(vi8 mask, v8 a, v8 b) { return (v8)((mask & (vi8)a) | (~mask & (vi8)b)); }

/* x clamped to [lo, hi], a NaN to lo: AVX's max and min where there is AVX (one instruction each, where the selects
   cost two or three), the selects elsewhere */
static inline v8 clamp8(v8 x, float lo, float hi)
{
#ifdef __AVX__
    return (v8)_mm256_min_ps(_mm256_max_ps((__m256)x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
#else
    x = select8(x > splat8(lo), x, splat8(lo));
    return select8(x < splat8(hi), x, splat8(hi));
#endif
}

/* e^x, exp8 below: within 1.02 ulp of the float64 value (every float32 in +-[1, 64], tests/test_cpu_fast.py).
   n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r = 1 + r + r^2 P(r) on [-ln2/2, ln2/2] with P a
   least-squares fit of degree 4, scaled by 2^n. exp8_reduced: e^r and n, for x in [-87.33654, 88.72283]. */
static inline v8 exp8_reduced(v8 x, vi8 *n_out)
{
    v8 round = splat8(12582912.0f);                    /* round to nearest by 1.5 * 2^23 */
    v8 n = (x * 1.44269504088896341f + round) - round;
    v8 r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    v8 p = splat8(0.0013751408181292297f);
    p = p * r + 0.008368919080973128f;
    p = p * r + 0.04166953339547563f;
    p = p * r + 0.16666518437209643f;
    p = p * r + 0.49999988592958855f;
    p = p * (r * r) + r;
    *n_out = __builtin_convertvector(n, vi8);
    return p + 1.0f;
}

/* e^x: +inf above 88.72283, 0 below -87.33654 (no subnormals), NaN kept; 2^n in two factors (n may be 128) */
static inline v8 exp8(v8 x)
{
    vi8 n;
    v8 p = exp8_reduced(clamp8(x, -87.33654f, 88.72283f), &n);     /* a NaN to the low end: no NaN to int */
    vi8 n1 = n >> 1;
    v8 y = (p * (v8)((n1 + 127) << 23)) * (v8)((n - n1 + 127) << 23);
    y = select8(x > splat8(88.72283f), splat8(INFINITY), y);
    y = select8(x < splat8(-87.33654f), splat8(0.0f), y);
    return select8(x == x, y, x);
}

/* e^z for z in [-87.33654, 88] (the callers clamp): one scale factor 2^n serves (-126 <= n <= 127) */
static inline v8 exp8_in_range(v8 z)
{
    vi8 n;
    v8 p = exp8_reduced(z, &n);
    return p * (v8)((n + 127) << 23);
}

/* e^z for z <= 0 (a softmax's shifted scores) or NaN: exp8's values there, its 0 below -87.33654 and its NaN
   kept by selects */
static inline v8 exp8_nonpositive(v8 z)
{
    v8 lo = splat8(-87.33654f);
    v8 e = exp8_in_range(select8(z > lo, z, lo));
    e = select8(z < lo, splat8(0.0f), e);
    return select8(z == z, e, z);
}

/* a loop's last n < 8 elements through the same 8-lane code: the lanes past n are `pad` */
static inline v8 load_tail8(const float *x, ptrdiff_t n, float pad)
{
    float lanes[8] = {pad, pad, pad, pad, pad, pad, pad, pad};
    memcpy(lanes, x, (size_t)n * sizeof(float));
    return LOAD8(lanes);
}

static inline void store_tail8(float *x, v8 y, ptrdiff_t n)
{
    float lanes[8];
    STORE8(lanes, y);
    memcpy(x, lanes, (size_t)n * sizeof(float));
}

/* Sums in double, in 8 lanes (vectorizable); the lanes are added pairwise at the end. */
#define LANES 8
static inline double lanes_total(double *acc)
{
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    return acc[0];
}

static inline double sum_f(const float *restrict x, ptrdiff_t n)
{
    double acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += (double)x[i + j];
    for (; i < n; i++)
        acc[0] += (double)x[i];
    return lanes_total(acc);
}

static inline float max_f(const float *restrict x, ptrdiff_t n)
{
    v8 m0 = splat8(-INFINITY), m1 = m0;
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8 a = LOAD8(x + i), b = LOAD8(x + i + 8);
        m0 = select8(a > m0, a, m0);
        m1 = select8(b > m1, b, m1);
    }
    float m[16], r = -INFINITY;
    STORE8(m, m0);
    STORE8(m + 8, m1);
    for (int j = 0; j < 16; j++)
        r = m[j] > r ? m[j] : r;
    for (; i < n; i++)
        r = x[i] > r ? x[i] : r;
    return r;
}

static inline double dot_f(const float *restrict x, const float *restrict y, ptrdiff_t n)
{
    double acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += (double)x[i + j] * (double)y[i + j];
    for (; i < n; i++)
        acc[0] += (double)x[i] * (double)y[i];
    return lanes_total(acc);
}

/* acc[j] += (double)e[j] for the 8 lanes */
static inline void add_lanes8(double *restrict acc, v8 e)
{
    float lanes[8];
    STORE8(lanes, e);
    for (int j = 0; j < 8; j++)
        acc[j] += (double)lanes[j];
}

/* dst[i] = e^{src[i] - m} for i < n (dst may be src, or NULL: the sum alone), returning their sum in double: 8 lanes,
   added pairwise at the end; the last n % 8 through the same code, padded with -inf (e^-inf = 0) */
static inline double exp_shifted_sum(float *dst, const float *src, ptrdiff_t n, float m)
{
    double acc[8] = {0};
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 e = exp8_nonpositive(LOAD8(src + i) - m);
        if (dst)
            STORE8(dst + i, e);
        add_lanes8(acc, e);
    }
    if (i < n) {
        v8 e = exp8_nonpositive(load_tail8(src + i, n - i, -INFINITY) - m);
        if (dst)
            store_tail8(dst + i, e, n - i);
        add_lanes8(acc, e);
    }
    return lanes_total(acc);
}

/* GELU's e^{-2u}, u = scale (x + cube x^3), with -2u clamped to [-87.33654, 88] (a NaN to the low end): outside,
   1 + e is 1 to float32 precision, or e ~ 1.7e38, so that x / (1 + e) is 0 but for a few 1e-38 (x 6e-39). */
static inline v8 gelu_exp8(v8 x, v8 x2, float cube, float scale)
{
    return exp8_in_range(clamp8((x2 * cube + 1.0f) * x * (-2.0f * scale), -87.33654f, 88.0f));
}

/* GELU, tanh form: 0.5 x (1 + tanh u) = x sigmoid(2u) = x / (1 + e^{-2u}); -inf gives NaN, as 0.5 x (1 + tanh u)
   does (-inf * 0). Each element alone, in 8 lanes. */
static inline v8 gelu8(v8 x, float cube, float scale)
{
    v8 y = x / (1.0f + gelu_exp8(x, x * x, cube, scale));
    return select8(x == splat8(-INFINITY), splat8(NAN), y);
}

void gelu_forward_fast(const float *restrict x, float *restrict out, ptrdiff_t n, float cube, float scale)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        STORE8(out + i, gelu8(LOAD8(x + i), cube, scale));
    if (i < n)
        store_tail8(out + i, gelu8(load_tail8(x + i, n - i, 0.0f), cube, scale), n - i);
}

/* gelu' = sg + 2 x sg (1 - sg) scale (1 + 3 cube x^2), sg = sigmoid(2u); 1 - sg taken as e sg where e = e^{-2u}
   <= 1 (no cancellation). x is taken in [-12, 12]: beyond, gelu' is 1 or 0 to float32 precision, and the clamped e
   (1e-38 where it is 0, 1.7e38 where it overflows) would meet the x^3 factor's growth (wrong from |x| ~ 6e10 on).
   A non-finite x gives NaN (+ (x - x)), as the tanh form does (inf * 0). */
static inline v8 gelu_grad8(v8 x, float cube, float scale)
{
    v8 xc = clamp8(x, -12.0f, 12.0f);
    v8 x2 = xc * xc;
    v8 e = gelu_exp8(xc, x2, cube, scale);
    v8 sg = 1.0f / (1.0f + e);
    v8 rest = select8(e > splat8(1.0f), 1.0f - sg, e * sg);
    return sg + 2.0f * xc * sg * rest * scale * (3.0f * cube * x2 + 1.0f) + (x - x);
}

/* dinp = dout * gelu'(x); dinp may be dout */
void gelu_backward_fast(const float *restrict x, const float *dout, float *dinp, ptrdiff_t n, float cube,
                        float scale)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 d = LOAD8(dout + i) * gelu_grad8(LOAD8(x + i), cube, scale);
        STORE8(dinp + i, d);
    }
    if (i < n) {
        v8 d = load_tail8(dout + i, n - i, 0.0f) * gelu_grad8(load_tail8(x + i, n - i, 0.0f), cube, scale);
        store_tail8(dinp + i, d, n - i);
    }
}

/* LayerNorm forward over rows of C: mean, var in double; out = (x - mean) rstd w + b. */
void layernorm_forward_fast(const float *restrict x, float *restrict out, float *restrict mean, float *restrict rstd,
                            const float *restrict w, const float *restrict b, ptrdiff_t rows, ptrdiff_t C, float eps)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float *o = out + r * C;
        float mu = (float)(sum_f(xr, C) / (double)C);
        for (ptrdiff_t c = 0; c < C; c++)
            o[c] = xr[c] - mu;
        float var = (float)(dot_f(o, o, C) / (double)C);
        float rs = 1.0f / sqrtf(var + eps);
        for (ptrdiff_t c = 0; c < C; c++)
            o[c] = o[c] * rs * w[c] + b[c];
        mean[r] = mu;
        rstd[r] = rs;
    }
}

/* LayerNorm backward over rows: x_hat = (x - mean) rstd, g = dout w, dinp += (g - mean(g) - x_hat mean(g x_hat)) rstd;
   and the parameter gradients' partial sums in double, one pair per block of `block` rows (row 0 starts a block):
   parts[b] = [sum dout x_hat (C) | sum dout (C)] over block b's rows, added in row order. The caller adds the blocks
   in order, so neither depends on how the rows were split over threads. work: 2C floats (this row's x_hat and g). */
void layernorm_backward_fast(const float *restrict x, const float *restrict dout, const float *restrict w,
                             const float *restrict mean, const float *restrict rstd, float *restrict work,
                             float *restrict dinp, double *restrict parts, ptrdiff_t rows, ptrdiff_t C,
                             ptrdiff_t block)
{
    float *restrict hr = work, *restrict g = work + C;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *xr = x + r * C, *dr = dout + r * C;
        float *ir = dinp + r * C;
        double *pw = parts + (r / block) * 2 * C, *pb = pw + C;
        if (r % block == 0)
            for (ptrdiff_t c = 0; c < 2 * C; c++)
                pw[c] = 0.0;
        float mu = mean[r], rs = rstd[r];
        for (ptrdiff_t c = 0; c < C; c++) {
            hr[c] = (xr[c] - mu) * rs;
            g[c] = dr[c] * w[c];
        }
        float m1 = (float)(sum_f(g, C) / (double)C), m2 = (float)(dot_f(g, hr, C) / (double)C);
        for (ptrdiff_t c = 0; c < C; c++) {
            ir[c] = ir[c] + (g[c] - m1 - hr[c] * m2) * rs;
            pw[c] += (double)dr[c] * (double)hr[c];
            pb[c] += (double)dr[c];
        }
    }
}

/* Attention's products, head by head, in 8-float vectors: heads of 64 (every GPT-2 size) keep a whole output row in
   registers. */

/* acc[0:HS] = sum_{i<n} c[i*cstride] rows[i*stride + 0:HS] (the sum in order of i) */
static inline void rows_combine(float *restrict acc, const float *restrict c, ptrdiff_t cstride,
                                const float *restrict rows, ptrdiff_t stride, ptrdiff_t n, ptrdiff_t HS)
{
    if (HS == 64) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (ptrdiff_t i = 0; i < n; i++) {
            const float *r = rows + i * stride;
            float ci = c[i * cstride];
            a0 += ci * LOAD8(r);
            a1 += ci * LOAD8(r + 8);
            a2 += ci * LOAD8(r + 16);
            a3 += ci * LOAD8(r + 24);
            a4 += ci * LOAD8(r + 32);
            a5 += ci * LOAD8(r + 40);
            a6 += ci * LOAD8(r + 48);
            a7 += ci * LOAD8(r + 56);
        }
        STORE8(acc, a0);
        STORE8(acc + 8, a1);
        STORE8(acc + 16, a2);
        STORE8(acc + 24, a3);
        STORE8(acc + 32, a4);
        STORE8(acc + 40, a5);
        STORE8(acc + 48, a6);
        STORE8(acc + 56, a7);
        return;
    }
    for (ptrdiff_t d = 0; d < HS; d++)
        acc[d] = 0.0f;
    for (ptrdiff_t i = 0; i < n; i++) {
        const float *r = rows + i * stride;
        float ci = c[i * cstride];
        for (ptrdiff_t d = 0; d < HS; d++)
            acc[d] = acc[d] + ci * r[d];
    }
}

/* out[r*Tp + s] = sum_{d<HS} a[r*HS + d] bt[d*Tp + s] for 4 rows r and s < n16 (a multiple of 16, <= Tp): four rows
   of a times the transposed matrix bt (HS, Tp), 4 x 16 results in registers */
static inline void scores4(float *restrict out, const float *restrict a, const float *restrict bt, ptrdiff_t Tp,
                           ptrdiff_t n16, ptrdiff_t HS)
{
    for (ptrdiff_t s = 0; s < n16; s += 16) {
        v8 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
        for (ptrdiff_t d = 0; d < HS; d++) {
            v8 b0 = LOAD8(bt + d * Tp + s), b1 = LOAD8(bt + d * Tp + s + 8);
            float x0 = a[d], x1 = a[HS + d], x2 = a[2 * HS + d], x3 = a[3 * HS + d];
            c00 += x0 * b0;
            c01 += x0 * b1;
            c10 += x1 * b0;
            c11 += x1 * b1;
            c20 += x2 * b0;
            c21 += x2 * b1;
            c30 += x3 * b0;
            c31 += x3 * b1;
        }
        STORE8(out + s, c00);
        STORE8(out + s + 8, c01);
        STORE8(out + Tp + s, c10);
        STORE8(out + Tp + s + 8, c11);
        STORE8(out + 2 * Tp + s, c20);
        STORE8(out + 2 * Tp + s + 8, c21);
        STORE8(out + 3 * Tp + s, c30);
        STORE8(out + 3 * Tp + s + 8, c31);
    }
}

/* dst[c*dstride + r] = src[r*sstride + c] for r < rows, c < cols */
static inline void transpose(float *restrict dst, ptrdiff_t dstride, const float *restrict src, ptrdiff_t sstride,
                             ptrdiff_t rows, ptrdiff_t cols)
{
    for (ptrdiff_t c = 0; c < cols; c++)                /* strided loads, not strided stores */
        for (ptrdiff_t r = 0; r < rows; r++)
            dst[c * dstride + r] = src[r * sstride + c];
}

/* a4 (4, HS) = rows t0..t0+3 of src (rows stride apart), rows past T zero */
static inline void four_rows(float *restrict a4, const float *restrict src, ptrdiff_t stride, ptrdiff_t t0,
                             ptrdiff_t T, ptrdiff_t HS)
{
    for (ptrdiff_t r = 0; r < 4; r++)
        for (ptrdiff_t d = 0; d < HS; d++)
            a4[r * HS + d] = t0 + r < T ? src[(t0 + r) * stride + d] : 0.0f;
}

static inline ptrdiff_t up16(ptrdiff_t n) { return (n + 15) / 16 * 16; }

/* the causal softmax of one row of scores x for query t = n - 1 into p (T): p[s] = e^{scale x[s] - max} / sum for
   s < n, 0 after (exactly); the sum in double */
static inline void softmax_causal_row(float *restrict p, float *restrict x, ptrdiff_t n, ptrdiff_t T, float scale)
{
    for (ptrdiff_t s = 0; s < n; s++)
        x[s] = x[s] * scale;
    float m = max_f(x, n);
    float total = (float)exp_shifted_sum(p, x, n, m);
    ptrdiff_t s;
    for (s = 0; s < n; s++)
        p[s] = p[s] / total;
    for (s = n; s < T; s++)
        p[s] = 0.0f;
}

/* Causal self-attention forward of heads lo:hi (head j = batch j / NH, head j % NH), the masked half skipped.
   inp (B,T,3C) = [q | k | v]; qkvr (3,B,NH,T,HS), plane = B*NH*T*HS apart, gets each head's q, k, v;
   att (B,NH,T,T) = softmax(scale q k^T), 0 above the diagonal; out (B,T,C) = att v, heads concatenated.
   Strictly causal: a NaN or inf in a later k or v does not reach earlier rows (in the NumPy code it does, through
   -inf + NaN and 0 * NaN; the loss is NaN either way). work: (HS + 4) * Tp + 4 * HS floats, Tp = T rounded up
   to 16. */
void attention_forward_fast(const float *restrict inp, float *restrict qkvr, float *restrict att, float *restrict out,
                            ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t T, ptrdiff_t NH, ptrdiff_t HS, ptrdiff_t plane,
                            float scale, float *restrict work)
{
    ptrdiff_t C = NH * HS, Tp = up16(T);
    float *kt = work, *sc = kt + HS * Tp, *a4 = sc + 4 * Tp;
    for (ptrdiff_t i = 0; i < HS * Tp; i++)
        kt[i] = 0.0f;                                   /* the columns past T stay 0 */
    /* q, k, v of the heads into qkvr, reading inp row by row (its rows are 3C long: head by head, the reads
       would be 64-float pieces far apart) */
    for (ptrdiff_t b = lo / NH; b * NH < hi; b++) {
        ptrdiff_t h0 = (lo > b * NH ? lo : b * NH) - b * NH, h1 = (hi < (b + 1) * NH ? hi : (b + 1) * NH) - b * NH;
        for (ptrdiff_t t = 0; t < T; t++) {
            const float *row = inp + (b * T + t) * 3 * C;
            for (ptrdiff_t part = 0; part < 3; part++)
                for (ptrdiff_t h = h0; h < h1; h++)
                    memcpy(qkvr + part * plane + ((b * NH + h) * T + t) * HS, row + part * C + h * HS,
                           (size_t)HS * sizeof(float));
        }
    }
    for (ptrdiff_t j = lo; j < hi; j++) {
        ptrdiff_t b = j / NH, h = j % NH;
        const float *q = qkvr + j * T * HS, *k = q + plane, *v = k + plane;
        transpose(kt, Tp, k, HS, T, HS);
        for (ptrdiff_t t0 = 0; t0 < T; t0 += 4) {
            four_rows(a4, q, HS, t0, T, HS);
            scores4(sc, a4, kt, Tp, up16(t0 + 4), HS);
            for (ptrdiff_t t = t0; t < t0 + 4 && t < T; t++) {
                float *p = att + (j * T + t) * T;
                softmax_causal_row(p, sc + (t - t0) * Tp, t + 1, T, scale);
                rows_combine(out + (b * T + t) * C + h * HS, p, 1, v, HS, t + 1, HS);
            }
        }
    }
}

/* Its backward for heads lo:hi: dout (B,T,C), the saved qkvr and att -> dinp (B,T,3C) = [dq | dk | dv] (written,
   not added): dv = att^T dy, datt = dy v^T, dpre = att (datt - sum(datt att)) scale (the sum in double),
   dq = dpre k, dk = dpre^T q, every sum over the causal half only. work: (HS + 4) * Tp + 4 * HS + T * T + T * HS
   floats. */
void attention_backward_fast(const float *restrict dout, const float *restrict qkvr, const float *restrict att,
                             float *restrict dinp, ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t T, ptrdiff_t NH,
                             ptrdiff_t HS, ptrdiff_t plane, float scale, float *restrict work)
{
    ptrdiff_t C = NH * HS, Tp = up16(T);
    float *vt = work, *sc = vt + HS * Tp, *a4 = sc + 4 * Tp, *ds = a4 + 4 * HS, *dy = ds + T * T;
    for (ptrdiff_t i = 0; i < HS * Tp; i++)
        vt[i] = 0.0f;
    for (ptrdiff_t j = lo; j < hi; j++) {
        ptrdiff_t b = j / NH, h = j % NH;
        const float *q = qkvr + j * T * HS, *k = q + plane, *v = k + plane, *p = att + j * T * T;
        for (ptrdiff_t t = 0; t < T; t++)                 /* dy (T,HS) contiguous: rows C apart thrash the L1 */
            memcpy(dy + t * HS, dout + (b * T + t) * C + h * HS, (size_t)HS * sizeof(float));
        float *dq = dinp + b * T * 3 * C + h * HS, *dk = dq + C, *dv = dk + C;    /* rows 3C apart */
        transpose(vt, Tp, v, HS, T, HS);
        for (ptrdiff_t t0 = 0; t0 < T; t0 += 4) {
            four_rows(a4, dy, HS, t0, T, HS);
            scores4(sc, a4, vt, Tp, up16(t0 + 4), HS);             /* datt rows t0..t0+3 */
            for (ptrdiff_t t = t0; t < t0 + 4 && t < T; t++) {
                const float *pr = p + t * T, *x = sc + (t - t0) * Tp;
                float *d = ds + t * T;
                ptrdiff_t n = t + 1;
                float dot = (float)dot_f(x, pr, n);
                for (ptrdiff_t s = 0; s < n; s++)
                    d[s] = (x[s] - dot) * pr[s] * scale;
                rows_combine(dq + t * 3 * C, d, 1, k, HS, n, HS);
            }
        }
        /* dv[s] = sum_{t>=s} att[t,s] dy[t];  dk[s] = sum_{t>=s} dpre[t,s] q[t]: columns of att and dpre */
        for (ptrdiff_t s = 0; s < T; s++) {
            rows_combine(dv + s * 3 * C, p + s * T + s, T, dy + s * HS, HS, T - s, HS);
            rows_combine(dk + s * 3 * C, ds + s * T + s, T, q + s * HS, HS, T - s, HS);
        }
    }
}

/* softmax + cross-entropy over rows of Vp logits (V real): losses[r] = log(sum e^{x - max}) + max - x[target];
   with write_dlogits the row becomes (softmax - onehot(target)) dloss over [0, V), 0 over [V, Vp). */
void classifier_fast(float *restrict logits, float *restrict losses, const int32_t *restrict targets, ptrdiff_t rows,
                     ptrdiff_t V, ptrdiff_t Vp, float dloss, int write_dlogits)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        float *x = logits + r * Vp;
        float target_logit = x[targets[r]];
        float m = max_f(x, V);
        double total = exp_shifted_sum(write_dlogits ? x : NULL, x, V, m);
        losses[r] = (float)(log(total) + (double)m - (double)target_logit);
        if (write_dlogits) {
            float scale = (float)((double)dloss / total);
            for (ptrdiff_t k = 0; k < V; k++)
                x[k] = x[k] * scale;
            x[targets[r]] -= dloss;
            for (ptrdiff_t k = V; k < Vp; k++)
                x[k] = 0.0f;
        }
    }
}

/* y = e^x element-wise (exp8; for its tests) */
void exp_fast_array(const float *restrict x, float *restrict y, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        STORE8(y + i, exp8(LOAD8(x + i)));
    if (i < n)
        store_tail8(y + i, exp8(load_tail8(x + i, n - i, 0.0f)), n - i);
}

/* sum of squares of x[0:n): float lanes within blocks of 1024 (a streaming pass: converting every element to double
   made it compute-bound, 30 ms against 24 for 124M here), the blocks added in double */
double sum_squares_fast(const float *restrict x, ptrdiff_t n)
{
    double total = 0.0;
    ptrdiff_t i = 0;
    for (; i + 1024 <= n; i += 1024) {
        float acc[2 * LANES] = {0};
        for (ptrdiff_t k = i; k < i + 1024; k += 2 * LANES)
            for (int j = 0; j < 2 * LANES; j++)
                acc[j] += x[k + j] * x[k + j];
        float s = 0.0f;
        for (int j = 0; j < 2 * LANES; j++)
            s += acc[j];
        total += (double)s;
    }
    for (; i < n; i++)
        total += (double)x[i] * (double)x[i];
    return total;
}

/* out[i] = the sum of squares of chunk i of x[0:n) (chunks of `chunk`, the last shorter), rounded to float32 (a sum
   past float32's range becomes inf): the norm's partial sums, a thread's whole run of chunks in one call */
void sum_squares_chunks(const float *restrict x, ptrdiff_t n, ptrdiff_t chunk, float *restrict out)
{
    for (ptrdiff_t i = 0; i * chunk < n; i++)
        out[i] = (float)sum_squares_fast(x + i * chunk, n - i * chunk < chunk ? n - i * chunk : chunk);
}
"""

# No -ffast-math, no FMA contraction: every operation rounds to float32 as NumPy's does.
# -fno-math-errno only lets sqrtf become one instruction (it is correctly rounded either way).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c99", "-fPIC"]
# The fast set: a*b+c may become one FMA; -fno-trapping-math lets the selects (x < lo ? lo : x, NaN-preserving,
# unlike fminf) vectorize. Still no -ffast-math: NaN and infinities keep their meaning (a NaN loss stays NaN).
FAST_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-std=c99",
              "-fPIC"]

_P, _N, _F, _I = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "adamw": [_P, _P, _P, _P, _N, _F, _F, _F, _F, _F, _F, _F, _I],
    "llmc_normal": [_P, _P, _N, _F, _F],
    "gelu_arg": [_P, _P, _N, _F, _F],
    "gelu_out": [_P, _P, _N],
    "gelu_grad": [_P, _P, _P, _P, _N, _F, _F],
    "ln_center": [_P, _P, _P, _N, _N],
    "ln_scale": [_P, _P, _P, _P, _N, _N],
    "ln_xhat": [_P, _P, _P, _P, _N, _N],
    "ln_dinp": [_P, _P, _P, _P, _P, _P, _N, _N],
    "att_split": [_P, _P, _N, _N, _N, _N, _N],
    "att_merge": [_P, _P, _N, _N, _N, _N, _N, _N],
    "softmax_shift": [_P, _N, _N, _F],
    "rows_divide": [_P, _P, _N, _N],
    "softmax_grad": [_P, _P, _P, _N, _N, _F],
    "col_sums": [_P, _P, _P, _P, _N, _N, _N, _N],
    "rows_add_at": [_P, _P, _P, _N, _N],
    "round_stochastic": [_P, _P, _N, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ushort],
    "gelu_forward_fast": [_P, _P, _N, _F, _F],
    "gelu_backward_fast": [_P, _P, _P, _N, _F, _F],
    "layernorm_forward_fast": [_P, _P, _P, _P, _P, _P, _N, _N, _F],
    "layernorm_backward_fast": [_P, _P, _P, _P, _P, _P, _P, _P, _N, _N, _N],
    "attention_forward_fast": [_P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _F, _P],
    "attention_backward_fast": [_P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _F, _P],
    "classifier_fast": [_P, _P, _P, _N, _N, _N, _F, _I],
    "sum_squares_fast": [_P, _N],
    "sum_squares_chunks": [_P, _N, _N, _P],
    "exp_fast_array": [_P, _P, _N],
}
RESTYPES = {"sum_squares_fast": ctypes.c_double}

_lock = threading.Lock()
_loaded = {}            # so path -> CDLL, or None when building failed


def cache_dir() -> Path:
    """Where the built library is kept: $GPT2NP_CPU_CACHE or ~/.cache/gpt2np/cpu."""
    env = os.environ.get("GPT2NP_CPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gpt2np" / "cpu"


def _compiler():
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        import platform
        return platform.processor() + platform.machine()


def _build(cc: str, so_path: Path) -> None:
    so_path.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=so_path.parent))
    try:
        objects = []
        for name, source, flags in (("exact", SOURCE, FLAGS), ("fast", FAST_SOURCE, FAST_FLAGS)):
            (build / f"{name}.c").write_text(source)
            objects.append(str(build / f"{name}.o"))
            _run([cc, *flags, "-c", str(build / f"{name}.c"), "-o", objects[-1]], cc)
        out = build / "cpu_kernels.so"
        _run([cc, "-shared", *objects, "-o", str(out), "-lm"], cc)
        os.replace(out, so_path)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _run(command, cc):
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")


def load():
    """The built kernels (a ctypes CDLL with SIGNATURES set), or None when they cannot be built here."""
    cc = _compiler()
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), FAST_SOURCE, " ".join(FAST_FLAGS), cc, version,
                                     _cpu_id()]).encode()).hexdigest()[:16]
    so_path = cache_dir() / f"cpu_kernels-{key}.so"
    with _lock:
        if str(so_path) not in _loaded:
            lib = None
            try:
                if not so_path.is_file():
                    _build(cc, so_path)
                lib = ctypes.CDLL(str(so_path))
                for name, argtypes in SIGNATURES.items():
                    getattr(lib, name).argtypes = argtypes
                    getattr(lib, name).restype = RESTYPES.get(name)
            except (OSError, RuntimeError):
                lib = None
            _loaded[str(so_path)] = lib
        return _loaded[str(so_path)]
