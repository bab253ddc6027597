/* Paged decode attention for CPU: one query token per request attends to its KV where it lies
 * in the page pool, so no request's KV is copied on any step (the torch fallback gathers it).
 *
 * Work is split into items of at most CHUNK_TOKENS keys: a request's own keys, and, where a
 * cascade plan groups requests over a shared cached prefix, the prefix's keys for the whole
 * group at once (cascade.c). Each OpenMP thread runs a contiguous run of items of about equal
 * cost. An item keeps fp32 softmax state per query head (max, sum, unnormalised output), and a
 * second pass merges a request's states by their log-sum-exp. Without a plan, chunk edges
 * depend only on the request's own length, never on the batch or the thread count, so a
 * request's output is the same whatever it runs beside.
 *
 * Memory bounds decode on most CPUs, and a core keeps only a few cache-line misses in flight.
 * So while an item computes, it requests KV into L2 a few lines per step, spread evenly over its
 * work: an item that reads all kv heads in one pass requests its own blocks a few blocks ahead
 * and then the thread's next item's first ones; other items request the next item's KV. The
 * memory never idles and the item itself reads from cache. (Requesting everything at once
 * stalled on full line-fill buffers; no software requests at all was 1.5-1.9x slower.)
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
#include "decode.h"

#include <omp.h>
#include <stdlib.h>

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

/* A span's query rows: per row D / 32 vectors of bf16 dim pairs (bf16 items) or D / 16 vectors
 * of floats (fp32 items). The helpers below take `bf16` as a constant, so each item's instance
 * holds only its own dtype's code. */
typedef __m512 SpanQueries[SPAN_ROWS][MAX_HEAD_DIM / 16];

/* q_r . k_j for one fp32 query row against key j's row of kv head h: lanes of partial sums by
 * fp32 FMAs, dim chunks in order. */
static inline __attribute__((always_inline)) __m512 row_dot(const __m512 *q, const char *key, int h, const int D) {
    const float *head = (const float *)key + h * D;
    __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(head));
    for (int c = 1; c < D / 16; c++) dot = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(head + 16 * c), dot);
    return dot;
}

/* fp32 scores of one block's n <= 16 keys for the span's query heads: s[r * SCORE_STRIDE + j] =
 * scale * q_r . k_j, 0 past n. Row by row, each row's 16 dot vectors and their sums held in
 * registers: the block's K rows (a few KiB) come from L1 after the first row, where key by key
 * every dot vector went through memory on its way to the sums (the same sums, in the same
 * order). The block's prefetch steps are spread over its rows. */
static inline __attribute__((always_inline)) void block_scores(SpanQueries qv, const char *k0, int64_t row_bytes,
                                                               int n, int heads, const int D, const int G,
                                                               float scale, float *s, Prefetcher *prefetcher) {
    const int rows = heads * G;
    int steps = 0;
    for (int r = 0; r < rows; r++) {
        prefetch_block_share(prefetcher, &steps, r, rows);
        __m512 dots[16];
        for (int j = 0; j < 16; j++)
            dots[j] = j < n ? row_dot(qv[r], k0 + j * row_bytes, r / G, D) : _mm512_setzero_ps();
        _mm512_storeu_ps(s + r * SCORE_STRIDE, _mm512_mul_ps(sum_lanes_16(dots), _mm512_set1_ps(scale)));
    }
    prefetch_block_share(prefetcher, &steps, 1, 1);
}

#ifdef HAVE_AVX512_BF16
/* bf16 scores of one block's n <= 16 keys, in quads: per kv head, 4 keys' rows at a time
 * (keys kq, kq + 4, kq + 8, kq + 12) are transposed by 128-bit pieces, so a lane (key, e) takes
 * the vdpbf16ps chain over the key's dim pairs 4m + e, m from 0; a key's score is then (e0 +
 * e2) + (e1 + e3), times scale. That is what tiles.h qk_scores_bf16 computes over a chunk's
 * transposed keys, so cascade groups' tiles give these bits, with 3 adds per query and 16 keys
 * where a dot vector per key took a 16-lane sum. Zero past n. */
static inline __attribute__((always_inline)) void block_scores_bf16(SpanQueries qv, const char *k0, int64_t row_bytes,
                                                                    int n, int heads, const int D, const int G,
                                                                    float scale, float *s, Prefetcher *prefetcher) {
    int steps = 0;
    for (int h = 0; h < heads; h++) {
        prefetch_block_share(prefetcher, &steps, h, heads);
        __m512 lanes[MAX_GROUP][4]; /* [row][kq]: lane 4j + e, key kq + 4j's residue e */
        for (int kq = 0; kq < 4; kq++) {
            __m512 acc[MAX_GROUP];
            for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
            for (int c = 0; c < D / 32; c++) {
                __m512i x[4]; /* key kq + 4j's dims 32c.. 32c + 31; then 128-bit piece 4c + i of the 4 keys */
                for (int j = 0; j < 4; j++) {
                    const int key = kq + 4 * j;
                    x[j] = key < n ? _mm512_loadu_si512(k0 + key * row_bytes + (int64_t)(h * D + 32 * c) * 2) : _mm512_setzero_si512();
                }
                const __m512i a = _mm512_shuffle_i32x4(x[0], x[1], 0x44), b = _mm512_shuffle_i32x4(x[2], x[3], 0x44);
                const __m512i d = _mm512_shuffle_i32x4(x[0], x[1], 0xEE), e = _mm512_shuffle_i32x4(x[2], x[3], 0xEE);
                x[0] = _mm512_shuffle_i32x4(a, b, 0x88), x[1] = _mm512_shuffle_i32x4(a, b, 0xDD);
                x[2] = _mm512_shuffle_i32x4(d, e, 0x88), x[3] = _mm512_shuffle_i32x4(d, e, 0xDD);
                for (int g = 0; g < G; g++) {
                    const __m128i *q = (const __m128i *)&qv[h * G + g][c];
                    for (int i = 0; i < 4; i++)
                        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(q + i)), (__m512bh)x[i]);
                }
            }
            for (int g = 0; g < G; g++) lanes[g][kq] = acc[g];
        }
        for (int g = 0; g < G; g++) {
            const __m512 *A = lanes[g];
            const __m512 p01 = _mm512_add_ps(_mm512_unpacklo_ps(A[0], A[1]), _mm512_unpackhi_ps(A[0], A[1]));
            const __m512 p23 = _mm512_add_ps(_mm512_unpacklo_ps(A[2], A[3]), _mm512_unpackhi_ps(A[2], A[3]));
            const __m512d a = _mm512_castps_pd(p01), b = _mm512_castps_pd(p23);
            const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
            _mm512_storeu_ps(s + (h * G + g) * SCORE_STRIDE, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
        }
    }
    prefetch_block_share(prefetcher, &steps, 1, 1);
}
#endif

/* Adds `keys` consecutive keys' weighted values into the span's accumulators, 16 dims (fp32)
 * or 32 (bf16) at a time across the kv heads, so rows are read in address order; each
 * accumulator takes its keys in key order, as a key-at-a-time loop would. bf16 accumulators
 * hold a 32-dim chunk as (even dims, odd dims) in acc[r][c], acc[r][c + 1]: a bf16 pair
 * converts to two float vectors by one shift and one mask, with no shuffle. */
static inline __attribute__((always_inline)) void keys_values(__m512 acc[SPAN_ROWS][MAX_HEAD_DIM / 16],
                                                              const char *v_row, int64_t row_bytes, int keys,
                                                              int heads, const int D, const int G, const int bf16,
                                                              const float *w) {
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < D / 16; c += 1 + bf16) {
            __m512 low[PREFETCH_KEYS], high[PREFETCH_KEYS];
            for (int i = 0; i < keys; i++) {
                const char *at = v_row + i * row_bytes + (int64_t)(h * D + 16 * c) * (bf16 ? 2 : 4);
                if (bf16) {
                    const __m512i pairs = _mm512_loadu_si512(at);
                    low[i] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                    high[i] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
                } else {
                    low[i] = _mm512_loadu_ps(at);
                }
            }
            for (int g = 0; g < G; g++) {
                const int r = h * G + g;
                __m512 a0 = acc[r][c], a1 = bf16 ? acc[r][c + 1] : a0;
                for (int i = 0; i < keys; i++) {
                    const __m512 weight = _mm512_set1_ps(w[r * SCORE_STRIDE + i]);
                    a0 = _mm512_fmadd_ps(weight, low[i], a0);
                    if (bf16) a1 = _mm512_fmadd_ps(weight, high[i], a1);
                }
                acc[r][c] = a0;
                if (bf16) acc[r][c + 1] = a1;
            }
        }
}

/* One block's n <= 16 keys into the accumulators, PREFETCH_KEYS at a time with a prefetch step
 * before each; w: the block's weights, row r at w[r * SCORE_STRIDE]. */
static inline __attribute__((always_inline)) void block_values(__m512 acc[SPAN_ROWS][MAX_HEAD_DIM / 16],
                                                               const char *v0, int64_t row_bytes, int n, int heads,
                                                               const int D, const int G, const int bf16,
                                                               const float *w, Prefetcher *prefetcher) {
    for (int j = 0; j < BLOCK_TOKENS; j += PREFETCH_KEYS) {
        prefetch_step(prefetcher);
        if (n - j >= PREFETCH_KEYS)
            keys_values(acc, v0 + j * row_bytes, row_bytes, PREFETCH_KEYS, heads, D, G, bf16, w + j);
        else if (n > j)
            keys_values(acc, v0 + j * row_bytes, row_bytes, n - j, heads, D, G, bf16, w + j);
    }
}

/* The AVX-512 item, a span of kv heads at a time, in three passes over the chunk: q.k for all
 * its keys (bf16: in key quads, block_scores_bf16, or AMX tiles for full 16-key blocks where
 * enabled), one softmax over the chunk (so no running max and no rescaling), then p.v with
 * fp32 FMAs (bf16: of the weights rounded to bf16, denormals flushed, so cascade.c's vdpbf16ps
 * tiles give the same bits).
 *
 * A span holds up to SPAN_ROWS query heads (every kv head of SmolLM2's models), and each pass
 * reads a page's rows once, in address order, for all of them; one pass per kv head touched
 * every page once per head. Where one span takes every kv head, K and V are requested
 * LEAD_BLOCKS blocks ahead of their reading; else the next item is requested meanwhile.
 * Measured with 32 x 1,032 tokens over 30 layers, A/B in one process, cold, outputs
 * bit-identical:
 * - bf16 spans against one kv head a pass: shuffled pages 11-16% faster;
 * - requests ahead against the next item's: bf16 19-21% faster (Zen 4);
 * - fp32 spans of all heads, with requests ahead, against one kv head a pass: 17-28% faster
 *   (Zen 4), though a key already in cache takes longer (its queries and sums no longer all
 *   in registers).
 * head_dim % 32 == 0 (bf16) or % 16 == 0 (fp32); D and G are constants in the hot instances. */
static inline __attribute__((always_inline)) void item_avx512_impl(
    const void *q_row, const void *k, const void *v, const int32_t *pages, int begin, int end, const Shape *sh,
    float *states, const NextItem *next, const int D, const int G, const int bf16, const int fixed_heads) {
    const int H = fixed_heads ? fixed_heads : sh->num_kv_heads, n = end - begin;
    const int span = SPAN_ROWS / G;
    const int bytes = bf16 ? 2 : 4;
    const int64_t token_stride = (int64_t)H * D, row_bytes = token_stride * bytes;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(pages, begin, end, sh, blocks);
    float s[SPAN_ROWS * SCORE_STRIDE] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    prefetcher_for_spans(&prefetcher, blocks, num_blocks, next, sh, (const char *)k, (const char *)v, bytes, H, span);
    for (int h0 = 0; h0 < H; h0 += span) {
        const int heads = H - h0 < span ? H - h0 : span, rows = heads * G;
        const char *q_span = (const char *)q_row + (int64_t)h0 * G * D * bytes;
        SpanQueries qv;
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < (bf16 ? D / 32 : D / 16); c++) qv[r][c] = _mm512_loadu_ps(q_span + (int64_t)r * D * bytes + 64 * c);
#ifdef HAVE_AMX
        /* q as AMX B tiles: per kv head and 32-dim chunk, [16 dim pairs][G heads] bf16 pairs. */
        uint32_t q_pairs[MAX_HEAD_DIM / 32 * 16 * SPAN_ROWS];
        const int head_pairs = D / 32 * 16 * G;
        if (bf16 && sh->use_amx) {
            const uint32_t *q_words = (const uint32_t *)q_span;
            for (int h = 0; h < heads; h++)
                for (int c = 0; c < D / 32; c++)
                    for (int pair = 0; pair < 16; pair++)
                        for (int g = 0; g < G; g++)
                            q_pairs[h * head_pairs + (c * 16 + pair) * G + g] = q_words[((h * G + g) * D) / 2 + 16 * c + pair];
        }
#endif
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            const char *k0 = (const char *)k + (blocks[bi].first + (int64_t)h0 * D) * bytes;
#ifdef HAVE_AMX
            if (bf16 && sh->use_amx && blocks[bi].n == 16) {
                for (int step = 0; step < STEPS_PER_BLOCK; step++) prefetch_step(&prefetcher);
                for (int h = 0; h < heads; h++)
                    scores_amx(q_pairs + h * head_pairs, (const uint16_t *)k0 + h * D, token_stride, D, G, sh->scale,
                               s + h * G * SCORE_STRIDE + offset);
            } else
#endif
#ifdef HAVE_AVX512_BF16
            if (bf16)
                block_scores_bf16(qv, k0, row_bytes, blocks[bi].n, heads, D, G, sh->scale, s + offset, &prefetcher);
            else
#endif
                block_scores(qv, k0, row_bytes, blocks[bi].n, heads, D, G, sh->scale, s + offset, &prefetcher);
        }
        for (int r = 0; r < rows; r++) {
            softmax_row(s + r * SCORE_STRIDE, n, states + (int64_t)(h0 * G + r) * (D + 2));
#ifdef HAVE_AVX512_BF16
            if (bf16) round_weights_bf16(s + r * SCORE_STRIDE, n);
#endif
        }
        __m512 acc[SPAN_ROWS][MAX_HEAD_DIM / 16];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_setzero_ps();
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n)
            block_values(acc, (const char *)v + (blocks[bi].first + (int64_t)h0 * D) * bytes, row_bytes, blocks[bi].n,
                         heads, D, G, bf16, s + offset, &prefetcher);
        for (int r = 0; r < rows; r++) {
            float *out = states + (int64_t)(h0 * G + r) * (D + 2) + 2;
            for (int c = 0; c < D / 16; c += 1 + bf16) {
                if (!bf16) {
                    _mm512_storeu_ps(out + 16 * c, acc[r][c]);
                    continue;
                }
                float chunk[32]; /* (even dims, odd dims) back to natural dim order for the merge */
                _mm512_storeu_ps(chunk, acc[r][c]);
                _mm512_storeu_ps(chunk + 16, acc[r][c + 1]);
                for (int d = 0; d < 16; d++) {
                    out[16 * c + 2 * d] = chunk[d];
                    out[16 * c + 2 * d + 1] = chunk[16 + d];
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void item_f32_avx512_impl(
    const float *q_row, const float *k, const float *v, const int32_t *pages, int begin, int end, const Shape *sh,
    float *states, const NextItem *next, const int D, const int G) {
    item_avx512_impl(q_row, k, v, pages, begin, end, sh, states, next, D, G, 0, 0);
}

/* The items below run as instances with head_dim and group as constants, so the compiler
 * unrolls the loops over dims and query heads; other shapes run the general instance. GROUP_CASES(IMPL, D) returns from the caller after the instance for its
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
static inline __attribute__((always_inline)) void item_bf16_avx512_impl(
    const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages, int begin, int end,
    const Shape *sh, float *states, const NextItem *next, const int D, const int G) {
    item_avx512_impl(q_row, k, v, pages, begin, end, sh, states, next, D, G, 1, 0);
}

static void item_bf16_avx512_shapes(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                                    int begin, int end, const Shape *sh, float *states, const NextItem *next) {
    if (default_model_shape(sh)) {
        item_avx512_impl(ITEM_ARGS, 64, 3, 1, 3);
        return;
    }
    if (sh->head_dim == 64) GROUP_CASES(item_bf16_avx512_impl, 64)
    if (sh->head_dim == 128) GROUP_CASES(item_bf16_avx512_impl, 128)
    item_bf16_avx512_impl(ITEM_ARGS, sh->head_dim, sh->group);
}

/* Under flushed denormals: the arithmetic cascade.c's tiles reproduce (decode.h). */
static void item_bf16_avx512(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                             int begin, int end, const Shape *sh, float *states, const NextItem *next) {
    const unsigned saved = flush_denormals();
    item_bf16_avx512_shapes(ITEM_ARGS);
    _mm_setcsr(saved);
}
#endif

static void item_f32_avx512(const float *q_row, const float *k, const float *v, const int32_t *pages, int begin,
                            int end, const Shape *sh, float *states, const NextItem *next) {
    if (default_model_shape(sh)) {
        item_avx512_impl(ITEM_ARGS, 64, 3, 0, 3);
        return;
    }
    if (sh->head_dim == 64) GROUP_CASES(item_f32_avx512_impl, 64)
    if (sh->head_dim == 128) GROUP_CASES(item_f32_avx512_impl, 128)
    item_f32_avx512_impl(ITEM_ARGS, sh->head_dim, sh->group);
}
#endif

/* The bf16 item: the AVX-512 one where the CPU and head_dim allow, else the AVX2 one, else the
 * portable one. */
HIDDEN void radixkv_item_bf16(const uint16_t *q_row, const uint16_t *k, const uint16_t *v, const int32_t *pages,
                      int begin, int end, const Shape *sh, float *states, const NextItem *next) {
#ifdef HAVE_AVX512_BF16
    if (sh->head_dim % 32 == 0) {
        item_bf16_avx512(q_row, k, v, pages, begin, end, sh, states, next);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (sh->head_dim % 16 == 0) {
        radixkv_item_avx2(q_row, k, v, pages, begin, end, sh, states, next, 1);
        return;
    }
#endif
    item_bf16_portable(q_row, k, v, pages, begin, end, sh, states, next);
}

/* The fp32 item: the AVX-512 one where the CPU and head_dim allow, else the AVX2 one, else the
 * portable one. */
HIDDEN void radixkv_item_f32(const float *q_row, const float *k, const float *v, const int32_t *pages, int begin, int end,
                     const Shape *sh, float *states, const NextItem *next) {
#ifdef HAVE_AVX512
    if (sh->head_dim % 16 == 0) {
        item_f32_avx512(q_row, k, v, pages, begin, end, sh, states, next);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (sh->head_dim % 8 == 0) {
        radixkv_item_avx2(q_row, k, v, pages, begin, end, sh, states, next, 0);
        return;
    }
#endif
    item_f32_portable(q_row, k, v, pages, begin, end, sh, states, next);
}

/* A request's softmax states: its share of its group's shared items, then its own items. Each
 * run is count states, stride floats apart. */
typedef struct {
    const float *base[2];
    int64_t stride[2], count[2];
} StateRuns;

#define FOR_EACH_STATE(runs, at, state, BODY)                                              \
    for (int run = 0; run < 2; run++)                                                      \
        for (int64_t c = 0; c < (runs)->count[run]; c++) {                                 \
            const float *state = (runs)->base[run] + c * (runs)->stride[run] + (at);       \
            BODY                                                                           \
        }

/* Merge one request's states by their log-sum-exp into its output row, one kv head's queries. */
#define DEFINE_MERGE(NAME, T, STORE)                                                              \
    static void NAME(const StateRuns *runs, int head, const Shape *sh, T *out_row) {              \
        const int D = sh->head_dim;                                                               \
        float merged[MAX_HEAD_DIM];                                                               \
        for (int g = 0; g < sh->group; g++) {                                                     \
            const int64_t at = (int64_t)(head * sh->group + g) * state_floats(sh);                \
            float top = -INFINITY, total = 0.0f;                                                  \
            FOR_EACH_STATE(runs, at, state, { top = state[0] > top ? state[0] : top; })           \
            const float sink = sh->sinks ? sh->sinks[head * sh->group + g] : -INFINITY;           \
            top = sink > top ? sink : top; /* so exp(sink - top) cannot overflow */               \
            memset(merged, 0, sizeof(float) * D);                                                 \
            FOR_EACH_STATE(runs, at, state, {                                                     \
                const float w = state[0] == -INFINITY ? 0.0f : expf(state[0] - top);              \
                total += state[1] * w;                                                            \
                for (int d = 0; d < D; d++) merged[d] += state[2 + d] * w;                        \
            })                                                                                    \
            if (sh->sinks) total += expf(sink - top);                                             \
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                 \
            T *dst = out_row + (int64_t)(head * sh->group + g) * D;                               \
            for (int d = 0; d < D; d++) dst[d] = STORE(merged[d] * inv);                          \
        }                                                                                         \
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

static inline int64_t num_chunks(int32_t tokens) {
    return tokens > 0 ? (tokens + CHUNK_TOKENS - 1) / CHUNK_TOKENS : 0;
}

/* A cascade plan (radixkv_cascade_plan) in the int32 buffer that carries it:
 *   [0] num_groups, then group_of[num_seqs] (-1: no group), member_index[num_seqs],
 *   group_start[num_groups + 1], members[group_start[num_groups]], shared_len[num_groups],
 *   and in the buffer's last int (EXACT_AT: radixkv_cascade_plan_ints leaves it spare) 1 for a
 *   batch-invariant plan (radixkv_cascade_plan_exact), else 0.
 * A group's members share the pages of their first shared_len keys. */
typedef struct {
    int num_groups, exact;
    const int32_t *group_of, *member_index, *group_start, *members, *shared_len;
} Plan;

#define EXACT_AT(num_seqs) (1 + 5 * (int64_t)(num_seqs))

static Plan plan_view(const int32_t *buffer, int num_seqs) {
    Plan plan = {0, 0, NULL, NULL, NULL, NULL, NULL};
    if (!buffer) return plan;
    plan.num_groups = buffer[0];
    plan.exact = buffer[EXACT_AT(num_seqs)] == 1;
    plan.group_of = buffer + 1;
    plan.member_index = plan.group_of + num_seqs;
    plan.group_start = plan.member_index + num_seqs;
    plan.members = plan.group_start + plan.num_groups + 1;
    plan.shared_len = plan.members + plan.group_start[plan.num_groups];
    return plan;
}

/* Makes plan (radixkv_cascade_plan's, for num_seqs requests) batch-invariant, in place: each
 * group's shared length rounded down to the chunk grid, so a member's chunks are the very
 * chunks it reads alone (from key 0, CHUNK_TOKENS each) and its states merge in the same order,
 * and the plan marked so its members run the own item's code over the shared chunks (which
 * reads each shared key from memory once, the other members from cache). Groups left with
 * nothing shared stay, reading all their keys as their own. Returns the KV tokens the groups
 * now save. */
int64_t radixkv_cascade_plan_exact(int32_t *buffer, int num_seqs) {
    const Plan plan = plan_view(buffer, num_seqs);
    int32_t *shared_len = (int32_t *)plan.shared_len;
    int64_t saved = 0;
    for (int g = 0; g < plan.num_groups; g++) {
        shared_len[g] -= shared_len[g] % CHUNK_TOKENS;
        saved += (int64_t)(plan.group_start[g + 1] - plan.group_start[g] - 1) * shared_len[g];
    }
    buffer[EXACT_AT(num_seqs)] = 1;
    return saved;
}

/* The first key of request b's own part: past its group's shared prefix, or with a sliding
 * window of W keys (window > 0; never with groups) the first of its last W keys. */
static inline int32_t own_begin(const Plan *plan, int b, const int32_t *seq_lens, int window) {
    if (plan->num_groups && plan->group_of[b] >= 0) return plan->shared_len[plan->group_of[b]];
    return window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
}

static inline int group_size(const Plan *plan, int group) {
    return plan->group_start[group + 1] - plan->group_start[group];
}

/* A unit of work: CHUNK_TOKENS keys at most, of one request's own part (members == 0) or of a
 * group's shared prefix for all its members; its states start at work + offset. */
typedef struct {
    int32_t owner; /* request, or group for a shared item */
    int32_t members;
    int32_t begin, end;
    int64_t offset;
    double cost_end; /* the running cost up to and including this item, for the thread split */
} Item;

/* Relative costs per key: a shared item's members share one read of the keys and compute with
 * matrix-shaped loops, cheaper per query than an own item (measured: scenarios/cpu_kernels.py). */
#define OWN_COST 1.0
#define SHARED_READ_COST 0.5
#define SHARED_MEMBER_COST 0.6

/* The call's items (shared ones first, group by group, then each request's own) and where each
 * request's runs start. Returns the number of items; NULL items: only counts them. */
typedef struct {
    Item *items;
    int64_t num_items, work_floats;
    int64_t *group_first, *own_first; /* item indices */
} Items;

static void build_items(const int32_t *seq_lens, int num_seqs, const Plan *plan, const Shape *sh, int window,
                        Items *out) {
    int64_t count = 0, floats = 0;
    double cost = 0.0;
    for (int g = 0; g < plan->num_groups; g++) {
        const int members = group_size(plan, g);
        if (out->group_first) out->group_first[g] = count;
        for (int32_t begin = 0; begin < plan->shared_len[g]; begin += CHUNK_TOKENS, count++) {
            const int32_t end = begin + CHUNK_TOKENS < plan->shared_len[g] ? begin + CHUNK_TOKENS : plan->shared_len[g];
            cost += (end - begin) * (SHARED_READ_COST + SHARED_MEMBER_COST * members);
            if (out->items) out->items[count] = (Item){g, members, begin, end, floats, cost};
            floats += members * item_floats(sh);
        }
    }
    for (int b = 0; b < num_seqs; b++) {
        if (out->own_first) out->own_first[b] = count;
        for (int32_t begin = own_begin(plan, b, seq_lens, window); begin < seq_lens[b]; begin += CHUNK_TOKENS, count++) {
            const int32_t end = begin + CHUNK_TOKENS < seq_lens[b] ? begin + CHUNK_TOKENS : seq_lens[b];
            cost += (end - begin) * OWN_COST;
            if (out->items) out->items[count] = (Item){b, 0, begin, end, floats, cost};
            floats += item_floats(sh);
        }
    }
    out->num_items = count;
    out->work_floats = floats;
}

/* Floats of work buffer the kernel needs for these lengths, plan (NULL: none) and window (0:
 * none); the caller allocates it. */
int64_t radixkv_decode_work_floats(const int32_t *seq_lens, int num_seqs, const int32_t *plan_buffer, int num_q_heads,
                                   int head_dim, int window) {
    const Plan plan = plan_view(plan_buffer, num_seqs);
    const Shape sh = {1, head_dim, num_q_heads, 16, 1.0f, 0, 0, NULL, NULL, 0, NULL};
    Items items = {NULL, 0, 0, NULL, NULL};
    build_items(seq_lens, num_seqs, &plan, &sh, window, &items);
    return items.work_floats;
}

/* The page list an item reads: its request's, or its group's first member's. */
static inline const int32_t *item_pages(const Item *item, const Plan *plan, const int32_t *page_table, int64_t stride) {
    const int seq = item->members ? plan->members[plan->group_start[item->owner]] : item->owner;
    return page_table + (int64_t)seq * stride;
}

/* Thread t of T runs the items whose cost midpoint falls in its T-th of the total: a contiguous
 * run, so each item knows the next one its thread runs, and shares of about equal cost. */
static inline int item_thread(const Items *items, int64_t i, int num_threads) {
    const double total = items->items[items->num_items - 1].cost_end;
    const double before = i ? items->items[i - 1].cost_end : 0.0;
    const int t = (int)((before + items->items[i].cost_end) * 0.5 / total * num_threads);
    return t < num_threads ? t : num_threads - 1;
}

#define KV_PARAMS_WIDE , const uint16_t *k_scales, const uint16_t *v_scales, int kv_kind
#define KV_ARGS_WIDE , k_scales, v_scales, kv_kind
#define KV_INIT_WIDE                                                                                              \
    if (!radixkv_decode_kv_fits(kv_kind, head_dim) || (kv_kind == 3 && !(k_scales && v_scales)))                 \
        return 1;                                                                                                 \
    sh.kv_kind = kv_kind, sh.k_scales = k_scales, sh.v_scales = v_scales;
int radixkv_decode_kv_fits(int kv_kind, int head_dim);
#define KV_INIT_BF16_INT8                                                                                         \
    if (kv_kind != 3 || !(k_scales && v_scales) || !radixkv_decode_kv_fits(kv_kind, head_dim)) return 1;           \
    sh.kv_kind = 4, sh.k_scales = k_scales, sh.v_scales = v_scales;

/* Returns 0, 1 for shapes this kernel does not take (callers check them first), or 2 when out
 * of memory. work: radixkv_decode_work_floats floats; plan: radixkv_cascade_plan's buffer or
 * NULL (every request reads all its keys itself); window: a sliding window of that many keys
 * (each request reads its last `window` keys; 0: all; a window with a plan returns 1).
 * KV_PARAMS, KV_ARGS, KV_INIT: the page dtype's own parameters after num_threads, their names,
 * and what they set in the shape (or a return for what it cannot run). NAME_sinks takes
 * gpt-oss's sink logits after them (Shape.sinks); NAME is NAME_sinks without. */
#define DEFINE_DECODE(NAME, T, KT, ITEM, SHARED_ITEM, MERGE, AMX_CAPABLE, KV_PARAMS, KV_ARGS, KV_INIT)           \
    int NAME##_sinks(const T *q, int64_t q_row_stride, const KT *k, const KT *v, const int32_t *page_table,       \
                     int64_t page_table_stride, const int32_t *seq_lens, const int32_t *rows, int num_seqs,       \
                     int num_q_heads, int num_kv_heads, int head_dim, int page_size, float scale, T *out,        \
                     float *work, const int32_t *plan_buffer, int num_threads, int window KV_PARAMS,             \
                     const float *sinks);                                                                        \
    int NAME(const T *q, int64_t q_row_stride, const KT *k, const KT *v, const int32_t *page_table,               \
             int64_t page_table_stride, const int32_t *seq_lens, const int32_t *rows, int num_seqs,               \
             int num_q_heads, int num_kv_heads, int head_dim, int page_size, float scale, T *out, float *work,   \
             const int32_t *plan_buffer, int num_threads, int window KV_PARAMS) {                                \
        return NAME##_sinks(q, q_row_stride, k, v, page_table, page_table_stride, seq_lens, rows, num_seqs,      \
                            num_q_heads, num_kv_heads, head_dim, page_size, scale, out, work, plan_buffer,        \
                            num_threads, window KV_ARGS, NULL);                                                  \
    }                                                                                                            \
    /* sinks: a logit per query head, fp32 (Shape.sinks), or NULL. */                                           \
    int NAME##_sinks(const T *q, int64_t q_row_stride, const KT *k, const KT *v, const int32_t *page_table,       \
                     int64_t page_table_stride, const int32_t *seq_lens, const int32_t *rows, int num_seqs,       \
                     int num_q_heads, int num_kv_heads, int head_dim, int page_size, float scale, T *out,        \
                     float *work, const int32_t *plan_buffer, int num_threads, int window KV_PARAMS,             \
                     const float *sinks) {                                                                       \
        if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || (window > 0 && plan_buffer)) return 1;       \
        Shape sh = {num_kv_heads, head_dim, num_q_heads / num_kv_heads, page_size, scale, 0, 0, NULL, NULL, 0,   \
                    sinks};                                                                                      \
        if (sh.group > MAX_GROUP || head_dim > MAX_HEAD_DIM || page_size <= 0) return 1;                         \
        KV_INIT                                                                                                  \
        sh.use_amx = AMX_CAPABLE && amx_fits(&sh);                                                               \
        const Plan plan = plan_view(plan_buffer, num_seqs);                                                      \
        sh.members_alone = plan.exact;                                                                           \
        for (int g = 0; plan.exact && g < plan.num_groups; g++)                                                  \
            if (plan.shared_len[g] % CHUNK_TOKENS) return 1; /* off the chunk grid: not exact */                 \
        Items items = {NULL, 0, 0, NULL, NULL};                                                                  \
        build_items(seq_lens, num_seqs, &plan, &sh, window, &items);                                             \
        items.items = malloc(sizeof(Item) * (size_t)(items.num_items + 1));                                      \
        items.group_first = malloc(sizeof(int64_t) * (size_t)(plan.num_groups + 1));                             \
        items.own_first = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));                                      \
        int status = items.items && items.group_first && items.own_first ? 0 : 2;                                \
        if (status == 0) build_items(seq_lens, num_seqs, &plan, &sh, window, &items);                            \
        /* Shared items' per-thread scratch (transposed keys, widened values), 64-byte aligned. */             \
        const int64_t scratch_bytes = plan.num_groups ? radixkv_shared_scratch_bytes(&sh, num_seqs) : 0;         \
        char *scratches = scratch_bytes ? aligned_alloc(64, (size_t)(scratch_bytes * num_threads)) : NULL;       \
        if (scratch_bytes && !scratches) status = 2;                                                             \
        const int64_t out_row_stride = (int64_t)num_q_heads * head_dim;                                          \
        _Pragma("omp parallel num_threads(num_threads) if(status == 0)")                                         \
        {                                                                                                        \
            const int threads = omp_get_num_threads(), self = omp_get_thread_num();                              \
            void *scratch = scratches ? scratches + self * scratch_bytes : NULL;                                 \
            thread_begin(&sh);                                                                                   \
            int32_t q_rows[num_seqs > 0 ? num_seqs : 1];                                                         \
            for (int64_t i = 0; status == 0 && i < items.num_items; i++) {                                       \
                if (item_thread(&items, i, threads) != self) continue;                                           \
                const Item *item = items.items + i;                                                              \
                const int32_t *pages = item_pages(item, &plan, page_table, page_table_stride);                   \
                NextItem next = {NULL, 0, 0};                                                                    \
                if (i + 1 < items.num_items && item_thread(&items, i + 1, threads) == self) {                    \
                    const Item *after = item + 1;                                                                \
                    next.pages = item_pages(after, &plan, page_table, page_table_stride);                        \
                    next.begin = after->begin, next.end = after->end;                                            \
                }                                                                                                \
                if (item->members) {                                                                             \
                    const int32_t *members = plan.members + plan.group_start[item->owner];                       \
                    for (int m = 0; m < item->members; m++) q_rows[m] = rows ? rows[members[m]] : members[m];     \
                    const SharedItem shared = {q, q_row_stride, q_rows, item->members, pages, item->begin,       \
                                               item->end, work + item->offset, &next};                           \
                    SHARED_ITEM(&shared, k, v, &sh, scratch);                                                    \
                } else {                                                                                         \
                    const int64_t row = rows ? rows[item->owner] : item->owner;                                  \
                    ITEM(q + row * q_row_stride, k, v, pages, item->begin, item->end, &sh, work + item->offset,  \
                         &next);                                                                                 \
                }                                                                                                \
            }                                                                                                    \
            _Pragma("omp barrier")                                                                               \
            _Pragma("omp for schedule(static)")                                                                  \
            for (int64_t pair = 0; pair < (int64_t)num_seqs * num_kv_heads; pair++) {                            \
                if (status != 0) continue;                                                                       \
                const int b = (int)(pair / num_kv_heads), head = (int)(pair % num_kv_heads);                     \
                const int group = plan.num_groups ? plan.group_of[b] : -1;                                       \
                StateRuns runs = {{NULL, NULL}, {0, item_floats(&sh)}, {0, 0}};                                  \
                if (group >= 0 && plan.shared_len[group] > 0) {                                                  \
                    const Item *first = items.items + items.group_first[group];                                  \
                    runs.base[0] = work + first->offset + plan.member_index[b] * item_floats(&sh);               \
                    runs.stride[0] = first->members * item_floats(&sh);                                          \
                    runs.count[0] = num_chunks(plan.shared_len[group]);                                          \
                }                                                                                                \
                runs.count[1] = num_chunks(seq_lens[b] - own_begin(&plan, b, seq_lens, window));                 \
                if (runs.count[1]) runs.base[1] = work + items.items[items.own_first[b]].offset;                 \
                const int64_t row = rows ? rows[b] : b;                                                          \
                MERGE(&runs, head, &sh, out + row * out_row_stride);                                             \
            }                                                                                                    \
            thread_end(&sh);                                                                                     \
        }                                                                                                        \
        free(scratches);                                                                                         \
        free(items.items);                                                                                       \
        free(items.group_first);                                                                                 \
        free(items.own_first);                                                                                   \
        return status;                                                                                           \
    }

DEFINE_DECODE(radixkv_paged_decode_bf16, uint16_t, uint16_t, radixkv_item_bf16, radixkv_shared_item_bf16, merge_bf16, 1, , , )
DEFINE_DECODE(radixkv_paged_decode_f32, float, float, radixkv_item_f32, radixkv_shared_item_f32, merge_f32, 0, , , )

/* Whether fp32 compute reads pages of kv_kind (2: bf16, 3: int8) of this head_dim: the AVX2
 * item widens them in vectors (head_dim % 8 == 0), the portable one element by element. */
int radixkv_decode_kv_fits(int kv_kind, int head_dim) {
    return (kv_kind == 2 || kv_kind == 3) && head_dim > 0 && head_dim <= MAX_HEAD_DIM;
}

/* Element i of kv head row `row` (element offset) of bf16 (kind 2) or int8 (3, 4) pages, in
 * fp32: an int8 row is scaled by its (token, kv head) fp16 scale, row / head_dim. */
static inline float wide_load(const void *pages, const uint16_t *scales, int64_t row, int i, int kind, int D) {
    if (kind == 2) return bf16_to_float(((const uint16_t *)pages)[row + i]);
    return (float)((const int8_t *)pages)[row + i] * fp16_to_float(scales[row / D]);
}

/* The portable item over pages in another dtype: DEFINE_ITEM's loops, each K and V row widened
 * into fp32 first; q fp32, or bf16 where q_bf16. */
static void item_kv_portable(const void *q_row, int q_bf16, const void *k, const void *v, const int32_t *pages,
                             int begin, int end, const Shape *sh, float *states) {
    const int D = sh->head_dim, G = sh->group, kind = sh->kv_kind;
    float kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM], qg[MAX_HEAD_DIM], s[BLOCK_TOKENS];
    init_states(states, sh);
    for (int h = 0; h < sh->num_kv_heads; h++) {
        for (int t = begin; t < end;) {
            const Block block = block_at(pages, t, end, sh);
            const int64_t token_stride = (int64_t)sh->num_kv_heads * D, first = block.first + (int64_t)h * D;
            for (int g = 0; g < G; g++) {
                const int64_t q_at = (int64_t)(h * G + g) * D;
                for (int d = 0; d < D; d++)
                    qg[d] = q_bf16 ? bf16_to_float(((const uint16_t *)q_row)[q_at + d]) : ((const float *)q_row)[q_at + d];
                float *state = states + (int64_t)(h * G + g) * state_floats(sh);
                for (int j = 0; j < block.n; j++) {
                    for (int d = 0; d < D; d++) kf[d] = wide_load(k, sh->k_scales, first + j * token_stride, d, kind, D);
                    float dot = 0.0f;
                    for (int d = 0; d < D; d++) dot += qg[d] * kf[d];
                    s[j] = dot * sh->scale;
                }
                const float alpha = fold_scores(state, s, block.n);
                float *acc = state + 2;
                for (int d = 0; d < D; d++) acc[d] *= alpha;
                for (int j = 0; j < block.n; j++) {
                    for (int d = 0; d < D; d++) vf[d] = wide_load(v, sh->v_scales, first + j * token_stride, d, kind, D);
                    for (int d = 0; d < D; d++) acc[d] += s[j] * vf[d];
                }
            }
            t += block.n;
        }
    }
}

/* One request's keys over bf16 or int8 pages (sh->kv_kind), q in fp32 or (q_bf16) bf16. */
static void item_kv(const void *q_row, int q_bf16, const void *k, const void *v, const int32_t *pages, int begin,
                    int end, const Shape *sh, float *states, const NextItem *next) {
#ifdef HAVE_AVX512
    if (sh->head_dim % 16 == 0) {
        radixkv_item_narrow_avx512(q_row, k, v, pages, begin, end, sh, states, next);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (sh->head_dim % 8 == 0) {
        radixkv_item_avx2(q_row, k, v, pages, begin, end, sh, states, next, sh->kv_kind);
        return;
    }
#endif
    (void)next;
    item_kv_portable(q_row, q_bf16, k, v, pages, begin, end, sh, states);
}

HIDDEN void radixkv_item_f32_kv(const float *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                int end, const Shape *sh, float *states, const NextItem *next) {
    item_kv(q_row, 0, k, v, pages, begin, end, sh, states, next);
}

HIDDEN void radixkv_item_bf16_kv(const uint16_t *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                 int end, const Shape *sh, float *states, const NextItem *next) {
    item_kv(q_row, 1, k, v, pages, begin, end, sh, states, next);
}

/* fp32 compute over bf16 (kv_kind 2) or int8 (3, with scales) pages, widened on load. */
DEFINE_DECODE(radixkv_paged_decode_f32_kv, float, void, radixkv_item_f32_kv, radixkv_shared_item_f32_kv, merge_f32, 0,
              KV_PARAMS_WIDE, KV_ARGS_WIDE, KV_INIT_WIDE)

/* bf16 compute over int8 pages (kv_kind 3, with scales): q widened from bf16 in the item, the
 * output rounded to bf16 in the merge, as the bf16 kernel's. */
DEFINE_DECODE(radixkv_paged_decode_bf16_kv, uint16_t, void, radixkv_item_bf16_kv, radixkv_shared_item_bf16_kv, merge_bf16,
              0, KV_PARAMS_WIDE, KV_ARGS_WIDE, KV_INIT_BF16_INT8)

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
void radixkv_decode_limits(int32_t *max_head_dim, int32_t *max_group, int32_t *chunk_tokens) {
    *max_head_dim = MAX_HEAD_DIM;
    *max_group = MAX_GROUP;
    *chunk_tokens = CHUNK_TOKENS;
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

/* Round fp32 to the nearest int8 step, ties to even, as torch's round() does. */
static inline int8_t quantize_one(float x, float scale) {
    if (scale == 0.0f) return 0;
    float q = nearbyintf(x / scale);
    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
    return (int8_t)q;
}

/* int8 pages' scales stay in fp16's normal range (radixkv.cache.kv_dtype.FP16_MIN_NORMAL, FP16_MAX). */
#define FP16_MIN_NORMAL 0x1p-14f
#define FP16_MAX 65504.0f

/* One (token, kv head) row of head_dim floats into int8 with its fp16 scale, as quantize_int8. */
static void quantize_head(int8_t *dst, uint16_t *scale_out, const float *x, int head_dim) {
    float absmax = 0.0f;
    for (int d = 0; d < head_dim; d++) absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
    float wide = absmax / 127.0f;
    if (wide > 0.0f) wide = wide < FP16_MIN_NORMAL ? FP16_MIN_NORMAL : wide > FP16_MAX ? FP16_MAX : wide;
    *scale_out = float_to_fp16(wide);
    const float scale = fp16_to_float(*scale_out);
    for (int d = 0; d < head_dim; d++) dst[d] = quantize_one(x[d], scale);
}

/* Write fp32 rows of K and V into narrower pages (kind 2: bf16, rounded to nearest even; 3:
 * int8, each (token, kv head) row quantized symmetrically with scale absmax / 127, clamped
 * into fp16's normal range and rounded to fp16 into the scales, then the row quantized with
 * the rounded scale, as radixkv.cache.kv_dtype.quantize_int8 computes it, to the same bytes).
 * Row strides in floats; a negative slot means "do not store". */
void radixkv_store_kv_narrow(void *k_cache, void *v_cache, uint16_t *k_scales, uint16_t *v_scales, const float *k,
                             const float *v, int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots, int rows,
                             int num_kv_heads, int head_dim, int kind) {
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        for (int which = 0; which < 2; which++) {
            const float *src = which ? v + r * v_row_stride : k + r * k_row_stride;
            void *cache = which ? v_cache : k_cache;
            if (kind == 2) {
                uint16_t *dst = (uint16_t *)cache + slots[r] * row;
                for (int64_t i = 0; i < row; i++) dst[i] = float_to_bf16(src[i]);
                continue;
            }
            uint16_t *scales = (which ? v_scales : k_scales) + slots[r] * num_kv_heads;
            for (int h = 0; h < num_kv_heads; h++)
                quantize_head((int8_t *)cache + slots[r] * row + (int64_t)h * head_dim, scales + h, src + (int64_t)h * head_dim, head_dim);
        }
    }
}

/* radixkv_store_kv_narrow for bf16 rows into int8 pages: each head's row widened exactly to
 * fp32 first, as quantize_int8 widens it, so the same bytes. Row strides in elements. */
void radixkv_store_kv_narrow_bf16(void *k_cache, void *v_cache, uint16_t *k_scales, uint16_t *v_scales, const uint16_t *k,
                                  const uint16_t *v, int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots,
                                  int rows, int num_kv_heads, int head_dim) {
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    float wide[head_dim];
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        for (int which = 0; which < 2; which++) {
            const uint16_t *src = which ? v + r * v_row_stride : k + r * k_row_stride;
            int8_t *dst = (int8_t *)(which ? v_cache : k_cache) + slots[r] * row;
            uint16_t *scales = (which ? v_scales : k_scales) + slots[r] * num_kv_heads;
            for (int h = 0; h < num_kv_heads; h++) {
                for (int d = 0; d < head_dim; d++) wide[d] = bf16_to_float(src[(int64_t)h * head_dim + d]);
                quantize_head(dst + (int64_t)h * head_dim, scales + h, wide, head_dim);
            }
        }
    }
}
