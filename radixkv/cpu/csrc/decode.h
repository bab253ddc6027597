/* What paged decode (paged_decode.c) and its cascade part (cascade.c) share: the work units'
 * shapes, the softmax state layout, the per-item kernels and the shared-prefix items. */
#ifndef RADIXKV_DECODE_H
#define RADIXKV_DECODE_H

#include "amx.h"

#define HIDDEN __attribute__((visibility("hidden"))) /* between the library's files only */

#define CHUNK_TOKENS 256
#define BLOCK_TOKENS 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* A query head's row of scores for a chunk, with room for a last block's 16-lane store. */
#define SCORE_STRIDE (CHUNK_TOKENS + BLOCK_TOKENS)
/* Query heads whose keys an AVX-512 item reads in one sweep: a span's kv heads are read row by
 * row, in address order. 16 covers every kv head of SmolLM2's models at once; wider models
 * sweep their rows in parts. At least one kv head (MAX_GROUP <= SPAN_ROWS). */
#define SPAN_ROWS 16

typedef struct {
    int num_kv_heads, head_dim, group, page_size;
    float scale;
    int use_amx; /* q.k of full 16-key blocks on AMX tiles (bf16, where the OS allows it) */
    /* Pages under fp32 compute in another dtype (paged_decode_avx2.c's KIND_*; 0: as q), and
     * int8 pages' fp16 scales, [num_pages][page_size][num_kv_heads] like the pages' rows. */
    int kv_kind;
    const uint16_t *k_scales, *v_scales;
    /* A batch-invariant plan (radixkv_cascade_plan_exact): each member of a group runs the own
     * item's very code over the shared chunks, so its states are the bits it would get alone. */
    int members_alone;
    /* gpt-oss's attention sinks: a logit per query head that joins each softmax's denominator
     * (exp(sink - max)) and weights no value; NULL: none. Applied once, where a request's
     * states merge, so cascade groups and chunking need nothing of their own. */
    const float *sinks;
} Shape;

/* The keys [t, t + n) that share a page (at most BLOCK_TOKENS of them) and where they start. */
typedef struct {
    int n;
    int64_t first; /* element offset of key t, kv head 0, in k and v */
} Block;

static inline Block block_at(const int32_t *pages, int t, int end, const Shape *sh) {
    const int ps = sh->page_size, offset = t % ps;
    int n = ps - offset;
    if (n > end - t) n = end - t;
    if (n > BLOCK_TOKENS) n = BLOCK_TOKENS;
    const Block block = {n, ((int64_t)pages[t / ps] * ps + offset) * sh->num_kv_heads * sh->head_dim};
    return block;
}

/* The blocks of keys [begin, end) into blocks[]; returns how many. */
static inline int chunk_blocks(const int32_t *pages, int begin, int end, const Shape *sh, Block *blocks) {
    int num_blocks = 0;
    for (int t = begin; t < end; t += blocks[num_blocks - 1].n) blocks[num_blocks++] = block_at(pages, t, end, sh);
    return num_blocks;
}

/* The item a thread runs after this one: its KV is requested while this one computes. A NULL
 * NextItem pointer, like NULL pages, means none. */
typedef struct {
    const int32_t *pages; /* NULL: none */
    int begin, end;
} NextItem;

/* One query head's online-softmax state: running max, running sum, unnormalised output. The
 * states of an item lie in the caller's buffer, kv head major: (head * group + g). */
static inline int64_t state_floats(const Shape *sh) { return sh->head_dim + 2; }
static inline int64_t item_floats(const Shape *sh) {
    return (int64_t)sh->num_kv_heads * sh->group * state_floats(sh);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#ifdef HAVE_AVX512
/* Softmax weights of the n scores in row, in place (unnormalised: e^(s - max)); the max and
 * their sum go to state[0] and state[1]. */
static inline void softmax_row(float *row, int n, float *state) {
    const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    const int full = n - n % 16;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < full; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
    if (tail) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, row + full));
    const float max = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < full; j += 16) {
        const __m512 weights = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
        _mm512_storeu_ps(row + j, weights);
        sum = _mm512_add_ps(sum, weights);
    }
    if (tail) {
        const __m512 weights = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), shift)));
        _mm512_mask_storeu_ps(row + full, tail, weights);
        sum = _mm512_add_ps(sum, weights);
    }
    state[0] = max;
    state[1] = _mm512_reduce_add_ps(sum);
}

/* Lane j of the result is the sum of the 16 lanes of v[j]: a transpose-and-add tree, 45
 * shuffles and adds for 16 sums where reducing each vector alone would take about 130. */
static inline __m512 sum_lanes_16(const __m512 v[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (v2i, v2i+1) partial sums, interleaved */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: tokens 4i..4i+3, each summed over the lane */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* fold the four 128-bit lanes pairwise */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88), _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

#ifdef HAVE_AVX512_BF16
/* The bf16 items' arithmetic, one for the own item's FMAs and the shared tiles' vdpbf16ps:
 * p.v takes the softmax weights rounded to bf16 (as flash attention rounds P), and runs with
 * denormals flushed (MXCSR FTZ and DAZ). vdpbf16ps is then, lane by lane, the FMA of its odd
 * element and then the FMA of its even one, bit for bit (checked over 64M lanes of random bit
 * patterns on Zen 4; radixkv_dpbf16_matches_fma checks it where the library runs), so a tile
 * that pairs keys (key 2t in the odd element) adds them in the own item's key order. */
static inline void round_weights_bf16(float *row, int n) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, row + j));
        _mm512_mask_storeu_ps(row + j, live, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
}

static inline unsigned flush_denormals(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    return saved;
}
#endif

#ifdef HAVE_AVX2

/* Softmax weights of the n scores in row, in place (unnormalised: e^(s - max)); the max and their
 * sum go to state[0] and state[1]. The last partial vector is read and written under a mask. */
static inline void softmax_row_avx2(float *row, int n, float *state) {
    const int full = n - n % 8;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n % 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 top = minus_inf;
    for (int j = 0; j < full; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
    if (n % 8) top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(row + full, tail), _mm256_castsi256_ps(tail)));
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float max = lanes[0];
    for (int i = 1; i < 8; i++) max = lanes[i] > max ? lanes[i] : max;
    const __m256 shift = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < full; j += 8) {
        const __m256 weights = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
        _mm256_storeu_ps(row + j, weights);
        sum = _mm256_add_ps(sum, weights);
    }
    if (n % 8) {
        const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(row + full, tail), shift);
        const __m256 weights = _mm256_and_ps(exp8(x), _mm256_castsi256_ps(tail));
        _mm256_maskstore_ps(row + full, tail, weights);
        sum = _mm256_add_ps(sum, weights);
    }
    _mm256_storeu_ps(lanes, sum);
    float total = 0.0f;
    for (int i = 0; i < 8; i++) total += lanes[i];
    state[0] = max;
    state[1] = total;
}

/* Plain items take a prefetch step every 4 keys rather than every 16-key block: smaller bursts
 * leave the item's own L2-to-L1 misses a free miss buffer (cold decode 4-12% faster, A/B). */
#define PREFETCH_KEYS 4
#define STEPS_PER_BLOCK (BLOCK_TOKENS / PREFETCH_KEYS)

/* Requests K and V a few lines at a time, spread over an item's work: the memory stays busy while
 * the item computes, and no burst fills the line-fill buffers. A block's rows (all kv heads) are
 * one contiguous run in K and one in V. Runs past the arrays' room are left unrequested. */
typedef struct {
    const char *start[2 * CHUNK_TOKENS];
    int64_t bytes[2 * CHUNK_TOKENS];
    int runs, run;
    int64_t offset;
    int lines_per_step;
} Prefetcher;

static inline void prefetcher_add_run(Prefetcher *p, const char *start, int64_t bytes) {
    if (p->runs == 2 * CHUNK_TOKENS) return;
    p->start[p->runs] = start;
    p->bytes[p->runs++] = bytes;
}

static inline int64_t lines_of(int64_t bytes) { return (bytes + 63) / 64; }

static inline void prefetcher_pace(Prefetcher *p, int64_t lines, int steps) {
    if (steps < 1) steps = 1;
    p->lines_per_step = (int)((lines + steps - 1) / steps);
    p->run = 0;
    p->offset = 0;
}

/* The next item's K and V, block by block, over this item's `steps` prefetch steps: it is in
 * L2 when its turn comes. */
static inline void prefetcher_init(Prefetcher *p, const NextItem *next, const Shape *sh, const char *k,
                                   const char *v, int element_bytes, int steps) {
    const int64_t row_bytes = (int64_t)sh->num_kv_heads * sh->head_dim * element_bytes;
    int64_t lines = 0;
    p->runs = 0;
    const int has_next = next != NULL && next->pages != NULL;
    for (int t = has_next ? next->begin : 0; has_next && t < next->end;) {
        const Block block = block_at(next->pages, t, next->end, sh);
        prefetcher_add_run(p, k + block.first * element_bytes, block.n * row_bytes);
        prefetcher_add_run(p, v + block.first * element_bytes, block.n * row_bytes);
        lines += 2 * lines_of(block.n * row_bytes);
        t += block.n;
    }
    prefetcher_pace(p, lines, steps);
}

/* How many blocks ahead of an all-heads item its K and V are requested (A/B on Zen 3: 2 was as
 * fast as any of 1, 3, 4 and 8, each of which lost a few percent with some page layouts; on
 * Zen 4, 1 and 4 were the same as 2). */
#define LEAD_BLOCKS 2

/* For an item that reads every block's K rows (all kv heads) and then every block's V rows, in
 * that order: the lines it reads LEAD_BLOCKS blocks from now, then the next item's first ones, at the
 * rate it reads its own. Each request arrives shortly before its block is read, as one
 * contiguous run; the next-item scheme above requests a whole item early, and on a 2-core Zen 3
 * (512 KiB of L2 a core, two 384 KiB fp32 items) this was 13-27% faster cold. */
static inline void prefetcher_init_ahead(Prefetcher *p, const Block *blocks, int num_blocks, const NextItem *next,
                                         const Shape *sh, const char *k, const char *v, int element_bytes,
                                         int steps) {
    const int64_t row_bytes = (int64_t)sh->num_kv_heads * sh->head_dim * element_bytes;
    Block next_blocks[CHUNK_TOKENS];
    const int num_next = next != NULL && next->pages != NULL
                             ? chunk_blocks(next->pages, next->begin, next->end, sh, next_blocks)
                             : 0;
    int64_t lines = 0;
    p->runs = 0;
    for (int item = 0, run = 0; item < 2; item++) {
        const Block *at = item ? next_blocks : blocks;
        const int count = item ? num_next : num_blocks;
        for (int which = 0; which < 2; which++)
            for (int b = 0; b < count; b++, run++) {
                if (item == 0) lines += lines_of(at[b].n * row_bytes);
                if (run >= LEAD_BLOCKS) prefetcher_add_run(p, (which ? v : k) + at[b].first * element_bytes, at[b].n * row_bytes);
            }
    }
    prefetcher_pace(p, lines, steps);
}

/* The requests of an item over `steps` prefetch steps: its own blocks ahead where one pass reads
 * every kv head's rows (all_heads), else the next item's KV meanwhile. */
static inline void prefetcher_for_item(Prefetcher *p, const Block *blocks, int num_blocks, const NextItem *next,
                                       const Shape *sh, const char *k, const char *v, int element_bytes, int steps,
                                       int all_heads) {
    if (all_heads) prefetcher_init_ahead(p, blocks, num_blocks, next, sh, k, v, element_bytes, steps);
    else prefetcher_init(p, next, sh, k, v, element_bytes, steps);
}

/* The requests of an AVX-512 item that reads its kv heads in spans of `span` (SPAN_ROWS / G):
 * per span a pass over K and one over V, STEPS_PER_BLOCK steps a block each. */
static inline void prefetcher_for_spans(Prefetcher *p, const Block *blocks, int num_blocks, const NextItem *next,
                                        const Shape *sh, const char *k, const char *v, int element_bytes, int H,
                                        int span) {
    const int steps = 2 * ((H + span - 1) / span) * num_blocks * STEPS_PER_BLOCK;
    prefetcher_for_item(p, blocks, num_blocks, next, sh, k, v, element_bytes, steps, span >= H);
}

static inline void prefetch_step(Prefetcher *p) {
    int budget = p->lines_per_step;
    while (budget > 0 && p->run < p->runs) {
        const char *base = p->start[p->run];
        const int64_t run_end = p->bytes[p->run];
        const int64_t stop = p->offset + (int64_t)budget * 64 < run_end ? p->offset + (int64_t)budget * 64 : run_end;
        /* Into L2 (T1): in L1 the lines would only push out the block being computed. */
#pragma GCC unroll 8
        for (int64_t offset = p->offset; offset < stop; offset += 64) _mm_prefetch(base + offset, _MM_HINT_T1);
        budget -= (int)((stop - p->offset + 63) / 64);
        p->offset = stop;
        if (stop >= run_end) p->run++, p->offset = 0;
    }
}

/* A block's STEPS_PER_BLOCK prefetch steps spread evenly over its `parts` (query rows or kv
 * heads): those due before part `part`; *taken counts the block's steps taken so far. part ==
 * parts takes the rest. */
static inline void prefetch_block_share(Prefetcher *p, int *taken, int part, int parts) {
    for (; *taken < STEPS_PER_BLOCK && *taken * parts <= part * STEPS_PER_BLOCK; (*taken)++) prefetch_step(p);
}

#ifndef HAVE_AVX512
/* Where AVX-512 is missing, the tiles (tiles.h) take the 8-lane softmax. */
static inline void softmax_row(float *row, int n, float *state) { softmax_row_avx2(row, n, state); }
#endif
#endif

/* The default model's shape (SmolLM2-135M: 3 kv heads of 64 dims, 3 query heads each): the
 * vector items run it with every count a constant. */
static inline int default_model_shape(const Shape *sh) {
    return sh->head_dim == 64 && sh->group == 3 && sh->num_kv_heads == 3;
}

/* One request's keys [begin, end) (at most CHUNK_TOKENS, through its page list) for its query
 * row: online-softmax states, kv head major, into states (item_floats floats). */
HIDDEN void radixkv_item_bf16(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                              int begin, int end, const Shape *sh, float *states, const NextItem *next);
HIDDEN void radixkv_item_f32(const float *q_row, const float *k, const float *v, const int32_t *pages, int begin,
                             int end, const Shape *sh, float *states, const NextItem *next);

#ifdef HAVE_AVX2
/* The same items in 8-lane vectors (paged_decode_avx2.c), for CPUs without AVX-512:
 * head_dim % 8 == 0 (fp32) or % 16 == 0 (bf16); kind 0 fp32, 1 bf16, and under fp32 compute
 * 2 bf16 pages, 3 int8 pages (scales in sh), head_dim % 8 == 0. */
HIDDEN void radixkv_item_avx2(const void *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                              int end, const Shape *sh, float *states, const NextItem *next, int kind);
#endif

#ifdef HAVE_AVX512
/* The items over pages narrower than the compute dtype in 16-lane vectors
 * (paged_decode_narrow.c): sh->kv_kind 2, 3 or 4, head_dim % 16 == 0. */
HIDDEN void radixkv_item_narrow_avx512(const void *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                       int end, const Shape *sh, float *states, const NextItem *next);
#endif

/* fp32 compute over bf16 or int8 pages (sh->kv_kind, sh->k_scales), and bf16 compute over int8
 * pages (kv_kind 4): the AVX-512 item where head_dim % 16 == 0, else the AVX2 one where
 * head_dim % 8 == 0, else a portable one. */
HIDDEN void radixkv_item_f32_kv(const float *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                int end, const Shape *sh, float *states, const NextItem *next);
HIDDEN void radixkv_item_bf16_kv(const uint16_t *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                 int end, const Shape *sh, float *states, const NextItem *next);

/* A shared prefix's keys [begin, end) (pages: any member's page list) for all members of a
 * group at once: member m reads q row q_rows[m] and its states go to states + m * item_floats.
 * scratch: shared_scratch_bytes bytes, 64-byte aligned. */
typedef struct {
    const void *q;
    int64_t q_row_stride;
    const int32_t *q_rows; /* one per member */
    int num_members;
    const int32_t *pages;
    int begin, end;
    float *states;
    const NextItem *next; /* the item this thread runs next: its KV is requested meanwhile */
} SharedItem;

HIDDEN int64_t radixkv_shared_scratch_bytes(const Shape *sh, int max_members);
HIDDEN void radixkv_shared_item_bf16(const SharedItem *item, const uint16_t *k, const uint16_t *v, const Shape *sh,
                                     void *scratch);
HIDDEN void radixkv_shared_item_f32(const SharedItem *item, const float *k, const float *v, const Shape *sh,
                                    void *scratch);
HIDDEN void radixkv_shared_item_f32_kv(const SharedItem *item, const void *k, const void *v, const Shape *sh,
                                       void *scratch);
HIDDEN void radixkv_shared_item_bf16_kv(const SharedItem *item, const void *k, const void *v, const Shape *sh,
                                        void *scratch);

#endif
