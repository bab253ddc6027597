/* Attention over a chunk of keys as small matrix products, for many queries at once: the keys
 * transposed (dimension major, 16 keys to a block) and the values paired by token (bf16), so
 * q.k and p.v run as vdpbf16ps (or FMA) tiles with no horizontal sums. Cascade decode's shared
 * items (cascade.c) and prefill attention (paged_extend.c) both run on these: in AVX-512, or in
 * AVX2 (8 lanes, fp32 only) where AVX-512 is missing. */
#ifndef RADIXKV_TILES_H
#define RADIXKV_TILES_H

#include "decode.h"

#define QK_TILE 8 /* queries whose scores one pass over the transposed keys computes */
#ifdef HAVE_AVX512
#define QK_BLOCKS_PER_PASS 4 /* 16-key blocks a q.k pass scores (and takes one prefetch step for) */
#else
#define QK_BLOCKS_PER_PASS 1
#endif

/* Bytes of a chunk's transposed keys: head_dim rows of CHUNK_TOKENS + BLOCK_TOKENS columns
 * (the last block stores 16 wherever it starts), 4 bytes each, and slack for the q.k passes
 * that read 4 blocks at a time past the last row's end. */
static inline int64_t key_bytes(int head_dim) { return ((int64_t)head_dim * (CHUNK_TOKENS + BLOCK_TOKENS) + 64) * 4; }

#ifdef HAVE_AVX512
/* Rows r[0..15] of 16 32-bit lanes, transposed in registers: afterwards r[i] holds lane i of
 * every row (unpacks within 128-bit lanes, then 128-bit lane shuffles: 64 shuffles). */
static inline __attribute__((always_inline)) void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++) {
            r[4 * i + 2 * j] = _mm512_unpacklo_epi64(t[4 * i + j], t[4 * i + 2 + j]);
            r[4 * i + 2 * j + 1] = _mm512_unpackhi_epi64(t[4 * i + j], t[4 * i + 2 + j]);
        }
    /* r[4i + m] now holds, per 128-bit lane L, element m of rows 4i..4i+3 at columns 4L + m. */
    for (int i = 0; i < 2; i++)
        for (int m = 0; m < 4; m++) {
            t[8 * i + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0x88);
            t[8 * i + 4 + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0xDD);
        }
    for (int m = 0; m < 8; m++) {
        r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);
    }
}

/* One block's keys (n <= 16 rows of `words` 32-bit words, row_stride words apart) into columns
 * [at, at + 16) of the transposed keys (npad words a row); rows past n are zero. */
static inline __attribute__((always_inline)) void transpose_block(const uint32_t *rows, int64_t row_stride, int n,
                                                                  int words, uint32_t *keys, int64_t npad, int at) {
    for (int w = 0; w < words; w += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = j < n ? _mm512_loadu_si512(rows + j * row_stride + w) : _mm512_setzero_si512();
        transpose_16x16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(keys + (int64_t)(w + i) * npad + at, r[i]);
    }
}

/* p.v for one tile's live queries: weights[i] (softmax weights of row i, n keys) against the
 * fp32 value rows, PV_TILE queries at a time so their accumulators stay in registers. */
static inline __attribute__((always_inline)) void weights_times_values(
    const float *weights, int live, int n, const float *const *value_rows, float *const *states, const int D) {
    enum { PV_TILE_MAX = 4 };
    const int tile = D <= 64 ? 4 : D <= 128 ? 2 : 1;
    for (int p0 = 0; p0 < live; p0 += tile) {
        __m512 acc[PV_TILE_MAX][MAX_HEAD_DIM / 16];
        for (int i = 0; i < tile; i++)
            for (int c = 0; c < D / 16; c++) acc[i][c] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const float *row = value_rows[j];
            for (int c = 0; c < D / 16; c++) {
                const __m512 x = _mm512_loadu_ps(row + 16 * c);
                for (int i = 0; i < tile; i++)
                    acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[(p0 + i) * SCORE_STRIDE + j]), x, acc[i][c]);
            }
        }
        for (int i = 0; i < tile && p0 + i < live; i++)
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(states[p0 + i] + 2 + 16 * c, acc[i][c]);
    }
}

/* Softmax of each live row of scores (n keys) into its state, then p.v. */
static inline __attribute__((always_inline)) void finish_tile(float *scores, int live, int n,
                                                              const float *const *value_rows, float *const *states,
                                                              const int D) {
    for (int i = 0; i < live; i++) softmax_row(scores + i * SCORE_STRIDE, n, states[i]);
    weights_times_values(scores, live, n, value_rows, states, D);
}
#endif

#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
/* The same tiles in 8-lane AVX2 vectors for CPUs without AVX-512, fp32 only (prefill attention
 * and cascade decode's fp32 shared items): the same transposed-key layout, a 16-key block as
 * two vectors. */

/* Rows r[0..7] of 8 floats transposed in registers: afterwards r[i] holds lane i of every row. */
static inline __attribute__((always_inline)) void transpose_8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);     /* rows 2i, 2i+1: lanes 0 1 | 4 5 */
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]); /* lanes 2 3 | 6 7 */
    }
    for (int i = 0; i < 2; i++) /* u[4i + m]: lane m (and m + 4) of rows 4i..4i+3 */
        for (int j = 0; j < 2; j++) {
            u[4 * i + 2 * j] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + 2 + j], 0x44);
            u[4 * i + 2 * j + 1] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + 2 + j], 0xEE);
        }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
        r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
    }
}

/* One block's keys (n <= 16 rows of `words` floats, row_stride words apart) into columns
 * [at, at + 16) of the transposed keys (npad words a row); rows past n are zero. */
static inline __attribute__((always_inline)) void transpose_block(const uint32_t *rows, int64_t row_stride, int n,
                                                                  int words, uint32_t *keys, int64_t npad, int at) {
    for (int w = 0; w < words; w += 8)
        for (int half = 0; half < 16; half += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = half + j < n ? _mm256_loadu_ps((const float *)(rows + (half + j) * row_stride + w)) : _mm256_setzero_ps();
            transpose_8x8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps((float *)(keys + (int64_t)(w + i) * npad + at + half), r[i]);
        }
}

/* Keys p.v takes per pass over the queries: their value rows stay in L1 while every query of
 * the tile reads them. */
#define VALUE_SLAB 64

/* p.v for one tile's live queries: weights[i] (softmax weights of row i, n keys) against the
 * fp32 value rows, 2 queries x 32 dims at a time so their 8 accumulators stay in registers;
 * each accumulator takes the keys in order. */
static inline __attribute__((always_inline)) void weights_times_values(
    const float *weights, int live, int n, const float *const *value_rows, float *const *states, const int D) {
    enum { QUERIES = 2, VECTORS = 4 };
    const int width = (D / 8) % 4 == 0 ? 4 : (D / 8) % 2 == 0 ? 2 : 1;
    for (int j0 = 0; j0 < n; j0 += VALUE_SLAB) {
        const int j1 = n - j0 < VALUE_SLAB ? n : j0 + VALUE_SLAB;
        for (int p0 = 0; p0 < live; p0 += QUERIES)
            for (int c0 = 0; c0 < D / 8; c0 += width) {
                __m256 acc[QUERIES][VECTORS];
                for (int i = 0; i < QUERIES; i++)
                    for (int c = 0; c < width; c++)
                        acc[i][c] = j0 == 0 || p0 + i >= live ? _mm256_setzero_ps() : _mm256_loadu_ps(states[p0 + i] + 2 + 8 * (c0 + c));
                for (int j = j0; j < j1; j++) {
                    __m256 x[VECTORS];
                    for (int c = 0; c < width; c++) x[c] = _mm256_loadu_ps(value_rows[j] + 8 * (c0 + c));
                    for (int i = 0; i < QUERIES; i++) { /* a row past live reads a spare row of weights */
                        const __m256 w = _mm256_set1_ps(weights[(p0 + i) * SCORE_STRIDE + j]);
                        for (int c = 0; c < width; c++) acc[i][c] = _mm256_fmadd_ps(w, x[c], acc[i][c]);
                    }
                }
                for (int i = 0; i < QUERIES && p0 + i < live; i++)
                    for (int c = 0; c < width; c++) _mm256_storeu_ps(states[p0 + i] + 2 + 8 * (c0 + c), acc[i][c]);
            }
    }
}

/* Softmax of each live row of scores (n keys) into its state, then p.v. */
static inline __attribute__((always_inline)) void finish_tile(float *scores, int live, int n,
                                                              const float *const *value_rows, float *const *states,
                                                              const int D) {
    for (int i = 0; i < live; i++) softmax_row(scores + i * SCORE_STRIDE, n, states[i]);
    weights_times_values(scores, live, n, value_rows, states, D);
}

/* Scores (times scale) of the `live` queries q[0..live) (QK_TILE pointers; past live they repeat
 * a live one, whose extra sums are never read) against ncols transposed fp32 keys (npad floats
 * a row, head_dim rows) into rows of scores, SCORE_STRIDE apart: 4 queries x one 16-key block a
 * pass, 8 accumulators in registers. */
static inline __attribute__((always_inline)) void qk_scores(const void *const *q, int live, const uint32_t *keys,
                                                            int64_t npad, int ncols, float scale, float *scores,
                                                            Prefetcher *prefetcher, const int D, const int bf16) {
    (void)bf16;
    for (int i0 = 0; i0 < live; i0 += 4)
        for (int block = 0; block < ncols / 16; block += QK_BLOCKS_PER_PASS) {
            if (prefetcher) prefetch_step(prefetcher);
            __m256 acc[4][2];
            for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int c = 0; c < D; c++) {
                const float *row = (const float *)keys + (int64_t)c * npad + 16 * block;
                const __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
                for (int i = 0; i < 4; i++) {
                    const __m256 query = _mm256_set1_ps(((const float *)q[i0 + i])[c]);
                    acc[i][0] = _mm256_fmadd_ps(query, k0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(query, k1, acc[i][1]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int b = 0; b < 2; b++)
                    _mm256_storeu_ps(scores + (i0 + i) * SCORE_STRIDE + 16 * block + 8 * b, _mm256_mul_ps(acc[i][b], _mm256_set1_ps(scale)));
        }
}
#endif

#ifdef HAVE_AVX2 /* AVX-512 builds too */
/* Kv head h of a chunk's keys (its blocks, in order) transposed into `keys` (npad words a row):
 * bf16 pairs (element_bytes 2) or floats (4). A block stores 16 columns wherever it starts, so
 * where a page ends early it overlaps the next block's columns, which that block overwrites. */
static inline __attribute__((always_inline)) void transpose_chunk_keys(const Block *blocks, int num_blocks, const void *k,
                                                                       int h, const int D, const int element_bytes,
                                                                       int64_t token_stride, uint32_t *keys, int64_t npad) {
    for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n) {
        const char *rows = (const char *)k + (blocks[bi].first + (int64_t)h * D) * element_bytes;
        transpose_block((const uint32_t *)rows, token_stride * element_bytes / 4, blocks[bi].n, D * element_bytes / 4, keys, npad, at);
    }
}

/* The addresses of kv head h's value rows for a chunk's keys (its blocks, in order). */
static inline __attribute__((always_inline)) void chunk_value_rows(const Block *blocks, int num_blocks, const void *v, int h,
                                                                   const int D, const int element_bytes,
                                                                   int64_t token_stride, const void **rows) {
    for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n)
        for (int j = 0; j < blocks[bi].n; j++)
            rows[at + j] = (const char *)v + (blocks[bi].first + (int64_t)h * D + j * token_stride) * element_bytes;
}

#endif

#ifdef HAVE_AVX512_BF16
/* Value rows of token pairs interleaved, [pairs][head_dim] of bf16 pairs with v[2t][d] in the
 * odd (high) element and v[2t + 1][d] in the even one, so one vdpbf16ps adds two keys' weighted
 * values into 16 dims in key order (it takes the odd element first); a last odd key pairs with
 * zeros. rows[j]: key j's value row. */
static inline __attribute__((always_inline)) void pair_values(const uint16_t *const *rows, int n, uint32_t *pairs,
                                                              const int D) {
    __m512i low_index, high_index;
    {
        uint16_t low[32], high[32];
        for (int m = 0; m < 16; m++) low[2 * m] = m, low[2 * m + 1] = 32 + m, high[2 * m] = 16 + m, high[2 * m + 1] = 48 + m;
        low_index = _mm512_loadu_si512(low), high_index = _mm512_loadu_si512(high);
    }
    for (int t = 0; 2 * t < n; t++)
        for (int c = 0; c < D / 32; c++) {
            const __m512i a = _mm512_loadu_si512(rows[2 * t] + 32 * c);
            const __m512i b = 2 * t + 1 < n ? _mm512_loadu_si512(rows[2 * t + 1] + 32 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + (int64_t)t * D + 32 * c, _mm512_permutex2var_epi16(b, low_index, a));
            _mm512_storeu_si512(pairs + (int64_t)t * D + 32 * c + 16, _mm512_permutex2var_epi16(b, high_index, a));
        }
}

/* p.v for one tile's live queries by vdpbf16ps: each row of softmax weights (n keys) rounded
 * to bf16 pairs in place (as flash attention rounds P before P.V; the output is bf16 anyway),
 * key 2t in the odd element as pair_values lays the values out, then two keys per instruction
 * against the paired values, PV_TILE queries at a time. Under flushed denormals this is the
 * own bf16 item's p.v, bit for bit (decode.h round_weights_bf16). */
static inline __attribute__((always_inline)) void weights_times_value_pairs(
    float *weights, int live, int n, const uint32_t *pairs, float *const *states, const int D) {
    enum { PV_TILE_MAX = 4 };
    const int tile = D <= 64 ? 4 : D <= 128 ? 2 : 1, num_pairs = (n + 1) / 2;
    for (int i = 0; i < live; i++) {
        float *row = weights + i * SCORE_STRIDE;
        /* The zero value row's partner weighs -0: acc + (-0 x 0) is acc, a -0 acc included, as
         * where the own item adds nothing (and never NaN from an unused column). */
        if (n % 2) row[n] = -0.0f;
        for (int j = 0; j < n; j += 32) /* 32 floats to 32 bf16 in place: the store trails the loads */
            _mm512_storeu_si512((uint16_t *)row + j,
                                _mm512_rol_epi32((__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + j + 16), _mm512_loadu_ps(row + j)), 16));
    }
    for (int p0 = 0; p0 < live; p0 += tile) {
        __m512 acc[PV_TILE_MAX][MAX_HEAD_DIM / 16];
        const uint32_t *weight_pairs[PV_TILE_MAX];
        for (int i = 0; i < tile; i++) {
            weight_pairs[i] = (const uint32_t *)(weights + (p0 + i < live ? p0 + i : live - 1) * SCORE_STRIDE);
            for (int c = 0; c < D / 16; c++) acc[i][c] = _mm512_setzero_ps();
        }
        for (int t = 0; t < num_pairs; t++)
            for (int c = 0; c < D / 16; c++) {
                const __m512bh x = (__m512bh)_mm512_loadu_si512(pairs + (int64_t)t * D + 16 * c);
                for (int i = 0; i < tile; i++)
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)_mm512_set1_epi32((int)weight_pairs[i][t]), x);
            }
        for (int i = 0; i < tile && p0 + i < live; i++)
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(states[p0 + i] + 2 + 16 * c, acc[i][c]);
    }
}
#endif

#ifdef HAVE_AVX512_BF16
/* bf16 scores (times scale) of the `live` queries q[0..live) (QK_TILE pointers, as qk_scores
 * takes them) against ncols transposed bf16 keys, with the own item's bits (paged_decode.c
 * block_scores_bf16): for each residue e of a key's dim pairs 4m + e, a vdpbf16ps chain over m
 * from 0, and a key's score (e0 + e2) + (e1 + e3). 4 queries x 4 blocks a pass, one residue at
 * a time, so 16 accumulators stay in registers and each key vector and broadcast query word
 * feeds 4 products. */
static inline __attribute__((always_inline)) void qk_scores_bf16(const void *const *q, int live, const uint32_t *keys,
                                                                 int64_t npad, int ncols, float scale, float *scores,
                                                                 Prefetcher *prefetcher, const int D) {
    for (int i0 = 0; i0 < live; i0 += 4)
        for (int block = 0; block < ncols / 16; block += QK_BLOCKS_PER_PASS) {
            if (prefetcher) prefetch_step(prefetcher);
            __m512 halves[2][4][4]; /* (e0 + e2), (e1 + e3): the compiler keeps them where it can */
            for (int e = 0; e < 4; e++) {
                __m512 acc[4][4];
                for (int i = 0; i < 4; i++)
                    for (int b = 0; b < 4; b++) acc[i][b] = _mm512_setzero_ps();
                for (int m = 0; m < D / 8; m++) {
                    /* Past the last block these read spare columns of the keys' buffer; their
                     * sums are never stored. */
                    __m512bh key[4];
                    for (int b = 0; b < 4; b++) key[b] = (__m512bh)_mm512_loadu_si512(keys + (int64_t)(4 * m + e) * npad + 16 * (block + b));
                    for (int i = 0; i < 4; i++) {
                        const __m512bh query = (__m512bh)_mm512_set1_epi32(((const int32_t *)q[i0 + i])[4 * m + e]);
                        for (int b = 0; b < 4; b++) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], query, key[b]);
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int b = 0; b < 4; b++) halves[e % 2][i][b] = e < 2 ? acc[i][b] : _mm512_add_ps(halves[e % 2][i][b], acc[i][b]);
            }
            for (int i = 0; i < 4; i++)
                for (int b = 0; b < 4 && block + b < ncols / 16; b++)
                    _mm512_store_ps(scores + (i0 + i) * SCORE_STRIDE + 16 * (block + b),
                                    _mm512_mul_ps(_mm512_add_ps(halves[0][i][b], halves[1][i][b]), _mm512_set1_ps(scale)));
        }
}
#endif

#ifdef HAVE_AVX512
/* a x b + acc over 32-bit lanes: bf16 pairs by vdpbf16ps, or floats by FMA. bf16 = 1 only
 * where the build has AVX512_BF16 (the callers' paths are compiled only there). */
static inline __attribute__((always_inline)) __m512 multiply_add(__m512 acc, __m512i a, __m512i b, const int bf16) {
#ifdef HAVE_AVX512_BF16
    if (bf16) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    (void)bf16;
#endif
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

/* Scores (times scale) of the `live` queries q[0..live) (QK_TILE pointers; past live they repeat
 * a live one, whose extra sums are never stored) against ncols transposed keys (npad words a
 * row: bf16 pairs, head_dim / 2 rows, or floats, head_dim rows) into rows of scores,
 * SCORE_STRIDE apart. 4 queries x 4 blocks of 16 keys a pass: each loaded key vector and
 * broadcast query word feeds 4 products (16 accumulators stay in registers). Each pass first
 * takes a prefetcher step, where one is given. */
static inline __attribute__((always_inline)) void qk_scores(const void *const *q, int live, const uint32_t *keys,
                                                            int64_t npad, int ncols, float scale, float *scores,
                                                            Prefetcher *prefetcher, const int D, const int bf16) {
    const int rows = bf16 ? D / 2 : D;
    for (int i0 = 0; i0 < live; i0 += 4)
        for (int block = 0; block < ncols / 16; block += QK_BLOCKS_PER_PASS) {
            if (prefetcher) prefetch_step(prefetcher);
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int b = 0; b < 4; b++) acc[i][b] = _mm512_setzero_ps();
            for (int c = 0; c < rows; c++) {
                /* Past the last block these read spare columns (and rows) of the keys' buffer;
                 * their sums are never stored. */
                __m512i key[4];
                for (int b = 0; b < 4; b++) key[b] = _mm512_loadu_si512(keys + (int64_t)c * npad + 16 * (block + b));
                for (int i = 0; i < 4; i++) {
                    const __m512i query = _mm512_set1_epi32(((const int32_t *)q[i0 + i])[c]);
                    for (int b = 0; b < 4; b++) acc[i][b] = multiply_add(acc[i][b], query, key[b], bf16);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int b = 0; b < 4 && block + b < ncols / 16; b++)
                    _mm512_store_ps(scores + (i0 + i) * SCORE_STRIDE + 16 * (block + b), _mm512_mul_ps(acc[i][b], _mm512_set1_ps(scale)));
        }
}
#endif

#endif
