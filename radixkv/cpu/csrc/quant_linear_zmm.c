/* Quantized linears (q8_0, q4_1) on 512-bit AVX-512 VNNI: quant_linear.c's contract (the same
 * int8 activations, the same fp32 steps per block, torch_quant_linear's bits) over records of
 * 16 output rows, so one zmm load feeds 16 rows and one vpdpbusd sums 4 inputs for all of them.
 *
 * Packed layout, per group g of 16 output rows (n padded to a multiple of 16 with zero rows), per
 * block b of 32 inputs, one contiguous record (of whole cache lines but q8_0h's 8.5):
 *   q8_0 (576 bytes): 8 chunks c of 64 bytes, chunk byte r * 4 + e = w[16g + r][32b + 4c + e] ^ 0x80
 *                     (w + 128 as u8: vpdpbusd takes u8 x s8, and 512-bit AVX-512 has no vpsignb);
 *                     then 16 fp32 scales (row r at lane r).
 *   q8_0h (544 bytes), q4_1h (320 bytes): q8_0's and q4_1's chunks, then their scales (and
 *                     mins) as fp16: a weight whose scales and mins are all fp16 (a GGUF's Q8_0,
 *                     Q5_0, Q4_0 and Q4_1) at the file's 8.5 and 5 bits a weight against 9 and 6;
 *                     widened in registers, exactly, so the sums are q8_0's and q4_1's bits.
 *   q4_1 (384 bytes): 4 chunks c of 64 bytes, chunk byte r * 4 + e = q[16g + r][32b + 4c + e]
 *                     | q[16g + r][32b + 16 + 4c + e] << 4; then 16 fp32 scales, 16 fp32 mins.
 * q8_0's sum over w + 128 is 128 * sum(xq) too many: the int32 sums start at -128 * sum(xq), so
 * they end exact, as the AVX2 kernel's.
 *
 * GGUF's Q4_K and Q6_K keep their super-blocks of 256 inputs (no requantizing, about their own
 * bits per weight): per group g, per super-block s, one record of 8 sub-blocks j of 32 inputs:
 *   q4_k (2368 bytes): per j 256 bytes of nibbles as q4_1's; at 2048 the 6-bit scale codes
 *                     (byte 16j + r), at 2176 the min codes, at 2304 16 fp16 d, at 2336 16 fp16
 *                     -dmin (the file's own values, widened exactly in registers). Block j's
 *                     scale d * sc and min -dmin * m are q4_1's, exact in fp32, so the sums are
 *                     q4_1's bits (quant.py converts Q4_K the same way).
 *   q6_k (3360 bytes, the file's own size): per j 384 bytes: 4 chunks of low nibbles as
 *                     q4_1's, then two 64-byte chunks of the top 2 bits (chunk h, byte r * 4 + e: bits 2c..2c+1 hold
 *                     input 32j + 16h + 4c + e); at 3072 the int8 scales of each 16 inputs
 *                     (byte 16 (2j + h) + r); at 3328 16 fp16 d. A block's integer sum is
 *                     sc_lo * dot_lo + sc_hi * dot_hi over w = q - 32 (|sum| < 2^24: exact in
 *                     fp32), then acc + (d * sx) * float(sum), as torch_quant_linear does with
 *                     w = sc * (q - 32) and scale d.
 */
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define ZGROUP 16      /* output rows interleaved in one record */
#define ZBLOCK 32      /* inputs per block */
#ifndef ZROW_TILE
#define ZROW_TILE 4    /* x rows that share each weight load (4 or 8) */
#endif
#ifndef ZPREFETCH
#define ZPREFETCH 0 /* records ahead to prefetch; 0: the records stream in order, and the hardware
                     * prefetcher alone kept one-row calls faster than software prefetches did */
#endif
#define ZPASS_X_BYTES (192 << 10) /* x rows per pass over the weights: as many as stay in L2 */
#define ZSERIAL_ROWS 32           /* up to this many x rows are quantized before the threads start */

#define ZSUPER 256     /* inputs per Q4_K / Q6_K super-block */

enum { ZFORMAT_Q8_0 = 0, ZFORMAT_Q4_1 = 1, ZFORMAT_Q4_K = 2, ZFORMAT_Q6_K = 3, ZFORMAT_Q8_0H = 4, ZFORMAT_Q4_1H = 5 };

static inline int zsuper_format(int format) { return format == ZFORMAT_Q4_K || format == ZFORMAT_Q6_K; }
static inline int zbytes_format(int format) { return format == ZFORMAT_Q8_0 || format == ZFORMAT_Q8_0H; }
static inline int zhalf_format(int format) { return format == ZFORMAT_Q8_0H || format == ZFORMAT_Q4_1H; }
static inline int zmins_format(int format) { return format == ZFORMAT_Q4_1 || format == ZFORMAT_Q4_1H; }
/* Bytes of one record: of 32 inputs (q8_0, q4_1) or of a super-block (q4_k, q6_k). */
static inline int64_t zrecord_bytes(int format) {
    switch (format) {
    case ZFORMAT_Q8_0: return 512 + 64;
    case ZFORMAT_Q8_0H: return 512 + 32;
    case ZFORMAT_Q4_1H: return 256 + 64;
    case ZFORMAT_Q4_1: return 256 + 128;
    case ZFORMAT_Q4_K: return 8 * 256 + 256 + 64;
    default: return 8 * 384 + 256 + 32;
    }
}
static inline int64_t zquant_bytes(int format) { return zbytes_format(format) ? 512 : 256; }
static inline int64_t zgroup_count(int n) { return (n + ZGROUP - 1) / ZGROUP; }
/* Bytes of one group's records over all k inputs. */
static inline int64_t zgroup_bytes(int format, int k) {
    return (zsuper_format(format) ? k / ZSUPER : k / ZBLOCK) * zrecord_bytes(format);
}
static inline int zformat_takes(int format, int k) {
    return format >= ZFORMAT_Q8_0 && format <= ZFORMAT_Q4_1H && k % (zsuper_format(format) ? ZSUPER : ZBLOCK) == 0;
}

/* A super-block of row `row` (GGUF's bytes, src) decoded: u [256] unsigned quants (q4_k: 0..15,
 * q6_k: 0..63), codes [16] (q4_k: 8 scale codes then 8 min codes; q6_k: 16 int8 scales), and
 * d, dmin as fp32. GGUF's element order, as csrc/moe.c reads it. quant_linear.c packs q6_k with it too. */
void radixkv_quant_decode_super(int format, const uint8_t *src, uint8_t u[ZSUPER], int codes[16], float *d, float *dmin) {
    uint16_t half;
    if (format == ZFORMAT_Q4_K) {
        memcpy(&half, src, 2), *d = fp16_to_float(half);
        memcpy(&half, src + 2, 2), *dmin = fp16_to_float(half);
        const uint8_t *s = src + 4, *qs = src + 16;
        for (int j = 0; j < 8; j++) {
            if (j < 4) codes[j] = s[j] & 63, codes[8 + j] = s[j + 4] & 63;
            else codes[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), codes[8 + j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            for (int l = 0; l < 32; l++) u[32 * j + l] = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0x0F;
        }
    } else {
        const uint8_t *ql = src, *qh = src + 128;
        memcpy(&half, src + 208, 2), *d = fp16_to_float(half), *dmin = 0.0f;
        for (int i = 0; i < 16; i++) codes[i] = (int8_t)src[192 + i];
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++)
                    u[128 * h + 32 * g + l] = (uint8_t)(((ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 0x0F) |
                                                        (((qh[32 * h + l] >> (2 * g)) & 3) << 4));
    }
}

/* Record s of group g from the GGUF rows (quants: n rows of k / 256 super-blocks). */
static void zpack_super(int format, const uint8_t *quants, int n, int k, int64_t g, int64_t s, uint8_t *record) {
    const int64_t row_bytes = (k / ZSUPER) * (format == ZFORMAT_Q4_K ? 144 : 210);
    const int q6 = format == ZFORMAT_Q6_K, sub = q6 ? 384 : 256, tail = 8 * sub;
    uint16_t lanes[2 * ZGROUP]; /* d, then -dmin: the file's fp16 bits (a sign flip is exact) */
    memset(record, 0, zrecord_bytes(format));
    for (int r = 0; r < ZGROUP; r++) {
        const int64_t row = g * ZGROUP + r;
        uint8_t u[ZSUPER] = {0};
        int codes[16] = {0};
        float d = 0.0f, dmin = 0.0f;
        uint16_t half_d = 0, half_dmin = 0;
        if (row < n) {
            const uint8_t *src = quants + row * row_bytes + s * (format == ZFORMAT_Q4_K ? 144 : 210);
            radixkv_quant_decode_super(format, src, u, codes, &d, &dmin);
            memcpy(&half_d, src + (q6 ? 208 : 0), 2);
            if (!q6) memcpy(&half_dmin, src + 2, 2);
        }
        lanes[r] = half_d, lanes[ZGROUP + r] = (uint16_t)(half_dmin ^ 0x8000);
        for (int j = 0; j < 8; j++) {
            uint8_t *block = record + j * sub;
            const uint8_t *q = u + 32 * j;
            for (int c = 0; c < 4; c++)
                for (int e = 0; e < 4; e++) {
                    block[c * 64 + r * 4 + e] = (uint8_t)((q[4 * c + e] & 0x0F) | ((q[16 + 4 * c + e] & 0x0F) << 4));
                    if (q6)
                        for (int h = 0; h < 2; h++) block[256 + h * 64 + r * 4 + e] |= (uint8_t)(((q[16 * h + 4 * c + e] >> 4) & 3) << (2 * c));
                }
            if (q6) {
                record[tail + 16 * (2 * j) + r] = (uint8_t)(int8_t)codes[2 * j];
                record[tail + 16 * (2 * j + 1) + r] = (uint8_t)(int8_t)codes[2 * j + 1];
            } else {
                record[tail + 16 * j + r] = (uint8_t)codes[j];
                record[tail + 128 + 16 * j + r] = (uint8_t)codes[8 + j];
            }
        }
    }
    memcpy(record + tail + 256, lanes, (q6 ? 1 : 2) * ZGROUP * sizeof(uint16_t));
}

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
    return zformat_takes(format, k) ? zgroup_count(n) * zgroup_bytes(format, k) : 0;
}

/* Pack QuantWeight's tensors (quants: int8 [n][k] or uint8 [n][k / 2] with block j's quants
 * 0..15 in the low nibbles of bytes 0..15 and 16..31 in the high ones; scales, mins: fp32
 * [n][k / 32] (q8_0h, q4_1h: fp16), mins q4_1 only; q4_k, q6_k: the GGUF's blocks, row after
 * row, no scales) into the layout above. */
void radixkv_quant_zmm_pack(int format, const uint8_t *quants, const float *scales, const float *mins, int n, int k,
                            uint8_t *packed) {
    if (zsuper_format(format)) {
        const int64_t supers = k / ZSUPER;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < zgroup_count(n); g++)
            for (int64_t s = 0; s < supers; s++)
                zpack_super(format, quants, n, k, g, s, packed + g * zgroup_bytes(format, k) + s * zrecord_bytes(format));
        return;
    }
    const int64_t nb = k / ZBLOCK, bytes = zrecord_bytes(format);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < zgroup_count(n); g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *record = packed + (g * nb + b) * bytes;
            float lanes[2 * ZGROUP];
            uint16_t halves[2 * ZGROUP];
            const int half = zhalf_format(format);
            for (int r = 0; r < ZGROUP; r++) {
                const int64_t row = g * ZGROUP + r;
                const int live = row < n;
                lanes[r] = live && !half ? scales[row * nb + b] : 0.0f;
                lanes[ZGROUP + r] = live && !half && mins ? mins[row * nb + b] : 0.0f;
                halves[r] = live && half ? ((const uint16_t *)scales)[row * nb + b] : 0;
                halves[ZGROUP + r] = live && half && mins ? ((const uint16_t *)mins)[row * nb + b] : 0;
                if (zbytes_format(format)) {
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
            const int fields = zmins_format(format) ? 2 : 1;
            if (half) memcpy(record + zquant_bytes(format), halves, fields * ZGROUP * sizeof(uint16_t));
            else memcpy(record + zquant_bytes(format), lanes, fields * ZGROUP * sizeof(float));
        }
}

/* Row r of a q4_k / q6_k group's records, dequantized: q4_k as q4_1 (scale * q, then + min),
 * q6_k as gguf does, (d * sc) * (q - 32). */
static void zdequant_super_row(int format, const uint8_t *group, int k, int r, float *dst) {
    const int q6 = format == ZFORMAT_Q6_K, sub = q6 ? 384 : 256, tail = 8 * sub;
    for (int64_t s = 0; s < k / ZSUPER; s++, dst += ZSUPER) {
        const uint8_t *record = group + s * zrecord_bytes(format);
        uint16_t half_d, half_negdmin = 0;
        memcpy(&half_d, record + tail + 256 + 2 * r, 2);
        memcpy(&half_negdmin, record + tail + 256 + 32 + 2 * r, q6 ? 0 : 2);
        const float d = fp16_to_float(half_d), negdmin = fp16_to_float(half_negdmin);
        for (int j = 0; j < 8; j++) {
            const uint8_t *block = record + j * sub;
            for (int l = 0; l < ZBLOCK; l++) {
                const int half = l / 16, c = (l % 16) / 4, e = l % 4;
                const uint8_t byte = block[c * 64 + r * 4 + e];
                int q = half ? byte >> 4 : byte & 0x0F;
                if (q6) {
                    q |= ((block[256 + half * 64 + r * 4 + e] >> (2 * c)) & 3) << 4;
                    const float scale = d * (float)(int8_t)record[tail + 16 * (2 * j + half) + r];
                    dst[32 * j + l] = scale * (float)(q - 32);
                } else {
                    const float scale = d * (float)record[tail + 16 * j + r];
                    const float min = negdmin * (float)record[tail + 128 + 16 * j + r];
                    const float w = scale * (float)q;
                    dst[32 * j + l] = w + min;
                }
            }
        }
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
        if (zsuper_format(format)) {
            zdequant_super_row(format, packed + g * zgroup_bytes(format, k), k, r, out + (int64_t)i * k);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *record = packed + (g * nb + b) * bytes;
            float scale, min = 0.0f;
            if (zhalf_format(format)) {
                uint16_t half[2] = {0, 0};
                memcpy(&half[0], record + zquant_bytes(format) + r * sizeof(uint16_t), sizeof(uint16_t));
                if (zmins_format(format)) memcpy(&half[1], record + zquant_bytes(format) + (ZGROUP + r) * sizeof(uint16_t), sizeof(uint16_t));
                scale = fp16_to_float(half[0]), min = fp16_to_float(half[1]);
            } else {
                memcpy(&scale, record + zquant_bytes(format) + r * sizeof(float), sizeof scale);
                if (zmins_format(format)) memcpy(&min, record + zquant_bytes(format) + (ZGROUP + r) * sizeof(float), sizeof min);
            }
            float *dst = out + (int64_t)i * k + b * ZBLOCK;
            for (int j = 0; j < ZBLOCK; j++) {
                if (zbytes_format(format)) {
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
static void zquantize_row(const void *x, int x_bf16, int k, int8_t *xq, float *xs, int32_t *xsum, float *xu, int32_t *xhalf) {
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
        const int low_sum = _mm512_reduce_add_epi32(q0), sum = low_sum + _mm512_reduce_add_epi32(q1);
        xhalf[2 * b] = low_sum, xhalf[2 * b + 1] = sum - low_sum; /* q6_k's offsets, per 16 inputs */
        xs[b] = scale;
        xsum[b] = sum;
        xu[b] = scale * (float)sum;
    }
}

/* The activations of one call, quantized: row r's at r * k and r * nb. */
typedef struct {
    const int8_t *q;
    const float *s, *u;
    const int32_t *sum, *half;
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
        if (zbytes_format(format)) {
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
        const __m512 scales = zhalf_format(format) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + zquant_bytes(format))))
                                                   : _mm512_loadu_ps((const float *)(record + zquant_bytes(format)));
        for (int i = 0; i < rows; i++) {
            const __m512 scaled = _mm512_mul_ps(scales, _mm512_set1_ps(x->s[(r0 + i) * x->nb + b]));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(dot[i])));
        }
        if (zmins_format(format)) {
            const __m512 mins = format == ZFORMAT_Q4_1H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + zquant_bytes(format) + 32)))
                                                        : _mm512_loadu_ps((const float *)(record + zquant_bytes(format) + 64));
            for (int i = 0; i < rows; i++)
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(mins, _mm512_set1_ps(x->u[(r0 + i) * x->nb + b])));
        }
    }
}

/* zgroup over q4_k / q6_k super-block records (layout above), the same steps per block of 32. */
static inline __attribute__((always_inline)) void zgroup_super(const uint8_t *group, int format, const ZQuantX *x,
                                                               int64_t r0, int rows, __m512 acc[ZROW_TILE]) {
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const int64_t bytes = zrecord_bytes(format);
    for (int i = 0; i < ZROW_TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < x->nb / 8; s++) {
        const uint8_t *record = group + s * bytes;
        if (format == ZFORMAT_Q4_K) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 2304)));
            const __m512 negdmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 2336)));
            for (int j = 0; j < 8; j++) {
                const int64_t b = s * 8 + j;
                const uint8_t *block = record + 256 * j;
                __m512i dot[ZROW_TILE];
                for (int i = 0; i < rows; i++) dot[i] = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(block + 64 * c));
                    const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                    for (int i = 0; i < rows; i++) {
                        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, xword(x, r0 + i, b * ZBLOCK + 4 * c));
                        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, xword(x, r0 + i, b * ZBLOCK + 16 + 4 * c));
                    }
                }
                const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(record + 2048 + 16 * j))));
                const __m512 min_codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(record + 2176 + 16 * j))));
                const __m512 scales = _mm512_mul_ps(d, codes), mins = _mm512_mul_ps(negdmin, min_codes); /* exact */
                for (int i = 0; i < rows; i++) {
                    const __m512 scaled = _mm512_mul_ps(scales, _mm512_set1_ps(x->s[(r0 + i) * x->nb + b]));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(dot[i])));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(mins, _mm512_set1_ps(x->u[(r0 + i) * x->nb + b])));
                }
            }
        } else {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 3328)));
            for (int j = 0; j < 8; j++) {
                const int64_t b = s * 8 + j;
                const uint8_t *block = record + 384 * j;
                const __m512i top0 = _mm512_loadu_si512((const void *)(block + 256)), top1 = _mm512_loadu_si512((const void *)(block + 320));
                __m512i dot_lo[ZROW_TILE], dot_hi[ZROW_TILE];
                for (int i = 0; i < rows; i++) {
                    /* sum (q - 32) x = sum q x - 32 sum x, per 16 inputs */
                    dot_lo[i] = _mm512_set1_epi32(-32 * x->half[(r0 + i) * 2 * x->nb + 2 * b]);
                    dot_hi[i] = _mm512_set1_epi32(-32 * x->half[(r0 + i) * 2 * x->nb + 2 * b + 1]);
                }
                for (int c = 0; c < 4; c++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(block + 64 * c));
                    /* bits 2c..2c+1 of each byte to bits 4..5; what crosses from the next byte is masked off */
                    const __m512i t0 = c < 2 ? _mm512_slli_epi16(top0, 4 - 2 * c) : _mm512_srli_epi16(top0, 2 * c - 4);
                    const __m512i t1 = c < 2 ? _mm512_slli_epi16(top1, 4 - 2 * c) : _mm512_srli_epi16(top1, 2 * c - 4);
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, low), _mm512_and_si512(t0, top));
                    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), low), _mm512_and_si512(t1, top));
                    for (int i = 0; i < rows; i++) {
                        dot_lo[i] = _mm512_dpbusd_epi32(dot_lo[i], lo, xword(x, r0 + i, b * ZBLOCK + 4 * c));
                        dot_hi[i] = _mm512_dpbusd_epi32(dot_hi[i], hi, xword(x, r0 + i, b * ZBLOCK + 16 + 4 * c));
                    }
                }
                const __m512i sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(record + 3072 + 32 * j)));
                const __m512i sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(record + 3072 + 32 * j + 16)));
                for (int i = 0; i < rows; i++) {
                    const __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(dot_lo[i], sc_lo), _mm512_mullo_epi32(dot_hi[i], sc_hi));
                    const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(x->s[(r0 + i) * x->nb + b]));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(sum)));
                }
            }
        }
    }
}

/* One copy per format and row count: both constant inside, so nothing spills. */
#if ZROW_TILE >= 8
#define ZWIDE_CASES(fn, F) case 8: fn(group, F, x, r0, 8, acc); break; case 7: fn(group, F, x, r0, 7, acc); break; \
                           case 6: fn(group, F, x, r0, 6, acc); break; case 5: fn(group, F, x, r0, 5, acc); break;
#else
#define ZWIDE_CASES(fn, F)
#endif
#define ZROW_CASES(fn, F)                                                                                              \
    switch (rows) {                                                                                                    \
    ZWIDE_CASES(fn, F)                                                                                                 \
    case 4: fn(group, F, x, r0, 4, acc); break;                                                                        \
    case 3: fn(group, F, x, r0, 3, acc); break;                                                                        \
    case 2: fn(group, F, x, r0, 2, acc); break;                                                                        \
    default: fn(group, F, x, r0, 1, acc); break;                                                                       \
    }
static void ztile(const uint8_t *group, int format, const ZQuantX *x, int64_t r0, int rows, __m512 acc[ZROW_TILE]) {
    switch (format) {
    case ZFORMAT_Q4_K: ZROW_CASES(zgroup_super, ZFORMAT_Q4_K) break;
    case ZFORMAT_Q6_K: ZROW_CASES(zgroup_super, ZFORMAT_Q6_K) break;
    case ZFORMAT_Q8_0: ZROW_CASES(zgroup, ZFORMAT_Q8_0) break;
    case ZFORMAT_Q8_0H: ZROW_CASES(zgroup, ZFORMAT_Q8_0H) break;
    case ZFORMAT_Q4_1H: ZROW_CASES(zgroup, ZFORMAT_Q4_1H) break;
    default: ZROW_CASES(zgroup, ZFORMAT_Q4_1) break;
    }
}
#undef ZROW_CASES
#undef ZWIDE_CASES

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
    if (!zformat_takes(format, k) || m <= 0) return m == 0 ? 0 : 1;
    const int nb = k / ZBLOCK;
    char *scratch = malloc((size_t)m * k + (size_t)m * nb * 5 * sizeof(float));
    if (!scratch) return 2;
    float *xs = (float *)(scratch + (size_t)m * k);
    ZQuantX qx = {(int8_t *)scratch, xs, xs + (size_t)m * nb, (int32_t *)(xs + 2 * (size_t)m * nb), (int32_t *)(xs + 3 * (size_t)m * nb), k, nb};
    const int64_t groups = zgroup_count(n), group_bytes = zgroup_bytes(format, k);
    int pass_rows = (int)(ZPASS_X_BYTES / k) / ZROW_TILE * ZROW_TILE;
    if (pass_rows < ZROW_TILE) pass_rows = ZROW_TILE;
    const size_t elem = x_bf16 ? 2 : 4;
#define ZQUANTIZE(r)                                                                                                \
    zquantize_row((const char *)x + (r) * x_stride * elem, x_bf16, k, (int8_t *)qx.q + (int64_t)(r) * k,              \
                  (float *)qx.s + (int64_t)(r) * nb, (int32_t *)qx.sum + (int64_t)(r) * nb, (float *)qx.u + (int64_t)(r) * nb, \
                  (int32_t *)qx.half + 2 * (int64_t)(r) * nb)
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
                const uint8_t *group = packed + g * group_bytes;
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
