/* Paged decode attention for CPU: one query token per request attends to its KV where it lies
 * in the page pool, so no request's KV is copied on any step (the torch fallback gathers it).
 *
 * Work is split into (request, chunk of CHUNK_TOKENS keys) items; each OpenMP thread runs a
 * contiguous run of them. An item keeps fp32 softmax state per query head (max, sum,
 * unnormalised output), and a second pass merges a request's chunks by their log-sum-exp.
 * Chunk edges depend only on the request's own length, never on the batch or the thread
 * count, so a request's output is the same whatever it runs beside.
 *
 * Memory, not arithmetic, bounds decode, and a core keeps only a few cache-line misses in
 * flight. So while an item computes, it requests the KV of the thread's next item into L2, a
 * few lines per step, spread evenly over its work: the memory never idles and the item itself
 * reads from cache. (Prefetching a block ahead, or all at once, left the memory idle during
 * compute or stalled on full line-fill buffers.)
 *
 * Layouts (element strides):
 *   q          [rows][q_row_stride], a row holds num_q_heads * head_dim values
 *   k, v       [num_pages][page_size][num_kv_heads][head_dim], contiguous
 *   page_table [num_seqs][page_table_stride] int32
 *   out        [rows][num_q_heads * head_dim], contiguous
 * Request b reads q row rows[b] (b when rows is NULL) and writes the same out row; its keys are
 * positions 0 .. seq_lens[b]-1. Query heads h*group .. h*group+group-1 share kv head h (GQA).
 */
#define _GNU_SOURCE /* syscall() for the AMX permission request */
#include "amx.h"

#include <stdlib.h>

#define CHUNK_TOKENS 256
#define BLOCK_TOKENS 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* A query head's row of scores for a chunk, with room for a last block's 16-lane store. */
#define SCORE_STRIDE (CHUNK_TOKENS + BLOCK_TOKENS)

typedef struct {
    int num_kv_heads, head_dim, group, page_size;
    float scale;
    int use_amx; /* q.k of full 16-key blocks on AMX tiles (bf16, where the OS allows it) */
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

/* The item a thread runs after this one: its KV is requested while this one computes. */
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

static void init_states(float *states, const Shape *sh) {
    const int64_t count = (int64_t)sh->num_kv_heads * sh->group;
    for (int64_t i = 0; i < count; i++) {
        float *state = states + i * state_floats(sh);
        state[0] = -INFINITY;
        memset(state + 1, 0, sizeof(float) * (sh->head_dim + 1));
    }
}

/* Fold scores s[0..n) into one state: returns the factor the old output must be scaled by and
 * leaves the block's softmax weights in s. */
static inline float fold_scores(float *state, float *s, int n) {
    float block_max = s[0];
    for (int j = 1; j < n; j++) block_max = s[j] > block_max ? s[j] : block_max;
    const float new_max = state[0] > block_max ? state[0] : block_max;
    const float alpha = state[0] == -INFINITY ? 0.0f : expf(state[0] - new_max);
    float block_sum = 0.0f;
    for (int j = 0; j < n; j++) {
        s[j] = expf(s[j] - new_max);
        block_sum += s[j];
    }
    state[0] = new_max;
    state[1] = state[1] * alpha + block_sum;
    return alpha;
}

/* The portable item, for element type T read through LOAD: plain loops the compiler may
 * vectorise. Used for fp32, and for bf16 where AVX-512 BF16 is missing. */
#define DEFINE_ITEM(NAME, T, LOAD)                                                                 \
    static void NAME(const T *q_row, const T *k, const T *v, const int32_t *pages, int begin,     \
                     int end, const Shape *sh, float *states, const NextItem *next) {              \
        const int D = sh->head_dim, G = sh->group;                                                 \
        (void)next;                                                                                \
        float qf[MAX_GROUP][MAX_HEAD_DIM], kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM];                     \
        float s[BLOCK_TOKENS];                                                                     \
        init_states(states, sh);                                                                   \
        for (int h = 0; h < sh->num_kv_heads; h++) {                                               \
            for (int g = 0; g < G; g++)                                                            \
                for (int d = 0; d < D; d++) qf[g][d] = LOAD(q_row[(int64_t)(h * G + g) * D + d]); \
            for (int t = begin; t < end;) {                                                        \
                const Block block = block_at(pages, t, end, sh);                                   \
                const int64_t token_stride = (int64_t)sh->num_kv_heads * D;                        \
                const T *k0 = k + block.first + (int64_t)h * D, *v0 = v + block.first + (int64_t)h * D; \
                for (int g = 0; g < G; g++) {                                                      \
                    float *state = states + (int64_t)(h * G + g) * state_floats(sh);               \
                    for (int j = 0; j < block.n; j++) {                                            \
                        for (int d = 0; d < D; d++) kf[d] = LOAD(k0[j * token_stride + d]);         \
                        float dot = 0.0f;                                                          \
                        for (int d = 0; d < D; d++) dot += qf[g][d] * kf[d];                        \
                        s[j] = dot * sh->scale;                                                    \
                    }                                                                              \
                    const float alpha = fold_scores(state, s, block.n);                            \
                    float *acc = state + 2;                                                        \
                    for (int d = 0; d < D; d++) acc[d] *= alpha;                                   \
                    for (int j = 0; j < block.n; j++) {                                            \
                        for (int d = 0; d < D; d++) vf[d] = LOAD(v0[j * token_stride + d]);         \
                        for (int d = 0; d < D; d++) acc[d] += s[j] * vf[d];                        \
                    }                                                                              \
                }                                                                                  \
                t += block.n;                                                                      \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_ITEM(item_bf16_portable, uint16_t, bf16_to_float)
DEFINE_ITEM(item_f32_portable, float, f32_load)

#ifdef HAVE_AVX512

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted = 0;
static int decode_amx = 0; /* set by radixkv_decode_use_amx only: the linears ask for tiles too */

int radixkv_enable_amx(void) {
    if (!amx_permitted)
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
}

/* Tiles: 0 = scores [16 keys][group] fp32, 1 = K [16 keys][32 dims] bf16, 2 = q pairs
 * [16 dim pairs][group]. Set on each thread before its first tile instruction. */
static void amx_thread_begin(const Shape *sh) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    config.rows[0] = 16, config.colsb[0] = (uint16_t)(sh->group * 4);
    config.rows[1] = 16, config.colsb[1] = 64;
    config.rows[2] = 16, config.colsb[2] = (uint16_t)(sh->group * 4);
    _tile_loadconfig(&config);
}

/* Scores of 16 keys for the G query heads of one kv head:
 * s[g * SCORE_STRIDE + j] = scale * q_g . k_j. */
static inline void scores_amx(const uint32_t *q_pairs, const uint16_t *k0, int64_t token_stride, int D,
                              int G, float scale, float *s) {
    float by_key[16 * MAX_GROUP];
    _tile_zero(0);
    for (int c = 0; c < D / 32; c++) {
        _tile_loadd(1, k0 + 32 * c, token_stride * (int64_t)sizeof(uint16_t));
        _tile_loadd(2, q_pairs + (int64_t)c * 16 * G, G * 4);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, by_key, G * 4);
    const __m512i key_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(G));
    for (int g = 0; g < G; g++) {
        const __m512 column = _mm512_i32gather_ps(_mm512_add_epi32(key_offsets, _mm512_set1_epi32(g)), by_key, 4);
        _mm512_storeu_ps(s + g * SCORE_STRIDE, _mm512_mul_ps(column, _mm512_set1_ps(scale)));
    }
}
#endif

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

#ifdef HAVE_AVX512_BF16
/* Scores of n <= 16 keys for the G query heads of one kv head, by vdpbf16ps; lanes past n
 * are 0. Same layout as scores_amx. */
static inline __attribute__((always_inline)) void scores_avx512(
    __m512bh qv[MAX_GROUP][MAX_HEAD_DIM / 32], const uint16_t *k0, int64_t token_stride, int n, const int D,
    const int G, float scale, float *s) {
    __m512 dots[MAX_GROUP][16];
    for (int j = 0; j < 16; j++) {
        if (j >= n) {
            for (int g = 0; g < G; g++) dots[g][j] = _mm512_setzero_ps();
            continue;
        }
        __m512bh kv[MAX_HEAD_DIM / 32];
        for (int c = 0; c < D / 32; c++) kv[c] = (__m512bh)_mm512_loadu_si512(k0 + j * token_stride + 32 * c);
        for (int g = 0; g < G; g++) {
            __m512 dot = _mm512_setzero_ps();
            for (int c = 0; c < D / 32; c++) dot = _mm512_dpbf16_ps(dot, qv[g][c], kv[c]);
            dots[g][j] = dot;
        }
    }
    for (int g = 0; g < G; g++) _mm512_storeu_ps(s + g * SCORE_STRIDE, _mm512_mul_ps(sum_lanes_16(dots[g]), _mm512_set1_ps(scale)));
}

#endif

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

/* Requests the next item's K and V a few lines at a time, spread over this item's work: the
 * memory stays busy while this item computes, and no burst fills the line-fill buffers. A
 * block's rows (all kv heads) are one contiguous run in K and one in V. */
typedef struct {
    const char *start[2 * CHUNK_TOKENS];
    int64_t bytes[2 * CHUNK_TOKENS];
    int runs, run;
    int64_t offset;
    int lines_per_step;
} Prefetcher;

static inline void prefetcher_init(Prefetcher *p, const NextItem *next, const Shape *sh, const char *k,
                                   const char *v, int element_bytes, int steps) {
    const int64_t row_bytes = (int64_t)sh->num_kv_heads * sh->head_dim * element_bytes;
    int64_t lines = 0;
    p->runs = p->run = 0;
    p->offset = 0;
    for (int t = next->begin; next->pages && t < next->end;) {
        const Block block = block_at(next->pages, t, next->end, sh);
        for (int which = 0; which < 2; which++) {
            p->start[p->runs] = (which ? v : k) + block.first * element_bytes;
            p->bytes[p->runs++] = block.n * row_bytes;
        }
        lines += 2 * (block.n * row_bytes + 63) / 64;
        t += block.n;
    }
    p->lines_per_step = (int)(lines / (steps > 0 ? steps : 1)) + 1;
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

/* The items below run as instances with head_dim and group as constants, so the compiler
 * unrolls the chunk loops and keeps q and the accumulators in registers; other shapes run the
 * general instance. GROUP_CASES(IMPL, D) returns from the caller after the instance for its
 * group, if there is one. */
#define ITEM_ARGS q_row, k, v, pages, begin, end, sh, states, next
#define GROUP_CASES(IMPL, D)                             \
    switch (sh->group) {                                 \
        case 1: IMPL(ITEM_ARGS, D, 1); return;           \
        case 2: IMPL(ITEM_ARGS, D, 2); return;           \
        case 3: IMPL(ITEM_ARGS, D, 3); return;           \
        case 4: IMPL(ITEM_ARGS, D, 4); return;           \
        case 5: IMPL(ITEM_ARGS, D, 5); return;           \
        case 6: IMPL(ITEM_ARGS, D, 6); return;           \
        case 7: IMPL(ITEM_ARGS, D, 7); return;           \
        case 8: IMPL(ITEM_ARGS, D, 8); return;           \
    }

#ifdef HAVE_AVX512_BF16
/* The bf16 item with AVX-512, one kv head at a time, in three passes over the chunk: q.k for
 * all its keys (AMX tiles for full 16-key blocks, else vdpbf16ps), one softmax over the chunk
 * (so no running max and no rescaling), then p.v with fp32 FMAs into accumulators that stay in
 * registers. The chunk's KV was requested during the previous item (prefetch_next), so the
 * passes read it from cache while this item requests the next one's. head_dim % 32 == 0; D and
 * G are constants in the hot instances. */
static inline __attribute__((always_inline)) void item_bf16_avx512_impl(
    const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages, int begin,
    int end, const Shape *sh, float *states, const NextItem *next, const int D, const int G) {
    const int H = sh->num_kv_heads, n = end - begin;
    const int64_t token_stride = (int64_t)H * D;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(pages, begin, end, sh, blocks);
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    prefetcher_init(&prefetcher, next, sh, (const char *)k, (const char *)v, 2, 2 * H * num_blocks);
    for (int h = 0; h < H; h++) {
        const uint16_t *q_head = q_row + (int64_t)h * G * D;
        __m512bh qv[MAX_GROUP][MAX_HEAD_DIM / 32];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D / 32; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q_head + (int64_t)g * D + 32 * c);
#ifdef HAVE_AMX
        /* q as AMX B tiles: per 32-dim chunk, [16 dim pairs][G heads] bf16 pairs. */
        uint32_t q_pairs[MAX_HEAD_DIM / 32 * 16 * MAX_GROUP];
        if (sh->use_amx) {
            const uint32_t *q_words = (const uint32_t *)q_head;
            for (int c = 0; c < D / 32; c++)
                for (int pair = 0; pair < 16; pair++)
                    for (int g = 0; g < G; g++) q_pairs[(c * 16 + pair) * G + g] = q_words[(g * D) / 2 + 16 * c + pair];
        }
#endif
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            const uint16_t *k0 = k + blocks[bi].first + (int64_t)h * D;
            prefetch_step(&prefetcher);
#ifdef HAVE_AMX
            if (sh->use_amx && blocks[bi].n == 16)
                scores_amx(q_pairs, k0, token_stride, D, G, sh->scale, s + offset);
            else
#endif
                scores_avx512(qv, k0, token_stride, blocks[bi].n, D, G, sh->scale, s + offset);
        }
        for (int g = 0; g < G; g++) softmax_row(s + g * SCORE_STRIDE, n, states + (int64_t)(h * G + g) * (D + 2));
        /* Accumulators hold a 32-dim chunk as (even dims, odd dims): a bf16 pair converts
         * to two float vectors by one shift and one mask, with no shuffle. */
        __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
        const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            prefetch_step(&prefetcher);
            const uint16_t *v0 = v + blocks[bi].first + (int64_t)h * D;
            for (int j = 0; j < blocks[bi].n; j++) {
                __m512 vf[MAX_HEAD_DIM / 16];
                for (int c = 0; c < D / 32; c++) {
                    const __m512i pairs = _mm512_loadu_si512(v0 + j * token_stride + 32 * c);
                    vf[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                    vf[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
                }
                for (int g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(s[g * SCORE_STRIDE + offset + j]);
                    for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
                }
            }
        }
        /* Back to natural dim order for the merge. */
        for (int g = 0; g < G; g++) {
            float *out = states + (int64_t)(h * G + g) * (D + 2) + 2, chunk[32];
            for (int c = 0; c < D / 32; c++) {
                _mm512_storeu_ps(chunk, acc[g][2 * c]);
                _mm512_storeu_ps(chunk + 16, acc[g][2 * c + 1]);
                for (int d = 0; d < 16; d++) {
                    out[32 * c + 2 * d] = chunk[d];
                    out[32 * c + 2 * d + 1] = chunk[16 + d];
                }
            }
        }
    }
}

static void item_bf16_avx512(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                             int begin, int end, const Shape *sh, float *states, const NextItem *next) {
    if (sh->head_dim == 64) GROUP_CASES(item_bf16_avx512_impl, 64)
    if (sh->head_dim == 128) GROUP_CASES(item_bf16_avx512_impl, 128)
    item_bf16_avx512_impl(ITEM_ARGS, sh->head_dim, sh->group);
}
#endif

/* The fp32 item with AVX-512: the bf16 item's three passes with fp32 FMAs. q.k sums each key's
 * head_dim products in 16 lanes, then folds 16 keys' lanes at once (sum_lanes_16); p.v adds
 * into accumulators kept in registers, in natural dim order. head_dim % 16 == 0. */
static inline __attribute__((always_inline)) void item_f32_avx512_impl(
    const float *q_row, const float *k, const float *v, const int32_t *pages, int begin, int end,
    const Shape *sh, float *states, const NextItem *next, const int D, const int G) {
    const int H = sh->num_kv_heads, n = end - begin;
    const int64_t token_stride = (int64_t)H * D;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(pages, begin, end, sh, blocks);
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    prefetcher_init(&prefetcher, next, sh, (const char *)k, (const char *)v, 4, 2 * H * num_blocks);
    for (int h = 0; h < H; h++) {
        const float *q_head = q_row + (int64_t)h * G * D;
        __m512 qv[MAX_GROUP][MAX_HEAD_DIM / 16];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D / 16; c++) qv[g][c] = _mm512_loadu_ps(q_head + (int64_t)g * D + 16 * c);
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            const float *k0 = k + blocks[bi].first + (int64_t)h * D;
            prefetch_step(&prefetcher);
            __m512 dots[MAX_GROUP][16];
            for (int j = 0; j < 16; j++) {
                if (j >= blocks[bi].n) {
                    for (int g = 0; g < G; g++) dots[g][j] = _mm512_setzero_ps();
                    continue;
                }
                __m512 kv[MAX_HEAD_DIM / 16];
                for (int c = 0; c < D / 16; c++) kv[c] = _mm512_loadu_ps(k0 + j * token_stride + 16 * c);
                for (int g = 0; g < G; g++) {
                    __m512 dot = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int c = 1; c < D / 16; c++) dot = _mm512_fmadd_ps(qv[g][c], kv[c], dot);
                    dots[g][j] = dot;
                }
            }
            for (int g = 0; g < G; g++)
                _mm512_storeu_ps(s + g * SCORE_STRIDE + offset, _mm512_mul_ps(sum_lanes_16(dots[g]), _mm512_set1_ps(sh->scale)));
        }
        for (int g = 0; g < G; g++) softmax_row(s + g * SCORE_STRIDE, n, states + (int64_t)(h * G + g) * (D + 2));
        __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            prefetch_step(&prefetcher);
            const float *v0 = v + blocks[bi].first + (int64_t)h * D;
            for (int j = 0; j < blocks[bi].n; j++) {
                __m512 vf[MAX_HEAD_DIM / 16];
                for (int c = 0; c < D / 16; c++) vf[c] = _mm512_loadu_ps(v0 + j * token_stride + 16 * c);
                for (int g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(s[g * SCORE_STRIDE + offset + j]);
                    for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            float *out = states + (int64_t)(h * G + g) * (D + 2) + 2;
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(out + 16 * c, acc[g][c]);
        }
    }
}

static void item_f32_avx512(const float *q_row, const float *k, const float *v, const int32_t *pages, int begin,
                            int end, const Shape *sh, float *states, const NextItem *next) {
    if (sh->head_dim == 64) GROUP_CASES(item_f32_avx512_impl, 64)
    if (sh->head_dim == 128) GROUP_CASES(item_f32_avx512_impl, 128)
    item_f32_avx512_impl(ITEM_ARGS, sh->head_dim, sh->group);
}
#endif

/* The bf16 item: the AVX-512 one where the CPU and head_dim allow, else the portable one. */
static void item_bf16(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                      int begin, int end, const Shape *sh, float *states, const NextItem *next) {
#ifdef HAVE_AVX512_BF16
    if (sh->head_dim % 32 == 0) {
        item_bf16_avx512(q_row, k, v, pages, begin, end, sh, states, next);
        return;
    }
#endif
    item_bf16_portable(q_row, k, v, pages, begin, end, sh, states, next);
}

/* The fp32 item: the AVX-512 one where the CPU and head_dim allow, else the portable one. */
static void item_f32(const float *q_row, const float *k, const float *v, const int32_t *pages, int begin, int end,
                     const Shape *sh, float *states, const NextItem *next) {
#ifdef HAVE_AVX512
    if (sh->head_dim % 16 == 0) {
        item_f32_avx512(q_row, k, v, pages, begin, end, sh, states, next);
        return;
    }
#endif
    item_f32_portable(q_row, k, v, pages, begin, end, sh, states, next);
}

/* Merge one request's count chunk items (consecutive in the buffer) into its output row. */
#define DEFINE_MERGE(NAME, T, STORE)                                                         \
    static void NAME(const float *items, int64_t count, int head, const Shape *sh, T *out_row) { \
        const int D = sh->head_dim;                                                          \
        float merged[MAX_HEAD_DIM];                                                          \
        for (int g = 0; g < sh->group; g++) {                                                \
            const int64_t at = (int64_t)(head * sh->group + g) * state_floats(sh);           \
            float top = -INFINITY, total = 0.0f;                                             \
            for (int64_t c = 0; c < count; c++) {                                            \
                const float m = items[c * item_floats(sh) + at];                             \
                top = m > top ? m : top;                                                     \
            }                                                                                \
            memset(merged, 0, sizeof(float) * D);                                            \
            for (int64_t c = 0; c < count; c++) {                                            \
                const float *state = items + c * item_floats(sh) + at;                       \
                const float w = state[0] == -INFINITY ? 0.0f : expf(state[0] - top);         \
                total += state[1] * w;                                                       \
                for (int d = 0; d < D; d++) merged[d] += state[2 + d] * w;                   \
            }                                                                                \
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;                            \
            T *dst = out_row + (int64_t)(head * sh->group + g) * D;                          \
            for (int d = 0; d < D; d++) dst[d] = STORE(merged[d] * inv);                     \
        }                                                                                    \
    }

DEFINE_MERGE(merge_bf16, uint16_t, float_to_bf16)
DEFINE_MERGE(merge_f32, float, f32_store)

/* Per-thread setup and teardown around a call's items (AMX tile state). */
static void thread_begin(const Shape *sh) {
#ifdef HAVE_AMX
    if (sh->use_amx) amx_thread_begin(sh);
#else
    (void)sh;
#endif
}

static void thread_end(const Shape *sh) {
#ifdef HAVE_AMX
    if (sh->use_amx) _tile_release();
#else
    (void)sh;
#endif
}

/* Whether bf16 items of this shape take the AMX q.k path. */
static int amx_fits(const Shape *sh) {
#ifdef HAVE_AMX
    return decode_amx && sh->head_dim % 32 == 0;
#else
    (void)sh;
    return 0;
#endif
}

static inline int64_t num_chunks(int32_t seq_len) {
    return seq_len > 0 ? (seq_len + CHUNK_TOKENS - 1) / CHUNK_TOKENS : 0;
}

/* The request owning a chunk item and the keys [begin, end) the item covers. */
typedef struct {
    int seq, begin, end;
} Span;

static inline Span locate_chunk(int64_t chunk, const int64_t *first_chunk, const int32_t *seq_lens, int num_seqs) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_chunk[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    const int begin = (int)((chunk - first_chunk[lo]) * CHUNK_TOKENS);
    const Span span = {lo, begin, begin + CHUNK_TOKENS < seq_lens[lo] ? begin + CHUNK_TOKENS : seq_lens[lo]};
    return span;
}

/* The kernel's work items for these lengths: each request's keys in chunks of CHUNK_TOKENS. */
int64_t radixkv_decode_num_items(const int32_t *seq_lens, int num_seqs) {
    int64_t items = 0;
    for (int b = 0; b < num_seqs; b++) items += num_chunks(seq_lens[b]);
    return items;
}

/* Floats of work buffer the kernel needs for these lengths (the caller allocates it). */
int64_t radixkv_decode_work_floats(const int32_t *seq_lens, int num_seqs, int num_q_heads, int head_dim) {
    int64_t chunks = 0;
    for (int b = 0; b < num_seqs; b++) chunks += num_chunks(seq_lens[b]);
    return chunks * num_q_heads * (head_dim + 2);
}

/* Returns 0, or 1 for shapes this kernel does not take (callers check them first).
 * work: radixkv_decode_work_floats floats; first_chunk: num_seqs int64 of scratch. */
#define DEFINE_DECODE(NAME, T, ITEM, MERGE, AMX_CAPABLE)                                                       \
    int NAME(const T *q, int64_t q_row_stride, const T *k, const T *v,                            \
             const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,       \
             const int32_t *rows, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,  \
             int page_size, float scale, T *out, float *work, int64_t *first_chunk,               \
             const int32_t *order, int num_threads) {                                             \
        if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return 1;                       \
        Shape sh = {num_kv_heads, head_dim, num_q_heads / num_kv_heads, page_size, scale, 0};     \
        if (sh.group > MAX_GROUP || head_dim > MAX_HEAD_DIM || page_size <= 0) return 1;          \
        sh.use_amx = AMX_CAPABLE && amx_fits(&sh);                                                \
        int64_t total_chunks = 0;                                                                 \
        for (int b = 0; b < num_seqs; b++) {                                                      \
            first_chunk[b] = total_chunks;                                                        \
            total_chunks += num_chunks(seq_lens[b]);                                              \
        }                                                                                         \
        const int64_t out_row_stride = (int64_t)num_q_heads * head_dim;                           \
        _Pragma("omp parallel num_threads(num_threads)")                                          \
        {                                                                                         \
            thread_begin(&sh);                                                                    \
            /* Static: each thread runs a contiguous run of items, so it knows the next one. */   \
            _Pragma("omp for schedule(static)")                                                   \
            for (int64_t index = 0; index < total_chunks; index++) {                              \
                const int64_t chunk = order ? order[index] : index;                               \
                const Span span = locate_chunk(chunk, first_chunk, seq_lens, num_seqs);          \
                NextItem next = {NULL, 0, 0};                                                     \
                if (index + 1 < total_chunks) {                                                   \
                    const int64_t following = order ? order[index + 1] : index + 1;               \
                    const Span after = locate_chunk(following, first_chunk, seq_lens, num_seqs);  \
                    next.pages = page_table + (int64_t)after.seq * page_table_stride;             \
                    next.begin = after.begin, next.end = after.end;                               \
                }                                                                                 \
                const int64_t row = rows ? rows[span.seq] : span.seq;                             \
                ITEM(q + row * q_row_stride, k, v, page_table + (int64_t)span.seq * page_table_stride, \
                     span.begin, span.end, &sh, work + chunk * item_floats(&sh), &next);          \
            }                                                                                     \
            _Pragma("omp for schedule(static)")                                                   \
            for (int64_t pair = 0; pair < (int64_t)num_seqs * num_kv_heads; pair++) {             \
                const int b = (int)(pair / num_kv_heads), head = (int)(pair % num_kv_heads);      \
                const int64_t row = rows ? rows[b] : b;                                           \
                MERGE(work + first_chunk[b] * item_floats(&sh), num_chunks(seq_lens[b]), head,    \
                      &sh, out + row * out_row_stride);                                           \
            }                                                                                     \
            thread_end(&sh);                                                                      \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_DECODE(radixkv_paged_decode_bf16, uint16_t, item_bf16, merge_bf16, 1)
DEFINE_DECODE(radixkv_paged_decode_f32, float, item_f32, merge_f32, 0)

/* Shared reads: requests that share a cached prefix hold the same pages for it, so their items
 * over it read the same KV. Ordered back to back (and so, mostly, on one thread), the first such
 * item reads the KV from memory and the others find it in L2: a shared prefix is read once per
 * step, not once per request, and every item still computes exactly what it computed alone (the
 * same code on the same numbers), so outputs are bit-identical to the natural order.
 *
 * Fills order (one entry per item, as radixkv_decode_work_floats counts them) with the item
 * indices sorted by (the item's first page, its first key, its request) and returns how many KV
 * tokens the ordered items read again: those of items whose pages and key range equal the item
 * just before them. */
typedef struct {
    int32_t page, begin, seq, item;
} ItemKey;

static int compare_keys(const void *a, const void *b) {
    const ItemKey *x = a, *y = b;
    if (x->page != y->page) return x->page < y->page ? -1 : 1;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Whether items a and b (sorted neighbours with the same first page and first key) read the
 * same KV: the same key range over the same pages. */
static int same_reads(const ItemKey *a, const ItemKey *b, const int32_t *page_table, int64_t stride,
                      const int32_t *seq_lens, int page_size) {
    const int32_t end_a = seq_lens[a->seq] < a->begin + CHUNK_TOKENS ? seq_lens[a->seq] : a->begin + CHUNK_TOKENS;
    const int32_t end_b = seq_lens[b->seq] < b->begin + CHUNK_TOKENS ? seq_lens[b->seq] : b->begin + CHUNK_TOKENS;
    if (end_a != end_b) return 0;
    const int32_t *pa = page_table + (int64_t)a->seq * stride, *pb = page_table + (int64_t)b->seq * stride;
    for (int32_t t = a->begin; t < end_a; t += page_size)
        if (pa[t / page_size] != pb[t / page_size]) return 0;
    return 1;
}

int64_t radixkv_decode_share_order(const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                                   int num_seqs, int page_size, int32_t *order) {
    int64_t total = 0;
    for (int b = 0; b < num_seqs; b++) total += num_chunks(seq_lens[b]);
    ItemKey *keys = malloc(sizeof(ItemKey) * (size_t)(total > 0 ? total : 1));
    if (!keys) { /* no memory for the sort: the natural order, nothing shared */
        for (int64_t i = 0; i < total; i++) order[i] = (int32_t)i;
        return 0;
    }
    int64_t item = 0;
    for (int b = 0; b < num_seqs; b++)
        for (int64_t c = 0; c < num_chunks(seq_lens[b]); c++, item++) {
            const int32_t begin = (int32_t)(c * CHUNK_TOKENS);
            const ItemKey key = {page_table[(int64_t)b * page_table_stride + begin / page_size], begin, b, (int32_t)item};
            keys[item] = key;
        }
    qsort(keys, (size_t)total, sizeof(ItemKey), compare_keys);
    int64_t shared_tokens = 0;
    for (int64_t i = 0; i < total; i++) {
        order[i] = keys[i].item;
        const ItemKey *a = keys + i, *before = keys + i - 1;
        if (i > 0 && a->page == before->page && a->begin == before->begin &&
            same_reads(a, before, page_table, page_table_stride, seq_lens, page_size)) {
            const int32_t end = seq_lens[a->seq] < a->begin + CHUNK_TOKENS ? seq_lens[a->seq] : a->begin + CHUNK_TOKENS;
            shared_tokens += end - a->begin;
        }
    }
    free(keys);
    return shared_tokens;
}

/* Turns the AMX q.k path on (on != 0, where the CPU and the OS allow) or off; returns whether
 * it is on. One setting per process: every later decode call reads it. */
int radixkv_decode_use_amx(int on) {
#ifdef HAVE_AMX
    decode_amx = on && radixkv_enable_amx();
    return decode_amx;
#else
    (void)on;
    return 0;
#endif
}

/* The kernel's fixed buffer sizes, so the Python wrapper checks shapes against these very
 * numbers instead of a copy of them. */
void radixkv_decode_limits(int32_t *max_head_dim, int32_t *max_group) {
    *max_head_dim = MAX_HEAD_DIM;
    *max_group = MAX_GROUP;
}

/* Write each new token's K and V rows (num_kv_heads * head_dim values, row_bytes bytes) into
 * its slot of the page pool; a negative slot means "do not store". k and v rows may be strided
 * (views into the fused qkv output); the caches are contiguous [slots][row]. */
void radixkv_store_kv(char *k_cache, char *v_cache, const char *k, const char *v, int64_t k_row_stride,
                      int64_t v_row_stride, const int64_t *slots, int rows, int64_t row_bytes) {
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        memcpy(k_cache + slots[r] * row_bytes, k + r * k_row_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[r] * row_bytes, v + r * v_row_stride, (size_t)row_bytes);
    }
}
