/* llm.c's random init draws (gpt2np/init.py), in the C library's logf, cosf and sinf, as llm.c's
   host code calls them. Built without FMA contraction or fast-math (cpu_kernels.EXACT_FLAGS):
   float32 arithmetic as written. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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

