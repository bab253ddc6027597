/* Prefill attention on CPU: each request's new tokens attend, causally, to its cached prefix and
 * to one another, reading the KV in place through the page table.
 *
 * A work item is one request's kv head for a block of up to QUERY_BLOCK new tokens. Its
 * QUERY_BLOCK x group query heads run against the keys chunk by chunk as the small matrix
 * products of tiles.h (a chunk's keys transposed once for all of them), and each chunk's partial
 * softmax is folded into their running states by log-sum-exp. The chunks are the keys before the
 * block in CHUNK_TOKENS pieces, then the block's own keys, the only chunk the causal mask cuts:
 * without a window every query sees at least one key of every chunk. A sliding window starts the
 * chunks at the block's first query's first key and masks each query's keys before its own
 * first; a chunk wholly before a query's window leaves its partial state empty, which the fold
 * skips (the block's own chunk is never empty). Items run
 * longest first over the threads. A row's result depends on its request alone, never on the
 * batch or the thread count.
 */
#include "tiles.h"

#include <stdlib.h>

#define QUERY_BLOCK 64 /* new tokens per work item: their queries share each transposed chunk */

typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_row_stride, out_row_stride, page_table_stride;
    const int32_t *page_table, *seq_lens, *q_starts, *q_lens;
    Shape sh;
    int window; /* a sliding window: position p sees keys p - window + 1 .. p; 0: every key */
} Extend;

typedef struct {
    int seq, head, first; /* the block's first new token */
    int64_t cost;
} Item;

/* Whether the vector kernel takes these shapes here (else the caller keeps its torch path). */
int radixkv_paged_extend_fits(int bf16, int head_dim, int group) {
    if (group < 1 || group > MAX_GROUP || head_dim < 16 || head_dim > MAX_HEAD_DIM) return 0;
#ifdef HAVE_AVX512_BF16
    if (bf16) return head_dim % 32 == 0;
#endif
#ifdef HAVE_AVX512
    if (!bf16) return head_dim % 16 == 0;
#elif defined(HAVE_AVX2)
    if (!bf16) return head_dim % 8 == 0;
#endif
    (void)bf16; /* portable builds take no shape */
    return 0;
}

#ifdef HAVE_AVX2 /* AVX-512 builds too */
/* One thread's scratch: a chunk's transposed keys and paired values, then per query its row
 * pointer, its partial state's pointer, its running state and its partial state. */
static int64_t scratch_bytes(const Shape *sh) {
    const int64_t queries = (int64_t)QUERY_BLOCK * sh->group;
    const int64_t bytes = key_bytes(sh->head_dim) + (int64_t)CHUNK_TOKENS * sh->head_dim * 4 +
                          queries * 2 * (int64_t)sizeof(void *) + queries * 2 * state_floats(sh) * 4;
    return (bytes + 63) / 64 * 64;
}

/* run += part, two online-softmax states merged by their log-sum-exp. A run that is still
 * empty (max -inf) takes part whole: e^-inf = 0. An empty part (a chunk wholly before a query's
 * window) changes nothing. */
static inline __attribute__((always_inline)) void fold_state(float *run, const float *part, const int D) {
    if (part[0] == -INFINITY) return;
    const float top = run[0] > part[0] ? run[0] : part[0];
    const float keep = expf(run[0] - top), add = expf(part[0] - top);
    run[0] = top;
    run[1] = run[1] * keep + part[1] * add;
    /* Each float is one FMA of its own, so 8 lanes give AVX-512 builds the same bits as 16. */
    const __m256 k = _mm256_set1_ps(keep), a = _mm256_set1_ps(add);
    for (int d = 0; d < D; d += 8)
        _mm256_storeu_ps(run + 2 + d, _mm256_fmadd_ps(_mm256_loadu_ps(run + 2 + d), k,
                                                      _mm256_mul_ps(_mm256_loadu_ps(part + 2 + d), a)));
}

/* A running state's output, acc / sum, to an output row (bf16 rounded to nearest even). A sink
 * logit (gpt-oss; -inf: none) joins the sum as exp(sink - max), both taken from the larger max. */
static inline __attribute__((always_inline)) void write_state(const float *run, float sink, void *dst, const int D,
                                                              const int bf16) {
    const float top = sink > run[0] ? sink : run[0], keep = expf(run[0] - top);
    const float scale = sink == -INFINITY ? 1.0f / run[1] : keep / (run[1] * keep + expf(sink - top));
#ifdef HAVE_AVX512_BF16
    if (bf16) {
        const __m512 inv = _mm512_set1_ps(scale);
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(run + 2 + d), inv)));
        return;
    }
#endif
    (void)bf16;
    const __m256 inv = _mm256_set1_ps(scale);
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps((float *)dst + d, _mm256_mul_ps(_mm256_loadu_ps(run + 2 + d), inv));
}

/* One item (see the file's comment): D and bf16 are constants in each instance. */
static inline __attribute__((always_inline)) void extend_item(const Extend *e, const Item *item, char *scratch,
                                                              const int D, const int bf16) {
    const Shape *sh = &e->sh;
    const int G = sh->group, element_bytes = bf16 ? 2 : 4, b = item->seq, h = item->head;
    const int64_t token_stride = (int64_t)sh->num_kv_heads * D, sf = state_floats(sh);
    const int32_t *pages = e->page_table + b * e->page_table_stride;
    const int q_len = e->q_lens[b], prefix = e->seq_lens[b] - q_len, t0 = item->first;
    const int t1 = q_len - t0 < QUERY_BLOCK ? q_len : t0 + QUERY_BLOCK, count = (t1 - t0) * G;
    uint32_t *keys = (uint32_t *)scratch, *value_pairs = (uint32_t *)(scratch + key_bytes(D));
    (void)value_pairs; /* bf16 only */
    const void **queries = (const void **)(scratch + key_bytes(D) + (int64_t)CHUNK_TOKENS * D * 4);
    float **partial = (float **)(queries + QUERY_BLOCK * G);
    float *running = (float *)(partial + QUERY_BLOCK * G), *partial_states = running + QUERY_BLOCK * G * sf;
    for (int i = 0; i < count; i++) { /* query i: new token t0 + i / G, query head h * G + i % G */
        const int64_t offset = (int64_t)(e->q_starts[b] + t0 + i / G) * e->q_row_stride + (int64_t)(h * G + i % G) * D;
        queries[i] = (const char *)e->q + offset * element_bytes;
        partial[i] = partial_states + i * sf;
        running[i * sf] = -INFINITY;
        memset(running + i * sf + 1, 0, sizeof(float) * (size_t)(D + 1));
    }
    Block blocks[CHUNK_TOKENS];
    const void *value_rows[CHUNK_TOKENS];
    float scores[QK_TILE * SCORE_STRIDE] __attribute__((aligned(64)));
    const int block_start = prefix + t0, end = prefix + t1, window = e->window;
    /* With a window, keys before the block's first query's window are no query's. */
    for (int begin = window > 0 && block_start - window + 1 > 0 ? block_start - window + 1 : 0; begin < end;) {
        const int diagonal = begin >= block_start;
        const int stop = diagonal ? end : block_start - begin > CHUNK_TOKENS ? begin + CHUNK_TOKENS : block_start;
        const int n = stop - begin, ncols = (n + 15) / 16 * 16;
        const int64_t npad = ncols + BLOCK_TOKENS;
        const int num_blocks = chunk_blocks(pages, begin, stop, sh, blocks);
        transpose_chunk_keys(blocks, num_blocks, e->k, h, D, element_bytes, token_stride, keys, npad);
        chunk_value_rows(blocks, num_blocks, e->v, h, D, element_bytes, token_stride, value_rows);
#ifdef HAVE_AVX512_BF16
        if (bf16) pair_values((const uint16_t *const *)value_rows, n, value_pairs, D);
#endif
        for (int first = 0; first < count; first += QK_TILE) {
            const int live = count - first < QK_TILE ? count - first : QK_TILE;
            const void *q[QK_TILE];
            for (int i = 0; i < QK_TILE; i++) q[i] = queries[first + (i < live ? i : live - 1)];
            qk_scores(q, live, keys, npad, ncols, sh->scale, scores, NULL, D, bf16);
            for (int i = 0; i < live; i++) {
                /* In the block's own chunk, new token t sees keys up to its own position; with a
                 * window, none before its first key (chunk-relative `skip`). */
                const int visible = diagonal ? (first + i) / G + 1 : n;
                const int lowest = window > 0 ? block_start + (first + i) / G - window + 1 - begin : 0;
                const int skip = lowest > 0 ? lowest : 0;
                float *row = scores + i * SCORE_STRIDE, *state = partial[first + i];
                if (skip >= visible) { /* the whole chunk is before this query's window */
                    state[0] = -INFINITY, state[1] = 0.0f;
                    for (int j = 0; j < n; j++) row[j] = 0.0f;
                    continue;
                }
                softmax_row(row + skip, visible - skip, state);
                for (int j = 0; j < skip; j++) row[j] = 0.0f;
                for (int j = visible; j < n; j++) row[j] = 0.0f;
            }
#ifdef HAVE_AVX512_BF16
            if (bf16) weights_times_value_pairs(scores, live, n, value_pairs, partial + first, D);
#endif
            if (!bf16) weights_times_values(scores, live, n, (const float *const *)value_rows, partial + first, D);
            for (int i = 0; i < live; i++) fold_state(running + (first + i) * sf, partial[first + i], D);
        }
        begin = stop;
    }
    for (int i = 0; i < count; i++) {
        const int64_t offset = (int64_t)(e->q_starts[b] + t0 + i / G) * e->out_row_stride + (int64_t)(h * G + i % G) * D;
        const float sink = sh->sinks ? sh->sinks[h * G + i % G] : -INFINITY;
        write_state(running + i * sf, sink, (char *)e->out + offset * element_bytes, D, bf16);
    }
}

static void run_item(const Extend *e, const Item *item, char *scratch, int bf16) {
    const int D = e->sh.head_dim;
#ifdef HAVE_AVX512_BF16
    if (bf16) {
        if (D == 64) extend_item(e, item, scratch, 64, 1);
        else if (D == 128) extend_item(e, item, scratch, 128, 1);
        else extend_item(e, item, scratch, D, 1);
        return;
    }
#else
    (void)bf16; /* bf16 items run only where AVX512_BF16 does (radixkv_paged_extend_fits) */
#endif
    if (D == 64) extend_item(e, item, scratch, 64, 0);
    else if (D == 128) extend_item(e, item, scratch, 128, 0);
    else extend_item(e, item, scratch, D, 0);
}

static int longest_first(const void *x, const void *y) {
    const int64_t a = ((const Item *)x)->cost, b = ((const Item *)y)->cost;
    return a > b ? -1 : a < b;
}

/* The items of every request with new tokens, longest first; NULL when out of memory. */
static Item *plan_items(const Extend *e, int num_seqs, int *num_items) {
    int64_t total = 0;
    for (int b = 0; b < num_seqs; b++) total += (int64_t)(e->q_lens[b] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    Item *items = malloc(sizeof(Item) * (size_t)(total * e->sh.num_kv_heads + 1));
    if (!items) return NULL;
    int n = 0;
    for (int b = 0; b < num_seqs; b++)
        for (int t0 = 0; t0 < e->q_lens[b]; t0 += QUERY_BLOCK) {
            const int t1 = e->q_lens[b] - t0 < QUERY_BLOCK ? e->q_lens[b] : t0 + QUERY_BLOCK;
            const int64_t keys = e->seq_lens[b] - e->q_lens[b] + t1;
            for (int h = 0; h < e->sh.num_kv_heads; h++) items[n++] = (Item){b, h, t0, (int64_t)(t1 - t0) * keys};
        }
    qsort(items, (size_t)n, sizeof(Item), longest_first);
    *num_items = n;
    return items;
}

static int extend(const Extend *e, int num_seqs, int num_threads, int bf16) {
    int num_items = 0, failed = 0;
    Item *items = plan_items(e, num_seqs, &num_items);
    if (!items) return 2;
    const int64_t bytes = scratch_bytes(&e->sh);
#pragma omp parallel num_threads(num_threads)
    {
        char *scratch = aligned_alloc(64, (size_t)bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_items; i++)
            if (scratch) run_item(e, &items[i], scratch, bf16);
        free(scratch);
    }
    free(items);
    return failed ? 2 : 0;
}
#endif

/* Attention of each request's q_lens[b] new tokens (q rows q_starts[b].., at positions
 * seq_lens[b] - q_lens[b]..) over its first seq_lens[b] keys, causally, into the same rows of
 * out; sinks: a logit per query head in each softmax's sum (gpt-oss), fp32, or NULL. Returns
 * 0; 1, doing nothing, where radixkv_paged_extend_fits says no; 2 out of memory. */
#define DEFINE_EXTEND(NAME, T, BF16)                                                                                  \
    int NAME(const T *q, int64_t q_row_stride, const T *k, const T *v, const int32_t *page_table,                    \
             int64_t page_table_stride, const int32_t *seq_lens, const int32_t *q_starts, const int32_t *q_lens,      \
             int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int page_size, float scale, T *out,        \
             int64_t out_row_stride, int num_threads, int window, const float *sinks) {                               \
        if (num_kv_heads < 1 || num_q_heads % num_kv_heads ||                                                         \
            !radixkv_paged_extend_fits(BF16, head_dim, num_q_heads / num_kv_heads))                                    \
            return 1;                                                                                                 \
        EXTEND_BODY(BF16)                                                                                             \
    }
#ifdef HAVE_AVX2
#define EXTEND_BODY(BF16)                                                                                            \
    const Extend e = {q, k, v, out, q_row_stride, out_row_stride, page_table_stride, page_table, seq_lens, q_starts, \
                      q_lens, {num_kv_heads, head_dim, num_q_heads / num_kv_heads, page_size, scale, 0, 0, NULL, NULL, 0,   \
                       sinks},                                                                                      \
                      window};                                                                                     \
    return extend(&e, num_seqs, num_threads, BF16);
#else
#define EXTEND_BODY(BF16)                                                                                            \
    (void)q, (void)q_row_stride, (void)k, (void)v, (void)page_table, (void)page_table_stride, (void)seq_lens,        \
        (void)q_starts, (void)q_lens, (void)num_seqs, (void)page_size, (void)scale, (void)out, (void)out_row_stride, \
        (void)num_threads, (void)window, (void)sinks;                                                                \
    return 1;
#endif
DEFINE_EXTEND(radixkv_paged_extend_bf16, uint16_t, 1)
DEFINE_EXTEND(radixkv_paged_extend_f32, float, 0)
