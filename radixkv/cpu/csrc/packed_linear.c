/* bf16 linear layers over weights packed once at load: y = x W^T (+ b), fp32 sums rounded
 * once to bf16. Two kernels read the one packed layout: AMX tiles (Sapphire Rapids and later)
 * and AVX512_BF16's vdpbf16ps (AMD Zen 4/5, Cooper Lake), for CPUs with bf16 dot products but no
 * tiles.
 *
 * oneDNN spends ~20 us of set-up on every call, more than a decode step's 32-row product
 * takes, and streams the weights ~1.3x slower at decode's row counts. Here the weights are packed
 * once, in the order the product reads them, so each thread streams one contiguous run; a call
 * is a loop. Each output row is summed over K in the same order whatever the row count, so a
 * row's bits never depend on its batch (with either kernel; the two differ from each other).
 *
 * Packed layout (uint16): for n-block pair p (32 output features), k-block kb (32 inputs),
 * half h (16 features): one 16 x 32 tile, row r = input pair (2r, 2r+1), column c = feature,
 * at ((p * KB + kb) * 2 + h) * 512 + r * 32 + c * 2 + {0, 1}. N is padded to 32 with zeros.
 * A tile row is also exactly vdpbf16ps's operand: 16 lanes, each one feature's weights for
 * the input pair (2r, 2r+1), against x's pair broadcast to every lane.
 */
#include "amx.h"
#include "kernels.h"

#define TILE_WORDS 512 /* one packed 16 x 32 bf16 tile */
#define PREFETCH_TILES 8 /* how far ahead, in tiles, the weight stream is requested */
#define ROW_BLOCK 32     /* rows per pass: two A tiles */
#define GROUP_X_BYTES (1 << 20) /* x rows per group: as many as fit this much of L2 */

static inline int64_t pair_count(int n) { return (n + 31) / 32; }

/* uint16 words of the packed form of an n x k weight (k % 32 == 0). */
int64_t radixkv_packed_words(int n, int k) { return pair_count(n) * (k / 32) * 2 * TILE_WORDS; }

/* Pack w [n][k] (row stride k) into the layout above. */
void radixkv_pack_weight(const uint16_t *w, int n, int k, uint16_t *packed) {
    const int64_t kb_count = k / 32;
    for (int64_t p = 0; p < pair_count(n); p++)
        for (int64_t kb = 0; kb < kb_count; kb++)
            for (int h = 0; h < 2; h++) {
                uint16_t *tile = packed + ((p * kb_count + kb) * 2 + h) * TILE_WORDS;
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        const int64_t feature = p * 32 + h * 16 + c;
                        for (int e = 0; e < 2; e++)
                            tile[r * 32 + c * 2 + e] = feature < n ? w[feature * k + kb * 32 + 2 * r + e] : 0;
                    }
            }
}

#ifdef HAVE_AVX512_BF16
/* bf16 of sums + bias for 16 features of one row, of which the first `live` exist (the rest
 * are padding: neither read from bias nor written). */
static inline void store_sums(__m512 sums, const float *bias, uint16_t *dst, int live) {
    const __mmask16 mask = live >= 16 ? 0xffff : (__mmask16)((1u << live) - 1);
    if (bias) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, bias));
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

/* Weight prefetch for k-block kb of a pass over a pair (b: its tiles). ahead == NULL: this
 * pass streams the pair, so its own tiles are requested PREFETCH_TILES ahead, into L1 (T0) or,
 * with into_l2, into L2 (T1); else the pass reads the pair from cache and requests its share
 * [ahead, ahead + ahead_bytes) of the next pair, ahead_step bytes per k-block. Always inlined:
 * a call inside the k-loop would spill the accumulators (every vector register is
 * caller-saved). */
static inline __attribute__((always_inline)) void prefetch_weights(const uint16_t *b, int kb, const char *ahead,
                                                                   int64_t ahead_step, int64_t ahead_bytes, const int into_l2) {
    if (ahead == NULL) {
        for (int line = 0; line < 2 * TILE_WORDS * 2; line += 64) {
            const char *at = (const char *)(b + PREFETCH_TILES * TILE_WORDS) + line;
            if (into_l2) _mm_prefetch(at, _MM_HINT_T1);
            else _mm_prefetch(at, _MM_HINT_T0);
        }
    } else {
        for (int64_t byte = kb * ahead_step; byte < (kb + 1) * ahead_step && byte < ahead_bytes; byte += 64)
            _mm_prefetch(ahead + byte, _MM_HINT_T1);
    }
}

/* Rows per group: as many as keep the group's x in L2 while every pair's weights stream past
 * it once (each group reads all the weights again), a multiple of block rows. */
static inline int group_rows_for(int k, int block_rows) {
    const int fit = GROUP_X_BYTES / (k * 2) / block_rows * block_rows;
    return fit > block_rows ? fit : block_rows;
}

#define VEC_ROWS 8 /* rows per pass of the vdpbf16ps kernel: 16 accumulators of 32 registers */

/* Rows [m0, m0 + R) of y for the 32 features of pair p by vdpbf16ps. Per input pair r of a
 * k-block, the two halves' tile rows r are loaded once and each x row's pair (one 32-bit word)
 * is broadcast against them. As in the AMX kernel: with ahead == NULL the weights are requested
 * a few tiles ahead in their stream (one pass over the pair: few rows); else this pass reads
 * the pair from cache and requests the bytes [ahead, ahead + ahead_bytes) of the next pair,
 * spread over its k-blocks, so the next pair streams in while this one computes. R is a
 * constant in the instances. The stream is requested into L2, not L1: on Zen 4 (2 cores,
 * 30 layers of SmolLM2's linears, cold) that took 1 row from 14.6 to 11.0 ms and 8 rows from
 * 16.7 to 10.1 ms, and left 32 rows as they were (A/B in one process); the AMX kernel keeps
 * T0, as measured on its machine. */
static inline __attribute__((always_inline)) void pair_rows_avx512(
    const uint16_t *x, int64_t x_stride, int m0, const int R, int k, const uint16_t *pair_tiles,
    const float *bias, int n, int64_t p, uint16_t *y, int64_t y_stride, const char *ahead, int64_t ahead_bytes) {
    __m512 acc[VEC_ROWS][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint16_t *rows = x + (int64_t)m0 * x_stride;
    const int kb_count = k / 32;
    const int64_t ahead_step = (ahead_bytes / kb_count + 63) / 64 * 64;
    for (int kb = 0; kb < kb_count; kb++) {
        const uint16_t *b = pair_tiles + (int64_t)kb * 2 * TILE_WORDS;
        prefetch_weights(b, kb, ahead, ahead_step, ahead_bytes, 1);
        for (int r = 0; r < 16; r++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + r * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + TILE_WORDS + r * 32);
            for (int i = 0; i < R; i++) {
                int32_t word;
                memcpy(&word, rows + i * x_stride + kb * 32 + 2 * r, sizeof word);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(word);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        uint16_t *dst = y + (int64_t)(m0 + i) * y_stride + p * 32;
        for (int h = 0; h < 2; h++) {
            const int64_t first = p * 32 + h * 16;
            if (first >= n) break;
            store_sums(acc[i][h], bias ? bias + first : NULL, dst + h * 16, (int)(n - first));
        }
    }
}

static void pair_rows_any(const uint16_t *x, int64_t x_stride, int m0, int rows, int k, const uint16_t *pair_tiles,
                          const float *bias, int n, int64_t p, uint16_t *y, int64_t y_stride, const char *ahead,
                          int64_t ahead_bytes) {
#define PAIR_ROWS_CASE(R) \
    case R: pair_rows_avx512(x, x_stride, m0, R, k, pair_tiles, bias, n, p, y, y_stride, ahead, ahead_bytes); return;
    switch (rows) {
        PAIR_ROWS_CASE(1) PAIR_ROWS_CASE(2) PAIR_ROWS_CASE(3) PAIR_ROWS_CASE(4)
        PAIR_ROWS_CASE(5) PAIR_ROWS_CASE(6) PAIR_ROWS_CASE(7) PAIR_ROWS_CASE(8)
    }
#undef PAIR_ROWS_CASE
}

/* The vdpbf16ps kernel, threaded as the AMX one: rows in groups whose x stays in L2, and each
 * thread one contiguous run of pairs, passing over each pair's weights once per VEC_ROWS rows. */
static void linear_avx512(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                          const float *bias, uint16_t *y, int64_t y_stride, int num_threads) {
    const int64_t pairs = pair_count(n), pair_words = (int64_t)(k / 32) * 2 * TILE_WORDS;
    const int group_rows = group_rows_for(k, VEC_ROWS);
#pragma omp parallel num_threads(num_threads)
    for (int g0 = 0; g0 < m; g0 += group_rows) {
        const int group_end = m - g0 < group_rows ? m : g0 + group_rows;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < pairs; p++) {
            const int blocks = (group_end - g0 + VEC_ROWS - 1) / VEC_ROWS;
            const char *next_pair = p + 1 < pairs ? (const char *)(packed + (p + 1) * pair_words) : NULL;
            /* Several row blocks: each requests its share of the next pair's weights. */
            const int64_t share = blocks > 1 && next_pair ? pair_words * 2 / blocks : 0;
            for (int block = 0; block < blocks; block++) {
                const int m0 = g0 + block * VEC_ROWS;
                pair_rows_any(x, x_stride, m0, group_end - m0 < VEC_ROWS ? group_end - m0 : VEC_ROWS, k,
                              packed + p * pair_words, bias, n, p, y, y_stride,
                              share ? next_pair + block * share : NULL, share);
            }
        }
    }
}
#endif

#ifdef HAVE_AMX
/* Tiles: 0..3 = sums [rows][16 features] (A half i x B half j -> 2i + j), 4, 5 = x rows
 * [rows][32 inputs], 6, 7 = weight halves. rows0/rows1: rows in the first/second A tile. */
static void configure(int rows0, int rows1) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

static inline void store_row(const float *sums, const float *bias, uint16_t *dst, int live) {
    store_sums(_mm512_loadu_ps(sums), bias, dst, live);
}

/* Rows [m0, m0 + rows) of y for the 32 features of pair p. With ahead == NULL the weights are
 * requested a few tiles ahead in their stream (one pass over the pair: decode); else this pass
 * reads the pair's tiles from cache and requests the bytes [ahead, ahead + ahead_bytes) of the
 * next pair instead, spread over its iterations (many row blocks per pair: prefill). */
static inline void pair_block(const uint16_t *x, int64_t x_stride, int m0, int rows, int k,
                              const uint16_t *pair_tiles, const float *bias, int n, int64_t p,
                              uint16_t *y, int64_t y_stride, const char *ahead, int64_t ahead_bytes) {
    const int kb_count = k / 32, rows1 = rows > 16 ? rows - 16 : 0;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t *x0 = x + (int64_t)m0 * x_stride, *x1 = x0 + 16 * x_stride;
    const int64_t ahead_step = (ahead_bytes / kb_count + 63) / 64 * 64;
    for (int kb = 0; kb < kb_count; kb++) {
        const uint16_t *b = pair_tiles + (int64_t)kb * 2 * TILE_WORDS;
        prefetch_weights(b, kb, ahead, ahead_step, ahead_bytes, 0);
        _tile_loadd(4, x0 + kb * 32, x_stride * 2);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + TILE_WORDS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, x1 + kb * 32, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[4][16 * 16];
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (rows1) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
    for (int r = 0; r < rows; r++) {
        const int half_row = r & 15, a = r >> 4;
        uint16_t *dst = y + (int64_t)(m0 + r) * y_stride + p * 32;
        for (int h = 0; h < 2; h++) {
            const int64_t first = p * 32 + h * 16;
            if (first >= n) break;
            store_row(sums[2 * a + h] + half_row * 16, bias ? bias + first : NULL, dst + h * 16, (int)(n - first));
        }
    }
}
#endif

/* The kernels this library runs here: RADIXKV_LINEAR_AMX where the CPU has tiles and the OS
 * grants them (asked once), RADIXKV_LINEAR_AVX512_BF16 where it was built for vdpbf16ps, and
 * RADIXKV_LINEAR_AVX2 (fp32 weights, linear_f32.c) where it was built for AVX2 with FMA. */
int radixkv_linear_kernels(void) {
    int kernels = 0;
#ifdef HAVE_AVX2
    kernels |= RADIXKV_LINEAR_AVX2;
#endif
#ifdef HAVE_AMX
    if (radixkv_enable_amx()) kernels |= RADIXKV_LINEAR_AMX;
#endif
#ifdef HAVE_AVX512_BF16
    kernels |= RADIXKV_LINEAR_AVX512_BF16;
#endif
    return kernels;
}

static int linear_amx(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                      const float *bias, uint16_t *y, int64_t y_stride, int num_threads) {
#ifdef HAVE_AMX
    if (!radixkv_enable_amx() || k % 32 != 0) return 1;
    const int64_t pairs = pair_count(n), pair_words = (int64_t)(k / 32) * 2 * TILE_WORDS;
#pragma omp parallel num_threads(num_threads)
    {
        int configured = -1; /* rows of the tile configuration this thread has loaded */
        const int group_rows = group_rows_for(k, ROW_BLOCK);
        for (int g0 = 0; g0 < m; g0 += group_rows) {
            const int group_end = m - g0 < group_rows ? m : g0 + group_rows;
            /* Each thread takes one contiguous run of pairs: one stream through the weights. */
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < pairs; p++) {
                const int blocks = (group_end - g0 + ROW_BLOCK - 1) / ROW_BLOCK;
                const char *next_pair = p + 1 < pairs ? (const char *)(packed + (p + 1) * pair_words) : NULL;
                for (int block = 0; block < blocks; block++) {
                    const int m0 = g0 + block * ROW_BLOCK;
                    const int rows = group_end - m0 < ROW_BLOCK ? group_end - m0 : ROW_BLOCK;
                    if (rows != configured) {
                        configure(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0);
                        configured = rows;
                    }
                    /* Several row blocks: each requests its share of the next pair's weights. */
                    const int64_t share = blocks > 1 && next_pair ? pair_words * 2 / blocks : 0;
                    pair_block(x, x_stride, m0, rows, k, packed + p * pair_words, bias, n, p, y, y_stride,
                               share ? next_pair + block * share : NULL, share);
                }
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)y_stride,
        (void)num_threads;
    return 1;
#endif
}

/* y [m][n] (row stride y_stride) = x [m][k] (row stride x_stride) W^T + bias (fp32, or NULL),
 * by `kernel` (one RADIXKV_LINEAR_* bit). Returns 1, doing nothing, where that kernel does not
 * run here or k % 32 != 0. */
int radixkv_packed_linear(int kernel, const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                          const float *bias, uint16_t *y, int64_t y_stride, int num_threads) {
    if (k % 32 != 0 || !(radixkv_linear_kernels() & kernel)) return 1;
    if (kernel == RADIXKV_LINEAR_AMX) return linear_amx(x, x_stride, m, k, packed, n, bias, y, y_stride, num_threads);
#ifdef HAVE_AVX512_BF16
    if (kernel == RADIXKV_LINEAR_AVX512_BF16) {
        linear_avx512(x, x_stride, m, k, packed, n, bias, y, y_stride, num_threads);
        return 0;
    }
#endif
    return 1;
}
