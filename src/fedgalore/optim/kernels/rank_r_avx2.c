/* AVX2/FMA kernels for the two rank-r GEMMs of a GaLore step on one CPU core (fp32, row-major,
 * contiguous, r a multiple of 8), compiled and loaded by fedgalore/optim/cpu_kernels.py.
 * Why hand-written: at r = 8 MKL and oneDNN reach 13-34 % of the core's FMA peak on these skinny
 * shapes, these 36-44 % (benchmarks/step_roofline.py, benchmarks/RESULTS.md §1.1). Every kernel
 * multiplies every entry it reads (NaN and Inf propagate: x * 0 = NaN for x non-finite).
 *
 *   rank_update:      W[m x n] = d W + c A[m x r] B[r x n]     (back-projection + decay, both sides)
 *   project_rows:     R[m x r] = G[m x n] Bt[n x r]            (right projection, Bt = P^T; 12-row
 *                                                               broadcast blocking)
 *   project_cols:     R[r x n] = A[m x r]^T G[m x n]           (left projection; 8-column panels over
 *                                                               chunks of h rows)
 *   adam_moments:     Adam's moment update and U on the projected gradient in one call (the
 *                     step's small m x r / r x n work: one call instead of about eight torch ops)
 *
 * Compiled without -ffast-math and with -ffp-contract=off: every product and sum is rounded as
 * written (IEEE), so NaN/Inf propagate and the moment update follows torch's formulas.
 */
#include <immintrin.h>

void rank_update(float *W, const float *A, const float *B, long m, long n, long r, float d, float c) {
    for (long i = 0; i < m; i++) {
        float *w = W + i * n;
        /* the next row of W, fetched while this one computes (measured 13-15 % faster; the
         * projections gained nothing from it) */
        const char *next = (const char *)(i + 1 < m ? w + n : w);
        for (long g = 0; g < r; g += 8) {
            const float *a = A + i * r + g;
            const float *b = B + g * n;
            float dg = g == 0 ? d : 1.0f;
            __m256 av[8];
            for (int j = 0; j < 8; j++) av[j] = _mm256_set1_ps(c * a[j]);
            __m256 dd = _mm256_set1_ps(dg);
            long col = 0;
            for (; col + 32 <= n; col += 32) {  /* four independent accumulation chains */
                if (g == 0) {
                    _mm_prefetch(next + 4 * col, _MM_HINT_T0);
                    _mm_prefetch(next + 4 * col + 64, _MM_HINT_T0);
                }
                __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(w + col), dd);
                __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(w + col + 8), dd);
                __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(w + col + 16), dd);
                __m256 x3 = _mm256_mul_ps(_mm256_loadu_ps(w + col + 24), dd);
                for (int j = 0; j < 8; j++) {
                    const float *bj = b + j * n + col;
                    x0 = _mm256_fmadd_ps(av[j], _mm256_loadu_ps(bj), x0);
                    x1 = _mm256_fmadd_ps(av[j], _mm256_loadu_ps(bj + 8), x1);
                    x2 = _mm256_fmadd_ps(av[j], _mm256_loadu_ps(bj + 16), x2);
                    x3 = _mm256_fmadd_ps(av[j], _mm256_loadu_ps(bj + 24), x3);
                }
                _mm256_storeu_ps(w + col, x0);
                _mm256_storeu_ps(w + col + 8, x1);
                _mm256_storeu_ps(w + col + 16, x2);
                _mm256_storeu_ps(w + col + 24, x3);
            }
            for (; col < n; col++) {
                float x = w[col] * dg;
                for (int j = 0; j < 8; j++) x += c * a[j] * b[j * n + col];
                w[col] = x;
            }
        }
    }
}

#define MR 12
void project_rows(float *R, const float *G, const float *Bt, long m, long n, long r) {
    long i = 0;
    for (; i + MR <= m; i += MR) {
        for (long g = 0; g < r; g += 8) {
            __m256 acc[MR];
            for (int t = 0; t < MR; t++) acc[t] = _mm256_setzero_ps();
            const float *gp = G + i * n;
            for (long k = 0; k < n; k++) {
                __m256 b = _mm256_loadu_ps(Bt + k * r + g);
                for (int t = 0; t < MR; t++) acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(gp + t * n + k), b, acc[t]);
            }
            for (int t = 0; t < MR; t++) _mm256_storeu_ps(R + (i + t) * r + g, acc[t]);
        }
    }
    for (; i < m; i++)
        for (long g = 0; g < r; g += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (long k = 0; k < n; k++) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(G + i * n + k), _mm256_loadu_ps(Bt + k * r + g), acc);
            _mm256_storeu_ps(R + i * r + g, acc);
        }
}

void project_cols(float *R, const float *A, const float *G, long m, long n, long r, long h) {
    for (long j = 0; j < r * n; j++) R[j] = 0.0f;
    for (long i0 = 0; i0 < m; i0 += h) {
        long i1 = i0 + h < m ? i0 + h : m;
        for (long g = 0; g < r; g += 8) {
            long col = 0;
            for (; col + 8 <= n; col += 8) {
                float *rp = R + g * n + col;
                __m256 c[8];
                for (int j = 0; j < 8; j++) c[j] = _mm256_loadu_ps(rp + j * n);
                for (long i = i0; i < i1; i++) {
                    __m256 x = _mm256_loadu_ps(G + i * n + col);
                    const float *a = A + i * r + g;
                    for (int j = 0; j < 8; j++) c[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + j), x, c[j]);
                }
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(rp + j * n, c[j]);
            }
            for (; col < n; col++)
                for (int j = 0; j < 8; j++) {
                    float s = R[(g + j) * n + col];
                    for (long i = i0; i < i1; i++) s += A[i * r + g + j] * G[i * n + col];
                    R[(g + j) * n + col] = s;
                }
        }
    }
}

/* Adam's moments on the projected gradient R (rows x cols, contiguous), all or nothing:
 * returns 0 and writes nothing when R holds a NaN or Inf; else, element-wise,
 *   M <- lerp(M, R, w1)                    (torch's lerp: M + w1 (R - M) for w1 < 0.5, else R - (R - M)(1 - w1))
 *   V <- b2 V + w2 R R,   CV likewise when CV is not NULL (the shadow cold moment)
 *   W8 <- b2 W8 + w2            when W8 is not NULL (prior weights: per column if w8_per_row == 0,
 *                                per row otherwise)
 *   S  <- V / W8 with W8, else V;   S <- max(S, CV * cap) when cap > 0 and CV is not NULL (the
 *                                cold cap: cap = 1 / (1 - b2^s) for the shadow's step count s)
 *   U <- M / (sqrt(S) + eps)
 * and returns 1. */
int adam_moments(const float *R, float *M, float *V, float *CV, float *W8, float *U,
                 long rows, long cols, int w8_per_row, float w1, float b2, float w2, float eps, float cap) {
    long total = rows * cols;
    __m256 acc = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= total; k += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(R + k), zero));
    float tail = 0.0f;
    for (; k < total; k++) tail += R[k] * 0.0f;
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) tail += lanes[j];
    if (tail != tail) return 0; /* x * 0 is NaN exactly when x is NaN or +-Inf */
    const float nb1 = 1.0f - w1; /* w1 = 1 - b1 and w2 = 1 - b2 come rounded from double, as torch's scalars */
    const int low = w1 < 0.5f;
    if (W8 != NULL) {
        long nw = w8_per_row ? rows : cols;
        for (long j = 0; j < nw; j++) W8[j] = W8[j] * b2 + w2;
    }
    const __m256 vw1 = _mm256_set1_ps(w1), vnb1 = _mm256_set1_ps(nb1), vb2 = _mm256_set1_ps(b2), vw2 = _mm256_set1_ps(w2);
    const __m256 veps = _mm256_set1_ps(eps), vcap = _mm256_set1_ps(cap);
    const int capped = cap > 0.0f && CV != NULL;
    for (long i = 0; i < rows; i++) {
        long base = i * cols, c = 0;
        __m256 wrow = W8 != NULL && w8_per_row ? _mm256_set1_ps(W8[i]) : _mm256_setzero_ps();
        for (; c + 8 <= cols; c += 8) {
            long q = base + c;
            __m256 x = _mm256_loadu_ps(R + q), m = _mm256_loadu_ps(M + q);
            __m256 d = _mm256_sub_ps(x, m);
            m = low ? _mm256_add_ps(m, _mm256_mul_ps(vw1, d)) : _mm256_sub_ps(x, _mm256_mul_ps(d, vnb1));
            __m256 xx = _mm256_mul_ps(_mm256_mul_ps(vw2, x), x);
            __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(V + q), vb2), xx);
            __m256 cv = _mm256_setzero_ps();
            if (CV != NULL) {
                cv = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(CV + q), vb2), xx);
                _mm256_storeu_ps(CV + q, cv);
            }
            __m256 s = v;
            if (W8 != NULL) s = _mm256_div_ps(v, w8_per_row ? wrow : _mm256_loadu_ps(W8 + c));
            if (capped) s = _mm256_max_ps(s, _mm256_mul_ps(cv, vcap));
            __m256 u = _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(s), veps));
            _mm256_storeu_ps(M + q, m);
            _mm256_storeu_ps(V + q, v);
            _mm256_storeu_ps(U + q, u);
        }
        for (; c < cols; c++) {
            long q = base + c;
            float x = R[q], m = M[q], d = x - m;
            m = low ? m + w1 * d : x - d * nb1;
            float xx = (w2 * x) * x;
            float v = V[q] * b2 + xx;
            float cv = 0.0f;
            if (CV != NULL) cv = CV[q] = CV[q] * b2 + xx;
            float s = v;
            if (W8 != NULL) s = v / (w8_per_row ? W8[i] : W8[c]);
            if (capped) {
                float sc = cv * cap;
                s = sc > s ? sc : s;
            }
            M[q] = m;
            V[q] = v;
            U[q] = m / (__builtin_sqrtf(s) + eps);
        }
    }
    return 1;
}
