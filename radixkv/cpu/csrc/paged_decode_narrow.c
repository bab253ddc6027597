/* Paged decode's item over pages narrower than the compute dtype, in 16-lane AVX-512 vectors:
 * bf16 or int8 pages under fp32 compute, int8 pages under bf16 compute (EngineConfig.kv_dtype).
 *
 * The AVX-512 item's three passes (q.k, one softmax over the chunk, p.v) over a span of kv heads
 * at a time. A block's K rows of one kv head are widened to fp32 once into an L1 buffer, so each
 * of the head's query rows takes plain fp32 dot products from there; a block's V dims are widened
 * as they are loaded, a few keys at a time. int8 rows stay integers through the widening (exact):
 * a key's fp16 scale multiplies its score, a value's scale its softmax weight, never an element.
 * The 8-lane item (paged_decode_avx2.c) does the same on CPUs without AVX-512.
 */
#include "decode.h"

#ifdef HAVE_AVX512

/* Shape.kv_kind: what the pages hold and what q is (paged_decode_avx2.c's KIND_* values). */
#define KIND_BF16_WIDE 2 /* bf16 pages, fp32 q */
#define KIND_INT8 3      /* int8 pages, fp32 q */
#define KIND_INT8_BF16 4 /* int8 pages, bf16 q */

static inline int kind_is_int8(const int kind) { return kind != KIND_BF16_WIDE; }

/* 16 page elements at `at` as floats: bf16 by a shift, int8 by two exact conversions. */
static inline __attribute__((always_inline)) __m512 load_wide(const char *at, const int kind) {
    if (kind == KIND_BF16_WIDE) return load16((const uint16_t *)at);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
}

/* 32 consecutive fp16 scales from `at`, those at or past `count` read as 0 (and not read). */
static inline __attribute__((always_inline)) __m512i scales_part(const uint16_t *at, int count) {
    const __mmask32 live = count >= 32 ? (__mmask32)0xffffffffu : count <= 0 ? 0 : (__mmask32)((1u << count) - 1);
    return _mm512_maskz_loadu_epi16(live, at);
}

/* The fp16 scales of kv head h over a block's n <= 16 keys as floats, 0 past n; `first`: the
 * block's first (token, kv head 0) scale, key j's kv head h at first[j * H + h]. Up to 8 kv heads
 * the block's scales are loaded whole, in four masked parts, and head h's picked by permutes: a
 * vector loaded from 16 scalar stores just made would wait for them to retire. */
static inline __attribute__((always_inline)) __m512 head_scales(const uint16_t *first, int n, int H, int h) {
    if (H <= 8) {
        const int count = n * H; /* <= 128 */
        const __m512i keys = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 14, 13, 12, 11, 10,
                                              9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i at = _mm512_add_epi16(_mm512_mullo_epi16(keys, _mm512_set1_epi16((short)H)), _mm512_set1_epi16((short)h));
        __m512i picked = _mm512_permutex2var_epi16(scales_part(first, count), at, scales_part(first + 32, count - 32));
        if (count > 64) { /* lanes whose index passes 63 take the parts from 64 */
            const __m512i upper = _mm512_permutex2var_epi16(scales_part(first + 64, count - 64), at,
                                                            scales_part(first + 96, count - 96));
            picked = _mm512_mask_mov_epi16(picked, _mm512_cmpge_epu16_mask(at, _mm512_set1_epi16(64)), upper);
        }
        return _mm512_cvtph_ps(_mm512_castsi512_si256(picked));
    }
    float picked[BLOCK_TOKENS] __attribute__((aligned(64)));
    for (int j = 0; j < BLOCK_TOKENS; j++) picked[j] = j < n ? fp16_to_float(first[(int64_t)j * H + h]) : 0.0f;
    return _mm512_load_ps(picked);
}

/* q_g . k_j over the widened key rows, 16 dims a lane: the lanes' sums are the scores. */
static inline __attribute__((always_inline)) __m512 wide_dot(const __m512 *q, const float *key, const int D) {
    __m512 dot = _mm512_mul_ps(q[0], _mm512_load_ps(key));
    for (int c = 1; c < D / 16; c++) dot = _mm512_fmadd_ps(q[c], _mm512_load_ps(key + 16 * c), dot);
    return dot;
}

/* Scores of one block's n <= 16 keys for kv head h's G query rows (q: the span's rows from the
 * head's first): s[g * SCORE_STRIDE + j] = scale * key scale_j * q_g . k_j, 0 past n. The keys
 * are widened into `wide` first; each row's 16 dot vectors and their sums stay in registers (a
 * full block's loop has no branch, so they do). key_scales: an int8 head's (head_scales). */
static inline __attribute__((always_inline)) void head_scores(const __m512 (*q)[MAX_HEAD_DIM / 16], const char *k0,
                                                              int64_t row_bytes, int n, const int D, const int G,
                                                              const int kind, float scale, __m512 key_scales,
                                                              float (*wide)[MAX_HEAD_DIM], float *s) {
    const int bytes = kind_is_int8(kind) ? 1 : 2;
    for (int j = 0; j < n; j++)
        for (int c = 0; c < D / 16; c++) _mm512_store_ps(wide[j] + 16 * c, load_wide(k0 + j * row_bytes + 16 * c * bytes, kind));
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const __m512 factor = _mm512_maskz_mov_ps(live, kind_is_int8(kind) ? _mm512_mul_ps(key_scales, _mm512_set1_ps(scale))
                                                                         : _mm512_set1_ps(scale));
    for (int g = 0; g < G; g++) {
        __m512 dots[16];
        if (n == BLOCK_TOKENS) {
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) dots[j] = wide_dot(q[g], wide[j], D);
        } else {
            for (int j = 0; j < 16; j++) dots[j] = j < n ? wide_dot(q[g], wide[j], D) : _mm512_setzero_ps();
        }
        _mm512_storeu_ps(s + g * SCORE_STRIDE, _mm512_mul_ps(sum_lanes_16(dots), factor));
    }
}

/* Adds `keys` consecutive keys' weighted values of kv head h into its G accumulators, 16 dims at
 * a time, each accumulator taking its keys in key order; w: the weights, row g's at
 * w[g * SCORE_STRIDE] (int8: already times each value's scale). */
static inline __attribute__((always_inline)) void head_values(__m512 (*acc)[MAX_HEAD_DIM / 16], const char *v_row,
                                                              int64_t row_bytes, int keys, const int D, const int G,
                                                              const int kind, const float *w) {
    const int bytes = kind_is_int8(kind) ? 1 : 2;
    for (int c = 0; c < D / 16; c++) {
        __m512 values[PREFETCH_KEYS];
        for (int i = 0; i < keys; i++) values[i] = load_wide(v_row + i * row_bytes + 16 * c * bytes, kind);
        for (int g = 0; g < G; g++) {
            __m512 a = acc[g][c];
            for (int i = 0; i < keys; i++) a = _mm512_fmadd_ps(_mm512_set1_ps(w[g * SCORE_STRIDE + i]), values[i], a);
            acc[g][c] = a;
        }
    }
}

/* The item: a span of kv heads at a time (every kv head where their query rows fit SPAN_ROWS,
 * with K and V requested a few blocks ahead, as the AVX-512 item does). head_dim % 16 == 0; D, G
 * and kind are constants in the hot instances. */
static inline __attribute__((always_inline)) void item_narrow_impl(const void *q_row, const void *k, const void *v,
                                                                   const int32_t *pages, int begin, int end,
                                                                   const Shape *sh, float *states, const NextItem *next,
                                                                   const int D, const int G, const int kind,
                                                                   const int fixed_heads) {
    const int H = fixed_heads ? fixed_heads : sh->num_kv_heads, n = end - begin;
    const int span = SPAN_ROWS / G, bytes = kind_is_int8(kind) ? 1 : 2;
    const int64_t row_bytes = (int64_t)H * D * bytes;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(pages, begin, end, sh, blocks);
    float s[SPAN_ROWS * SCORE_STRIDE] __attribute__((aligned(64)));
    float wide[BLOCK_TOKENS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    Prefetcher prefetcher;
    prefetcher_for_spans(&prefetcher, blocks, num_blocks, next, sh, (const char *)k, (const char *)v, bytes, H, span);
    for (int h0 = 0; h0 < H; h0 += span) {
        const int heads = H - h0 < span ? H - h0 : span, rows = heads * G;
        __m512 qv[SPAN_ROWS][MAX_HEAD_DIM / 16];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < D / 16; c++) {
                const int64_t at = (int64_t)(h0 * G + r) * D + 16 * c;
                qv[r][c] = kind == KIND_INT8_BF16 ? load16((const uint16_t *)q_row + at) : _mm512_loadu_ps((const float *)q_row + at);
            }
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n) {
            int steps = 0;
            for (int h = 0; h < heads; h++) {
                prefetch_block_share(&prefetcher, &steps, h, heads);
                const int64_t first = blocks[bi].first + (int64_t)(h0 + h) * D;
                const __m512 key_scales = kind_is_int8(kind)
                                              ? head_scales(sh->k_scales + blocks[bi].first / D, blocks[bi].n, H, h0 + h)
                                              : _mm512_setzero_ps();
                head_scores((const __m512(*)[MAX_HEAD_DIM / 16])qv + h * G, (const char *)k + first * bytes, row_bytes,
                            blocks[bi].n, D, G, kind, sh->scale, key_scales, wide, s + h * G * SCORE_STRIDE + offset);
            }
            prefetch_block_share(&prefetcher, &steps, 1, 1);
        }
        for (int r = 0; r < rows; r++) softmax_row(s + r * SCORE_STRIDE, n, states + (int64_t)(h0 * G + r) * (D + 2));
        if (kind_is_int8(kind)) /* each key's weight times its value's scale */
            for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n)
                for (int h = 0; h < heads; h++) {
                    const __mmask16 live = (__mmask16)((1u << blocks[bi].n) - 1);
                    const __m512 value_scales = head_scales(sh->v_scales + blocks[bi].first / D, blocks[bi].n, H, h0 + h);
                    for (int g = 0; g < G; g++) {
                        float *w = s + (h * G + g) * SCORE_STRIDE + offset;
                        _mm512_mask_storeu_ps(w, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, w), value_scales));
                    }
                }
        __m512 acc[SPAN_ROWS][MAX_HEAD_DIM / 16];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_setzero_ps();
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n)
            for (int j = 0; j < BLOCK_TOKENS; j += PREFETCH_KEYS) {
                prefetch_step(&prefetcher);
                const int keys = blocks[bi].n - j < PREFETCH_KEYS ? blocks[bi].n - j : PREFETCH_KEYS;
                for (int h = 0; keys > 0 && h < heads; h++) {
                    const char *v_row = (const char *)v + (blocks[bi].first + (int64_t)(h0 + h) * D + j * H * D) * bytes;
                    const float *w = s + h * G * SCORE_STRIDE + offset + j;
                    if (keys == PREFETCH_KEYS) head_values(acc + h * G, v_row, row_bytes, PREFETCH_KEYS, D, G, kind, w);
                    else head_values(acc + h * G, v_row, row_bytes, keys, D, G, kind, w);
                }
            }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(states + (int64_t)(h0 * G + r) * (D + 2) + 2 + 16 * c, acc[r][c]);
    }
}

#define ITEM_ARGS q_row, k, v, pages, begin, end, sh, states, next
#define KIND_CASE(KIND)                                                                          \
    case KIND:                                                                                   \
        if (default_model_shape(sh)) item_narrow_impl(ITEM_ARGS, 64, 3, KIND, 3);                \
        else if (sh->head_dim == 64) item_narrow_impl(ITEM_ARGS, 64, sh->group, KIND, 0);        \
        else if (sh->head_dim == 128) item_narrow_impl(ITEM_ARGS, 128, sh->group, KIND, 0);      \
        else item_narrow_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND, 0);                      \
        return;

/* sh->kv_kind 2, 3 or 4; head_dim % 16 == 0. The default model's shape runs with every count a
 * constant, head_dim 64 and 128 with theirs. */
HIDDEN void radixkv_item_narrow_avx512(const void *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                                       int end, const Shape *sh, float *states, const NextItem *next) {
    switch (sh->kv_kind) {
        KIND_CASE(KIND_BF16_WIDE)
        KIND_CASE(KIND_INT8)
        KIND_CASE(KIND_INT8_BF16)
    }
}

#endif
