/* The elementwise tail of the all-pairs Poincaré distance kernel (pml_hyperbolic/_pairwise_dist.py),
 * fused into one pass over each row: from P (the Gram product) and the column scale q,
 *
 *     W = P_ij q_j,   S = sqrt(W + W²/2),   D = log1p(W + √2 S) / √c,
 *
 * D written over P, S (kept for the backward) written to its own buffer when one is given.
 * The torch path takes about eight passes and a dispatch per pass for the same thing.
 *
 * Built by pml_hyperbolic/_native.py with the system C compiler (no -march=native, no fast-math:
 * the shared object must run on any CPU of the architecture and keep IEEE results). On x86-64 with
 * GCC the loops are cloned for AVX2+FMA and AVX-512 and picked at load time (target_clones).
 *
 * log1p is evaluated inline so that the loop vectorises (libm's log1pf is a scalar call).
 * With v = fl(1 + u) = 2^k m, m in [√½, √2), f = m - 1 (exact), e = u - (v - 1) (the exact
 * rounding error of 1 + u):
 *
 *     log1p(u) = k ln2 + log(1 + f) + e/v + O((e/v)²),      e/v = e 2^-k / m.
 *
 * float: log(1 + f) = f - f²/2 + f³ P(f), P a degree-7 fit (see below; no division), 1/m from
 * its series to O(f⁴) (the correction is at most 2^-24, 3% of it is far below an ulp).
 * double: log(1 + f) = f - (f²/2 - s (f²/2 + R)), s = f / (2 + f), z = s²,
 *     R = 2z/3 + 2z²/5 + ... + 2z¹¹/23      (2 atanh(s) = 2s + s R and f - 2s = s f),
 * |s| <= 0.1716, z <= 0.0295: truncation below 1e-17 relative; s and e/v share one division.
 * ln2 is split into a head with trailing zero bits (k ln2_hi is exact) and a tail. Measured
 * against float64 log1p over u in [1e-38, 3e38]: 0.66 eps (float32), 1 eps (float64).
 *
 * u that is not finite and >= 0 gives libm's log1p there: NaN for NaN (and u < 0), +inf for +inf
 * (P is +inf on the rows/columns of extreme points; the torch path's log-based rebuild gives NaN
 * there; both are overwritten by those pairs' explicit values). GCC 11 or later is needed for the
 * x86-64-v3/v4 clone names; an older one builds without clones and the torch path is kept.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PML_NO_CLONES)
#define PML_CLONES __attribute__((target_clones("arch=x86-64-v3", "arch=x86-64-v4", "default")))
#else
#define PML_CLONES
#endif

/* 1 when the loops have AVX2/AVX-512 clones: the plain x86-64 (SSE2) build measured slower than
 * torch's own vectorised ops, so _native.py uses the native tail on x86-64 only with clones. */
int pml_vector_clones(void)
{
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PML_NO_CLONES)
    return 1;
#else
    return 0;
#endif
}

#define PML_SQRT2_F 1.41421356237309504880f
#define PML_SQRT2_D 1.41421356237309504880

/* ln2 = LN2_HI + LN2_LO; LN2_HI keeps 12 (float) / 32 (double) significant bits. */
static const float LN2_HI_F = 0x1.62ep-1f;
static const float LN2_LO_F = 0x1.0bfbe8p-15f;
static const double LN2_HI_D = 0x1.62e42feep-1;
static const double LN2_LO_D = 0x1.a39ef35793c76p-33;

/* log1p(u) for finite u >= 0, vectorisable (see the header). */
static inline float log1p_nonneg_f(float u)
{
    const float v = 1.0f + u;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    /* subtracting the bits of √½ puts m in [√½, √2) and the exponent in k */
    const int32_t shifted = (int32_t)bits - 0x3f3504f3;
    const int32_t k = shifted >> 23;
    const uint32_t m_bits = (uint32_t)(shifted & 0x007fffff) + 0x3f3504f3u;
    float m;
    memcpy(&m, &m_bits, sizeof m);
    const float f = m - 1.0f;
    const float e = u - (v - 1.0f);
    /* e/v = e 2^-k / m: 2^-k from its bits (k <= 126 here unless u > 1.2e38, where the
     * correction is 1e-9 of the result and a clamped scale changes nothing) */
    const uint32_t inv_2k_bits = (uint32_t)(127 - (k < 126 ? k : 126)) << 23;
    float inv_2k;
    memcpy(&inv_2k, &inv_2k_bits, sizeof inv_2k);
    /* 1/m to O(f⁴): enough for a correction of at most 2^-24 (relative 0.03 of it at worst) */
    const float inv_m = 1.0f + f * (-1.0f + f * (1.0f - f));
    const float corr = (e * inv_2k) * inv_m;
    /* (log(1 + f) - f + f²/2) / f³, least-squares fit weighted for the relative error of log(1 + f)
     * on [√½ - 1, √2 - 1] (iterated towards minimax): 6e-9 relative, no division */
    const float cubic = 0.3333333171060373f + f * (-0.2500082106610295f + f * (0.20001226572414607f + f * (
        -0.16623356088199162f + f * (0.14201764499320677f + f * (-0.13160200791295582f + f * (
        0.12761538220881954f + f * -0.07634399656696929f))))));
    const float hfsq = 0.5f * f * f;
    const float kf = (float)k;
    return kf * LN2_HI_F + (f - (hfsq - (f * f * f * cubic + (kf * LN2_LO_F + corr))));
}

static inline double log1p_nonneg_d(double u)
{
    const double v = 1.0 + u;
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    const int64_t shifted = (int64_t)bits - 0x3fe6a09e667f3bcdLL; /* bits of √½ */
    const int64_t k = shifted >> 52;
    const uint64_t m_bits = (uint64_t)(shifted & 0x000fffffffffffffLL) + 0x3fe6a09e667f3bcdULL;
    double m;
    memcpy(&m, &m_bits, sizeof m);
    const double f = m - 1.0;
    const double e = u - (v - 1.0);
    const uint64_t inv_2k_bits = (uint64_t)(1023 - (k < 1022 ? k : 1022)) << 52;
    double inv_2k;
    memcpy(&inv_2k, &inv_2k_bits, sizeof inv_2k);
    const double two_f = 2.0 + f;
    const double r = 1.0 / (two_f * m);
    const double s = f * (m * r);
    const double corr = (e * inv_2k) * (two_f * r);
    const double z = s * s;
    const double R = z * (2.0 / 3 + z * (2.0 / 5 + z * (2.0 / 7 + z * (2.0 / 9 + z * (2.0 / 11 + z * (
        2.0 / 13 + z * (2.0 / 15 + z * (2.0 / 17 + z * (2.0 / 19 + z * (2.0 / 21 + z * (2.0 / 23)))))))))));
    const double hfsq = 0.5 * f * f;
    const double kd = (double)k;
    return kd * LN2_HI_D + (f - (hfsq - (s * (hfsq + R) + (kd * LN2_LO_D + corr))));
}

/* Rows [row_begin, row_end) of the n_cols-wide row-major P (and S, or NULL). u outside [0, FLT_MAX] gives what libm's log1p gives there: +inf
 * for +inf, NaN for NaN and u < 0 (W < 0 only reaches u >= -1 as a limit). */
#define PML_TAIL(NAME, T, SQRT, LOG1P, SQRT2, T_MAX)                                                 \
    PML_CLONES                                                                                       \
    void NAME(T *restrict P, T *restrict S, const T *restrict q, long row_begin, long row_end,       \
              long n_cols, T inv_sqrt_c)                                                             \
    {                                                                                                \
        for (long i = row_begin; i < row_end; ++i) {                                                 \
            T *restrict p = P + i * n_cols;                                                          \
            if (S) {                                                                                 \
                T *restrict s_row = S + i * n_cols;                                                  \
                for (long j = 0; j < n_cols; ++j) {                                                  \
                    const T w = p[j] * q[j];                                                         \
                    const T s = SQRT(w + (T)0.5 * w * w);                                            \
                    const T u = w + SQRT2 * s;                                                       \
                    const int finite = u >= (T)0 && u <= T_MAX;                                      \
                    const T d = LOG1P(finite ? u : (T)0) * inv_sqrt_c;                               \
                    s_row[j] = s;                                                                    \
                    p[j] = finite ? d : (u > (T)0 ? u : (T)NAN);                                     \
                }                                                                                    \
            } else {                                                                                 \
                for (long j = 0; j < n_cols; ++j) {                                                  \
                    const T w = p[j] * q[j];                                                         \
                    const T u = w + SQRT2 * SQRT(w + (T)0.5 * w * w);                                \
                    const int finite = u >= (T)0 && u <= T_MAX;                                      \
                    const T d = LOG1P(finite ? u : (T)0) * inv_sqrt_c;                               \
                    p[j] = finite ? d : (u > (T)0 ? u : (T)NAN);                                     \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

PML_TAIL(pml_tail_f32, float, sqrtf, log1p_nonneg_f, PML_SQRT2_F, 0x1.fffffep127f)
PML_TAIL(pml_tail_f64, double, sqrt, log1p_nonneg_d, PML_SQRT2_D, 0x1.fffffffffffffp1023)

/* log1p(u) elementwise (u >= 0 finite): exposed for the tests' reference values. */
PML_CLONES
void pml_log1p_f32(const float *restrict u, float *restrict out, long n)
{
    for (long j = 0; j < n; ++j)
        out[j] = log1p_nonneg_f(u[j]);
}

PML_CLONES
void pml_log1p_f64(const double *restrict u, double *restrict out, long n)
{
    for (long j = 0; j < n; ++j)
        out[j] = log1p_nonneg_d(u[j]);
}
