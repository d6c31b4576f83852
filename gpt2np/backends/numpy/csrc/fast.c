/* The numpy backend's fast path (--cpu-math fast): whole ops in one loop each, not bitwise the
   NumPy reference (gpt2np/ops/reference). Each has its own e^x (exp8, 8 lanes at a time: within
   1.02 ulp of the float64 value, where NumPy's float32 exp is within about 2.5 and not vectorized
   on every CPU; GELU and the softmaxes clamp their arguments first and skip its selects), every
   row sum in double (the norm's: float blocks of 1024 added in double), and FMA contraction
   allowed (cpu_kernels.FAST_FLAGS): GELU forward and backward (through sigmoid(2u) = (1 + tanh u)
   / 2, one e^x and no cancellation near GELU's zero), LayerNorm forward and backward rows, causal
   attention forward and backward per head (the masked half of its products skipped), the
   classifier's softmax + cross-entropy, the sum of squares. The documented tolerance is a bound
   per op on the distance from the float64 value of the same formula (tests/test_cpu_fast.py lists
   them). Results do not depend on the thread count (every row is computed alone), only on the
   machine's vector width and FMA (the library is built with -march=native). */
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

/* sum of squares of x[0:n): float lanes within blocks of 1024 (converting every element to double would make this
   streaming pass compute-bound), the blocks added in double */
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
