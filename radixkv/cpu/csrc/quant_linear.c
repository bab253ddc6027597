/* Linear layers over quantized weights (radixkv/cpu/quant.py's q8_0 and q4_1), multiplied with
 * activations quantized per row and block of 32 to int8 in integer dot products: AVX2's
 * vpmaddubsw + vpmaddwd, or AVX-512 VNNI's vpdpbusd (on the same 256-bit records, with
 * AVX512VL: one instruction for the AVX2 kernel's three). y = x W^T (+ b), y in x's dtype.
 * No AMX-INT8 kernel yet: a tile product per block of 32 must add each block under its own scale,
 * and no machine with AMX was at hand to test one.
 *
 * A CPU decode step reads every weight once, so its speed is the weight's bytes over memory
 * bandwidth: 9 (q8_0) or 6 (q4_1) bits a weight as packed here, scales included, against
 * fp32's 32. The integer sums are exact, and each output's fp32 sum takes its blocks in order
 * with the steps torch_quant_linear documents (quant_linear.py), no fused multiply-adds: every
 * kernel, and the torch path, compute the same bits, and a row's bits never depend on how many
 * rows the call has.
 *
 * Packed layout, per group g of 8 output rows (n padded to a multiple of 8 with zero rows), per
 * block b of 32 inputs, one contiguous record (the whole weight is one stream per thread):
 *   q8_0 (288 bytes): 8 chunks c of 32 bytes, chunk byte r * 4 + e = w[8g + r][32b + 4c + e];
 *                     then 8 fp32 scales (row r at lane r).
 *   q4_1 (192 bytes): 4 chunks c of 32 bytes, chunk byte r * 4 + e = q[8g + r][32b + 4c + e]
 *                     | q[8g + r][32b + 16 + 4c + e] << 4; then 8 fp32 scales, 8 fp32 mins.
 *   q8_0h (272 bytes), q4_1h (160 bytes): q8_0's and q4_1's chunks, then their scales (and
 *                     mins) as fp16: a weight whose scales and mins are all fp16 (a GGUF's Q8_0,
 *                     Q5_0, Q4_0, Q4_1), at the file's 8.5 and 5 bits a weight against 9 and 6;
 *                     widened exactly, so the sums are q8_0's and q4_1's bits.
 *   q6_k (304 bytes): q8_0's chunks of q - 32 (packed from the GGUF's Q6_K blocks); then the int8
 *                     scales of inputs 0..15 (8 bytes, row r at byte r) and of 16..31, then 8
 *                     fp32 d. The block's integer sum is sc_lo * dot_lo + sc_hi * dot_hi, then
 *                     acc + (d * sx) * float(sum): torch_quant_linear's q6_k steps. (q4_k runs
 *                     here as its q4_1 form, the same bits.)
 * One 32-byte load holds 4 inputs of 8 rows: against x's 4 inputs broadcast to every lane, a
 * lane's dot product is its row's, so 8 outputs sum in 8 lanes with no horizontal adds.
 */
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define QGROUP 8       /* output rows interleaved in one record */
#define QBLOCK 32      /* inputs per block: one scale (and min) per block */
#define ROW_TILE 4     /* x rows that share each weight load */
#define GROUP_X_BYTES (192 << 10) /* x rows per pass over the weights: as many as stay in L2 */
#define SERIAL_QUANTIZE_ROWS 32   /* up to this many x rows are quantized before the threads start */

enum { FORMAT_Q8_0 = 0, FORMAT_Q4_1 = 1, FORMAT_Q6_K = 3, FORMAT_Q8_0H = 4, FORMAT_Q4_1H = 5 };

static inline int half_format(int format) { return format == FORMAT_Q8_0H || format == FORMAT_Q4_1H; }
/* q8_0h and q4_1h multiply as q8_0 and q4_1: only their scales' width differs. */
static inline int base_format(int format) {
    return format == FORMAT_Q8_0H ? FORMAT_Q8_0 : (format == FORMAT_Q4_1H ? FORMAT_Q4_1 : format);
}
static inline int64_t record_bytes(int format) {
    switch (format) {
    case FORMAT_Q8_0: return 256 + 32;
    case FORMAT_Q8_0H: return 256 + 16;
    case FORMAT_Q6_K: return 256 + 16 + 32;
    case FORMAT_Q4_1H: return 128 + 32;
    default: return 128 + 64;
    }
}
static inline int64_t quant_bytes(int format) { return base_format(format) == FORMAT_Q4_1 ? 128 : 256; }
static inline int64_t group_count(int n) { return (n + QGROUP - 1) / QGROUP; }

/* Bytes of the packed form of an n x k weight (k % 32 == 0). */
int64_t radixkv_quant_packed_bytes(int format, int n, int k) {
    if (format == FORMAT_Q6_K && k % 256 != 0) return 0;
    return group_count(n) * (k / QBLOCK) * record_bytes(format);
}

/* q6_k's records of group g, super-block s, from the GGUF's rows (210 bytes a super-block). */
static void pack_q6_k(const uint8_t *quants, int n, int k, int64_t g, int64_t s, uint8_t *packed) {
    const int64_t nb = k / QBLOCK, bytes = record_bytes(FORMAT_Q6_K), row_bytes = (k / 256) * 210;
    for (int r = 0; r < QGROUP; r++) {
        const int64_t row = g * QGROUP + r;
        uint8_t u[256] = {0};
        int codes[16] = {0};
        float d = 0.0f, dmin;
        if (row < n) radixkv_quant_decode_super(FORMAT_Q6_K, quants + row * row_bytes + s * 210, u, codes, &d, &dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t *record = packed + (g * nb + s * 8 + j) * bytes;
            for (int c = 0; c < 8; c++)
                for (int e = 0; e < 4; e++) record[c * 32 + r * 4 + e] = row < n ? (uint8_t)(int8_t)(u[32 * j + 4 * c + e] - 32) : 0;
            record[256 + r] = (uint8_t)(int8_t)codes[2 * j];
            record[264 + r] = (uint8_t)(int8_t)codes[2 * j + 1];
            memcpy(record + 272 + 4 * r, &d, sizeof d);
        }
    }
}

/* The 32 quants (0..15) of q4_1 row `row`, block b, from QuantWeight's nibble order. */
static void q4_row_block(const uint8_t *quants, int k, int64_t row, int64_t b, uint8_t q[QBLOCK]) {
    const uint8_t *src = quants + row * (k / 2) + b * (QBLOCK / 2);
    for (int j = 0; j < QBLOCK / 2; j++) q[j] = src[j] & 0x0F, q[j + QBLOCK / 2] = src[j] >> 4;
}

/* Pack QuantWeight's tensors (quants: int8 [n][k] or uint8 [n][k / 2]; scales, mins: fp32
 * [n][k / 32] (q8_0h, q4_1h: fp16), mins q4_1 only) into the layout above. */
void radixkv_quant_pack(int format, const uint8_t *quants, const float *scales, const float *mins, int n, int k,
                        uint8_t *packed) {
    const int64_t nb = k / QBLOCK, bytes = record_bytes(format);
    if (format == FORMAT_Q6_K) { /* quants: the GGUF's Q6_K blocks; no scales */
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < group_count(n); g++)
            for (int64_t s = 0; s < k / 256; s++) pack_q6_k(quants, n, k, g, s, packed);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < group_count(n); g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *record = packed + (g * nb + b) * bytes;
            float lanes[2 * QGROUP];
            uint16_t halves[2 * QGROUP];
            const int half = half_format(format);
            for (int r = 0; r < QGROUP; r++) {
                const int64_t row = g * QGROUP + r;
                const int live = row < n;
                lanes[r] = live && !half ? scales[row * nb + b] : 0.0f;
                lanes[QGROUP + r] = live && !half && mins ? mins[row * nb + b] : 0.0f;
                halves[r] = live && half ? ((const uint16_t *)scales)[row * nb + b] : 0;
                halves[QGROUP + r] = live && half && mins ? ((const uint16_t *)mins)[row * nb + b] : 0;
                if (base_format(format) == FORMAT_Q8_0) {
                    for (int c = 0; c < 8; c++)
                        for (int e = 0; e < 4; e++)
                            record[c * 32 + r * 4 + e] = live ? quants[row * k + b * QBLOCK + 4 * c + e] : 0;
                } else {
                    uint8_t q[QBLOCK] = {0};
                    if (live) q4_row_block(quants, k, row, b, q);
                    for (int c = 0; c < 4; c++)
                        for (int e = 0; e < 4; e++)
                            record[c * 32 + r * 4 + e] = (uint8_t)(q[4 * c + e] | (q[16 + 4 * c + e] << 4));
                }
            }
            const int fields = base_format(format) == FORMAT_Q4_1 ? 2 : 1;
            if (half) memcpy(record + quant_bytes(format), halves, fields * QGROUP * sizeof(uint16_t));
            else memcpy(record + quant_bytes(format), lanes, fields * QGROUP * sizeof(float));
        }
}

/* Rows `ids` of the packed weight, dequantized to fp32 [count][k] as quant.dequantize does
 * (scale * q, then + min): a tied embedding's lookup. */
void radixkv_quant_dequant_rows(int format, const uint8_t *packed, int n, int k, const int64_t *ids, int count,
                                float *out) {
    (void)n;
    const int64_t nb = k / QBLOCK, bytes = record_bytes(format);
    for (int i = 0; i < count; i++) {
        const int64_t g = ids[i] / QGROUP;
        const int r = (int)(ids[i] % QGROUP);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *record = packed + (g * nb + b) * bytes;
            float lanes[2 * QGROUP] = {0};
            const int fields = base_format(format) == FORMAT_Q4_1 ? 2 : 1;
            if (half_format(format)) {
                uint16_t halves[2 * QGROUP];
                memcpy(halves, record + quant_bytes(format), fields * QGROUP * sizeof(uint16_t));
                for (int j = 0; j < fields * QGROUP; j++) lanes[j] = fp16_to_float(halves[j]);
            } else if (format != FORMAT_Q6_K) {
                memcpy(lanes, record + quant_bytes(format), fields * QGROUP * sizeof(float));
            }
            float *dst = out + (int64_t)i * k + b * QBLOCK;
            if (format == FORMAT_Q6_K) { /* as gguf: (d * sc) * (q - 32) */
                float d;
                memcpy(&d, record + 272 + 4 * r, sizeof d);
                for (int j = 0; j < QBLOCK; j++)
                    dst[j] = (d * (float)(int8_t)record[256 + 8 * (j / 16) + r]) * (float)(int8_t)record[(j / 4) * 32 + r * 4 + j % 4];
                continue;
            }
            for (int j = 0; j < QBLOCK; j++) {
                float w;
                if (base_format(format) == FORMAT_Q8_0) {
                    w = lanes[r] * (float)(int8_t)record[(j / 4) * 32 + r * 4 + j % 4];
                } else {
                    const int c = (j % 16) / 4, e = j % 4;
                    const uint8_t byte = record[c * 32 + r * 4 + e];
                    w = lanes[r] * (float)(j < 16 ? byte & 0x0F : byte >> 4);
                    w = w + lanes[QGROUP + r];
                }
                dst[j] = w;
            }
        }
    }
}

#ifdef HAVE_AVX2
/* One row of x, block by block: per block scale = absmax / 127, q = round_half_even(x * (1 /
 * scale)) (0 for an all-zero block) as int8, and for q4_1's min term scale * sum(q). Stored:
 * xq [k]; xs, xu [k / 32]. */
static void quantize_row(const void *x, int x_bf16, int k, int8_t *xq, float *xs, float *xu) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < k / QBLOCK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            const int64_t at = (int64_t)b * QBLOCK + 8 * i;
            if (x_bf16) {
                const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at)));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
            } else {
                v[i] = _mm256_loadu_ps((const float *)x + at);
            }
        }
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        half = _mm_max_ss(half, _mm_movehdup_ps(half));
        const float scale = _mm_cvtss_f32(half) / 127.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        const __m256 by = _mm256_set1_ps(inverse);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], by)); /* MXCSR: half to even */
        const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256((__m256i *)(xq + (int64_t)b * QBLOCK), packed);
        xs[b] = scale;
        if (xu) {
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            xu[b] = scale * (float)_mm_cvtsi128_si32(s);
        }
    }
}

/* 4 bytes of x at `at`, in every 32-bit lane. */
static inline __m256i broadcast4(const int8_t *at) {
    int32_t word;
    memcpy(&word, at, sizeof word);
    return _mm256_set1_epi32(word);
}

/* The activations of one call, quantized (see quantize_row), row r's at r * k and r * nb. */
typedef struct {
    const int8_t *q;
    const float *s, *u;
    int k, nb;
} QuantX;

/* 8 fp32 lanes from a record's scales (or mins): fp32, or fp16 widened exactly. */
static inline __attribute__((always_inline)) __m256 load_lanes(const uint8_t *at, int half) {
    if (!half) return _mm256_loadu_ps((const float *)at);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
#else
    float lanes[QGROUP];
    for (int j = 0; j < QGROUP; j++) {
        uint16_t h;
        memcpy(&h, at + 2 * j, 2);
        lanes[j] = fp16_to_float(h);
    }
    return _mm256_loadu_ps(lanes);
#endif
}

/* acc[i] (8 rows of group `record`, x row r0 + i) += the block's term, as torch_quant_linear
 * orders it: (scale * sx) * float(dot), then (q4_1) + min * (sx * sum(xq)). lanes: the
 * record's scales, then (q4) its mins, fp16 where half. */
static inline __attribute__((always_inline)) void add_block(__m256 *acc, __m256i dot, const uint8_t *lanes, int half,
                                                            const QuantX *x, int64_t row, int64_t b, int q4) {
    const __m256 scaled = _mm256_mul_ps(load_lanes(lanes, half), _mm256_set1_ps(x->s[row * x->nb + b]));
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(scaled, _mm256_cvtepi32_ps(dot)));
    if (q4) {
        const __m256 mins = load_lanes(lanes + QGROUP * (half ? 2 : 4), half);
        *acc = _mm256_add_ps(*acc, _mm256_mul_ps(mins, _mm256_set1_ps(x->u[row * x->nb + b])));
    }
}

/* q6_k's block sum from its two halves' dot products: sc_lo * lo + sc_hi * hi, exact. */
static inline __attribute__((always_inline)) __m256i q6_sum(const uint8_t *record, __m256i lo, __m256i hi) {
    int64_t lo_bytes, hi_bytes;
    memcpy(&lo_bytes, record + 256, 8), memcpy(&hi_bytes, record + 264, 8);
    const __m256i sc_lo = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(lo_bytes)), sc_hi = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(hi_bytes));
    return _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo), _mm256_mullo_epi32(hi, sc_hi));
}

/* Sums of one group (8 outputs) for `rows` x rows from r0 (rows a constant 1..4 after
 * inlining, so the sums stay in registers), over all blocks. vpmaddubsw multiplies u8 by s8:
 * q8_0 takes |w| and x carrying w's sign (vpsignb; x is in [-127, 127], so negating it is safe,
 * while a GGUF's w may be -128, whose |w| is 128 as u8), whose pair sums (<= 2 * 128 * 127) fit
 * int16; q4_1's nibbles are already unsigned, and 8 of its pair sums (<= 8 * 2 * 15 * 127)
 * still fit int16, so one vpmaddwd per block widens them. */
static inline __attribute__((always_inline)) void group_avx2(const uint8_t *group, int format, const QuantX *x,
                                                             int64_t r0, int rows, __m256 acc[ROW_TILE]) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    const int64_t bytes = record_bytes(format);
    for (int i = 0; i < ROW_TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *record = group + b * bytes;
        _mm_prefetch((const char *)record + 8 * bytes, _MM_HINT_T0);
        _mm_prefetch((const char *)record + 8 * bytes + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)record + 8 * bytes + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)record + 8 * bytes + 192, _MM_HINT_T0);
        if (base_format(format) != FORMAT_Q4_1) _mm_prefetch((const char *)record + 8 * bytes + 256, _MM_HINT_T0);
        if (base_format(format) == FORMAT_Q8_0) {
            __m256i dot[ROW_TILE];
            for (int i = 0; i < rows; i++) dot[i] = _mm256_setzero_si256();
            /* Unrolled further, GCC computes every chunk's products first and spills them. */
#pragma GCC unroll 2
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i magnitude = _mm256_abs_epi8(w); /* -128 -> 0x80: 128 as u8 */
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(x->q + at), w));
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(pairs, ones));
                }
            }
            for (int i = 0; i < rows; i++) add_block(&acc[i], dot[i], record + 256, half_format(format), x, r0 + i, b, 0);
        } else if (format == FORMAT_Q6_K) {
            __m256i dot[2][ROW_TILE];
            for (int i = 0; i < rows; i++) dot[0][i] = dot[1][i] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i magnitude = _mm256_abs_epi8(w); /* |q - 32| <= 32 */
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(x->q + at), w));
                    dot[c / 4][i] = _mm256_add_epi32(dot[c / 4][i], _mm256_madd_epi16(pairs, ones));
                }
            }
            for (int i = 0; i < rows; i++) add_block(&acc[i], q6_sum(record, dot[0][i], dot[1][i]), record + 272, 0, x, r0 + i, b, 0);
        } else {
            __m256i pairs[ROW_TILE];
            for (int i = 0; i < rows; i++) pairs[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(lo, broadcast4(x->q + at)));
                    pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(hi, broadcast4(x->q + at + 16)));
                }
            }
            for (int i = 0; i < rows; i++)
                add_block(&acc[i], _mm256_madd_epi16(pairs[i], ones), record + 128, half_format(format), x, r0 + i, b, 1);
        }
    }
}

/* VNNI's vpdpbusd sums u8 x s8 products into int32 lanes in one instruction, without
 * vpmaddubsw's int16 saturation; the operands are those of the AVX2 kernel. Inlined into
 * group_vnni once per row count, as group_avx2 is: with `rows` unknown the sums went through
 * memory and the kernel ran slower than AVX2's. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni"))) void vnni_rows(const uint8_t *group, int format, const QuantX *x, int64_t r0, int rows,
                                                __m256 acc[ROW_TILE]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t bytes = record_bytes(format);
    for (int i = 0; i < ROW_TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *record = group + b * bytes;
        for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)record + 8 * bytes + line, _MM_HINT_T0);
        __m256i dot[ROW_TILE];
        for (int i = 0; i < rows; i++) dot[i] = _mm256_setzero_si256();
        if (format == FORMAT_Q6_K) {
            __m256i dot_hi[ROW_TILE];
            for (int i = 0; i < rows; i++) dot_hi[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i magnitude = _mm256_abs_epi8(w);
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    if (c < 4) dot[i] = _mm256_dpbusd_epi32(dot[i], magnitude, _mm256_sign_epi8(broadcast4(x->q + at), w));
                    else dot_hi[i] = _mm256_dpbusd_epi32(dot_hi[i], magnitude, _mm256_sign_epi8(broadcast4(x->q + at), w));
                }
            }
            for (int i = 0; i < rows; i++) dot[i] = q6_sum(record, dot[i], dot_hi[i]);
            for (int i = 0; i < rows; i++) add_block(&acc[i], dot[i], record + 272, 0, x, r0 + i, b, 0);
            continue;
        }
        if (base_format(format) == FORMAT_Q8_0) {
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i magnitude = _mm256_abs_epi8(w);
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    dot[i] = _mm256_dpbusd_epi32(dot[i], magnitude, _mm256_sign_epi8(broadcast4(x->q + at), w));
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(record + 32 * c));
                const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                for (int i = 0; i < rows; i++) {
                    const int64_t at = (r0 + i) * x->k + b * QBLOCK + 4 * c;
                    dot[i] = _mm256_dpbusd_epi32(dot[i], lo, broadcast4(x->q + at));
                    dot[i] = _mm256_dpbusd_epi32(dot[i], hi, broadcast4(x->q + at + 16));
                }
            }
        }
        const uint8_t *lanes = record + quant_bytes(format);
        for (int i = 0; i < rows; i++) add_block(&acc[i], dot[i], lanes, half_format(format), x, r0 + i, b, base_format(format) == FORMAT_Q4_1);
    }
}

/* acc + bias into y row `row`, features [8g, 8g + live) (live <= 8; the rest is padding). */
static void store_group(__m256 acc, const float *bias, int live, void *y, int y_bf16, int64_t offset) {
    float lanes[QGROUP];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < live; j++) {
        const float v = bias ? lanes[j] + bias[j] : lanes[j];
        if (y_bf16) ((uint16_t *)y)[offset + j] = float_to_bf16(v);
        else ((float *)y)[offset + j] = v;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void
group_vnni(const uint8_t *group, int format, const QuantX *x, int64_t r0, int rows, __m256 acc[ROW_TILE]) {
    switch (rows) {
    case 4: vnni_rows(group, format, x, r0, 4, acc); break;
    case 3: vnni_rows(group, format, x, r0, 3, acc); break;
    case 2: vnni_rows(group, format, x, r0, 2, acc); break;
    default: vnni_rows(group, format, x, r0, 1, acc); break;
    }
}

static inline __attribute__((always_inline)) void run_tile(int kernel, const uint8_t *group, int format, const QuantX *x,
                                                           int64_t r0, int rows, __m256 acc[ROW_TILE]) {
    if (kernel == RADIXKV_QUANT_AVX512_VNNI) {
        group_vnni(group, format, x, r0, rows, acc);
        return;
    }
    switch (rows) { /* a constant row count per copy: the sums stay in registers */
    case 4: group_avx2(group, format, x, r0, 4, acc); break;
    case 3: group_avx2(group, format, x, r0, 3, acc); break;
    case 2: group_avx2(group, format, x, r0, 2, acc); break;
    default: group_avx2(group, format, x, r0, 1, acc); break;
    }
}
#endif

#ifdef HAVE_AVX2
static int vnni_runs(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}
#endif

/* 1: this build multiplies q4_k / q6_k records and linears of parts (quant_linear.py asks, so a
 * library built from older sources, as scenarios/quant_ab.py loads, gets only q8_0 and q4_1). */
int radixkv_quant_super_blocks(void) { return 1; }

/* The quantized kernels that run here, as RADIXKV_QUANT_* bits. */
int radixkv_quant_linear_kernels(void) {
    int kernels = 0;
#ifdef HAVE_AVX2
    kernels |= RADIXKV_QUANT_AVX2;
    if (vnni_runs()) kernels |= RADIXKV_QUANT_AVX512_VNNI;
#endif
    if (radixkv_quant_zmm_runs()) kernels |= RADIXKV_QUANT_AVX512_ZMM;
    return kernels;
}

/* y [m][y_stride] = x [m][x_stride] W^T (+ bias), W packed by radixkv_quant_pack; x and y fp32,
 * or bf16 with x_bf16. Returns 1 where `kernel` does not run here or the shape is not one it
 * takes, 2 where scratch memory ran out. x is quantized once (threads split the rows); then
 * rows go in passes whose quantized x stays in L2, and within a pass the threads split the
 * groups, each group's records streaming once past the pass's rows, 4 rows per weight load. */
int radixkv_quant_linear(int kernel, int format, const void *x, int x_bf16, int64_t x_stride, int m, int k,
                         const uint8_t *packed, int n, const float *bias, void *y, int64_t y_stride, int num_threads) {
    if (format == RADIXKV_QUANT_PARTS) { /* row ranges in their own formats, behind a header */
        int64_t header[1 + 3 * 16], row = 0;
        memcpy(header, packed, sizeof(int64_t));
        if (header[0] < 1 || header[0] > 16) return 1;
        memcpy(header, packed, (1 + 3 * header[0]) * sizeof(int64_t));
        for (int64_t p = 0; p < header[0]; p++) {
            const int64_t *part = header + 1 + 3 * p;
            if (part[0] == RADIXKV_QUANT_PARTS) return 1;
            const int status = radixkv_quant_linear(kernel, (int)part[0], x, x_bf16, x_stride, m, k, packed + part[2], (int)part[1],
                                                    bias ? bias + row : NULL, (char *)y + row * (x_bf16 ? 2 : 4), y_stride, num_threads);
            if (status) return status;
            row += part[1];
        }
        return row == n ? 0 : 1;
    }
    if (kernel == RADIXKV_QUANT_AVX512_ZMM) /* packed in its own layout */
        return radixkv_quant_zmm_linear(format, x, x_bf16, x_stride, m, k, packed, n, bias, y, y_stride, num_threads);
#ifdef HAVE_AVX2
    if (!(radixkv_quant_linear_kernels() & kernel) || (kernel != RADIXKV_QUANT_AVX2 && kernel != RADIXKV_QUANT_AVX512_VNNI))
        return 1;
    const int known = base_format(format) == FORMAT_Q8_0 || base_format(format) == FORMAT_Q4_1 || format == FORMAT_Q6_K;
    if (k % QBLOCK != 0 || !known || m <= 0) return m == 0 ? 0 : 1;
    if (format == FORMAT_Q6_K && k % 256 != 0) return 1;
    const int nb = k / QBLOCK;
    char *scratch = malloc((size_t)m * k + (size_t)m * nb * 2 * sizeof(float));
    if (!scratch) return 2;
    QuantX qx = {(int8_t *)scratch, (float *)(scratch + (size_t)m * k), NULL, k, nb};
    qx.u = qx.s + (size_t)m * nb;
    const int64_t groups = group_count(n), bytes = record_bytes(format);
    int pass_rows = (int)(GROUP_X_BYTES / k) / ROW_TILE * ROW_TILE;
    if (pass_rows < ROW_TILE) pass_rows = ROW_TILE;
    const size_t elem = x_bf16 ? 2 : 4;
    /* A decode step's few rows are quantized here, before the threads start: microseconds,
     * against a barrier that on a busy machine can wait out another process's time slice. */
    const int serial_rows = m <= SERIAL_QUANTIZE_ROWS ? m : 0;
    for (int r = 0; r < serial_rows; r++)
        quantize_row((const char *)x + r * x_stride * elem, x_bf16, k, (int8_t *)qx.q + (int64_t)r * k, (float *)qx.s + (int64_t)r * nb,
                     base_format(format) == FORMAT_Q4_1 ? (float *)qx.u + (int64_t)r * nb : NULL);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial_rows) {
#pragma omp for schedule(static)
            for (int r = 0; r < m; r++)
                quantize_row((const char *)x + r * x_stride * elem, x_bf16, k, (int8_t *)qx.q + (int64_t)r * k,
                             (float *)qx.s + (int64_t)r * nb, base_format(format) == FORMAT_Q4_1 ? (float *)qx.u + (int64_t)r * nb : NULL);
        }
        for (int p0 = 0; p0 < m; p0 += pass_rows) {
            const int pass_end = p0 + pass_rows < m ? p0 + pass_rows : m;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *group = packed + g * nb * bytes;
                const int live = n - g * QGROUP < QGROUP ? (int)(n - g * QGROUP) : QGROUP;
                for (int r0 = p0; r0 < pass_end; r0 += ROW_TILE) {
                    const int rows = pass_end - r0 < ROW_TILE ? pass_end - r0 : ROW_TILE;
                    __m256 acc[ROW_TILE];
                    run_tile(kernel, group, format, &qx, r0, rows, acc);
                    for (int i = 0; i < rows; i++)
                        store_group(acc[i], bias ? bias + g * QGROUP : NULL, live, y, x_bf16, (r0 + i) * y_stride + g * QGROUP);
                }
            }
        }
    }
    free(scratch);
    return 0;
#else
    (void)kernel, (void)format, (void)x, (void)x_bf16, (void)x_stride, (void)m, (void)k, (void)packed, (void)n;
    (void)bias, (void)y, (void)y_stride, (void)num_threads;
    return 1;
#endif
}
