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
#include "tiles.h"

#include <stdlib.h>
#include <string.h>

/* The shared items' matrix-product tiles on (1, the default) or off (0: every member runs the
 * own-item kernel over the shared keys, as where no vector path fits), so any CPU tests both. */
static int cascade_tiles = 1;

int radixkv_cascade_use_tiles(int on) {
    cascade_tiles = on != 0;
    return cascade_tiles;
}

/* Transposed keys (head_dim x padded keys, 4 bytes each: bf16 pairs or fp32), room for the
 * bf16 path's paired values (CHUNK_TOKENS x head_dim x 4 bytes), then per member query and
 * state pointers. */
HIDDEN int64_t radixkv_shared_scratch_bytes(const Shape *sh, int max_members) {
    const int64_t keys = key_bytes(sh->head_dim);
    const int64_t values = (int64_t)CHUNK_TOKENS * sh->head_dim * 4;
    const int64_t pointers = (int64_t)max_members * sh->group * 2 * (int64_t)sizeof(void *);
    /* Pages in another dtype (sh->kv_kind): a chunk's keys widened to fp32 before transposing
     * (its values widen into the values' room). */
    const int64_t widened = sh->kv_kind ? (int64_t)CHUNK_TOKENS * sh->head_dim * 4 + 64 : 0;
    return (keys + values + pointers + widened + 63) / 64 * 64;
}

#ifdef HAVE_AVX512_BF16
/* 1 where this CPU's vdpbf16ps is, lane by lane, the FMA of the odd element and then of the
 * even one under flushed denormals (decode.h): then a batch-invariant plan's tiles may pair
 * keys; elsewhere its members run the own item one by one. Checked once, at load, over random
 * bit patterns (NaN lanes aside). */
static int dpbf16_is_fma_pair = 0;

static __attribute__((constructor)) void check_dpbf16(void) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    const unsigned saved = flush_denormals();
    int same = 1;
    for (int round = 0; round < 512 && same; round++) {
        uint32_t a[16], b[16];
        float acc[16], got[16];
        for (int i = 0; i < 16; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            a[i] = (uint32_t)x, b[i] = (uint32_t)(x >> 32);
            const uint32_t bits = (uint32_t)(x >> 16);
            memcpy(&acc[i], &bits, 4);
        }
        _mm512_storeu_ps(got, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b)));
        for (int i = 0; i < 16; i++) {
            const __m128 odd = _mm_fmadd_ss(_mm_set_ss(bf16_to_float((uint16_t)(a[i] >> 16))),
                                            _mm_set_ss(bf16_to_float((uint16_t)(b[i] >> 16))), _mm_set_ss(acc[i]));
            const float want = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(bf16_to_float((uint16_t)a[i])),
                                                          _mm_set_ss(bf16_to_float((uint16_t)b[i])), odd));
            if (want == want && memcmp(&want, &got[i], 4) != 0) same = 0;
        }
    }
    _mm_setcsr(saved);
    dpbf16_is_fma_pair = same;
}

int radixkv_dpbf16_matches_fma(void) { return dpbf16_is_fma_pair; }
#else
int radixkv_dpbf16_matches_fma(void) { return 0; }
#endif

#ifdef HAVE_AVX2 /* the vector items below use the scratch; portable builds run members alone */
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
    at += key_bytes(sh->head_dim);
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

#endif

#ifdef HAVE_AVX512_BF16
/* The bf16 shared item: keys as bf16 pairs [head_dim / 2][padded keys], so one vdpbf16ps
 * multiplies a query's dimension pair (broadcast) into 16 keys' scores. Under flushed
 * denormals its scores, softmax and p.v are the own bf16 item's, bit for bit (paged_decode.c
 * block_scores_bf16, decode.h round_weights_bf16), so a batch-invariant plan's groups run it. */
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
    const void *value_rows[CHUNK_TOKENS];
    float scores[QK_TILE * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    /* Steps: each kv head's set-up, and each pass of 4 queries over 4 key blocks. */
    const int quads = (item->num_members * sh->group + 3) / 4;
    const int passes = (ncols / 16 + QK_BLOCKS_PER_PASS - 1) / QK_BLOCKS_PER_PASS;
    prefetcher_init(&prefetcher, item->next, sh, (const char *)k, (const char *)v, 2, H * (1 + quads * passes));
    const unsigned saved = flush_denormals();
    for (int h = 0; h < H; h++) {
        prefetch_step(&prefetcher);
        transpose_chunk_keys(blocks, num_blocks, k, h, D, 2, token_stride, keys, npad);
        chunk_value_rows(blocks, num_blocks, v, h, D, 2, token_stride, value_rows);
        pair_values((const uint16_t *const *)value_rows, n, value_pairs, D);
        const int count = gather_queries(item, sh, h, 2, &s);
        for (int first = 0; first < count; first += QK_TILE) {
            const int live = count - first < QK_TILE ? count - first : QK_TILE;
            const uint32_t *q[QK_TILE];
            for (int i = 0; i < QK_TILE; i++) q[i] = s.queries[first + (i < live ? i : live - 1)];
            qk_scores_bf16((const void *const *)q, live, keys, npad, ncols, sh->scale, scores, &prefetcher, D);
            for (int i = 0; i < live; i++) softmax_row(scores + i * SCORE_STRIDE, n, s.states[first + i]);
            weights_times_value_pairs(scores, live, n, value_pairs, s.states + first, D);
        }
    }
    _mm_setcsr(saved);
}
#endif

#ifdef HAVE_AVX2 /* AVX-512 builds too */
/* One kv head's gathered fp32 queries (count of them) against its chunk's transposed keys and
 * value rows, QK_TILE queries at a time, into their softmax states. */
static inline __attribute__((always_inline)) void f32_tiles(const Scratch *s, int count, const float *keys, int64_t npad,
                                                            int ncols, int n, const void *const *value_rows,
                                                            const Shape *sh, Prefetcher *prefetcher, const int D) {
    float scores[QK_TILE * SCORE_STRIDE] __attribute__((aligned(64)));
    for (int first = 0; first < count; first += QK_TILE) {
        const int live = count - first < QK_TILE ? count - first : QK_TILE;
        const float *q[QK_TILE];
        for (int i = 0; i < QK_TILE; i++) q[i] = s->queries[first + (i < live ? i : live - 1)];
        qk_scores((const void *const *)q, live, (const uint32_t *)keys, npad, ncols, sh->scale, scores, prefetcher, D, 0);
        finish_tile(scores, live, n, (const float *const *)value_rows, s->states + first, D);
    }
}

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
    const void *value_rows[CHUNK_TOKENS];
    Prefetcher prefetcher;
    const int quads = (item->num_members * sh->group + 3) / 4;
    const int passes = (ncols / 16 + QK_BLOCKS_PER_PASS - 1) / QK_BLOCKS_PER_PASS;
    prefetcher_init(&prefetcher, item->next, sh, (const char *)k, (const char *)v, 4, H * (1 + quads * passes));
    for (int h = 0; h < H; h++) {
        prefetch_step(&prefetcher);
        transpose_chunk_keys(blocks, num_blocks, k, h, D, 4, token_stride, (uint32_t *)keys, npad);
        chunk_value_rows(blocks, num_blocks, v, h, D, 4, token_stride, value_rows);
        f32_tiles(&s, gather_queries(item, sh, h, 4, &s), keys, npad, ncols, n, value_rows, sh, &prefetcher, D);
    }
}
#endif

#ifdef HAVE_AVX2
/* Kv head h's rows of a chunk (blocks) as contiguous fp32 [n][D] in out: bf16 pages (kind 2)
 * shifted into the top half, int8 pages (3) times their (token, kv head) fp16 scale. */
static void widen_chunk_rows(const Block *blocks, int num_blocks, const void *pages, const uint16_t *scales, int h,
                             const Shape *sh, float *out) {
    const int D = sh->head_dim, H = sh->num_kv_heads;
    const int64_t token_stride = (int64_t)H * D;
    for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n)
        for (int j = 0; j < blocks[bi].n; j++) {
            const int64_t first = blocks[bi].first + (int64_t)h * D + j * token_stride;
            float *dst = out + (int64_t)(at + j) * D;
            if (sh->kv_kind == 2) {
                const uint16_t *src = (const uint16_t *)pages + first;
                for (int d = 0; d < D; d++) dst[d] = bf16_to_float(src[d]);
            } else {
                const int8_t *src = (const int8_t *)pages + first;
                const float scale = fp16_to_float(scales[first / D]);
                for (int d = 0; d < D; d++) dst[d] = (float)src[d] * scale;
            }
        }
}

/* The fp32 shared item over pages in another dtype: each kv head's chunk widened to fp32 rows
 * in the scratch, then the fp32 item's matrix products over them (as one contiguous "page"). */
static inline __attribute__((always_inline)) void shared_f32_kv_impl(const SharedItem *item, const void *k,
                                                                     const void *v, const Shape *sh, void *buffer,
                                                                     const int D) {
    const int H = sh->num_kv_heads, n = item->end - item->begin, ncols = (n + 15) / 16 * 16;
    const int64_t npad = ncols + BLOCK_TOKENS;
    const int element_bytes = sh->kv_kind == 2 ? 2 : 1;
    Block blocks[CHUNK_TOKENS], rows[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(item->pages, item->begin, item->end, sh, blocks);
    Scratch s = scratch_view(buffer, sh);
    float *keys = s.keys, *wide_values = s.values;
    /* After this item's query and state pointers (radixkv_shared_scratch_bytes left room). */
    const int64_t pointers = (int64_t)item->num_members * sh->group * 2 * (int64_t)sizeof(void *);
    float *wide_keys = (float *)(((uintptr_t)((char *)wide_values + (int64_t)CHUNK_TOKENS * D * 4 + pointers) + 63) / 64 * 64);
    /* The widened rows as blocks of one contiguous page: kv head 0, token stride D. */
    for (int bi = 0, at = 0; bi < num_blocks; at += blocks[bi++].n) rows[bi] = (Block){blocks[bi].n, (int64_t)at * D};
    const void *value_rows[CHUNK_TOKENS];
    Prefetcher prefetcher;
    const int quads = (item->num_members * sh->group + 3) / 4;
    const int passes = (ncols / 16 + QK_BLOCKS_PER_PASS - 1) / QK_BLOCKS_PER_PASS;
    prefetcher_init(&prefetcher, item->next, sh, (const char *)k, (const char *)v, element_bytes, H * (1 + quads * passes));
    for (int h = 0; h < H; h++) {
        prefetch_step(&prefetcher);
        widen_chunk_rows(blocks, num_blocks, k, sh->k_scales, h, sh, wide_keys);
        widen_chunk_rows(blocks, num_blocks, v, sh->v_scales, h, sh, wide_values);
        transpose_chunk_keys(rows, num_blocks, wide_keys, 0, D, 4, D, (uint32_t *)keys, npad);
        chunk_value_rows(rows, num_blocks, wide_values, 0, D, 4, D, value_rows);
        f32_tiles(&s, gather_queries(item, sh, h, 4, &s), keys, npad, ncols, n, value_rows, sh, &prefetcher, D);
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
    /* A batch-invariant plan: the own item's bits as tiles, except where the own item takes
     * AMX for q.k (whose sums run in another order), head_dim is off the 32-dim grid or
     * vdpbf16ps is not the own item's FMAs. */
    if (!cascade_tiles || (sh->members_alone && (sh->use_amx || sh->head_dim % 32 || !dpbf16_is_fma_pair)))
        MEMBER_BY_MEMBER(radixkv_item_bf16, uint16_t)
    else if (sh->head_dim == 64) shared_bf16_impl(item, k, v, sh, scratch, 64);
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
#ifdef HAVE_AVX2
#ifdef HAVE_AVX512
    const int lanes = 16;
#else
    const int lanes = 8;
#endif
    if (!cascade_tiles || sh->members_alone) MEMBER_BY_MEMBER(radixkv_item_f32, float)
    else if (sh->head_dim == 64) shared_f32_impl(item, k, v, sh, scratch, 64);
    else if (sh->head_dim == 128) shared_f32_impl(item, k, v, sh, scratch, 128);
    else if (sh->head_dim % lanes == 0) shared_f32_impl(item, k, v, sh, scratch, sh->head_dim);
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
    int64_t min_saved_pages; /* (members - 1) x shared pages a group must save: the bytes rule */
} Thresholds;

static int64_t best_saving(const int32_t *lcp, int lo, int hi, const Thresholds *at_least, uint8_t *merged) {
    if (hi - lo < 2) return 0;
    const int k = argmin_lcp(lcp, lo, hi);
    const int64_t split = best_saving(lcp, lo, k, at_least, merged) + best_saving(lcp, k, hi, at_least, merged);
    const int64_t saving = (int64_t)(hi - lo - 1) * lcp[k];
    const int worth = lcp[k] >= at_least->min_pages && hi - lo >= at_least->min_members && saving >= at_least->min_saved_pages;
    const int64_t whole = worth ? saving : 0;
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
 * prefix and save at least min_saved_tokens of KV reads ((members - 1) x shared tokens), into
 * plan (the layout paged_decode.c reads: see Plan there). Returns the KV tokens
 * the groups save: what members other than the first would have read of the shared prefixes;
 * -1 when out of memory (the plan then has no groups). */
int64_t radixkv_cascade_plan(const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                             int num_seqs, int page_size, int min_shared_tokens, int min_members,
                             int64_t min_saved_tokens, int32_t *plan) {
    plan[0] = 0;
    plan[radixkv_cascade_plan_ints(num_seqs) - 1] = 0; /* not batch-invariant (radixkv_cascade_plan_exact) */
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
        const int64_t min_saved_pages = min_saved_tokens > 0 ? (min_saved_tokens + page_size - 1) / page_size : 0;
        const Thresholds at_least = {min_pages > 0 ? min_pages : 1, min_members > 2 ? min_members : 2, min_saved_pages};
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

/* fp32 compute over bf16 or int8 pages (sh->kv_kind): widened chunk by chunk into the scratch. */
HIDDEN void radixkv_shared_item_f32_kv(const SharedItem *item, const void *k, const void *v, const Shape *sh,
                                       void *scratch) {
#ifdef HAVE_AVX2
#ifdef HAVE_AVX512
    const int lanes = 16;
#else
    const int lanes = 8;
#endif
    if (!cascade_tiles || sh->members_alone) MEMBER_BY_MEMBER(radixkv_item_f32_kv, float)
    else if (sh->head_dim == 64) shared_f32_kv_impl(item, k, v, sh, scratch, 64);
    else if (sh->head_dim % lanes == 0) shared_f32_kv_impl(item, k, v, sh, scratch, sh->head_dim);
    else
#else
    (void)scratch;
#endif
    MEMBER_BY_MEMBER(radixkv_item_f32_kv, float)
}

/* bf16 compute over int8 pages: member by member (the shared tiles gather fp32 queries). */
HIDDEN void radixkv_shared_item_bf16_kv(const SharedItem *item, const void *k, const void *v, const Shape *sh,
                                        void *scratch) {
    (void)scratch;
    MEMBER_BY_MEMBER(radixkv_item_bf16_kv, uint16_t)
}
