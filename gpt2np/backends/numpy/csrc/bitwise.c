/* The fast path's loops whose results are BITWISE the NumPy reference's (gpt2np/ops/reference):
   each performs the reference's float32 operations in the same order, each rounded to float32
   (built without FMA contraction or fast-math: cpu_kernels.EXACT_FLAGS), in one pass over memory
   where NumPy makes many. tests/test_cpu_kernels.py checks each against the reference. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* AdamW, the sequence of the reference adamw_update (gpt2np/ops/reference/adamw.py) per element:
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

/* column sums over rows of C, columns [c0, c1), as NumPy's sum(axis=0) adds them (for C > 1): from 0, row
   after row. sums[c] = 0 + x[0][c] + x[1][c] + ... */
void col_sums(const float *restrict x, float *restrict sums, ptrdiff_t rows, ptrdiff_t C, ptrdiff_t c0,
              ptrdiff_t c1)
{
    for (ptrdiff_t c = c0; c < c1; c++)
        sums[c] = 0.0f;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        for (ptrdiff_t c = c0; c < c1; c++)
            sums[c] = sums[c] + xr[c];
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
