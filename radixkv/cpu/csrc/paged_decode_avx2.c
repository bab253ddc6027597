/* Paged decode's plain item in 8-lane AVX2 vectors, for CPUs without AVX-512 (Intel Haswell to
 * Alder Lake, AMD Zen 1-3): the three passes of paged_decode.c's AVX-512 item, over all kv heads
 * at once where their query rows fit.
 *
 * A row of head_dim values is held as head_dim / 8 float vectors. fp32 rows are in dim order;
 * a bf16 row's 16-dim chunk becomes (even dims, odd dims) by one shift and one mask, with no
 * shuffle. q and K take the same order, so their dot product needs no reordering, and the
 * output accumulators put the dims back in order once, at the end. bf16 and int8 pages under
 * fp32 compute (EngineConfig.kv_dtype) widen each 8-dim chunk in dim order on load.
 */
#include "decode.h"

#ifdef HAVE_AVX2

#define LANES 8
#define MAX_VECTORS (MAX_HEAD_DIM / LANES)

/* What an item's K and V rows hold (Shape.kv_kind; q and out are fp32 unless KIND_BF16):
 * KIND_F32 and KIND_BF16 as the compute dtype; KIND_BF16_WIDE bf16 pages under fp32 compute,
 * widened in dim order; KIND_INT8 int8 pages under fp32 compute, whose per-(token, kv head)
 * scales multiply each key's score and each value's weight rather than every element. */
#define KIND_F32 0
#define KIND_BF16 1
#define KIND_BF16_WIDE 2
#define KIND_INT8 3
#define KIND_INT8_BF16 4 /* int8 pages under bf16 compute: q widened from bf16 in dim order */

static inline int is_int8(const int kind) { return kind == KIND_INT8 || kind == KIND_INT8_BF16; }
static inline int kind_bytes(const int kind) { return kind == KIND_F32 ? 4 : is_int8(kind) ? 1 : 2; }

/* One load at `at`: 8 floats into low (fp32, or bf16 / int8 widened in dim order), or for
 * KIND_BF16 16 bf16 values as (even dims, odd dims) into low and high, by a shift and a mask. */
static inline __attribute__((always_inline)) void load_dims(const char *at, const int kind, __m256 *low,
                                                            __m256 *high) {
    if (kind == KIND_BF16) {
        const __m256i pairs = _mm256_loadu_si256((const __m256i *)at);
        *low = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        *high = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000u)));
    } else if (kind == KIND_BF16_WIDE) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at));
        *low = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    } else if (is_int8(kind)) {
        *low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
    } else {
        *low = _mm256_loadu_ps((const float *)at);
    }
}

/* The D values at `row` as D / 8 float vectors, in the order above: vector c starts 8 elements
 * (KIND_BF16: a pair of vectors, 16) after vector c - 1. */
static inline __attribute__((always_inline)) void row_vectors(const char *row, const int D, const int kind,
                                                              __m256 out[MAX_VECTORS]) {
    const int pairs = kind == KIND_BF16;
    for (int c = 0; c < D / 8; c += 1 + pairs) load_dims(row + 8 * kind_bytes(kind) * c, kind, &out[c], &out[c + pairs]);
}

/* Lane j of the result is the sum of the 8 lanes of v[j] (a transpose-and-add tree). */
static inline __m256 sum_lanes_8(const __m256 v[LANES]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* 128-bit halves apart */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Scores of one block's n <= 16 keys for the kv head's G query heads: s[g * SCORE_STRIDE + j] =
 * scale * q_g . k_j, 0 past n. A prefetch step every PREFETCH_KEYS keys, full block or not, as
 * the prefetcher's step count assumes. ks: KIND_INT8's fp16 scale of key 0, key j's H apart. */
static inline __attribute__((always_inline)) void block_scores(__m256 (*qv)[MAX_VECTORS], const char *k0,
                                                               int64_t row_bytes, int n, const int D, const int G,
                                                               const int kind, float scale, const uint16_t *ks, int H,
                                                               float *s, Prefetcher *prefetcher) {
    for (int j0 = 0; j0 < BLOCK_TOKENS; j0 += LANES) {
        __m256 dots[MAX_GROUP][LANES];
        for (int j = 0; j < LANES; j++) {
            if ((j0 + j) % PREFETCH_KEYS == 0) prefetch_step(prefetcher);
            if (j0 + j >= n) {
                for (int g = 0; g < G; g++) dots[g][j] = _mm256_setzero_ps();
                continue;
            }
            __m256 kv[MAX_VECTORS];
            row_vectors(k0 + (j0 + j) * row_bytes, D, kind, kv);
            for (int g = 0; g < G; g++) {
                __m256 dot = _mm256_mul_ps(qv[g][0], kv[0]);
                for (int c = 1; c < D / 8; c++) dot = _mm256_fmadd_ps(qv[g][c], kv[c], dot);
                dots[g][j] = dot;
            }
        }
        if (j0 < n) {
            __m256 factor = _mm256_set1_ps(scale);
            if (is_int8(kind)) {
                float key_scales[LANES];
                for (int j = 0; j < LANES; j++) key_scales[j] = j0 + j < n ? fp16_to_float(ks[(int64_t)(j0 + j) * H]) * scale : 0.0f;
                factor = _mm256_loadu_ps(key_scales);
            }
            for (int g = 0; g < G; g++) _mm256_storeu_ps(s + g * SCORE_STRIDE + j0, _mm256_mul_ps(sum_lanes_8(dots[g]), factor));
        }
    }
}

/* Adds `keys` consecutive keys' weighted values into the G accumulators, 8 dims (KIND_BF16: 16,
 * one load, two vectors) at a time; each accumulator takes its keys in key order. vs:
 * KIND_INT8's fp16 scale of the first key, key i's H apart (it scales the key's weight). */
static inline __attribute__((always_inline)) void keys_values(__m256 (*acc)[MAX_VECTORS], const char *v_row,
                                                              int64_t row_bytes, int keys, const int D, const int G,
                                                              const int kind, const float *w, const uint16_t *vs, int H) {
    const int pairs = kind == KIND_BF16;
    float value_scales[PREFETCH_KEYS];
    for (int i = 0; i < keys; i++) value_scales[i] = is_int8(kind) ? fp16_to_float(vs[(int64_t)i * H]) : 1.0f;
    for (int c = 0; c < D / 8; c += 1 + pairs) {
        __m256 low[PREFETCH_KEYS], high[PREFETCH_KEYS];
        for (int i = 0; i < keys; i++) load_dims(v_row + i * row_bytes + 8 * kind_bytes(kind) * c, kind, &low[i], &high[i]);
        for (int g = 0; g < G; g++) {
            __m256 a0 = acc[g][c], a1 = pairs ? acc[g][c + 1] : a0;
            for (int i = 0; i < keys; i++) {
                const float weight_of = is_int8(kind) ? w[g * SCORE_STRIDE + i] * value_scales[i] : w[g * SCORE_STRIDE + i];
                const __m256 weight = _mm256_set1_ps(weight_of);
                a0 = _mm256_fmadd_ps(weight, low[i], a0);
                if (pairs) a1 = _mm256_fmadd_ps(weight, high[i], a1);
            }
            acc[g][c] = a0;
            if (pairs) acc[g][c + 1] = a1;
        }
    }
}

/* One block's n <= 16 keys into the accumulators, PREFETCH_KEYS at a time with a prefetch step
 * before each; w: the block's weights, query head g's at w[g * SCORE_STRIDE]. */
static inline __attribute__((always_inline)) void block_values(__m256 (*acc)[MAX_VECTORS], const char *v0,
                                                               int64_t row_bytes, int n, const int D, const int G,
                                                               const int kind, const float *w, const uint16_t *vs, int H,
                                                               Prefetcher *prefetcher) {
    for (int j = 0; j < BLOCK_TOKENS; j += PREFETCH_KEYS) {
        prefetch_step(prefetcher);
        const uint16_t *at = vs ? vs + (int64_t)j * H : NULL;
        if (n - j >= PREFETCH_KEYS) keys_values(acc, v0 + j * row_bytes, row_bytes, PREFETCH_KEYS, D, G, kind, w + j, at, H);
        else if (n > j) keys_values(acc, v0 + j * row_bytes, row_bytes, n - j, D, G, kind, w + j, at, H);
    }
}

/* An accumulator row back to dim order into out: KIND_BF16's (even, odd) vector pairs interleave. */
static inline __attribute__((always_inline)) void store_output(const __m256 acc[MAX_VECTORS], const int D,
                                                               const int kind, float *out) {
    const int pairs = kind == KIND_BF16;
    for (int c = 0; c < D / 8; c += 1 + pairs) {
        if (!pairs) {
            _mm256_storeu_ps(out + 8 * c, acc[c]);
            continue;
        }
        const __m256 low = _mm256_unpacklo_ps(acc[c], acc[c + 1]), high = _mm256_unpackhi_ps(acc[c], acc[c + 1]);
        _mm256_storeu_ps(out + 8 * c, _mm256_permute2f128_ps(low, high, 0x20));
        _mm256_storeu_ps(out + 8 * c + 8, _mm256_permute2f128_ps(low, high, 0x31));
    }
}

/* The item: q.k for all the chunk's keys, one softmax over the chunk (no running max, no
 * rescaling), then p.v. Where all kv heads' query rows fit the buffers (H * G <= MAX_GROUP) one
 * pass takes every kv head, so each block's K rows, then its V rows, are read once, in address
 * order, with requests a few blocks ahead; otherwise one pass a kv head, with the next item
 * requested meanwhile. Query row r of a pass over kv heads [h0, ...) is h0 * G + r. D, G and
 * kind are constants in the hot instances. */
static inline __attribute__((always_inline)) void item_avx2_impl(const void *q_row, const void *k, const void *v,
                                                                 const int32_t *pages, int begin, int end,
                                                                 const Shape *sh, float *states, const NextItem *next,
                                                                 const int D, const int G, const int kind,
                                                                 const int fixed_heads) {
    const int H = fixed_heads ? fixed_heads : sh->num_kv_heads, n = end - begin, bytes = kind_bytes(kind);
    const int q_kind = kind == KIND_BF16 ? KIND_BF16 : kind == KIND_INT8_BF16 ? KIND_BF16_WIDE : KIND_F32;
    const int q_bytes = kind_bytes(q_kind);
    const int64_t row_bytes = (int64_t)H * D * bytes;
    const int heads_per_pass = H * G <= MAX_GROUP ? H : 1, rows = heads_per_pass * G;
    Block blocks[CHUNK_TOKENS];
    const int num_blocks = chunk_blocks(pages, begin, end, sh, blocks);
    const int steps = 2 * H * num_blocks * STEPS_PER_BLOCK;
    float s[MAX_GROUP * SCORE_STRIDE] __attribute__((aligned(32)));
    Prefetcher prefetcher;
    prefetcher_for_item(&prefetcher, blocks, num_blocks, next, sh, (const char *)k, (const char *)v, bytes, steps,
                        heads_per_pass == H);
    for (int h0 = 0; h0 < H; h0 += heads_per_pass) {
        __m256 qv[MAX_GROUP][MAX_VECTORS], acc[MAX_GROUP][MAX_VECTORS];
        float *first_state = states + (int64_t)h0 * G * (D + 2);
        for (int r = 0; r < rows; r++) row_vectors((const char *)q_row + (int64_t)(h0 * G + r) * D * q_bytes, D, q_kind, qv[r]);
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n)
            for (int h = 0; h < heads_per_pass; h++) {
                /* The block's first key's scale for kv head h0 + h: block.first / D is its slot's
                 * first (token, kv head) pair. */
                const uint16_t *ks = is_int8(kind) ? sh->k_scales + blocks[bi].first / D + h0 + h : NULL;
                block_scores(qv + h * G, (const char *)k + (blocks[bi].first + (int64_t)(h0 + h) * D) * bytes, row_bytes,
                             blocks[bi].n, D, G, kind, sh->scale, ks, H, s + h * G * SCORE_STRIDE + offset, &prefetcher);
            }
        for (int r = 0; r < rows; r++) {
            softmax_row_avx2(s + r * SCORE_STRIDE, n, first_state + (int64_t)r * (D + 2));
            for (int c = 0; c < D / 8; c++) acc[r][c] = _mm256_setzero_ps();
        }
        for (int bi = 0, offset = 0; bi < num_blocks; offset += blocks[bi++].n)
            for (int h = 0; h < heads_per_pass; h++) {
                const uint16_t *vs = is_int8(kind) ? sh->v_scales + blocks[bi].first / D + h0 + h : NULL;
                block_values(acc + h * G, (const char *)v + (blocks[bi].first + (int64_t)(h0 + h) * D) * bytes, row_bytes,
                             blocks[bi].n, D, G, kind, s + h * G * SCORE_STRIDE + offset, vs, H, &prefetcher);
            }
        for (int r = 0; r < rows; r++) store_output(acc[r], D, kind, first_state + (int64_t)r * (D + 2) + 2);
    }
}

#define ITEM_ARGS q_row, k, v, pages, begin, end, sh, states, next

/* The default model's shape runs as an instance with every count a constant. kind: KIND_*. */
HIDDEN void radixkv_item_avx2(const void *q_row, const void *k, const void *v, const int32_t *pages, int begin,
                              int end, const Shape *sh, float *states, const NextItem *next, int kind) {
    const int fixed = default_model_shape(sh);
    switch (kind) {
    case KIND_BF16:
        if (fixed) item_avx2_impl(ITEM_ARGS, 64, 3, KIND_BF16, 3);
        else item_avx2_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND_BF16, 0);
        break;
    case KIND_BF16_WIDE:
        if (fixed) item_avx2_impl(ITEM_ARGS, 64, 3, KIND_BF16_WIDE, 3);
        else item_avx2_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND_BF16_WIDE, 0);
        break;
    case KIND_INT8:
        if (fixed) item_avx2_impl(ITEM_ARGS, 64, 3, KIND_INT8, 3);
        else item_avx2_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND_INT8, 0);
        break;
    case KIND_INT8_BF16:
        item_avx2_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND_INT8_BF16, 0);
        break;
    default:
        if (fixed) item_avx2_impl(ITEM_ARGS, 64, 3, KIND_F32, 3);
        else item_avx2_impl(ITEM_ARGS, sh->head_dim, sh->group, KIND_F32, 0);
    }
}

#endif
