/* The elementwise tail of the all-pairs Poincaré distance kernel (pml_hyperbolic/kernels/pairwise.py),
 * fused into one pass over each row: from P (the Gram product) and the column scale q,
 *
 *     W = P_ij q_j,   S = sqrt(W + W²/2),   D = log1p(W + √2 S) / √c,
 *
 * D written over P, S (kept for the backward) written to its own buffer when one is given.
 * The torch path takes about eight passes and a dispatch per pass for the same thing.
 *
 * Built by pml_hyperbolic/kernels/build.py (torch.utils.cpp_extension, through csrc/ops.cpp) (no -march=native, no fast-math:
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
 * ln2 is split into a head with trailing zero bits (k ln2_hi is exact) and a tail. Its accuracy
 * against float64 log1p: docs/design/native-code.md.
 *
 * u that is not finite and >= 0 gives libm's log1p there: NaN for NaN (and u < 0), +inf for +inf
 * (P is +inf on the rows/columns of extreme points; the torch path's log-based rebuild gives NaN
 * there; both are overwritten by those pairs' explicit values). GCC 11 or later is needed for the
 * x86-64-v3/v4 clone names; an older one builds without clones and the torch path is kept.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Helpers of the vectorised loops: forced inline, so that each AVX2 / AVX-512 clone of a loop gets
 * its own copy (a called helper is compiled once, for the baseline ISA). */
#if defined(__GNUC__)
#define PML_INLINE static inline __attribute__((always_inline))
#else
#define PML_INLINE static inline
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PML_NO_CLONES)
#define PML_CLONES __attribute__((target_clones("arch=x86-64-v3", "arch=x86-64-v4", "default")))
#else
#define PML_CLONES
#endif

/* 1 when the loops have AVX2/AVX-512 clones: the plain x86-64 (SSE2) build is slower than torch's
 * own vectorised ops (docs/design/native-code.md), so kernels/build.py uses it on x86-64 only with clones. */
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

/* v = 2^k m with m in [√½, √2) (v > 0 finite): returns f = m − 1 (exact) and k. Subtracting the
 * bits of √½ puts m in that range and the exponent in k. */
PML_INLINE float split_log_f(float v, int32_t *k)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const int32_t shifted = (int32_t)bits - 0x3f3504f3;
    *k = shifted >> 23;
    const uint32_t m_bits = (uint32_t)(shifted & 0x007fffff) + 0x3f3504f3u;
    float m;
    memcpy(&m, &m_bits, sizeof m);
    return m - 1.0f;
}

/* (log(1 + f) - f + f²/2) / f³, least-squares fit weighted for the relative error of log(1 + f)
 * on [√½ - 1, √2 - 1] (iterated towards minimax): 6e-9 relative, no division */
PML_INLINE float log1p_cubic_f(float f)
{
    return 0.3333333171060373f + f * (-0.2500082106610295f + f * (0.20001226572414607f + f * (
        -0.16623356088199162f + f * (0.14201764499320677f + f * (-0.13160200791295582f + f * (
        0.12761538220881954f + f * -0.07634399656696929f))))));
}

/* log1p(u) for finite u >= 0, vectorisable (see the header). */
PML_INLINE float log1p_nonneg_f(float u)
{
    const float v = 1.0f + u;
    int32_t k;
    const float f = split_log_f(v, &k);
    const float e = u - (v - 1.0f);
    /* e/v = e 2^-k / m: 2^-k from its bits (k <= 126 here unless u > 1.2e38, where the
     * correction is 1e-9 of the result and a clamped scale changes nothing) */
    const uint32_t inv_2k_bits = (uint32_t)(127 - (k < 126 ? k : 126)) << 23;
    float inv_2k;
    memcpy(&inv_2k, &inv_2k_bits, sizeof inv_2k);
    /* 1/m to O(f⁴): enough for a correction of at most 2^-24 (relative 0.03 of it at worst) */
    const float inv_m = 1.0f + f * (-1.0f + f * (1.0f - f));
    const float corr = (e * inv_2k) * inv_m;
    const float hfsq = 0.5f * f * f;
    const float kf = (float)k;
    return kf * LN2_HI_F + (f - (hfsq - (f * f * f * log1p_cubic_f(f) + (kf * LN2_LO_F + corr))));
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

/* One pair of the Gram-based tails (symmetric and general): with NORMS = ||x_i||^2 + ||y_j||^2 and SCALE =
 * p2_i q_j, s = NORMS - 2 GJ and W = s SCALE; GJ (the Gram entry) becomes D, or -1 for a pair the product cannot
 * resolve (s < F NORMS, counted in CLOSE); S_VAR receives S = sqrt(W + W^2/2). */
#define PML_GRAM_PAIR(T, SQRT, LOG1P, SQRT2, T_MAX,                                                  \
              NORMS, SCALE, GJ, F, INV_SQRT_C, CLOSE, S_VAR)                                         \
    do {                                                                                             \
        const T norms_ = (NORMS);                                                                    \
        const T sq_ = norms_ - (T)2 * (GJ);                                                          \
        const int close_ = sq_ < (F) * norms_;                                                       \
        const T w_ = sq_ * (SCALE);                                                                  \
        (S_VAR) = SQRT(w_ + (T)0.5 * w_ * w_);                                                       \
        const T u_ = w_ + SQRT2 * (S_VAR);                                                           \
        const int finite_ = u_ >= (T)0 && u_ <= T_MAX;                                               \
        const T d_ = LOG1P(finite_ ? u_ : (T)0) * (INV_SQRT_C);                                      \
        (CLOSE) += close_;                                                                           \
        (GJ) = close_ ? (T)-1 : (finite_ ? d_ : (u_ > (T)0 ? u_ : (T)NAN));                          \
    } while (0)

/* x is not y: rows [row_begin, row_end) of G = x y^T (n_cols wide) -> D, with s = x2_i + y2_j - 2 G_ij and
 * W = s p2_i q_j; pairs with s < f (x2_i + y2_j), which the Gram product cannot resolve, get D = -1 (the caller
 * recomputes them) and are counted in *n_close. S (or NULL) as in PML_TAIL. */
#define PML_GEN_TAIL(NAME, T, SQRT, LOG1P, SQRT2, T_MAX)                                             \
    PML_CLONES                                                                                       \
    void NAME(T *restrict G, T *restrict S, const T *restrict x2, const T *restrict p2,              \
              const T *restrict y2, const T *restrict q, long row_begin, long row_end, long n_cols,  \
              T inv_sqrt_c, T f, long *restrict n_close)                                             \
    {                                                                                                \
        long close = 0;                                                                              \
        for (long i = row_begin; i < row_end; ++i) {                                                 \
            T *restrict g = G + i * n_cols;                                                          \
            T *restrict s_row = S ? S + i * n_cols : NULL;                                           \
            const T xi = x2[i], pi = p2[i];                                                          \
            long row_close = 0;                                                                      \
            if (s_row) {                                                                             \
                for (long j = 0; j < n_cols; ++j) {                                                  \
                    T s;                                                                             \
                    PML_GRAM_PAIR(T, SQRT, LOG1P, SQRT2, T_MAX,                                      \
                                  xi + y2[j], pi * q[j], g[j], f, inv_sqrt_c, row_close, s);         \
                    s_row[j] = s;                                                                    \
                }                                                                                    \
            } else {                                                                                 \
                for (long j = 0; j < n_cols; ++j) {                                                  \
                    T s;                                                                             \
                    PML_GRAM_PAIR(T, SQRT, LOG1P, SQRT2, T_MAX,                                      \
                                  xi + y2[j], pi * q[j], g[j], f, inv_sqrt_c, row_close, s);         \
                    (void)s;                                                                         \
                }                                                                                    \
            }                                                                                        \
            close += row_close;                                                                      \
        }                                                                                            \
        *n_close = close;                                                                            \
    }

PML_GEN_TAIL(pml_gen_tail_f32, float, sqrtf, log1p_nonneg_f, PML_SQRT2_F, 0x1.fffffep127f)
PML_GEN_TAIL(pml_gen_tail_f64, double, sqrt, log1p_nonneg_d, PML_SQRT2_D, 0x1.fffffffffffffp1023)

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

/* The symmetric forward (x is y): G holds the Gram matrix x xᵀ on and above its diagonal (the
 * caller's row-blocked products fill only that part, about half the flops of one full product).
 * Per pair i < j, from the squared norms x2 and the row scales p2 = 2c/a, q = 1/a:
 *
 *     s = x2_i + x2_j - 2 G_ij,  W = s p2_i q_j,  S = sqrt(W + W²/2),  D = log1p(W + √2 S)/√c,
 *
 * written to (i, j) and (j, i) of G's buffer, and S to (i, j) of its own buffer when one is given
 * (on and above the diagonal only: the symmetric backward reads no more, and mirroring it too
 * costs time): every transcendental once per unordered pair. A pair with s < f (x2_i + x2_j) is beyond the product's resolution: its D is
 * set to -1 (no distance is negative) for the caller to recompute from explicit differences, and
 * counted (both orientations) in *n_close. The diagonal is 0 in D and S (NaN for a point that is
 * not finite, as the general path gives).
 *
 * Order: groups of up to PML_SYM_GROUP bands of PML_SYM_ROWS rows (128 rows: one Gram block of
 * the 1-thread forward); in each, chunks of PML_SYM_COLS columns are first evaluated along the rows
 * (long contiguous runs: the loop vectorises), then mirrored: row j of the chunk receives the
 * group's values of column j, one run of up to 128 values, read back from the chunk while it is
 * still in cache. A value is mirrored only to (j, i) with j > i, which no later read of G as a Gram
 * entry touches (those are all on or above the diagonal), so bands are independent:
 * [band_begin, band_end) lets threads share one matrix. */
#define PML_SYM_ROWS 16
#define PML_SYM_COLS 256
#define PML_SYM_GROUP 8

/* mirror_block(src, src_n, dst, dst_n): dst[r][k] = src[k][r] for a 16 × 16 block (src row k at
 * src + k src_n, dst row r at dst + r dst_n). With GCC, as 16 row vectors transposed in registers by four
 * rounds of shuffles (round s swaps the off-diagonal s × s sub-blocks of every 2s × 2s block);
 * element by element otherwise. The mirror of the symmetric loops was a third of their time with
 * strided scalar copies. */
#if defined(__GNUC__) && !defined(__clang__)
/* Shuffle masks of round s: lane l of the new row k takes a[l] or b[l - s], of row k + s a[l + s]
 * or b[l] (indices 16.. select from b), by whether bit s of l is set. Constants, so that each
 * shuffle is one or two permute instructions. */
#define PML_LO8 {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
#define PML_HI8 {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}
#define PML_LO4 {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
#define PML_HI4 {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}
#define PML_LO2 {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
#define PML_HI2 {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}
#define PML_LO1 {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}
#define PML_HI1 {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}
#define PML_SWAP(VT, r, k, s, LO, HI)                                                                \
    {                                                                                                \
        const VT a_ = r##k, b_ = r##s;                                                               \
        r##k = __builtin_shuffle(a_, b_, (VT##_mask)LO);                                             \
        r##s = __builtin_shuffle(a_, b_, (VT##_mask)HI);                                             \
    }
#define PML_MIRROR_BLOCK(NAME, T, VT, IT)                                                            \
    typedef T VT __attribute__((vector_size(16 * sizeof(T))));                                       \
    typedef IT VT##_mask __attribute__((vector_size(16 * sizeof(T))));                               \
    static inline void NAME(const T *restrict src, long src_n, T *restrict dst, long dst_n)         \
    {                                                                                               \
        VT r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15;                    \
        memcpy(&r0, src + 0 * src_n, sizeof(VT));                                                   \
        memcpy(&r1, src + 1 * src_n, sizeof(VT));                                                   \
        memcpy(&r2, src + 2 * src_n, sizeof(VT));                                                   \
        memcpy(&r3, src + 3 * src_n, sizeof(VT));                                                   \
        memcpy(&r4, src + 4 * src_n, sizeof(VT));                                                   \
        memcpy(&r5, src + 5 * src_n, sizeof(VT));                                                   \
        memcpy(&r6, src + 6 * src_n, sizeof(VT));                                                   \
        memcpy(&r7, src + 7 * src_n, sizeof(VT));                                                   \
        memcpy(&r8, src + 8 * src_n, sizeof(VT));                                                   \
        memcpy(&r9, src + 9 * src_n, sizeof(VT));                                                   \
        memcpy(&r10, src + 10 * src_n, sizeof(VT));                                                 \
        memcpy(&r11, src + 11 * src_n, sizeof(VT));                                                 \
        memcpy(&r12, src + 12 * src_n, sizeof(VT));                                                 \
        memcpy(&r13, src + 13 * src_n, sizeof(VT));                                                 \
        memcpy(&r14, src + 14 * src_n, sizeof(VT));                                                 \
        memcpy(&r15, src + 15 * src_n, sizeof(VT));                                                 \
        PML_SWAP(VT, r, 0, 8, PML_LO8, PML_HI8)                                                     \
        PML_SWAP(VT, r, 1, 9, PML_LO8, PML_HI8)                                                     \
        PML_SWAP(VT, r, 2, 10, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 3, 11, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 4, 12, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 5, 13, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 6, 14, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 7, 15, PML_LO8, PML_HI8)                                                    \
        PML_SWAP(VT, r, 0, 4, PML_LO4, PML_HI4)                                                     \
        PML_SWAP(VT, r, 1, 5, PML_LO4, PML_HI4)                                                     \
        PML_SWAP(VT, r, 2, 6, PML_LO4, PML_HI4)                                                     \
        PML_SWAP(VT, r, 3, 7, PML_LO4, PML_HI4)                                                     \
        PML_SWAP(VT, r, 8, 12, PML_LO4, PML_HI4)                                                    \
        PML_SWAP(VT, r, 9, 13, PML_LO4, PML_HI4)                                                    \
        PML_SWAP(VT, r, 10, 14, PML_LO4, PML_HI4)                                                   \
        PML_SWAP(VT, r, 11, 15, PML_LO4, PML_HI4)                                                   \
        PML_SWAP(VT, r, 0, 2, PML_LO2, PML_HI2)                                                     \
        PML_SWAP(VT, r, 1, 3, PML_LO2, PML_HI2)                                                     \
        PML_SWAP(VT, r, 4, 6, PML_LO2, PML_HI2)                                                     \
        PML_SWAP(VT, r, 5, 7, PML_LO2, PML_HI2)                                                     \
        PML_SWAP(VT, r, 8, 10, PML_LO2, PML_HI2)                                                    \
        PML_SWAP(VT, r, 9, 11, PML_LO2, PML_HI2)                                                    \
        PML_SWAP(VT, r, 12, 14, PML_LO2, PML_HI2)                                                   \
        PML_SWAP(VT, r, 13, 15, PML_LO2, PML_HI2)                                                   \
        PML_SWAP(VT, r, 0, 1, PML_LO1, PML_HI1)                                                     \
        PML_SWAP(VT, r, 2, 3, PML_LO1, PML_HI1)                                                     \
        PML_SWAP(VT, r, 4, 5, PML_LO1, PML_HI1)                                                     \
        PML_SWAP(VT, r, 6, 7, PML_LO1, PML_HI1)                                                     \
        PML_SWAP(VT, r, 8, 9, PML_LO1, PML_HI1)                                                     \
        PML_SWAP(VT, r, 10, 11, PML_LO1, PML_HI1)                                                   \
        PML_SWAP(VT, r, 12, 13, PML_LO1, PML_HI1)                                                   \
        PML_SWAP(VT, r, 14, 15, PML_LO1, PML_HI1)                                                   \
        memcpy(dst + 0 * dst_n, &r0, sizeof(VT));                                                   \
        memcpy(dst + 1 * dst_n, &r1, sizeof(VT));                                                   \
        memcpy(dst + 2 * dst_n, &r2, sizeof(VT));                                                   \
        memcpy(dst + 3 * dst_n, &r3, sizeof(VT));                                                   \
        memcpy(dst + 4 * dst_n, &r4, sizeof(VT));                                                   \
        memcpy(dst + 5 * dst_n, &r5, sizeof(VT));                                                   \
        memcpy(dst + 6 * dst_n, &r6, sizeof(VT));                                                   \
        memcpy(dst + 7 * dst_n, &r7, sizeof(VT));                                                   \
        memcpy(dst + 8 * dst_n, &r8, sizeof(VT));                                                   \
        memcpy(dst + 9 * dst_n, &r9, sizeof(VT));                                                   \
        memcpy(dst + 10 * dst_n, &r10, sizeof(VT));                                                 \
        memcpy(dst + 11 * dst_n, &r11, sizeof(VT));                                                 \
        memcpy(dst + 12 * dst_n, &r12, sizeof(VT));                                                 \
        memcpy(dst + 13 * dst_n, &r13, sizeof(VT));                                                 \
        memcpy(dst + 14 * dst_n, &r14, sizeof(VT));                                                 \
        memcpy(dst + 15 * dst_n, &r15, sizeof(VT));                                                 \
    }
#else
#define PML_MIRROR_BLOCK(NAME, T, VT, IT)                                                            \
    static inline void NAME(const T *restrict src, long src_n, T *restrict dst, long dst_n)         \
    {                                                                                                \
        for (int r = 0; r < 16; ++r)                                                                 \
            for (int k = 0; k < 16; ++k)                                                             \
                dst[r * dst_n + k] = src[k * src_n + r];                                             \
    }
#endif
PML_MIRROR_BLOCK(pml_mirror_block_f32, float, pml_v16f, int32_t)
PML_MIRROR_BLOCK(pml_mirror_block_f64, double, pml_v16d, int64_t)

/* Rows [i0, i1) (i0 a multiple of 16), columns [j_begin, j1): (j, i) ← (i, j) for every i < j.
 * By 16 × 16 blocks where a 16-row slice is full and the block lies right of it, taken column tile
 * by column tile: the 16 destination rows of a tile receive their slices one after the other, each
 * row one run of up to (i1 - i0) values (a line split by a row start off a 64-byte boundary is
 * completed while it is in cache), and the destination lines of the tile PML_MIRROR_AHEAD rows
 * further are prefetched for writing (they are usually cold: nothing else touches the lower
 * triangle). Element by element elsewhere. Why: slice by slice and without the prefetch, the
 * mirror stalls on its destination lines (docs/design/native-code.md). */
#define PML_MIRROR_AHEAD 48
#define PML_MIRROR(NAME, T, BLOCK)                                                                   \
    static inline void NAME(T *restrict M, long n, long i0, long i1, long j_begin, long j1)          \
    {                                                                                                \
        const long full_end = i0 + (i1 - i0) / 16 * 16; /* end of the full 16-row slices */          \
        const long tiles_begin = i0 + (j_begin - i0 + 15) / 16 * 16;                                 \
        long tiles_end = tiles_begin;                                                                \
        for (; tiles_end + 16 <= j1; tiles_end += 16) {                                              \
            const long r_end = tiles_end < full_end ? tiles_end : full_end;                          \
            if (tiles_end + PML_MIRROR_AHEAD + 16 <= j1) /* the lines of a later tile, for writing */ \
                for (long k = 0; k < 16; ++k)                                                        \
                    for (long c = i0; c < r_end; c += 64 / (long)sizeof(T))                          \
                        __builtin_prefetch(M + (tiles_end + PML_MIRROR_AHEAD + k) * n + c, 1, 3);    \
            for (long r0 = i0; r0 + 16 <= r_end; r0 += 16)                                           \
                BLOCK(M + r0 * n + tiles_end, n, M + tiles_end * n + r0, n);                         \
        }                                                                                            \
        for (long jj = j_begin > i0 + 1 ? j_begin : i0 + 1; jj < j1; ++jj) {                         \
            long i = i0; /* rows below i were done by blocks */                                      \
            if (jj >= tiles_begin && jj < tiles_end) {                                               \
                const long tile = tiles_begin + (jj - tiles_begin) / 16 * 16;                        \
                i = tile < full_end ? tile : full_end;                                               \
            }                                                                                        \
            const long i_end = jj < i1 ? jj : i1;                                                    \
            T *restrict out = M + jj * n;                                                            \
            for (; i < i_end; ++i)                                                                   \
                out[i] = M[i * n + jj];                                                              \
        }                                                                                            \
    }
PML_MIRROR(pml_mirror_f32, float, pml_mirror_block_f32)
PML_MIRROR(pml_mirror_f64, double, pml_mirror_block_f64)
#define PML_SYM_TAIL(NAME, T, SQRT, LOG1P, SQRT2, T_MAX, MIRROR)                                           \
    PML_CLONES                                                                                       \
    void NAME(T *restrict G, T *restrict S, const T *restrict x2, const T *restrict p2,              \
              const T *restrict q, long n, T inv_sqrt_c, T f, long band_begin, long band_end,        \
              long *restrict n_close)                                                                \
    {                                                                                                \
        long close = 0;                                                                              \
        for (long group = band_begin; group < band_end; group += PML_SYM_GROUP) {                    \
            const long group_end = group + PML_SYM_GROUP < band_end ? group + PML_SYM_GROUP : band_end;\
            const long i0 = group * PML_SYM_ROWS;                                                    \
            const long i1 = group_end * PML_SYM_ROWS < n ? group_end * PML_SYM_ROWS : n;             \
            for (long i = i0; i < i1; ++i) { /* 0, or NaN for a NaN / infinite point */              \
                G[i * n + i] = x2[i] * (T)0;                                                         \
                if (S)                                                                               \
                    S[i * n + i] = x2[i] * (T)0;                                                     \
            }                                                                                        \
            for (long j0 = i0; j0 < n; j0 += PML_SYM_COLS) {                                         \
                const long j1 = j0 + PML_SYM_COLS < n ? j0 + PML_SYM_COLS : n;                       \
                for (long i = i0; i < i1; ++i) {                                                     \
                    const long start = i + 1 > j0 ? i + 1 : j0;                                      \
                    T *restrict g = G + i * n;                                                       \
                    const T xi = x2[i], pi = p2[i];                                                  \
                    long row_close = 0;                                                              \
                    if (S) {                                                                         \
                        T *restrict s_row = S + i * n;                                               \
                        for (long j = start; j < j1; ++j) {                                          \
                            T s;                                                                     \
                            PML_GRAM_PAIR(T, SQRT, LOG1P, SQRT2, T_MAX,                              \
                                          xi + x2[j], pi * q[j], g[j], f, inv_sqrt_c, row_close, s); \
                            s_row[j] = s;                                                            \
                        }                                                                            \
                    } else {                                                                         \
                        for (long j = start; j < j1; ++j) {                                          \
                            T s;                                                                     \
                            PML_GRAM_PAIR(T, SQRT, LOG1P, SQRT2, T_MAX,                              \
                                          xi + x2[j], pi * q[j], g[j], f, inv_sqrt_c, row_close, s); \
                            (void)s;                                                                 \
                        }                                                                            \
                    }                                                                                \
                    close += row_close;                                                              \
                }                                                                                    \
                MIRROR(G, n, i0, i1, j0 > i0 + 1 ? j0 : i0 + 1, j1);                                 \
            }                                                                                        \
        }                                                                                            \
        *n_close = 2 * close;                                                                        \
    }

PML_SYM_TAIL(pml_sym_tail_f32, float, sqrtf, log1p_nonneg_f, PML_SQRT2_F, 0x1.fffffep127f, pml_mirror_f32)
PML_SYM_TAIL(pml_sym_tail_f64, double, sqrt, log1p_nonneg_d, PML_SQRT2_D, 0x1.fffffffffffffp1023, pml_mirror_f64)

/* The symmetric backward's weights (x is y): with U the upstream gradient (n × n, strides su0, su1
 * in elements: 0 for a broadcast one) and S = √2 √(w(1+w)) from the symmetric forward
 * (S_ij = S_ji),
 *
 *     E_ij = E_ji = (U_ij + U_ji) / S_ij   (i ≠ j),   E_ii = 0,
 *
 * i.e. U/S + (U/S)ᵀ in one pass, written over S (read on and above the diagonal only). Per band
 * and chunk as in the forward: the chunk's block of Uᵀ is first transposed into a small buffer
 * (so that U_ji is contiguous along the row of i; by 16 × 16 register blocks when U is
 * contiguous), then the row pass, then the mirror. */
#define PML_SYM_GRAD(NAME, T, MIRROR, BLOCK)                                                         \
    PML_CLONES                                                                                       \
    void NAME(const T *restrict U, long su0, long su1, T *restrict S, long n, long band_begin,       \
              long band_end)                                                                         \
    {                                                                                                \
        T ut[PML_SYM_ROWS * PML_SYM_COLS]; /* ut[i - i0][j - j0] = U[j][i] */                        \
        const int contiguous = su1 == 1 && su0 == n;                                                 \
        for (long band = band_begin; band < band_end; ++band) {                                      \
            const long i0 = band * PML_SYM_ROWS;                                                     \
            const long i1 = i0 + PML_SYM_ROWS < n ? i0 + PML_SYM_ROWS : n;                           \
            for (long i = i0; i < i1; ++i)                                                           \
                S[i * n + i] = (T)0;                                                                 \
            for (long j0 = i0; j0 < n; j0 += PML_SYM_COLS) {                                         \
                const long j1 = j0 + PML_SYM_COLS < n ? j0 + PML_SYM_COLS : n;                       \
                for (long r0 = i0; r0 < i1; r0 += 16) {                                              \
                    const long r1 = r0 + 16 < i1 ? r0 + 16 : i1;                                     \
                    long j = j0;                                                                     \
                    if (contiguous && r1 - r0 == 16)                                                 \
                        for (; j + 16 <= j1; j += 16)                                                \
                            BLOCK(U + j * n + r0, n, ut + (r0 - i0) * PML_SYM_COLS + (j - j0),       \
                                  PML_SYM_COLS);                                                     \
                    for (; j < j1; ++j)                                                              \
                        for (long i = r0; i < r1; ++i)                                               \
                            ut[(i - i0) * PML_SYM_COLS + (j - j0)] = U[j * su0 + i * su1];           \
                }                                                                                    \
                for (long i = i0; i < i1; ++i) {                                                     \
                    const long start = i + 1 > j0 ? i + 1 : j0;                                      \
                    T *restrict s_row = S + i * n;                                                   \
                    const T *restrict ut_row = ut + (i - i0) * PML_SYM_COLS - j0;                    \
                    if (contiguous) {                                                                \
                        const T *restrict u_row = U + i * n;                                         \
                        for (long jj = start; jj < j1; ++jj)                                         \
                            s_row[jj] = (u_row[jj] + ut_row[jj]) / s_row[jj];                        \
                    } else {                                                                         \
                        const T *restrict u_row = U + i * su0;                                       \
                        for (long jj = start; jj < j1; ++jj)                                         \
                            s_row[jj] = (u_row[jj * su1] + ut_row[jj]) / s_row[jj];                  \
                    }                                                                                \
                }                                                                                    \
                MIRROR(S, n, i0, i1, j0 > i0 + 1 ? j0 : i0 + 1, j1);                                 \
            }                                                                                        \
        }                                                                                            \
    }

PML_SYM_GRAD(pml_sym_grad_f32, float, pml_mirror_f32, pml_mirror_block_f32)
PML_SYM_GRAD(pml_sym_grad_f64, double, pml_mirror_f64, pml_mirror_block_f64)

/* Row terms of the kernel in float64: x2_i = ‖x_i‖² (each product exact for float32 input) and
 * inv_a_i = 1 / max(1 - c x2_i, floor), for n contiguous rows of dim values. A NaN row gives NaN
 * (not the floor: a NaN point must not pass for one on the boundary).
 *
 * With x2_t non-NULL (the symmetric forward: one call instead of about ten small torch ops), also
 * the tail's row vectors in T, x2_t = (T)x2, p2_t = (T)(2c inv_a),
 * q_t = (T)inv_a (the roundings of torch's .to(dtype)), and in counts[0] the rows with x2 != 0
 * (NaN included: a NaN row is not "at the origin"), in counts[1] the extreme rows,
 * inv_a > extreme_inv_a or 0 < x2 < tiny_sq (pml_hyperbolic.kernels.gram._extreme_points). */
#define PML_ROW_TERMS(NAME, T)                                                                       \
    PML_CLONES                                                                                       \
    void NAME(const T *restrict x, long n, long dim, double c, double floor_a, double *restrict x2,   \
              double *restrict inv_a, double extreme_inv_a, double tiny_sq, T *restrict x2_t,        \
              T *restrict p2_t, T *restrict q_t, long *restrict counts)                              \
    {                                                                                                \
        long nonzero = 0, extreme = 0;                                                               \
        for (long i = 0; i < n; ++i) {                                                               \
            const T *restrict row = x + i * dim;                                                     \
            double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* 8 partial sums: the loop vectorises */      \
            long k = 0;                                                                              \
            for (; k + 8 <= dim; k += 8)                                                             \
                for (int l = 0; l < 8; ++l)                                                          \
                    acc[l] += (double)row[k + l] * (double)row[k + l];                               \
            double sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])); \
            for (; k < dim; ++k)                                                                     \
                sum += (double)row[k] * (double)row[k];                                              \
            const double a = 1.0 - c * sum;                                                          \
            const double inv = 1.0 / (a < floor_a ? floor_a : a); /* (NaN stays NaN, as clamp_min) */ \
            x2[i] = sum;                                                                             \
            inv_a[i] = inv;                                                                          \
            if (x2_t) {                                                                              \
                x2_t[i] = (T)sum;                                                                    \
                p2_t[i] = (T)((2.0 * c) * inv);                                                      \
                q_t[i] = (T)inv;                                                                     \
                nonzero += sum != 0.0;                                                               \
                extreme += inv > extreme_inv_a || (sum > 0.0 && sum < tiny_sq);                      \
            }                                                                                        \
        }                                                                                            \
        if (counts) {                                                                                \
            counts[0] = nonzero;                                                                     \
            counts[1] = extreme;                                                                     \
        }                                                                                            \
    }

PML_ROW_TERMS(pml_row_terms_f32, float)
PML_ROW_TERMS(pml_row_terms_f64, double)

/* ---- HIER's LCA triplet rows (pml_hyperbolic/losses/hier_loss.py, _LCATripletLoss) ----------------
 *
 * For triplet rows t in [t_begin, t_end) with points i_t, j_t, k_t and the P candidate proxies,
 * D = dist (N × P, row-major):
 *
 *     m¹ = max(D_i, D_j),  m² = max(m¹, D_k),  z^r = −m^r / τ,
 *
 * the LCA choices a = argmax(z¹ + g¹), b = argmax(z² + g²) (g: Gumbel noise drawn as the
 * exponential race q_p = e^{z_p − max z} / log U_p, the choice argmin q, π = q / Σq; without noise
 * the first maximum and π = softmax(z)), the loss
 *
 *     ℓ = [D_ia − D_ib + δ]₊ + [D_ja − D_jb + δ]₊ + [D_kb − D_ka + δ]₊,
 *
 * and, when grads is given, the two rows u¹, u² of the straight-through estimator (the formulas of
 * _LCATripletLoss's docstring): w = on₁ D_i + on₂ D_j − on₃ D_k, u^r = π^r ⊙ (w − ⟨π^r, w⟩); the
 * backward (pml_lca_backward_* below) routes them through the maxima. The uniform draws in [0, 1)
 * are generated in the loop from a counter (noise != 0; none otherwise): U^r_{t,p} =
 * pml_uniform_*(key, 2t + r, p) below, the definition that hier_loss._CounterUniform evaluates for
 * the torch path; loss, a, b are indexed by t, grads as
 * (2, T_rows, P) and on as (3, T_rows). One pass per row over P for the maxima, one per choice,
 * one for the gradients, all vectorised (the torch path: about twenty (rows × P) ops per block).
 * Every index is checked against [0, N) first: one outside it makes the call return -1 with
 * nothing read or written (0 otherwise).
 *
 * exp and log are inline polynomial forms (the loops vectorise; libm's are scalar calls): e^x for
 * x ≤ 0 by x = n ln2 + r, |r| ≤ ln2/2, degree-7 Taylor on r (1.5e-8 relative truncation), 0 below
 * the smallest normal; log x for 0 < x < 2^128 from the log1p polynomial above; log 0 = −inf.
 * The helpers are forced inline (PML_INLINE): called, they would be compiled once for the
 * baseline ISA, not for the row loop's AVX2 / AVX-512 clones (docs/design/native-code.md). */
PML_INLINE float exp_nonpos_f(float x)
{
    /* nearest integer by the 1.5·2^23 shift (|x log2 e| < 2^22 here): vectorises, unlike roundf */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0x1.62e4p-1f) - n * 0x1.7f7d1cp-20f; /* ln2 split: n ln2_hi exact */
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (
        1.0f / 720 + r * (1.0f / 5040)))))));
    const int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)(e > 1 ? e : 1) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

PML_INLINE float log_pos_f(float x)
{
    int32_t k;
    const float f = split_log_f(x, &k);
    const float kf = (float)k;
    const float out = kf * LN2_HI_F + (f - (0.5f * f * f - (f * f * f * log1p_cubic_f(f) + kf * LN2_LO_F)));
    return x > 0.0f ? out : -__builtin_inff();
}

PML_INLINE double exp_nonpos_d(double x) { return exp(x); }
PML_INLINE double log_pos_d(double x) { return log(x); }

/* The Gumbel noise's uniform draws, from a counter (no state, no buffer: generated where they are
 * used, and the rows of one call can be split between threads in any way). Draw p of stream
 * `row` under a 64-bit key:
 *
 *     s = splitmix64(key + (row + 1)·γ)        (one per row: γ = 0x9E3779B97F4A7C15)
 *     x = mix32(mix32(p + s_lo) ^ s_hi)        (32-bit lanes: the loop over p vectorises)
 *     float:  U = (x >> 8) · 2⁻²⁴,   double:  U = (x · 2²¹ + (mix32(x + γ_lo) >> 11)) · 2⁻⁵³,
 *
 * splitmix64 is Steele, Lea and Flood's finaliser (SplitMix64, 2014); mix32 the "lowbias32"
 * integer hash (C. Wellons's hash prospector): xor-shift-multiply rounds, each a bijection on
 * 32 bits, so the P draws of a row are distinct 32-bit values. U = 0 is possible (probability
 * 2⁻²⁴ / 2⁻⁵³): log U = −∞ gives that candidate weight 0. numpy evaluates the same formula for the
 * torch path (hier_loss._CounterUniform); the tests hold the two equal bit for bit. */
PML_INLINE uint64_t pml_row_seed(uint64_t key, uint64_t row)
{
    uint64_t z = key + (row + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

PML_INLINE uint32_t pml_mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

PML_INLINE uint32_t pml_counter_bits(uint32_t lo, uint32_t hi, uint32_t p)
{
    return pml_mix32(pml_mix32(p + lo) ^ hi);
}

PML_INLINE float pml_uniform_f32(uint32_t lo, uint32_t hi, uint32_t p)
{
    return (float)(int32_t)(pml_counter_bits(lo, hi, p) >> 8) * 0x1p-24f; /* signed: one vector convert */
}

PML_INLINE double pml_uniform_f64(uint32_t lo, uint32_t hi, uint32_t p)
{
    const uint32_t x = pml_counter_bits(lo, hi, p);
    const uint64_t bits = ((uint64_t)x << 21) | (pml_mix32(x + 0x7F4A7C15u) >> 11);
    return (double)(int64_t)bits * 0x1p-53;
}

/* The draws themselves (for the tests, against hier_loss's numpy form): out[r][p] = U of stream
 * `first_row + r`, for r < rows, p < P. */
#define PML_UNIFORM_ROWS(NAME, T, UNIFORM)                                                           \
    void NAME(uint64_t key, uint64_t first_row, long rows, long P, T *restrict out)                  \
    {                                                                                                \
        for (long r = 0; r < rows; ++r) {                                                            \
            const uint64_t seed = pml_row_seed(key, first_row + (uint64_t)r);                        \
            const uint32_t lo = (uint32_t)seed, hi = (uint32_t)(seed >> 32);                         \
            for (long p = 0; p < P; ++p)                                                             \
                out[r * P + p] = UNIFORM(lo, hi, (uint32_t)p);                                       \
        }                                                                                            \
    }
PML_UNIFORM_ROWS(pml_uniform_rows_f32, float, pml_uniform_f32)
PML_UNIFORM_ROWS(pml_uniform_rows_f64, double, pml_uniform_f64)

#define PML_LANES 16

/* (first index of the smallest v[0..P)) in 64-byte vectors (GCC's generic vector types: one
 * register per step in the AVX-512 clone, two or four in the others): per lane the first strict
 * minimum, by a compare mask and bitwise selects of value and index; across lanes the smallest
 * value, then the smallest index; the remainder after the lanes in order. Written as scalar lanes,
 * GCC left the select of a (value, index) pair scalar. */
typedef float pml_v16f __attribute__((vector_size(64)));
typedef int32_t pml_v16i __attribute__((vector_size(64)));
typedef double pml_v8d __attribute__((vector_size(64)));
typedef int64_t pml_v8l __attribute__((vector_size(64)));
#define PML_ARGMIN(NAME, T, VT, VI, IT, LANES)                                                       \
    PML_INLINE long NAME(const T *restrict v, long P)                                                 \
    {                                                                                                \
        VT best;                                                                                     \
        VI at, lane, step;                                                                           \
        for (int l = 0; l < LANES; ++l) {                                                            \
            best[l] = __builtin_inf();                                                               \
            at[l] = (IT)P;                                                                           \
            lane[l] = (IT)l;                                                                         \
            step[l] = (IT)LANES;                                                                     \
        }                                                                                            \
        long p = 0;                                                                                  \
        for (; p + LANES <= P; p += LANES) {                                                         \
            VT x;                                                                                    \
            VI x_bits, best_bits;                                                                    \
            memcpy(&x, v + p, sizeof x);                                                             \
            const VI less = x < best; /* all ones where x is smaller (never for NaN) */              \
            memcpy(&x_bits, &x, sizeof x);                                                           \
            memcpy(&best_bits, &best, sizeof best);                                                  \
            best_bits = (x_bits & less) | (best_bits & ~less);                                       \
            memcpy(&best, &best_bits, sizeof best);                                                  \
            at = (lane & less) | (at & ~less);                                                       \
            lane += step;                                                                            \
        }                                                                                            \
        long choice = P;                                                                             \
        T value = __builtin_inf();                                                                   \
        for (int l = 0; l < LANES; ++l)                                                              \
            if (best[l] < value || (best[l] == value && (long)at[l] < choice)) {                     \
                value = best[l];                                                                     \
                choice = (long)at[l];                                                                \
            }                                                                                        \
        for (; p < P; ++p) /* later indices: only a strictly smaller value wins */                   \
            if (v[p] < value) {                                                                      \
                value = v[p];                                                                        \
                choice = p;                                                                          \
            }                                                                                        \
        return choice < P ? choice : 0; /* (all +inf or NaN: the first, as torch's first-of-equal) */ \
    }
PML_ARGMIN(pml_argmin_f32, float, pml_v16f, pml_v16i, int32_t, 16)
PML_ARGMIN(pml_argmin_f64, double, pml_v8d, pml_v8l, int64_t, 8)

/* In place: z (the row's −m/τ) becomes π, the choice is returned. noise: draw U from the row's
 * seed (pml_row_seed), else none. */
#define PML_LCA_CHOOSE(NAME, T, EXP, LOG, ARGMIN, UNIFORM)                                           \
    PML_INLINE long NAME(T *restrict z, int noise, uint64_t seed, long P, T z_max, int need_pi)       \
    {                                                                                                \
        T sum = 0;                                                                                   \
        long choice;                                                                                 \
        if (noise) { /* q = e^{z − max} / log U (≤ 0): the choice is the smallest q */               \
            const uint32_t lo = (uint32_t)seed, hi = (uint32_t)(seed >> 32);                         \
            for (long p = 0; p < P; ++p)                                                             \
                z[p] = EXP(z[p] - z_max) / LOG(UNIFORM(lo, hi, (uint32_t)p));                        \
            choice = ARGMIN(z, P);                                                                   \
        } else { /* the first maximum of z: the smallest −z */                                       \
            choice = 0;                                                                              \
            for (long p = 0; p < P; ++p)                                                             \
                if (z[p] == z_max) {                                                                 \
                    choice = p;                                                                      \
                    break;                                                                           \
                }                                                                                    \
            for (long p = 0; p < P; ++p)                                                             \
                z[p] = EXP(z[p] - z_max);                                                            \
        }                                                                                            \
        if (need_pi) {                                                                               \
            T part[PML_LANES] = {0};                                                                 \
            long p = 0;                                                                              \
            for (; p + PML_LANES <= P; p += PML_LANES)                                               \
                for (int l = 0; l < PML_LANES; ++l)                                                  \
                    part[l] += z[p + l];                                                             \
            for (; p < P; ++p)                                                                       \
                part[p % PML_LANES] += z[p];                                                         \
            for (int l = 0; l < PML_LANES; ++l)                                                      \
                sum += part[l];                                                                      \
            const T inv = (T)1 / sum;                                                                \
            for (long q = 0; q < P; ++q)                                                             \
                z[q] *= inv;                                                                         \
        }                                                                                            \
        return choice;                                                                               \
    }
PML_LCA_CHOOSE(pml_lca_choose_f32, float, exp_nonpos_f, log_pos_f, pml_argmin_f32, pml_uniform_f32)
PML_LCA_CHOOSE(pml_lca_choose_f64, double, exp_nonpos_d, log_pos_d, pml_argmin_f64, pml_uniform_f64)

#define PML_LCA_ROWS(NAME, T, CHOOSE)                                                                \
    PML_CLONES                                                                                       \
    int NAME(const T *restrict dist, long N, long P, const long *restrict ii, const long *restrict jj,\
             const long *restrict kk, long T_rows, long t_begin, long t_end, T inv_tau, T margin,    \
             int noise, uint64_t key, T *restrict loss, long *restrict a_out,                        \
             long *restrict b_out, T *restrict grads, T *restrict on, T *restrict work)              \
    {                                                                                                \
        for (long t = t_begin; t < t_end; ++t) /* every row index checked before any read */        \
            if (ii[t] < 0 || ii[t] >= N || jj[t] < 0 || jj[t] >= N || kk[t] < 0 || kk[t] >= N)       \
                return -1;                                                                           \
        T *restrict z1 = work, *restrict z2 = work + P; /* 2P scratch from the caller */             \
        for (long t = t_begin; t < t_end; ++t) {                                                     \
            const T *restrict di = dist + ii[t] * P;                                                 \
            const T *restrict dj = dist + jj[t] * P;                                                 \
            const T *restrict dk = dist + kk[t] * P;                                                 \
            T max1[PML_LANES], max2[PML_LANES];                                                      \
            for (int l = 0; l < PML_LANES; ++l)                                                      \
                max1[l] = max2[l] = -__builtin_inf();                                                \
            long p = 0;                                                                              \
            for (; p < P; ++p) {                                                                     \
                const T m1 = di[p] > dj[p] ? di[p] : dj[p];                                          \
                const T m2 = m1 > dk[p] ? m1 : dk[p];                                                \
                z1[p] = -m1 * inv_tau;                                                               \
                z2[p] = -m2 * inv_tau;                                                               \
            }                                                                                        \
            for (p = 0; p + PML_LANES <= P; p += PML_LANES)                                          \
                for (int l = 0; l < PML_LANES; ++l) {                                                \
                    max1[l] = z1[p + l] > max1[l] ? z1[p + l] : max1[l];                             \
                    max2[l] = z2[p + l] > max2[l] ? z2[p + l] : max2[l];                             \
                }                                                                                    \
            for (; p < P; ++p) {                                                                     \
                max1[p % PML_LANES] = z1[p] > max1[p % PML_LANES] ? z1[p] : max1[p % PML_LANES];     \
                max2[p % PML_LANES] = z2[p] > max2[p % PML_LANES] ? z2[p] : max2[p % PML_LANES];     \
            }                                                                                        \
            T zmax1 = max1[0], zmax2 = max2[0];                                                      \
            for (int l = 1; l < PML_LANES; ++l) {                                                    \
                zmax1 = max1[l] > zmax1 ? max1[l] : zmax1;                                           \
                zmax2 = max2[l] > zmax2 ? max2[l] : zmax2;                                           \
            }                                                                                        \
            const int need = grads != 0;                                                             \
            const uint64_t row = 2 * (uint64_t)t;                                                    \
            const long a = CHOOSE(z1, noise, noise ? pml_row_seed(key, row) : 0, P, zmax1, need);    \
            const long b = CHOOSE(z2, noise, noise ? pml_row_seed(key, row + 1) : 0, P, zmax2, need); \
            a_out[t] = a;                                                                            \
            b_out[t] = b;                                                                            \
            const T h1 = di[a] - di[b] + margin, h2 = dj[a] - dj[b] + margin;                        \
            const T h3 = dk[b] - dk[a] + margin;                                                     \
            loss[t] = (h1 > 0 ? h1 : 0) + (h2 > 0 ? h2 : 0) + (h3 > 0 ? h3 : 0);                     \
            if (!need)                                                                               \
                continue;                                                                            \
            const T on1 = h1 > 0, on2 = h2 > 0, on3 = h3 > 0;                                        \
            on[t] = on1;                                                                             \
            on[T_rows + t] = on2;                                                                    \
            on[2 * T_rows + t] = on3;                                                                \
            T part1[PML_LANES] = {0}, part2[PML_LANES] = {0};                                        \
            for (p = 0; p + PML_LANES <= P; p += PML_LANES)                                          \
                for (int l = 0; l < PML_LANES; ++l) {                                                \
                    const T w = di[p + l] * on1 + dj[p + l] * on2 - dk[p + l] * on3;                 \
                    part1[l] += z1[p + l] * w;                                                       \
                    part2[l] += z2[p + l] * w;                                                       \
                }                                                                                    \
            for (; p < P; ++p) {                                                                     \
                const T w = di[p] * on1 + dj[p] * on2 - dk[p] * on3;                                 \
                part1[p % PML_LANES] += z1[p] * w;                                                   \
                part2[p % PML_LANES] += z2[p] * w;                                                   \
            }                                                                                        \
            T s1 = 0, s2 = 0;                                                                        \
            for (int l = 0; l < PML_LANES; ++l) {                                                    \
                s1 += part1[l];                                                                      \
                s2 += part2[l];                                                                      \
            }                                                                                        \
            T *restrict u1_out = grads + t * P;                                                      \
            T *restrict u2_out = grads + (T_rows + t) * P;                                           \
            for (p = 0; p < P; ++p) {                                                                \
                const T w = di[p] * on1 + dj[p] * on2 - dk[p] * on3;                                 \
                u1_out[p] = z1[p] * (w - s1);                                                        \
                u2_out[p] = z2[p] * (w - s2);                                                        \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }
PML_LCA_ROWS(pml_lca_rows_f32, float, pml_lca_choose_f32)
PML_LCA_ROWS(pml_lca_rows_f64, double, pml_lca_choose_f64)

#if defined(__GNUC__) && !defined(__clang__)
#define PML_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define PML_NO_CONTRACT
#endif

/* HIER's backward (hier_loss._LCATripletLoss.backward), for t in [0, T_rows) in order, with the
 * forward's u¹, u² rows (U: (2, T_rows, P)) routed through the maxima m¹ = max(D_i, D_j),
 * m² = max(m¹, D_k) (ties to the first argument):
 *
 *     g_k = u² [D_k > m¹],  g_m = (u² − g_k) − u¹,  g_i = g_m [D_i ≥ D_j],  g_j = g_m − g_i,
 *     grad[i_t] += g_i s_t,  grad[j_t] += g_j s_t,  grad[k_t] += g_k s_t     (s = scale),
 *
 * each product rounded, then added (no fused multiply-add), the three rows of t in that order. The
 * routing is recomputed from the distances (rows of the (N, P) matrix, in cache) instead of being
 * stored: the forward writes and this reads two (T, P) slabs instead of three. Three passes per row,
 * one per target row (they may coincide); u¹, u², D_i, D_j, D_k stay in L1 between them. Only target
 * rows in [row_begin, row_end) are written: threads given disjoint ranges scan every t in the same
 * order, so each row of grad receives the same additions in the same order as on one thread.
 * Returns -1 with nothing read or written when an index lies outside [0, N), else 0. */
#define PML_LCA_BACKWARD(NAME, T)                                                                    \
    PML_CLONES PML_NO_CONTRACT                                                                       \
    int NAME(T *grad, const T *restrict dist, long N, long P, const int64_t *restrict ii,            \
             const int64_t *restrict jj, const int64_t *restrict kk, const T *restrict U,             \
             const T *restrict scale, long T_rows, long row_begin, long row_end)                     \
    {                                                                                                \
        for (long t = 0; t < T_rows; ++t) /* every row index checked before any read or write */    \
            if (ii[t] < 0 || ii[t] >= N || jj[t] < 0 || jj[t] >= N || kk[t] < 0 || kk[t] >= N)       \
                return -1;                                                                           \
        for (long t = 0; t < T_rows; ++t) {                                                          \
            const int do_i = ii[t] >= row_begin && ii[t] < row_end;                                  \
            const int do_j = jj[t] >= row_begin && jj[t] < row_end;                                  \
            const int do_k = kk[t] >= row_begin && kk[t] < row_end;                                  \
            if (!(do_i || do_j || do_k))                                                             \
                continue;                                                                            \
            const long n_i = do_i ? P : 0, n_j = do_j ? P : 0, n_k = do_k ? P : 0;                   \
            const T *restrict di = dist + ii[t] * P;                                                 \
            const T *restrict dj = dist + jj[t] * P;                                                 \
            const T *restrict dk = dist + kk[t] * P;                                                 \
            const T *restrict u1 = U + t * P;                                                        \
            const T *restrict u2 = U + (T_rows + t) * P;                                             \
            const T s = scale[t];                                                                    \
            T *gi_row = grad + ii[t] * P;                                                            \
            for (long p = 0; p < n_i; ++p) {                                                         \
                const T m1 = di[p] > dj[p] ? di[p] : dj[p];                                          \
                const T gk = dk[p] > m1 ? u2[p] : (T)0;                                              \
                const T gm = (u2[p] - gk) - u1[p];                                                   \
                const T product = (di[p] >= dj[p] ? gm : (T)0) * s;                                  \
                gi_row[p] = gi_row[p] + product;                                                     \
            }                                                                                        \
            T *gj_row = grad + jj[t] * P;                                                            \
            for (long p = 0; p < n_j; ++p) {                                                         \
                const T m1 = di[p] > dj[p] ? di[p] : dj[p];                                          \
                const T gk = dk[p] > m1 ? u2[p] : (T)0;                                              \
                const T gm = (u2[p] - gk) - u1[p];                                                   \
                const T gi = di[p] >= dj[p] ? gm : (T)0;                                             \
                const T product = (gm - gi) * s;                                                     \
                gj_row[p] = gj_row[p] + product;                                                     \
            }                                                                                        \
            T *gk_row = grad + kk[t] * P;                                                            \
            for (long p = 0; p < n_k; ++p) {                                                         \
                const T m1 = di[p] > dj[p] ? di[p] : dj[p];                                          \
                const T product = (dk[p] > m1 ? u2[p] : (T)0) * s;                                   \
                gk_row[p] = gk_row[p] + product;                                                     \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }
PML_LCA_BACKWARD(pml_lca_backward_f32, float)
PML_LCA_BACKWARD(pml_lca_backward_f64, double)
