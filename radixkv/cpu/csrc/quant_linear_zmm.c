/* Quantized linears (q8_0, q4_1) on 512-bit AVX-512 VNNI: quant_linear.c's contract (the same
 * int8 activations, the same fp32 steps per block, torch_quant_linear's bits) over records of
 * 16 output rows, so one zmm load feeds 16 rows and one vpdpbusd sums 4 inputs for all of them.
 *
 * Packed layout, per group g of 16 output rows (n padded to a multiple of 16 with zero rows), per
 * block b of 32 inputs, one contiguous record of whole cache lines:
 *   q8_0 (576 bytes): 8 chunks c of 64 bytes, chunk byte r * 4 + e = w[16g + r][32b + 4c + e] ^ 0x80
 *                     (w + 128 as u8: vpdpbusd takes u8 x s8, and 512-bit AVX-512 has no vpsignb);
 *                     then 16 fp32 scales (row r at lane r).
 *   q4_1 (384 bytes): 4 chunks c of 64 bytes, chunk byte r * 4 + e = q[16g + r][32b + 4c + e]
 *                     | q[16g + r][32b + 16 + 4c + e] << 4; then 16 fp32 scales, 16 fp32 mins.
 * q8_0's sum over w + 128 is 128 * sum(xq) too many: the int32 sums start at -128 * sum(xq), so
 * they end exact, as the AVX2 kernel's.
 */
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define ZGROUP 16      /* output rows interleaved in one record */
#define ZBLOCK 32      /* inputs per block */
#define ZROW_TILE 4    /* x rows that share each weight load */
#ifndef ZPREFETCH
#define ZPREFETCH 0 /* records ahead to prefetch; 0: the records stream in order, and the hardware
                     * prefetcher alone kept one-row calls faster than software prefetches did */
#endif
#define ZPASS_X_BYTES (192 << 10) /* x rows per pass over the weights: as many as stay in L2 */
#define ZSERIAL_ROWS 32           /* up to this many x rows are quantized before the threads start */

enum { ZFORMAT_Q8_0 = 0, ZFORMAT_Q4_1 = 1 };

static inline int64_t zrecord_bytes(int format) { return format == ZFORMAT_Q8_0 ? 512 + 64 : 256 + 128; }
static inline int64_t zquant_bytes(int format) { return format == ZFORMAT_Q8_0 ? 512 : 256; }
static inline int64_t zgroup_count(int n) { return (n + ZGROUP - 1) / ZGROUP; }

/* Whether this build has the kernel (the library is built for this CPU: -march=native). */
int radixkv_quant_zmm_runs(void) {
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of the packed form of an n x k weight (k % 32 == 0). */
int64_t radixkv_quant_zmm_packed_bytes(int format, int n, int k) {
    return zgroup_count(n) * (k / ZBLOCK) * zrecord_bytes(format);
}

/* Pack QuantWeight's tensors (quants: int8 [n][k] or uint8 [n][k / 2] with block j's quants
 * 0..15 in the low nibbles of bytes 0..15 and 16..31 in the high ones; scales, mins: fp32
 * [n][k / 32], mins q4_1 only) into the layout above. */
void radixkv_quant_zmm_pack(int format, const uint8_t *quants, const float *scales, const float *mins, int n, int k,
                            uint8_t *packed) {
    const int64_t nb = k / ZBLOCK, bytes = zrecord_bytes(format);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < zgroup_count(n); g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *record = packed + (g * nb + b) * bytes;
            float lanes[2 * ZGROUP];
            for (int r = 0; r < ZGROUP; r++) {
                const int64_t row = g * ZGROUP + r;
                const int live = row < n;
                lanes[r] = live ? scales[row * nb + b] : 0.0f;
                lanes[ZGROUP + r] = live && mins ? mins[row * nb + b] : 0.0f;
                if (format == ZFORMAT_Q8_0) {
                    for (int c = 0; c < 8; c++)
                        for (int e = 0; e < 4; e++)
                            record[c * 64 + r * 4 + e] = (uint8_t)((live ? quants[row * k + b * ZBLOCK + 4 * c + e] : 0) ^ 0x80);
                } else {
                    uint8_t q[ZBLOCK] = {0};
                    if (live) {
                        const uint8_t *src = quants + row * (k / 2) + b * (ZBLOCK / 2);
                        for (int j = 0; j < ZBLOCK / 2; j++) q[j] = src[j] & 0x0F, q[j + ZBLOCK / 2] = src[j] >> 4;
                    }
                    for (int c = 0; c < 4; c++)
                        for (int e = 0; e < 4; e++)
                            record[c * 64 + r * 4 + e] = (uint8_t)(q[4 * c + e] | (q[16 + 4 * c + e] << 4));
                }
            }
            memcpy(record + zquant_bytes(format), lanes, (format == ZFORMAT_Q8_0 ? 1 : 2) * ZGROUP * sizeof(float));
        }
}

/* Rows `ids` of the packed weight, dequantized to fp32 [count][k] as quant.dequantize does
 * (scale * q, then + min): a tied embedding's lookup. */
void radixkv_quant_zmm_dequant_rows(int format, const uint8_t *packed, int n, int k, const int64_t *ids, int count,
                                    float *out) {
    (void)n;
    const int64_t nb = k / ZBLOCK, bytes = zrecord_bytes(format);
    for (int i = 0; i < count; i++) {
        const int64_t g = ids[i] / ZGROUP;
        const int r = (int)(ids[i] % ZGROUP);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *record = packed + (g * nb + b) * bytes;
            float scale, min = 0.0f;
            memcpy(&scale, record + zquant_bytes(format) + r * sizeof(float), sizeof scale);
            if (format == ZFORMAT_Q4_1) memcpy(&min, record + zquant_bytes(format) + (ZGROUP + r) * sizeof(float), sizeof min);
            float *dst = out + (int64_t)i * k + b * ZBLOCK;
            for (int j = 0; j < ZBLOCK; j++) {
                if (format == ZFORMAT_Q8_0) {
                    dst[j] = scale * (float)(int8_t)(record[(j / 4) * 64 + r * 4 + j % 4] ^ 0x80);
                } else {
                    const uint8_t byte = record[((j % 16) / 4) * 64 + r * 4 + j % 4];
                    const float w = scale * (float)(j < 16 ? byte & 0x0F : byte >> 4);
                    dst[j] = w + min;
                }
            }
        }
    }
}

#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
/* One x row quantized as quant_linear.c's quantize_row does (scale = absmax / 127, q =
 * round_half_even(x * (1 / scale)), 0 for an all-zero block), plus each block's integer sum
 * (q8_0's correction) and scale * sum (q4_1's min term). */
static void zquantize_row(const void *x, int x_bf16, int k, int8_t *xq, float *xs, int32_t *xsum, float *xu) {
    for (int b = 0; b < k / ZBLOCK; b++) {
        __m512 v[2];
        for (int i = 0; i < 2; i++) {
            const int64_t at = (int64_t)b * ZBLOCK + 16 * i;
            if (x_bf16) {
                const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at)));
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
            } else {
                v[i] = _mm512_loadu_ps((const float *)x + at);
            }
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float scale = amax / 127.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        const __m512 by = _mm512_set1_ps(inverse);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], by)); /* MXCSR: half to even */
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], by));
        _mm_storeu_si128((__m128i *)(xq + (int64_t)b * ZBLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + (int64_t)b * ZBLOCK + 16), _mm512_cvtsepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        xs[b] = scale;
        xsum[b] = sum;
        xu[b] = scale * (float)sum;
    }
}

/* The activations of one call, quantized: row r's at r * k and r * nb. */
typedef struct {
    const int8_t *q;
    const float *s, *u;
    const int32_t *sum;
    int k, nb;
} ZQuantX;

static inline __m512i xword(const ZQuantX *x, int64_t row, int64_t at) {
    int32_t word;
    memcpy(&word, x->q + row * x->k + at, sizeof word);
    return _mm512_set1_epi32(word);
}

/* Sums of one group (16 outputs) for `rows` x rows from r0 (a constant after inlining, so the
 * sums stay in registers), over all blocks, in torch_quant_linear's order per output:
 * acc + (scale * sx) * float(dot), then (q4_1) + min * (sx * sum(xq)). */
static inline __attribute__((always_inline)) void zgroup(const uint8_t *group, int format, const ZQuantX *x, int64_t r0,
                                                         int rows, __m512 acc[ZROW_TILE]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t bytes = zrecord_bytes(format);
    for (int i = 0; i < ZROW_TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *record = group + b * bytes;
        if (ZPREFETCH)
            for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)record + ZPREFETCH * bytes + line, _MM_HINT_T0);
        __m512i dot[ZROW_TILE];
        if (format == ZFORMAT_Q8_0) {
            for (int i = 0; i < rows; i++) dot[i] = _mm512_set1_epi32(-128 * x->sum[(r0 + i) * x->nb + b]);
            for (int c = 0; c < 8; c++) {
                const __m512i w = _mm512_loadu_si512((const void *)(record + 64 * c));
                for (int i = 0; i < rows; i++) dot[i] = _mm512_dpbusd_epi32(dot[i], w, xword(x, r0 + i, b * ZBLOCK + 4 * c));
            }
        } else {
            for (int i = 0; i < rows; i++) dot[i] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i w = _mm512_loadu_si512((const void *)(record + 64 * c));
                const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                for (int i = 0; i < rows; i++) {
                    dot[i] = _mm512_dpbusd_epi32(dot[i], lo, xword(x, r0 + i, b * ZBLOCK + 4 * c));
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, xword(x, r0 + i, b * ZBLOCK + 16 + 4 * c));
                }
            }
        }
        const __m512 scales = _mm512_loadu_ps((const float *)(record + zquant_bytes(format)));
        for (int i = 0; i < rows; i++) {
            const __m512 scaled = _mm512_mul_ps(scales, _mm512_set1_ps(x->s[(r0 + i) * x->nb + b]));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(dot[i])));
        }
        if (format == ZFORMAT_Q4_1) {
            const __m512 mins = _mm512_loadu_ps((const float *)(record + zquant_bytes(format) + 64));
            for (int i = 0; i < rows; i++)
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(mins, _mm512_set1_ps(x->u[(r0 + i) * x->nb + b])));
        }
    }
}

static void ztile(const uint8_t *group, int format, const ZQuantX *x, int64_t r0, int rows, __m512 acc[ZROW_TILE]) {
    /* One copy per format and row count: both constant inside, so nothing spills. */
    if (format == ZFORMAT_Q8_0) {
        switch (rows) {
        case 4: zgroup(group, ZFORMAT_Q8_0, x, r0, 4, acc); break;
        case 3: zgroup(group, ZFORMAT_Q8_0, x, r0, 3, acc); break;
        case 2: zgroup(group, ZFORMAT_Q8_0, x, r0, 2, acc); break;
        default: zgroup(group, ZFORMAT_Q8_0, x, r0, 1, acc); break;
        }
    } else {
        switch (rows) {
        case 4: zgroup(group, ZFORMAT_Q4_1, x, r0, 4, acc); break;
        case 3: zgroup(group, ZFORMAT_Q4_1, x, r0, 3, acc); break;
        case 2: zgroup(group, ZFORMAT_Q4_1, x, r0, 2, acc); break;
        default: zgroup(group, ZFORMAT_Q4_1, x, r0, 1, acc); break;
        }
    }
}

/* acc + bias into y at `offset`, features [16g, 16g + live) (the rest is padding). */
static void zstore(__m512 acc, const float *bias, int live, void *y, int y_bf16, int64_t offset) {
    float lanes[ZGROUP];
    _mm512_storeu_ps(lanes, acc);
    for (int j = 0; j < live; j++) {
        const float v = bias ? lanes[j] + bias[j] : lanes[j];
        if (y_bf16) ((uint16_t *)y)[offset + j] = float_to_bf16(v);
        else ((float *)y)[offset + j] = v;
    }
}
#endif

/* radixkv_quant_linear's contract (quant_linear.c) over this file's packed layout: y [m][y_stride]
 * = x [m][x_stride] W^T (+ bias), fp32 or bf16 (x_bf16) in and out. Returns 1 where the kernel
 * does not run here or the shape is not one it takes, 2 where scratch memory ran out. */
int radixkv_quant_zmm_linear(int format, const void *x, int x_bf16, int64_t x_stride, int m, int k,
                             const uint8_t *packed, int n, const float *bias, void *y, int64_t y_stride,
                             int num_threads) {
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
    if (k % ZBLOCK != 0 || (format != ZFORMAT_Q8_0 && format != ZFORMAT_Q4_1) || m <= 0) return m == 0 ? 0 : 1;
    const int nb = k / ZBLOCK;
    char *scratch = malloc((size_t)m * k + (size_t)m * nb * 3 * sizeof(float));
    if (!scratch) return 2;
    float *xs = (float *)(scratch + (size_t)m * k);
    ZQuantX qx = {(int8_t *)scratch, xs, xs + (size_t)m * nb, (int32_t *)(xs + 2 * (size_t)m * nb), k, nb};
    const int64_t groups = zgroup_count(n), bytes = zrecord_bytes(format);
    int pass_rows = (int)(ZPASS_X_BYTES / k) / ZROW_TILE * ZROW_TILE;
    if (pass_rows < ZROW_TILE) pass_rows = ZROW_TILE;
    const size_t elem = x_bf16 ? 2 : 4;
#define ZQUANTIZE(r)                                                                                                \
    zquantize_row((const char *)x + (r) * x_stride * elem, x_bf16, k, (int8_t *)qx.q + (int64_t)(r) * k,              \
                  (float *)qx.s + (int64_t)(r) * nb, (int32_t *)qx.sum + (int64_t)(r) * nb, (float *)qx.u + (int64_t)(r) * nb)
    /* A decode step's few rows are quantized before the threads start: a barrier on a busy
     * machine can wait out another process's time slice. */
    const int serial_rows = m <= ZSERIAL_ROWS ? m : 0;
    for (int r = 0; r < serial_rows; r++) ZQUANTIZE(r);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial_rows) {
#pragma omp for schedule(static)
            for (int r = 0; r < m; r++) ZQUANTIZE(r);
        }
        for (int p0 = 0; p0 < m; p0 += pass_rows) {
            const int pass_end = p0 + pass_rows < m ? p0 + pass_rows : m;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *group = packed + g * nb * bytes;
                const int live = n - g * ZGROUP < ZGROUP ? (int)(n - g * ZGROUP) : ZGROUP;
                for (int r0 = p0; r0 < pass_end; r0 += ZROW_TILE) {
                    const int rows = pass_end - r0 < ZROW_TILE ? pass_end - r0 : ZROW_TILE;
                    __m512 acc[ZROW_TILE];
                    ztile(group, format, &qx, r0, rows, acc);
                    for (int i = 0; i < rows; i++)
                        zstore(acc[i], bias ? bias + g * ZGROUP : NULL, live, y, x_bf16, (r0 + i) * y_stride + g * ZGROUP);
                }
            }
        }
    }
#undef ZQUANTIZE
    free(scratch);
    return 0;
#else
    (void)format, (void)x, (void)x_bf16, (void)x_stride, (void)m, (void)k, (void)packed, (void)n;
    (void)bias, (void)y, (void)y_stride, (void)num_threads;
    return 1;
#endif
}
