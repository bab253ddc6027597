/* Grouped expert linears over MXFP4 blocks (ggml type 39, gpt-oss's experts; radixkv/cpu/mxfp4.py):
 * for each routed expert, y = x W_e^T + b_e for the rows of x routed to it, W_e read in place from
 * the stacked experts tensor (a memory map of the file). A work item is one expert's tile of
 * ROW_TILE output rows; each weight row is decoded once into a thread's fp32 buffer and multiplied
 * with every token routed to the expert, TOKENS at a time, so an expert's bytes are read once a call.
 *
 * A block is 17 bytes: an E8M0 scale byte e, then 16 bytes of E2M1 codes, the low nibbles values
 * 0..15 and the high ones 16..31. Code c means MXFP4_VALUES[c] (ggml's kvalues_mxfp4, the values
 * doubled) times 2^(e - 128), with ggml's bits for e < 2 (subnormal); every weight is exact in fp32.
 *
 * Arithmetic (mxfp4.py's torch_mxfp4_linear computes the same bits): x stays fp32. Per output, 16
 * fp32 lanes start at 0; for each 16 values i0..i0+15 in order, lane l = lane l + x[i0 + l] *
 * w[i0 + l] (the product rounded, then the sum: -std=c11 turns contraction off, and the vector
 * paths use separate multiplies and adds); then the lanes are halved 16 -> 8 -> 4 -> 2 -> 1 (lane
 * i + lane i + half), then the bias added. The AVX-512, AVX2 and portable paths run the same
 * per-lane operations, so they give the same bits; which one runs is the caller's choice.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define BLOCK_VALUES 32
#define BLOCK_BYTES 17
#define ROW_TILE 32 /* output rows a work item takes */
#define TOKENS 4    /* tokens a pass over a decoded row multiplies */

/* The paths compiled in, as bits of radixkv_moe_mxfp4_kernels(); mxfp4.py names them. */
enum { K_PORTABLE = 1, K_AVX2 = 2, K_AVX512 = 4 };

static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

int radixkv_moe_mxfp4_kernels(void) {
    int kernels = K_PORTABLE;
#ifdef HAVE_AVX2
    kernels |= K_AVX2;
#endif
#ifdef HAVE_AVX512
    kernels |= K_AVX512;
#endif
    return kernels;
}

static inline float half_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return scale;
}

/* A row of k values (k / 32 blocks) as fp32 into w. Exact, so the decode's own path never
 * changes a result. */
static void decode_row(const uint8_t *row, int k, float *w) {
    for (int b = 0; b < k / BLOCK_VALUES; b++) {
        const uint8_t *block = row + (int64_t)b * BLOCK_BYTES;
        const float scale = half_scale(block[0]);
        float *dst = w + (int64_t)b * BLOCK_VALUES;
#ifdef HAVE_AVX512
        const __m512 table = _mm512_loadu_ps(MXFP4_VALUES), s = _mm512_set1_ps(scale);
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 1)));
        const __m512i low = _mm512_and_si512(codes, _mm512_set1_epi32(15)), high = _mm512_srli_epi32(codes, 4);
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_permutexvar_ps(low, table), s));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_permutexvar_ps(high, table), s));
#else
        for (int i = 0; i < 16; i++) {
            dst[i] = MXFP4_VALUES[block[1 + i] & 15] * scale;
            dst[16 + i] = MXFP4_VALUES[block[1 + i] >> 4] * scale;
        }
#endif
    }
}

static inline float halve16(float lanes[16]) {
    for (int half = 8; half >= 1; half /= 2)
        for (int i = 0; i < half; i++) lanes[i] = lanes[i] + lanes[i + half];
    return lanes[0];
}

/* y[t] = the dot of w with x[t] for t < count, the order the file's comment gives. */
static void dots_portable(const float *w, const float *const *x, int count, int k, float *y) {
    for (int t = 0; t < count; t++) {
        float lanes[16] = {0};
        for (int i0 = 0; i0 < k; i0 += 16)
            for (int l = 0; l < 16; l++) lanes[l] = lanes[l] + x[t][i0 + l] * w[i0 + l];
        y[t] = halve16(lanes);
    }
}

#ifdef HAVE_AVX2
static void dots_avx2(const float *w, const float *const *x, int count, int k, float *y) {
    __m256 acc[TOKENS][2];
    for (int t = 0; t < count; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int i0 = 0; i0 < k; i0 += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i0), w1 = _mm256_loadu_ps(w + i0 + 8);
        for (int t = 0; t < count; t++) {
            acc[t][0] = _mm256_add_ps(acc[t][0], _mm256_mul_ps(_mm256_loadu_ps(x[t] + i0), w0));
            acc[t][1] = _mm256_add_ps(acc[t][1], _mm256_mul_ps(_mm256_loadu_ps(x[t] + i0 + 8), w1));
        }
    }
    for (int t = 0; t < count; t++) {
        float lanes[16];
        _mm256_storeu_ps(lanes, acc[t][0]);
        _mm256_storeu_ps(lanes + 8, acc[t][1]);
        y[t] = halve16(lanes);
    }
}
#endif

#ifdef HAVE_AVX512
static void dots_avx512(const float *w, const float *const *x, int count, int k, float *y) {
    __m512 acc[TOKENS];
    for (int t = 0; t < count; t++) acc[t] = _mm512_setzero_ps();
    for (int i0 = 0; i0 < k; i0 += 16) {
        const __m512 wv = _mm512_loadu_ps(w + i0);
        for (int t = 0; t < count; t++) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_loadu_ps(x[t] + i0), wv));
    }
    for (int t = 0; t < count; t++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[t]);
        y[t] = halve16(lanes);
    }
}
#endif

typedef void (*Dots)(const float *, const float *const *, int, int, float *);

static Dots pick(int kernel) {
    if (kernel == K_PORTABLE) return dots_portable;
#ifdef HAVE_AVX2
    if (kernel == K_AVX2) return dots_avx2;
#endif
#ifdef HAVE_AVX512
    if (kernel == K_AVX512) return dots_avx512;
#endif
    return NULL;
}

/* out[p] = x[x_rows[p]] W_e^T + bias_e for the pairs p of each expert e = experts[g] (offsets[g]
 * to offsets[g + 1]). weights: the stacked experts [E][n][k / 32 blocks], expert_bytes apart;
 * bias: [E][n] fp32 or NULL; out rows out_stride floats apart. kernel: one bit of
 * radixkv_moe_mxfp4_kernels(). Returns 0; 1 for a kernel not compiled in or k not whole blocks;
 * 2 out of memory. The caller checked the indices (experts, x_rows) against the tensors. */
int radixkv_moe_mxfp4(const uint8_t *weights, int64_t expert_bytes, int n, int k, const float *x, int64_t x_stride,
                      const int32_t *experts, const int32_t *offsets, int num_groups, const int32_t *x_rows,
                      const float *bias, float *out, int64_t out_stride, int num_threads, int kernel) {
    const Dots dots = pick(kernel);
    if (!dots || k <= 0 || k % BLOCK_VALUES || n <= 0) return 1;
    const int tiles = (n + ROW_TILE - 1) / ROW_TILE;
    const int64_t num_items = (int64_t)num_groups * tiles, row_bytes = (int64_t)k / BLOCK_VALUES * BLOCK_BYTES;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *w = aligned_alloc(64, ((size_t)k * sizeof(float) + 63) / 64 * 64);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_items; item++) {
            if (!w) continue;
            const int g = (int)(item / tiles), first = (int)(item % tiles) * ROW_TILE;
            const int last = first + ROW_TILE < n ? first + ROW_TILE : n, expert = experts[g];
            const uint8_t *rows = weights + expert * expert_bytes;
            for (int j = first; j < last; j++) {
                decode_row(rows + j * row_bytes, k, w);
                const float b = bias ? bias[(int64_t)expert * n + j] : 0.0f;
                for (int p = offsets[g]; p < offsets[g + 1]; p += TOKENS) {
                    const int count = offsets[g + 1] - p < TOKENS ? offsets[g + 1] - p : TOKENS;
                    const float *xs[TOKENS];
                    float y[TOKENS];
                    for (int t = 0; t < count; t++) xs[t] = x + x_rows[p + t] * x_stride;
                    dots(w, xs, count, k, y);
                    for (int t = 0; t < count; t++) out[(p + t) * out_stride + j] = bias ? y[t] + b : y[t];
                }
            }
        }
        free(w);
    }
    return failed ? 2 : 0;
}
