/* fp32 linear layers over weights packed once at load, in AVX2 FMAs: y = x W^T (+ b), for the
 * CPUs where models run in fp32 (no bf16 arithmetic: Intel before Cooper Lake, AMD Zen 1-3).
 *
 * torch's fp32 linear at decode's 32 rows ran at 38-105 GFLOP/s on a 2-core Zen 3 whose large
 * products reach 114-180 (lm_head, 49,152 features, the slowest), since its kernels are tuned for
 * large matrices. Here a call is a loop over panels of 24 features packed in the order the
 * product reads them, each one contiguous run.
 *
 * Packed layout (float): panel p (features 24p .. 24p + 23), input i at (p * k + i) * 24, the
 * panel's 24 weights for that input; n is padded to a multiple of 24 with zeros. A block of 4
 * rows x 24 features keeps its 12 sums in registers over all k inputs and adds the inputs in
 * order, one FMA each, so a row's bits never depend on the call's row count.
 */
#include "bf16.h"
#include "kernels.h"

#define PANEL 24
#define BLOCK_ROWS 4
#define GROUP_X_BYTES (256 << 10) /* x rows per group: as many as stay in L2 while the panels stream past */
/* Groups of up to this many row blocks request the next panel while they compute this one
 * (below); larger ones compute long enough per panel for the hardware prefetcher alone. */
#define PREFETCH_MAX_BLOCKS 16

static inline int64_t panel_count(int n) { return (n + PANEL - 1) / PANEL; }

/* Floats of the packed form of an n x k weight. */
int64_t radixkv_packed_floats_f32(int n, int k) { return panel_count(n) * PANEL * (int64_t)k; }

/* Pack w [n][k] (row stride k) into the layout above. */
void radixkv_pack_weight_f32(const float *w, int n, int k, float *packed) {
    for (int64_t p = 0; p < panel_count(n); p++)
        for (int64_t i = 0; i < k; i++)
            for (int f = 0; f < PANEL; f++) {
                const int64_t feature = p * PANEL + f;
                packed[(p * k + i) * PANEL + f] = feature < n ? w[feature * k + i] : 0.0f;
            }
}

#ifdef HAVE_AVX2
/* Lanes below `live` (0..8) set: the features of a vector that exist. */
static inline __m256i live_lanes(int live) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* sums + bias into one row's `live` features (at most 24; the rest are padding: neither read
 * from bias nor written). */
static inline __attribute__((always_inline)) void store_row(float *dst, const __m256 sums[3], const float *bias,
                                                            int live) {
    for (int j = 0; j < 3; j++) {
        const __m256i mask = live_lanes(live - 8 * j < 8 ? live - 8 * j : 8);
        const __m256 b = bias ? _mm256_maskload_ps(bias + 8 * j, mask) : _mm256_setzero_ps();
        if (live >= PANEL) _mm256_storeu_ps(dst + 8 * j, _mm256_add_ps(sums[j], b));
        else _mm256_maskstore_ps(dst + 8 * j, mask, _mm256_add_ps(sums[j], b));
    }
}

/* y rows [0, rows) (1 to 4) x the panel's features, of which the first `live` exist. A block
 * short of 4 rows repeats its last row, whose extra sums are never stored. The 12 sums are
 * named, not an array: GCC stored an array's sums to memory on every input. With a broadcast
 * and the weights as memory operands they fit AVX2's 16 registers. Meanwhile `ahead_lines`
 * lines from `ahead` are requested into L2, one before each equal stretch of inputs. */
static void panel_rows(const float *x, int64_t x_stride, int rows, int k, const float *panel, const float *bias,
                       int live, float *y, int64_t y_stride, const char *ahead, int ahead_lines) {
    const int stretch = ahead_lines > 0 ? k / ahead_lines : k; /* callers keep ahead_lines <= k: stretches >= lines */
    const float *row[BLOCK_ROWS];
    for (int r = 0; r < BLOCK_ROWS; r++) row[r] = x + (r < rows ? r : rows - 1) * x_stride;
    const float *x0 = row[0], *x1 = row[1], *x2 = row[2], *x3 = row[3];
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    for (int i0 = 0, line = 0; i0 < k; i0 += stretch, line++) {
        if (line < ahead_lines) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
        for (int i = i0, stop = i0 + stretch < k ? i0 + stretch : k; i < stop; i++) {
            const float *w = panel + (int64_t)i * PANEL;
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16);
            /* In registers: each weight vector loaded once, not once per row as an FMA operand. */
            __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));
            __m256 xi = _mm256_broadcast_ss(x0 + i);
            a00 = _mm256_fmadd_ps(xi, w0, a00), a01 = _mm256_fmadd_ps(xi, w1, a01), a02 = _mm256_fmadd_ps(xi, w2, a02);
            xi = _mm256_broadcast_ss(x1 + i);
            a10 = _mm256_fmadd_ps(xi, w0, a10), a11 = _mm256_fmadd_ps(xi, w1, a11), a12 = _mm256_fmadd_ps(xi, w2, a12);
            xi = _mm256_broadcast_ss(x2 + i);
            a20 = _mm256_fmadd_ps(xi, w0, a20), a21 = _mm256_fmadd_ps(xi, w1, a21), a22 = _mm256_fmadd_ps(xi, w2, a22);
            xi = _mm256_broadcast_ss(x3 + i);
            a30 = _mm256_fmadd_ps(xi, w0, a30), a31 = _mm256_fmadd_ps(xi, w1, a31), a32 = _mm256_fmadd_ps(xi, w2, a32);
        }
    }
    const __m256 sums[BLOCK_ROWS][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
    for (int r = 0; r < rows; r++) store_row(y + r * y_stride, sums[r], bias, live);
}
#endif

/* y [m][y_stride] = x [m][x_stride] W^T (+ bias) with W packed by radixkv_pack_weight_f32;
 * returns 1 where this build has no AVX2. Rows go in groups whose x fits L2; within a group
 * the threads split the panels, and each panel streams once past the group's row blocks. */
int radixkv_packed_linear_f32(const float *x, int64_t x_stride, int m, int k, const float *packed, int n,
                              const float *bias, float *y, int64_t y_stride, int num_threads) {
#ifdef HAVE_AVX2
    const int64_t panels = panel_count(n);
    int group_rows = (int)(GROUP_X_BYTES / ((int64_t)k * 4)) / BLOCK_ROWS * BLOCK_ROWS;
    if (group_rows < BLOCK_ROWS) group_rows = BLOCK_ROWS;
#pragma omp parallel num_threads(num_threads)
    for (int g0 = 0; g0 < m; g0 += group_rows) {
        const int group_end = g0 + group_rows < m ? g0 + group_rows : m;
        const int blocks = (group_end - g0 + BLOCK_ROWS - 1) / BLOCK_ROWS;
        /* The next panel's lines, a slice per row block: without them each panel's first block
         * waits on memory, then the rest compute from L2 with memory idle (decode's 32 rows: 15%
         * faster, A/B in one process on Zen 3; 2 panels ahead was slower). */
        const int64_t panel_lines = ((int64_t)k * PANEL * 4 + 63) / 64;
        const int slice = blocks <= PREFETCH_MAX_BLOCKS ? (int)((panel_lines + blocks - 1) / blocks) : 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int live = (int)(n - p * PANEL);
            const char *next = (const char *)(packed + (p + 1) * k * PANEL);
            for (int m0 = g0, b = 0; m0 < group_end; m0 += BLOCK_ROWS, b++) {
                const int64_t first = (int64_t)b * slice, left = p + 1 < panels ? panel_lines - first : 0;
                const int lines = (int)(left < slice ? (left > 0 ? left : 0) : slice);
                panel_rows(x + (int64_t)m0 * x_stride, x_stride, group_end - m0 < BLOCK_ROWS ? group_end - m0 : BLOCK_ROWS,
                           k, packed + p * k * PANEL, bias ? bias + p * PANEL : NULL, live,
                           y + (int64_t)m0 * y_stride + p * PANEL, y_stride, next + 64 * first, lines < k ? lines : k);
            }
        }
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)y_stride;
    (void)num_threads;
    return 1;
#endif
}
