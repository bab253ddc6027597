/* Cascade decode on CPU: requests that share a cached prefix read its KV once per step, for all
 * of them together, and the grouping that decides who shares what (radixkv_cascade_plan).
 *
 * A shared item holds one chunk of a group's shared prefix. Per kv head it lays the chunk's
 * keys out once, transposed (dimension major, 16 keys to a vector), and (bf16) pairs its values
 * by token; then every member's query heads run against them as small matrix products: q.k
 * takes one vdpbf16ps (or FMA) per dimension pair for 16 keys at once, with no horizontal sums,
 * and p.v reuses each value row for a tile of queries. The per-query cost falls to about half of
 * an own item's, and the KV is read from memory once for the group instead of once per member.
 * Each member's states go where its own items' states would, and paged_decode.c merges them
 * by log-sum-exp with the member's own suffix. Like an own item, a shared item requests the
 * KV of its thread's next item while it computes.
 */
#define _GNU_SOURCE /* qsort_r */
#include "decode.h"

#include <stdlib.h>

#define QK_TILE 8 /* queries whose scores one pass over the transposed keys computes */

static inline int64_t padded_keys(void) { return CHUNK_TOKENS + BLOCK_TOKENS; }

/* Bytes of transposed keys: head_dim rows of padded keys, 4 bytes each, and slack for the
 * q.k passes that read 4 blocks at a time past the last row's end. */
static inline int64_t key_bytes(const Shape *sh) { return ((int64_t)sh->head_dim * padded_keys() + 64) * 4; }

/* Transposed keys (head_dim x padded keys, 4 bytes each: bf16 pairs or fp32), room for the
 * bf16 path's paired values (CHUNK_TOKENS x head_dim x 4 bytes), then per member query and
 * state pointers. */
HIDDEN int64_t radixkv_shared_scratch_bytes(const Shape *sh, int max_members) {
    const int64_t keys = key_bytes(sh);
    const int64_t values = (int64_t)CHUNK_TOKENS * sh->head_dim * 4;
    const int64_t pointers = (int64_t)max_members * sh->group * 2 * (int64_t)sizeof(void *);
    return (keys + values + pointers + 63) / 64 * 64;
}

typedef struct {
    void *keys;           /* transposed */
    float *values;        /* bf16: value pairs [keys / 2][head_dim] */
    const void **queries; /* [members * group] query head rows of the current kv head */
    float **states;       /* [members * group] their softmax states */
} Scratch;

static Scratch scratch_view(void *buffer, const Shape *sh) {
    char *at = buffer;
    Scratch s;
    s.keys = at;
    at += key_bytes(sh);
    s.values = (float *)at;
    at += (int64_t)CHUNK_TOKENS * sh->head_dim * 4;
    s.queries = (const void **)at;
    s.states = NULL; /* after the queries: gather_queries knows how many */
    return s;
}

/* Query and state pointers of every member's query heads over kv head h; returns how many.
 * A last tile short of QK_TILE repeats its last query, whose extra results are never stored. */
static int gather_queries(const SharedItem *item, const Shape *sh, int h, int element_bytes, Scratch *s) {
    const int G = sh->group, count = item->num_members * G;
    s->states = (float **)(s->queries + count);
    for (int m = 0; m < item->num_members; m++)
        for (int g = 0; g < G; g++) {
            const int64_t offset = (int64_t)item->q_rows[m] * item->q_row_stride + (int64_t)(h * G + g) * sh->head_dim;
            s->queries[m * G + g] = (const char *)item->q + offset * element_bytes;
            s->states[m * G + g] = item->states + m * item_floats(sh) + (int64_t)(h * G + g) * state_floats(sh);
        }
    return count;
}

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

#ifdef HAVE_AVX512_BF16
/* Value rows of token pairs interleaved, [pairs][head_dim] of (v[2t][d], v[2t + 1][d]) bf16
 * pairs, so one vdpbf16ps adds two keys' weighted values into 16 dims; a last odd key pairs
 * with zeros. rows[j]: key j's value row. */
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
            _mm512_storeu_si512(pairs + (int64_t)t * D + 32 * c, _mm512_permutex2var_epi16(a, low_index, b));
            _mm512_storeu_si512(pairs + (int64_t)t * D + 32 * c + 16, _mm512_permutex2var_epi16(a, high_index, b));
        }
}

/* p.v for one tile's live queries by vdpbf16ps: each row of softmax weights (n keys) rounded
 * to bf16 pairs in place (as flash attention rounds P before P.V; the output is bf16 anyway),
 * then two keys per instruction against the paired values, PV_TILE queries at a time. */
static inline __attribute__((always_inline)) void weights_times_value_pairs(
    float *weights, int live, int n, const uint32_t *pairs, float *const *states, const int D) {
    enum { PV_TILE_MAX = 4 };
    const int tile = D <= 64 ? 4 : D <= 128 ? 2 : 1, num_pairs = (n + 1) / 2;
    for (int i = 0; i < live; i++) {
        float *row = weights + i * SCORE_STRIDE;
        if (n % 2) row[n] = 0.0f; /* the zero value row's partner: never NaN from an unused column */
        for (int j = 0; j < n; j += 32) /* 32 floats to 32 bf16 in place: the store trails the loads */
            _mm512_storeu_si512((uint16_t *)row + j,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + j + 16), _mm512_loadu_ps(row + j)));
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

/* The bf16 shared item: keys as bf16 pairs [head_dim / 2][padded keys], so one vdpbf16ps
 * multiplies a query's dimension pair (broadcast) into 16 keys' scores. */
static inline __attribute__((always_inline)) void shared_bf16_impl(const SharedItem *item, const uint16_t *k,
                                                                   const uint16_t *v, const Shape *sh, void *buffer,
                                                                   const int D) {
    const int H = sh->num_kv_heads, n = item->end - item->begin, ncols = (n + 15) / 16 * 16;
    /* A block stores 16 columns wherever it starts: one row of transposed keys has room past ncols. */
    const int64_t npad = ncols + BLOCK_TOKENS;
    const int64_t token_stride = (int64_t)H * D;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(item->pages, item->begin, item->end, sh, blocks);
    Scratch s = scratch_view(buffer, sh);
    uint32_t *keys = s.keys, *value_pairs = (uint32_t *)s.values;
    const uint16_t *value_rows[CHUNK_TOKENS];
    float scores[QK_TILE * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    /* Steps: each kv head's set-up, and each pass of 4 queries over 4 key blocks. */
    const int quads = (item->num_members * sh->group + 3) / 4, passes = (ncols / 16 + 3) / 4;
    prefetcher_init(&prefetcher, item->next, sh, (const char *)k, (const char *)v, 2, H * (1 + quads * passes));
    for (int h = 0; h < H; h++) {
        prefetch_step(&prefetcher);
        /* Blocks are 16 keys but where a page ends: stored at `at`, they overlap the next
         * block's columns, which that block then overwrites (blocks run in order). */
        for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n) {
            const int64_t first = blocks[bi].first + (int64_t)h * D;
            transpose_block((const uint32_t *)(k + first), token_stride / 2, blocks[bi].n, D / 2, keys, npad, at);
            for (int j = 0; j < blocks[bi].n; j++) value_rows[at + j] = v + first + j * token_stride;
        }
        pair_values(value_rows, n, value_pairs, D);
        const int count = gather_queries(item, sh, h, 2, &s);
        for (int first = 0; first < count; first += QK_TILE) {
            const int live = count - first < QK_TILE ? count - first : QK_TILE;
            const uint32_t *q[QK_TILE];
            for (int i = 0; i < QK_TILE; i++) q[i] = s.queries[first + (i < live ? i : live - 1)];
            /* 4 queries x 4 blocks of 16 keys a pass: each loaded key vector and broadcast
             * query pair feeds 4 products (16 accumulators stay in registers). */
            for (int i0 = 0; i0 < live; i0 += 4)
                for (int block = 0; block < ncols / 16; block += 4) {
                    prefetch_step(&prefetcher);
                    __m512 acc[4][4];
                    for (int i = 0; i < 4; i++)
                        for (int b = 0; b < 4; b++) acc[i][b] = _mm512_setzero_ps();
                    for (int c = 0; c < D / 2; c++) {
                        /* Past the last block these read spare columns (and rows) of the
                         * scratch buffer; their sums are never stored. */
                        __m512bh key_pairs[4];
                        for (int b = 0; b < 4; b++)
                            key_pairs[b] = (__m512bh)_mm512_loadu_si512(keys + (int64_t)c * npad + 16 * (block + b));
                        for (int i = 0; i < 4; i++) {
                            const __m512bh query_pair = (__m512bh)_mm512_set1_epi32((int)q[i0 + i][c]);
                            for (int b = 0; b < 4; b++) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], query_pair, key_pairs[b]);
                        }
                    }
                    for (int i = 0; i < 4; i++)
                        for (int b = 0; b < 4 && block + b < ncols / 16; b++)
                            _mm512_store_ps(scores + (i0 + i) * SCORE_STRIDE + 16 * (block + b),
                                            _mm512_mul_ps(acc[i][b], _mm512_set1_ps(sh->scale)));
                }
            for (int i = 0; i < live; i++) softmax_row(scores + i * SCORE_STRIDE, n, s.states[first + i]);
            weights_times_value_pairs(scores, live, n, value_pairs, s.states + first, D);
        }
    }
}
#endif

#ifdef HAVE_AVX512
/* The fp32 shared item: keys transposed to [head_dim][padded keys]; values read in place. */
static inline __attribute__((always_inline)) void shared_f32_impl(const SharedItem *item, const float *k,
                                                                  const float *v, const Shape *sh, void *buffer,
                                                                  const int D) {
    const int H = sh->num_kv_heads, n = item->end - item->begin, ncols = (n + 15) / 16 * 16;
    /* A block stores 16 columns wherever it starts: one row of transposed keys has room past ncols. */
    const int64_t npad = ncols + BLOCK_TOKENS;
    const int64_t token_stride = (int64_t)H * D;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(item->pages, item->begin, item->end, sh, blocks);
    Scratch s = scratch_view(buffer, sh);
    float *keys = s.keys;
    const float *value_rows[CHUNK_TOKENS];
    float scores[QK_TILE * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    const int quads = (item->num_members * sh->group + 3) / 4, passes = (ncols / 16 + 3) / 4;
    prefetcher_init(&prefetcher, item->next, sh, (const char *)k, (const char *)v, 4, H * (1 + quads * passes));
    for (int h = 0; h < H; h++) {
        prefetch_step(&prefetcher);
        for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n) {
            const int64_t first = blocks[bi].first + (int64_t)h * D;
            transpose_block((const uint32_t *)(k + first), token_stride, blocks[bi].n, D, (uint32_t *)keys, npad, at);
            for (int j = 0; j < blocks[bi].n; j++) value_rows[at + j] = v + first + j * token_stride;
        }
        const int count = gather_queries(item, sh, h, 4, &s);
        for (int first = 0; first < count; first += QK_TILE) {
            const int live = count - first < QK_TILE ? count - first : QK_TILE;
            const float *q[QK_TILE];
            for (int i = 0; i < QK_TILE; i++) q[i] = s.queries[first + (i < live ? i : live - 1)];
            for (int i0 = 0; i0 < live; i0 += 4) /* 4 queries x 4 blocks a pass, as in bf16 */
                for (int block = 0; block < ncols / 16; block += 4) {
                    prefetch_step(&prefetcher);
                    __m512 acc[4][4];
                    for (int i = 0; i < 4; i++)
                        for (int b = 0; b < 4; b++) acc[i][b] = _mm512_setzero_ps();
                    for (int d = 0; d < D; d++) {
                        __m512 key[4];
                        for (int b = 0; b < 4; b++) key[b] = _mm512_loadu_ps(keys + (int64_t)d * npad + 16 * (block + b));
                        for (int i = 0; i < 4; i++) {
                            const __m512 query = _mm512_set1_ps(q[i0 + i][d]);
                            for (int b = 0; b < 4; b++) acc[i][b] = _mm512_fmadd_ps(query, key[b], acc[i][b]);
                        }
                    }
                    for (int i = 0; i < 4; i++)
                        for (int b = 0; b < 4 && block + b < ncols / 16; b++)
                            _mm512_store_ps(scores + (i0 + i) * SCORE_STRIDE + 16 * (block + b),
                                            _mm512_mul_ps(acc[i][b], _mm512_set1_ps(sh->scale)));
                }
            finish_tile(scores, live, n, value_rows, s.states + first, D);
        }
    }
}
#endif

/* Where no vector path fits: each member runs the own-item kernel over the shared keys in
 * turn; the first reads them from memory, the others from cache. */
/* One statement, since it follows an else. */
#define MEMBER_BY_MEMBER(ITEM, T)                                                                         \
    for (int m = 0; m < item->num_members; m++)                                                           \
        ITEM((const T *)item->q + (int64_t)item->q_rows[m] * item->q_row_stride, k, v, item->pages,       \
             item->begin, item->end, sh, item->states + m * item_floats(sh), NULL);

HIDDEN void radixkv_shared_item_bf16(const SharedItem *item, const uint16_t *k, const uint16_t *v, const Shape *sh,
                                     void *scratch) {
#ifdef HAVE_AVX512_BF16
    if (sh->head_dim == 64) shared_bf16_impl(item, k, v, sh, scratch, 64);
    else if (sh->head_dim == 128) shared_bf16_impl(item, k, v, sh, scratch, 128);
    else if (sh->head_dim % 32 == 0) shared_bf16_impl(item, k, v, sh, scratch, sh->head_dim);
    else
#else
    (void)scratch;
#endif
    MEMBER_BY_MEMBER(radixkv_item_bf16, uint16_t)
}

HIDDEN void radixkv_shared_item_f32(const SharedItem *item, const float *k, const float *v, const Shape *sh,
                                    void *scratch) {
#ifdef HAVE_AVX512
    if (sh->head_dim == 64) shared_f32_impl(item, k, v, sh, scratch, 64);
    else if (sh->head_dim == 128) shared_f32_impl(item, k, v, sh, scratch, 128);
    else if (sh->head_dim % 16 == 0) shared_f32_impl(item, k, v, sh, scratch, sh->head_dim);
    else
#else
    (void)scratch;
#endif
    MEMBER_BY_MEMBER(radixkv_item_f32, float)
}

/* ---- The plan: who shares which prefix this step. ----
 *
 * Requests share a prefix exactly where their page tables hold the same pages: a page is one
 * radix-tree block, so equal page ids at the same positions are the same cached blocks. Sorted
 * by page table, requests that share a prefix are neighbours, and the pages two neighbours
 * have in common (lcp) bound what any run of them shares: the run's minimum. */
typedef struct {
    const int32_t *table;
    int64_t stride;
    const int32_t *seq_lens;
    int page_size;
} Tables;

/* Only full pages are shared: a request's last, partly filled page is its own. */
static inline int full_pages(const Tables *t, int b) { return t->seq_lens[b] / t->page_size; }

static int common_pages(const Tables *t, int a, int b) {
    const int n = full_pages(t, a) < full_pages(t, b) ? full_pages(t, a) : full_pages(t, b);
    const int32_t *pa = t->table + (int64_t)a * t->stride, *pb = t->table + (int64_t)b * t->stride;
    int i = 0;
    while (i < n && pa[i] == pb[i]) i++;
    return i;
}

static int compare_tables(const void *x, const void *y, void *context) {
    const Tables *t = context;
    const int a = *(const int32_t *)x, b = *(const int32_t *)y;
    const int common = common_pages(t, a, b);
    const int fa = full_pages(t, a), fb = full_pages(t, b);
    if (common < fa && common < fb) {
        const int32_t pa = t->table[(int64_t)a * t->stride + common], pb = t->table[(int64_t)b * t->stride + common];
        return pa < pb ? -1 : 1;
    }
    if (fa != fb) return fa < fb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* The best grouping of the sorted requests [lo, hi): either one group sharing the run's
 * minimum lcp, or the best groupings of the two sides of that minimum, whichever saves more
 * reads ((members - 1) x shared pages). merged[k] records the choice for the run split at k. */
static int argmin_lcp(const int32_t *lcp, int lo, int hi) {
    int k = lo + 1;
    for (int i = lo + 2; i < hi; i++)
        if (lcp[i] < lcp[k]) k = i;
    return k;
}

typedef struct {
    int min_pages, min_members;
} Thresholds;

static int64_t best_saving(const int32_t *lcp, int lo, int hi, const Thresholds *at_least, uint8_t *merged) {
    if (hi - lo < 2) return 0;
    const int k = argmin_lcp(lcp, lo, hi);
    const int64_t split = best_saving(lcp, lo, k, at_least, merged) + best_saving(lcp, k, hi, at_least, merged);
    const int worth = lcp[k] >= at_least->min_pages && hi - lo >= at_least->min_members;
    const int64_t whole = worth ? (int64_t)(hi - lo - 1) * lcp[k] : 0;
    merged[k] = whole > 0 && whole >= split;
    return merged[k] ? whole : split;
}

typedef struct {
    int32_t *group_of, *member_index, *group_start, *members, *shared_pages;
    int num_groups;
} PlanOut;

static void emit_groups(const int32_t *lcp, const int32_t *sorted, int lo, int hi, const uint8_t *merged, PlanOut *out) {
    if (hi - lo < 2) return;
    const int k = argmin_lcp(lcp, lo, hi);
    if (!merged[k]) {
        emit_groups(lcp, sorted, lo, k, merged, out);
        emit_groups(lcp, sorted, k, hi, merged, out);
        return;
    }
    const int g = out->num_groups++;
    const int start = out->group_start[g];
    for (int i = lo; i < hi; i++) {
        out->members[start + i - lo] = sorted[i];
        out->group_of[sorted[i]] = g;
        out->member_index[sorted[i]] = i - lo;
    }
    out->group_start[g + 1] = start + hi - lo;
    out->shared_pages[g] = lcp[k];
}

/* Ints of plan buffer radixkv_cascade_plan may write for num_seqs requests. */
int64_t radixkv_cascade_plan_ints(int num_seqs) { return 2 + 5 * (int64_t)(num_seqs > 0 ? num_seqs : 0); }

/* Groups of at least min_members requests that share at least min_shared_tokens of cached
 * prefix, into plan (the layout paged_decode.c reads: see Plan there). Returns the KV tokens
 * the groups save: what members other than the first would have read of the shared prefixes;
 * -1 when out of memory (the plan then has no groups). */
int64_t radixkv_cascade_plan(const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                             int num_seqs, int page_size, int min_shared_tokens, int min_members, int32_t *plan) {
    plan[0] = 0;
    for (int b = 0; b < num_seqs; b++) plan[1 + b] = -1, plan[1 + num_seqs + b] = 0;
    int32_t *group_start = plan + 1 + 2 * num_seqs;
    group_start[0] = 0;
    if (num_seqs < 2 || page_size <= 0) return 0;
    int32_t *sorted = malloc(sizeof(int32_t) * (size_t)num_seqs), *lcp = malloc(sizeof(int32_t) * (size_t)num_seqs);
    int32_t *members = malloc(sizeof(int32_t) * (size_t)num_seqs), *shared = malloc(sizeof(int32_t) * (size_t)num_seqs);
    uint8_t *merged = calloc((size_t)num_seqs, 1);
    int64_t saved = -1;
    if (sorted && lcp && members && shared && merged) {
        Tables tables = {page_table, page_table_stride, seq_lens, page_size};
        for (int b = 0; b < num_seqs; b++) sorted[b] = b;
        qsort_r(sorted, (size_t)num_seqs, sizeof(int32_t), compare_tables, &tables);
        lcp[0] = 0;
        for (int i = 1; i < num_seqs; i++) lcp[i] = common_pages(&tables, sorted[i - 1], sorted[i]);
        const int min_pages = (min_shared_tokens + page_size - 1) / page_size;
        const Thresholds at_least = {min_pages > 0 ? min_pages : 1, min_members > 2 ? min_members : 2};
        best_saving(lcp, 0, num_seqs, &at_least, merged);
        PlanOut out = {plan + 1, plan + 1 + num_seqs, group_start, members, shared, 0};
        emit_groups(lcp, sorted, 0, num_seqs, merged, &out);
        /* Members and shared lengths follow group_start in the buffer. */
        int32_t *members_out = group_start + out.num_groups + 1;
        memmove(members_out, members, sizeof(int32_t) * (size_t)group_start[out.num_groups]);
        int32_t *shared_out = members_out + group_start[out.num_groups];
        saved = 0;
        for (int g = 0; g < out.num_groups; g++) {
            shared_out[g] = shared[g] * page_size;
            saved += (int64_t)(group_start[g + 1] - group_start[g] - 1) * shared_out[g];
        }
        plan[0] = out.num_groups;
    }
    free(sorted), free(lcp), free(members), free(shared), free(merged);
    return saved;
}
