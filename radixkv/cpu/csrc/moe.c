/* Grouped expert linears over a GGUF's own blocks (radixkv/cpu/moe.py): for each routed expert,
 * y = x W_e^T for the rows of x routed to it, W_e read in place from the stacked experts tensor
 * (a memory map of the file), in tiles of 8 rows, each row read once a call and multiplied with
 * every routed token, so an expert's bytes are read once a step however many tokens picked it.
 * Q4_K and Q6_K rows are read straight from their blocks into 512-bit lanes, four rows at a time,
 * prefetching the rows ahead (q4_k_dot4_zmm); where QUAD_TOKENS or more tokens picked the expert
 * (a prefill), four rows are decoded once into L1 and each token's pass is the dot products
 * alone (q4_k_dot4_decoded: the same bits); Q8_0 tiles take their quants from the blocks (only
 * scales are decoded); the other types, and tails of fewer than 8 rows, decode a row into a
 * buffer first. A decode step's one token takes radixkv_moe_row_gate_up and radixkv_moe_row_down:
 * the same items, and the weighted sum.
 *
 * Arithmetic (cpu/moe.py's torch_block_linear computes the same bits). Blocks of 32 types (Q8_0,
 * Q4_0, Q4_1, Q5_0): x is quantized per row and block of 32 as quant_linear.c does (scale =
 * absmax / 127, q = round_half_even(x / scale)). Each weight block of 32 is integers w with an
 * fp32 scale s (and min m): Q8_0 w = q, s = d; Q4_0 w = q, s = d, m = -8d; Q4_1 w = q, s = d,
 * m = m; Q5_0 w = q - 16, s = d. Per output an fp32 sum starts at 0 and takes the blocks in
 * order: acc = acc + (s * sx) * float(sum w * xq) (an exact integer), then with a min acc = acc +
 * m * (sx * float(sum xq)).
 * K-quants (Q4_K, Q6_K) take x quantized per 256 the same way (one scale sx per super-block, as
 * llama.cpp's Q8_K), so a super-block's sub-blocks combine in integers, in 16 lanes: Q6_K's value
 * v of a super-block (w = sc16 * (q - 32), sc16 the scale of its 16) goes to lane (v % 64) / 4;
 * Q4_K's (w = sc * q) value 32j + 4t + e (sub-block j) to lane 8 * ((j >> 1) & 1) + t. A lane's
 * integer L = sum w * xq over its 16 values of the super-block. Per output, fp32 lanes start at 0
 * and take the super-blocks in order: acc[l] = acc[l] + (d * sx) * float(L[l]); then acc is
 * halved, acc[0:8] + acc[8:16], then 4, 2, 1. Q4_K's mins: 8 lanes, macc[j] = macc[j] + (dmin *
 * sx) * float(mn_j * sum xq over sub-block j), halved 8 -> 1, and y = dot - mins.
 * The integers are exact in fp32 and fit int32: Q4_K |L| <= 16 values x 15 x 127 x 63 = 1.92M,
 * |mn_j * sum| <= 63 x 32 x 127 = 256K; Q6_K |L| <= 16 x 32 x 127 x 128 = 8.3M (all < 2^24);
 * the 16-bit pair sums below stay inside int16, and so do a min (<= 63) and a sum of 32 xq
 * (|sum| <= 4064), the factors of the mins' vpmaddwd. Being exact, a super-block's integers may
 * be summed in any order (the vector paths sum its steps in two chains); the fp steps may not.
 * No fused multiply-adds (-std=c11 turns contraction off): the order is the result.
 *
 * Integer dot products: w is decoded to unsigned bytes u with w = u - offset (Q8_0: 128, Q5_0:
 * 16, Q6_K: 32, others 0), so sum w * xq = sum u * xq - offset * sum xq, one vpdpbusd per 32
 * bytes (K-quants: vpmaddubsw then vpdpwssd with the sub-block scales; a pair of u * xq is at
 * most 63 x 127 x 2 = 16002, a Q6_K pair less its offset 32 x 127 x 2 = 8128, inside int16); the
 * scalar loop computes the same integers where VNNI is not compiled in.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define MBLOCK 32
/* Tokens of one expert from which its K-quant rows are decoded once for all of them: decoding
 * four Q4_K rows costs about what 3.7 tokens' direct dots save (17 cycles a row and super-block,
 * against 18.6 a token direct and 14 decoded, Zen 4) */
#define QUAD_TOKENS 6
#define KBLOCK 256

enum { T_Q8_0 = 0, T_Q4_0 = 1, T_Q4_1 = 2, T_Q5_0 = 3, T_Q4_K = 4, T_Q6_K = 5 };

static float f16_to_f32(const uint8_t *at) {
    uint16_t h;
    memcpy(&h, at, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as below, for every non-NaN half */
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (mant << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (!mant) bits = sign;
    else { /* subnormal: value mant * 2^-24, exact in fp32 */
        float v = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* Bytes a row of k values takes in `type`; 0 for an unknown type or a k it cannot hold. */
int64_t radixkv_moe_row_bytes(int type, int k) {
    switch (type) {
    case T_Q8_0: return k % MBLOCK ? 0 : (int64_t)k / MBLOCK * 34;
    case T_Q4_0: return k % MBLOCK ? 0 : (int64_t)k / MBLOCK * 18;
    case T_Q4_1: return k % MBLOCK ? 0 : (int64_t)k / MBLOCK * 20;
    case T_Q5_0: return k % MBLOCK ? 0 : (int64_t)k / MBLOCK * 22;
    case T_Q4_K: return k % KBLOCK ? 0 : (int64_t)k / KBLOCK * 144;
    case T_Q6_K: return k % KBLOCK ? 0 : (int64_t)k / KBLOCK * 210;
    default: return 0;
    }
}

/* One row of a blocks of 32 type decoded: u [k] unsigned quants, s and m [k / 32] (m only
 * where the type has mins). */
typedef struct {
    uint8_t *u;
    float *s, *m;
} Row;

static void decode_row_part(int type, const uint8_t *restrict src, int k, const Row *row, int with_quants) {
    /* Local restrict pointers: stores through row's fields would otherwise alias row itself,
     * and the byte loops would stay scalar, reloading the pointers every byte. */
    uint8_t *restrict u = row->u;
    float *restrict rs = row->s, *restrict rm = row->m;
    const int nb = k / MBLOCK;
    switch (type) {
    case T_Q8_0:
        for (int b = 0; b < nb; b++, src += 34) {
            rs[b] = f16_to_f32(src);
            if (with_quants)
                for (int j = 0; j < MBLOCK; j++) u[b * MBLOCK + j] = (uint8_t)(src[2 + j] ^ 0x80);
        }
        break;
    case T_Q4_0:
    case T_Q4_1: {
        const int q4_1 = type == T_Q4_1, size = q4_1 ? 20 : 18, at = q4_1 ? 4 : 2;
        for (int b = 0; b < nb; b++, src += size) {
            const float d = f16_to_f32(src);
            rs[b] = d;
            rm[b] = q4_1 ? f16_to_f32(src + 2) : d * -8.0f;
            for (int j = 0; j < 16; j++) {
                u[b * MBLOCK + j] = src[at + j] & 0x0F;
                u[b * MBLOCK + 16 + j] = src[at + j] >> 4;
            }
        }
        break;
    }
    case T_Q5_0:
        for (int b = 0; b < nb; b++, src += 22) {
            rs[b] = f16_to_f32(src);
            uint32_t high;
            memcpy(&high, src + 2, 4);
            for (int j = 0; j < 16; j++) {
                u[b * MBLOCK + j] = (uint8_t)((src[6 + j] & 0x0F) | (((high >> j) & 1) << 4));
                u[b * MBLOCK + 16 + j] = (uint8_t)((src[6 + j] >> 4) | (((high >> (j + 16)) & 1) << 4));
            }
        }
        break;
    }
}

static void decode_row(int type, const uint8_t *src, int k, const Row *row) { decode_row_part(type, src, k, row, 1); }

/* Activations of one call quantized. Per 32 (blocks of 32 types): q [m][k], s and u (= s * sum
 * q) [m][k / 32], half sums [m][k / 16] (sum q over each 16: every offset's sum as two halves).
 * Per 256 (K-quants): kq [m][k], ks [m][k / 256], ksum32 [m][k / 32] (sums of kq over each
 * 32), kqp (Q4_K: kq with each super-block's sub-blocks in Q4K_ORDER), kpair. Parts a call does
 * not use are NULL. */
typedef struct {
    int8_t *q;
    float *s, *u;
    int32_t *half;
    int k, nb, nsb;
    int8_t *kq, *kqp;
    float *ks;
    int32_t *ksum32;
    int16_t *kpair; /* Q6_K: 32 * (kq[2g] + kq[2g + 1]) [m][k / 2] */
    uint8_t *kqu;   /* Q6_K: kq + 128 as unsigned bytes [m][k] (decoded quads' x) */
} QX;

/* Q4_K's steps take sub-blocks in pairs (0, 2), (1, 3), (4, 6), (5, 7) of each super-block:
 * 64 bytes of its quants hold sub-blocks 2c, 2c + 2 in their low nibbles, 2c + 1, 2c + 3 in the
 * high. The order is its own inverse. */
static const int Q4K_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};

/* x's n values quantized as one block: scale = absmax / 127, q = round_half_even(x / scale). */
static float quantize_block(const float *v, int n, int8_t *q) {
    float amax = 0.0f;
    /* fmaxf's value for every input (a NaN is skipped either way), without its libm call */
    for (int j = 0; j < n; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    const float scale = amax / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int j = 0; j < n; j++) {
        float r = rintf(v[j] * inverse); /* round half to even, as torch.round */
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[j] = (int8_t)r;
    }
    return scale;
}

static void quantize_x_row(const float *x, int k, int8_t *q, float *s, float *u, int32_t *half) {
    for (int b = 0; b < k / MBLOCK; b++) {
        s[b] = quantize_block(x + (int64_t)b * MBLOCK, MBLOCK, q + b * MBLOCK);
        int32_t sums[2] = {0, 0};
        for (int j = 0; j < MBLOCK; j++) sums[j / 16] += q[b * MBLOCK + j];
        u[b] = s[b] * (float)(sums[0] + sums[1]);
        half[2 * b] = sums[0], half[2 * b + 1] = sums[1];
    }
}

static void quantize_x_row256(const float *x, int k, int8_t *q, float *s, int32_t *sum32) {
    for (int sb = 0; sb < k / KBLOCK; sb++) s[sb] = quantize_block(x + (int64_t)sb * KBLOCK, KBLOCK, q + sb * KBLOCK);
    for (int b = 0; b < k / MBLOCK; b++) {
        int32_t sum = 0;
        for (int j = 0; j < MBLOCK; j++) sum += q[MBLOCK * b + j];
        sum32[b] = sum;
    }
}

/* The integer sums of u * xq over the two halves of block b. */
static inline void dot_halves(const uint8_t *u, const int8_t *xq, int use_vnni, int32_t out[2]) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (use_vnni) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)u), x = _mm256_loadu_si256((const __m256i *)xq);
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
        __m128i lo = _mm256_castsi256_si128(dot), hi = _mm256_extracti128_si256(dot, 1);
        __m128i both = _mm_hadd_epi32(lo, hi); /* lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3 */
        both = _mm_hadd_epi32(both, both);
        out[0] = _mm_cvtsi128_si32(both), out[1] = _mm_extract_epi32(both, 1);
        return;
    }
#endif
    (void)use_vnni;
    int32_t a = 0, b = 0;
    for (int j = 0; j < 16; j++) a += (int32_t)u[j] * xq[j], b += (int32_t)u[16 + j] * xq[16 + j];
    out[0] = a, out[1] = b;
}

/* y[o] for one x row against one decoded weight row, in the documented order. */
static float row_dot(int type, const Row *row, const QX *x, int64_t r, int use_vnni) {
    const int8_t *xq = x->q + r * x->k;
    const float *xs = x->s + r * x->nb, *xu = x->u + r * x->nb;
    const int32_t *half = x->half + r * 2 * x->nb;
    const int offset = type == T_Q8_0 ? 128 : (type == T_Q5_0 ? 16 : 0);
    const int mins = type == T_Q4_0 || type == T_Q4_1;
    float acc = 0.0f;
    for (int b = 0; b < x->nb; b++) {
        int32_t h[2];
        dot_halves(row->u + b * MBLOCK, xq + b * MBLOCK, use_vnni, h);
        h[0] -= offset * half[2 * b], h[1] -= offset * half[2 * b + 1];
        const int32_t i = h[0] + h[1];
        const float scaled = row->s[b] * xs[b];
        acc = acc + scaled * (float)i;
        if (mins) {
            const float term = row->m[b] * xu[b];
            acc = acc + term;
        }
    }
    return acc;
}

/* Q4_K's 6-bit sub-block scales and mins of a super-block's 12 packed bytes. */
static inline void q4_k_unpack(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) *sc = s[j] & 63, *mn = s[j + 4] & 63;
    else *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

/* The header's lanes summed: v[0:half] + v[half:], halving to 1 (reduce_lanes's tree). */
static float reduce_lanes(float *v, int lanes) {
    for (int w = lanes / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) v[i] = v[i] + v[w + i];
    return v[0];
}

/* K-quant rows in the header's lanes, one value at a time (any CPU). */
static float q4_k_dot_scalar(const uint8_t *raw, const QX *x, int64_t r) {
    const int8_t *xq = x->kq + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    const int32_t *sum32 = x->ksum32 + r * (x->k / MBLOCK);
    float acc[16] = {0.0f}, macc[8] = {0.0f};
    for (int sb = 0; sb < x->nsb; sb++) {
        const uint8_t *blk = raw + (int64_t)sb * 144;
        const int8_t *xb = xq + sb * KBLOCK;
        int32_t lane[16] = {0}, n[8];
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            q4_k_unpack(blk + 4, j, &sc, &mn);
            const uint8_t *chunk = blk + 16 + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            for (int t = 0; t < 8; t++) {
                int32_t dot = 0;
                for (int e = 0; e < 4; e++) dot += ((chunk[4 * t + e] >> shift) & 0x0F) * xb[32 * j + 4 * t + e];
                lane[8 * ((j >> 1) & 1) + t] += sc * dot;
            }
            n[j] = mn * sum32[sb * 8 + j];
        }
        const float ds = f16_to_f32(blk) * xs[sb], ms = f16_to_f32(blk + 2) * xs[sb];
        for (int l = 0; l < 16; l++) acc[l] = acc[l] + ds * (float)lane[l];
        for (int j = 0; j < 8; j++) macc[j] = macc[j] + ms * (float)n[j];
    }
    const float dot = reduce_lanes(acc, 16);
    return dot - reduce_lanes(macc, 8);
}

static float q6_k_dot_scalar(const uint8_t *raw, const QX *x, int64_t r) {
    const int8_t *xq = x->kq + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    float acc[16] = {0.0f};
    for (int sb = 0; sb < x->nsb; sb++) {
        const uint8_t *blk = raw + (int64_t)sb * 210, *ql = blk, *qh = blk + 128;
        const int8_t *scales = (const int8_t *)(blk + 192), *xb = xq + sb * KBLOCK;
        int32_t lane[16] = {0};
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {
                /* values v = 128h + 32g + l: low 4 bits from ql, high 2 from qh; scale per 16 */
                const uint8_t *low = ql + 64 * h + 32 * (g & 1);
                const int shift = 4 * (g >> 1);
                for (int l = 0; l < 32; l++) {
                    const int v = 128 * h + 32 * g + l;
                    const int q = ((low[l] >> shift) & 0x0F) | (((qh[32 * h + l] >> (2 * g)) & 3) << 4);
                    lane[(v % 64) / 4] += scales[v / 16] * (q - 32) * xb[v];
                }
            }
        const float ds = f16_to_f32(blk + 208) * xs[sb];
        for (int l = 0; l < 16; l++) acc[l] = acc[l] + ds * (float)lane[l];
    }
    return reduce_lanes(acc, 16);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A vpshufb mask whose 128-bit lane i holds the 16-bit value v_i in every 16-bit lane. */
static inline __m512i lanes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    a *= 0x10001u, b *= 0x10001u, c *= 0x10001u, d *= 0x10001u;
    return _mm512_set_epi32((int)d, (int)d, (int)d, (int)d, (int)c, (int)c, (int)c, (int)c, (int)b, (int)b, (int)b, (int)b,
                            (int)a, (int)a, (int)a, (int)a);
}

/* The last two halvings (4 -> 2 -> 1) in each 128-bit lane of c: element 0 of lane i holds
 * (c0 + c2) + (c1 + c3) of that lane, reduce_lanes's order (a float sum is commutative). */
static inline __m128 halve4x4(__m512 c) {
    const __m512 two = _mm512_add_ps(c, _mm512_permute_ps(c, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 one = _mm512_add_ps(two, _mm512_permute_ps(two, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), one));
}

/* Four rows' 16 lanes halved 16 -> 1 (reduce_lanes's tree) together: row i's sum in element i.
 * Each halving takes the four rows' lanes in one register, so 4 rows cost one row's steps. */
static inline __m128 halve16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* 16 -> 8: rows (0, 1) and (2, 3) side by side, lanes i and i + 8 added */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    /* 8 -> 4: 128-bit lane i row i, lanes i and i + 4 added */
    return halve4x4(_mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD)));
}

/* Four rows' 8 lanes (rows 0, 1 in m01's halves, 2, 3 in m23's) halved 8 -> 1: row i's in element i. */
static inline __m128 halve8x4(__m512 m01, __m512 m23) {
    return halve4x4(_mm512_add_ps(_mm512_shuffle_f32x4(m01, m23, 0x88), _mm512_shuffle_f32x4(m01, m23, 0xDD)));
}

/* Part sb, of `part` bytes (whole cache lines), of [ahead, ahead + span) prefetched into L2
 * (ahead NULL: none): rows read four at a time are four interleaved streams, which the
 * hardware prefetchers follow poorly. */
static inline void prefetch_part(const uint8_t *ahead, int64_t span, int64_t part, int sb) {
    if (!ahead) return;
    const int64_t end = (sb + 1) * part < span ? (sb + 1) * part : span;
    for (int64_t at = sb * part; at < end; at += 64) _mm_prefetch((const char *)(ahead + at), _MM_HINT_T1);
}

/* Four Q4_K rows (rows[i], repeats allowed) times x row r, in the header's lanes: out[i], the
 * scalar loop's bits. The rows share x's loads, their 12 scale bytes are unpacked together in
 * vector registers, their mins go two rows a register, and the sums are halved four at once.
 * Each step's 64 quants times x in pairs (vpmaddubsw, 16-bit lanes), times each pair's scale
 * and summed into the 32-bit lanes (vpdpwssd): 32-bit lane l of step i holds its values 4l to
 * 4l + 3; steps (0, 1) and (2, 3) sum apart and then together (exact integers, shorter chains). */
/* Q4_K's constant vectors: the scale picks of its four steps and the header's unpacking. */
typedef struct {
    __m512i pick[4], spread, spread_top, low, high, fields, mins, nibble, top2;
} Q4kConsts;

static inline Q4kConsts q4_k_consts(void) {
    Q4kConsts c;
    /* step i = 2c + j takes sub-blocks 4c + j (lanes 0-7) and 4c + j + 2 (8-15): each 16-bit
     * lane their scale byte, zero-extended (0x80 picks a zero) */
    c.pick[0] = lanes4(0x8000, 0x8000, 0x8002, 0x8002), c.pick[1] = lanes4(0x8001, 0x8001, 0x8003, 0x8003);
    c.pick[2] = lanes4(0x8004, 0x8004, 0x8006, 0x8006), c.pick[3] = lanes4(0x8005, 0x8005, 0x8007, 0x8007);
    /* The 16 header bytes (d, dmin, packed a[4] b[4] c[4]) -> sc0-7, mn0-7 (q4_k_unpack): a c b c
     * (low 6 bits of a and b; c's low and high nibbles) and 0 a 0 b (the top 2 bits of a and b) */
    c.spread = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    c.spread_top = _mm512_broadcast_i32x4(_mm_setr_epi8(-128, -128, -128, -128, 4, 5, 6, 7, -128, -128, -128, -128, 8, 9, 10, 11));
    c.low = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    c.high = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    c.fields = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); /* each row's d, dmin */
    c.mins = _mm512_setr_epi64(1, 3, 5, 7, 0, 0, 0, 0);                            /* each row's mn bytes */
    c.nibble = _mm512_set1_epi8(0x0F), c.top2 = _mm512_set1_epi8(0x30);
    return c;
}

/* Super-block `at` of four Q4_K rows' headers: 128-bit lane i of *unpacked holds row i's sc0-7
 * in bytes 0-7 and mn0-7 in 8-15; returns d0, dmin0, ..., d3, dmin3. */
static inline __m256 q4_k_head4(const uint8_t *const rows[4], int64_t at, const Q4kConsts *c, __m512i *unpacked) {
    __m512i head = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[0] + at)));
    head = _mm512_inserti32x4(head, _mm_loadu_si128((const __m128i *)(rows[1] + at)), 1);
    head = _mm512_inserti32x4(head, _mm_loadu_si128((const __m128i *)(rows[2] + at)), 2);
    head = _mm512_inserti32x4(head, _mm_loadu_si128((const __m128i *)(rows[3] + at)), 3);
    const __m512i acbc = _mm512_shuffle_epi8(head, c->spread), top = _mm512_shuffle_epi8(head, c->spread_top);
    *unpacked = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(acbc, c->low), _mm512_and_si512(_mm512_srli_epi32(acbc, 4), c->high)),
                                _mm512_and_si512(_mm512_srli_epi32(top, 2), c->top2));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(c->fields, head)));
}

/* Row i's 256 quants of a super-block (q: its 128 bytes) as its four steps' unsigned bytes, and
 * its four steps' 16-bit scale lanes. */
static inline void q4_k_row_steps(const uint8_t *q, __m512i unpacked, int i, const Q4kConsts *c, __m512i w[4], __m512i sc[4]) {
    const __m512i scales = _mm512_shuffle_i32x4(unpacked, unpacked, 0x55 * i);
    const __m512i w0 = _mm512_loadu_si512(q), w1 = _mm512_loadu_si512(q + 64);
    w[0] = _mm512_and_si512(w0, c->nibble), w[1] = _mm512_and_si512(_mm512_srli_epi16(w0, 4), c->nibble);
    w[2] = _mm512_and_si512(w1, c->nibble), w[3] = _mm512_and_si512(_mm512_srli_epi16(w1, 4), c->nibble);
    for (int j = 0; j < 4; j++) sc[j] = _mm512_shuffle_epi8(scales, c->pick[j]);
}

/* A row's super-block integers, its 16 lanes: the four steps times x (xv: the super-block's 256
 * values in Q4K_ORDER), steps (0, 1) and (2, 3) in two chains, then together. */
static inline __m512i q4_k_lanes(const __m512i w[4], const __m512i sc[4], const __m512i xv[4]) {
    __m512i first = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(w[0], xv[0]), sc[0]);
    __m512i second = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(w[2], xv[2]), sc[2]);
    first = _mm512_dpwssd_epi32(first, _mm512_maddubs_epi16(w[1], xv[1]), sc[1]);
    second = _mm512_dpwssd_epi32(second, _mm512_maddubs_epi16(w[3], xv[3]), sc[3]);
    return _mm512_add_epi32(first, second);
}

/* mins: mn_j * (sum of x over sub-block j), two rows a register; vpmaddwd's high words are mn's
 * zero and the sum's sign, so each 32-bit lane is the exact product. Adds (dmin * sx) times
 * them to rows (0, 1)'s and (2, 3)'s accumulators. */
static inline void q4_k_mins4(__m256i mn, const int32_t *sum32, __m512 dsx, __m512 *macc01, __m512 *macc23) {
    const __m512i dmin01 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m512i dmin23 = _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
    const __m512i sums = _mm512_broadcast_i32x8(_mm256_loadu_si256((const __m256i *)sum32));
    const __m512i n01 = _mm512_madd_epi16(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(mn)), sums);
    const __m512i n23 = _mm512_madd_epi16(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(mn, 1)), sums);
    *macc01 = _mm512_add_ps(*macc01, _mm512_mul_ps(_mm512_permutexvar_ps(dmin01, dsx), _mm512_cvtepi32_ps(n01)));
    *macc23 = _mm512_add_ps(*macc23, _mm512_mul_ps(_mm512_permutexvar_ps(dmin23, dsx), _mm512_cvtepi32_ps(n23)));
}

/* Four Q4_K rows (rows[i], repeats allowed) times x row r, in the header's lanes: out[i], the
 * scalar loop's bits. The rows share x's loads, their 12 scale bytes are unpacked together in
 * vector registers, their mins go two rows a register, and the sums are halved four at once.
 * Each step's 64 quants times x in pairs (vpmaddubsw, 16-bit lanes), times each pair's scale
 * and summed into the 32-bit lanes (vpdpwssd): 32-bit lane l of step i holds its values 4l to
 * 4l + 3; steps (0, 1) and (2, 3) sum apart and then together (exact integers, shorter chains). */
static void q4_k_dot4_zmm(const uint8_t *const rows[4], const QX *x, int64_t r, const uint8_t *ahead, int64_t span, float out[4]) {
    const int8_t *xq = x->kqp + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    const int32_t *sum32 = x->ksum32 + r * (x->k / MBLOCK);
    const Q4kConsts c = q4_k_consts();
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 macc01 = _mm512_setzero_ps(), macc23 = _mm512_setzero_ps();
    const int64_t part = (span / x->nsb + 63) & ~(int64_t)63;
    for (int sb = 0; sb < x->nsb; sb++) {
        const int64_t at = (int64_t)sb * 144;
        const int8_t *xb = xq + sb * KBLOCK;
        prefetch_part(ahead, span, part, sb);
        __m512i unpacked;
        /* d * sx, dmin * sx of rows 0-3 */
        const __m512 dsx = _mm512_castps256_ps512(_mm256_mul_ps(q4_k_head4(rows, at, &c, &unpacked), _mm256_set1_ps(xs[sb])));
        const __m512i xv[4] = {_mm512_loadu_si512(xb), _mm512_loadu_si512(xb + 64), _mm512_loadu_si512(xb + 128),
                               _mm512_loadu_si512(xb + 192)};
        for (int i = 0; i < 4; i++) {
            __m512i w[4], sc[4];
            q4_k_row_steps(rows[i] + at + 16, unpacked, i, &c, w, sc);
            const __m512 ds = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), dsx);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(ds, _mm512_cvtepi32_ps(q4_k_lanes(w, sc, xv))));
        }
        q4_k_mins4(_mm512_castsi512_si256(_mm512_permutexvar_epi64(c.mins, unpacked)), sum32 + sb * 8, dsx, &macc01, &macc23);
    }
    _mm_storeu_ps(out, _mm_sub_ps(halve16x4(acc[0], acc[1], acc[2], acc[3]), halve8x4(macc01, macc23)));
}

/* Four K-quant rows decoded once for the several tokens routed to them (a prefill's groups):
 * per super-block, each row's four steps' bytes (Q4_K: unsigned q; Q6_K: signed q - 32) and
 * 16-bit scale lanes, the rows' d (and Q4_K's dmin) and Q4_K's mins, so each token's pass is
 * the dot products alone. */
typedef struct {
    __m512i *w, *sc; /* [nsb][4 rows][4 steps] */
    float *d;        /* [nsb][8]: Q4_K d0, dmin0, ..., d3, dmin3; Q6_K d0-d3 */
    __m256i *mn;     /* Q4_K [nsb]: rows 0-3's mn0-7 */
    __m512i *offset; /* Q6_K [nsb][4 rows]: 128 * (each lane's sum of scale * (q - 32)) */
} Quad;

static int quad_alloc(Quad *quad, int nsb) {
    quad->w = aligned_alloc(64, (size_t)nsb * 16 * 64), quad->sc = aligned_alloc(64, (size_t)nsb * 16 * 64);
    quad->d = malloc((size_t)nsb * 8 * sizeof(float)), quad->mn = aligned_alloc(32, (size_t)nsb * 32);
    quad->offset = aligned_alloc(64, (size_t)nsb * 4 * 64);
    return quad->w && quad->sc && quad->d && quad->mn && quad->offset;
}

static void quad_free(Quad *quad) { free(quad->w), free(quad->sc), free(quad->d), free(quad->mn), free(quad->offset); }

static void q4_k_decode4(const uint8_t *const rows[4], int nsb, const uint8_t *ahead, int64_t span, Quad *quad) {
    const Q4kConsts c = q4_k_consts();
    const int64_t part = (span / nsb + 63) & ~(int64_t)63;
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t at = (int64_t)sb * 144;
        prefetch_part(ahead, span, part, sb);
        __m512i unpacked;
        _mm256_storeu_ps(quad->d + 8 * sb, q4_k_head4(rows, at, &c, &unpacked));
        for (int i = 0; i < 4; i++) q4_k_row_steps(rows[i] + at + 16, unpacked, i, &c, quad->w + 16 * sb + 4 * i, quad->sc + 16 * sb + 4 * i);
        quad->mn[sb] = _mm512_castsi512_si256(_mm512_permutexvar_epi64(c.mins, unpacked));
    }
}

/* q4_k_dot4_zmm's steps over a decoded quad: the same bits. */
static void q4_k_dot4_decoded(const Quad *quad, const QX *x, int64_t r, float out[4]) {
    const int8_t *xq = x->kqp + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    const int32_t *sum32 = x->ksum32 + r * (x->k / MBLOCK);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 macc01 = _mm512_setzero_ps(), macc23 = _mm512_setzero_ps();
    for (int sb = 0; sb < x->nsb; sb++) {
        const int8_t *xb = xq + sb * KBLOCK;
        const __m512 dsx = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(quad->d + 8 * sb), _mm256_set1_ps(xs[sb])));
        const __m512i xv[4] = {_mm512_loadu_si512(xb), _mm512_loadu_si512(xb + 64), _mm512_loadu_si512(xb + 128),
                               _mm512_loadu_si512(xb + 192)};
        for (int i = 0; i < 4; i++) {
            const __m512 ds = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), dsx);
            const __m512i lanes = q4_k_lanes(quad->w + 16 * sb + 4 * i, quad->sc + 16 * sb + 4 * i, xv);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(ds, _mm512_cvtepi32_ps(lanes)));
        }
        q4_k_mins4(quad->mn[sb], sum32 + sb * 8, dsx, &macc01, &macc23);
    }
    _mm_storeu_ps(out, _mm_sub_ps(halve16x4(acc[0], acc[1], acc[2], acc[3]), halve8x4(macc01, macc23)));
}

/* Row blk's super-block of Q6_K as its four steps (step s = 2h + j: values 64s to 64s + 63)
 * of unsigned 6-bit quants, and their 16-bit scale lanes: 128-bit lane t of step s takes
 * scale 4s + t. */
static inline void q6_k_row_steps(const uint8_t *blk, __m512i q[4], __m512i sc[4]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    /* of the 8 scales of half h broadcast to every 128-bit lane: bytes (2s, 2s + 1) for s = 4j + t */
    const __m512i pick[2] = {lanes4(0x0100, 0x0302, 0x0504, 0x0706), lanes4(0x0908, 0x0B0A, 0x0D0C, 0x0F0E)};
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int h = 0; h < 2; h++) {
        const __m512i scales = _mm512_broadcast_i32x4(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, nibble), _mm512_and_si512(_mm512_sllv_epi16(qh, left), high2));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), _mm512_and_si512(_mm512_srlv_epi16(qh, right), high2));
        for (int j = 0; j < 2; j++) sc[2 * h + j] = _mm512_shuffle_epi8(scales, pick[j]);
    }
}

/* A Q6_K row's super-block integers, its 16 lanes: (q - 32) * xq in pairs (q * xq less 32 * the
 * pair's xq sum, xp), times the scales, halves h = 0 and 1 apart, then together. */
static inline __m512i q6_k_lanes(const __m512i q[4], const __m512i sc[4], const int8_t *xb, const int16_t *xp) {
    __m512i lanes[2];
    for (int h = 0; h < 2; h++) {
        lanes[h] = _mm512_setzero_si512();
        for (int j = 0; j < 2; j++) {
            const int s = 2 * h + j;
            const __m512i uq = _mm512_maddubs_epi16(q[s], _mm512_loadu_si512(xb + 64 * s));
            lanes[h] = _mm512_dpwssd_epi32(lanes[h], _mm512_sub_epi16(uq, _mm512_loadu_si512(xp + 32 * s)), sc[s]);
        }
    }
    return _mm512_add_epi32(lanes[0], lanes[1]);
}

/* The four rows' d at super-block offset at. */
static inline __m128 q6_k_d4(const uint8_t *const rows[4], int64_t at) {
    uint16_t d[4];
    for (int i = 0; i < 4; i++) memcpy(&d[i], rows[i] + at + 208, 2);
    uint64_t packed;
    memcpy(&packed, d, 8);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)packed));
}

/* Four Q6_K rows times x row r, in the header's lanes: out[i], the scalar loop's bits (x's
 * loads shared, the sums halved four at once, as q4_k_dot4_zmm). */
static void q6_k_dot4_zmm(const uint8_t *const rows[4], const QX *x, int64_t r, const uint8_t *ahead, int64_t span, float out[4]) {
    const int8_t *xq = x->kq + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    const int16_t *pairs = x->kpair + r * (x->k / 2);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t part = (span / x->nsb + 63) & ~(int64_t)63;
    for (int sb = 0; sb < x->nsb; sb++) {
        const int64_t at = (int64_t)sb * 210;
        prefetch_part(ahead, span, part, sb);
        const __m128 dsx = _mm_mul_ps(q6_k_d4(rows, at), _mm_set1_ps(xs[sb]));
        for (int i = 0; i < 4; i++) {
            __m512i q[4], sc[4];
            q6_k_row_steps(rows[i] + at, q, sc);
            const __m512 ds = _mm512_permutexvar_ps(_mm512_set1_epi32(i), _mm512_castps128_ps512(dsx));
            const __m512i lanes = q6_k_lanes(q, sc, xq + sb * KBLOCK, pairs + sb * (KBLOCK / 2));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(ds, _mm512_cvtepi32_ps(lanes)));
        }
    }
    _mm_storeu_ps(out, halve16x4(acc[0], acc[1], acc[2], acc[3]));
}

static void q6_k_decode4(const uint8_t *const rows[4], int nsb, const uint8_t *ahead, int64_t span, Quad *quad) {
    const int64_t part = (span / nsb + 63) & ~(int64_t)63;
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t at = (int64_t)sb * 210;
        prefetch_part(ahead, span, part, sb);
        _mm_storeu_ps(quad->d + 8 * sb, q6_k_d4(rows, at));
        for (int i = 0; i < 4; i++) {
            __m512i *q = quad->w + 16 * sb + 4 * i, *sc = quad->sc + 16 * sb + 4 * i;
            q6_k_row_steps(rows[i] + at, q, sc);
            /* q - 32 as signed bytes, so a token's x goes in as x + 128 (unsigned) and the 128s
             * come off once a row and super-block: (x + 128)(q - 32) less 128 (q - 32) */
            __m512i offset = _mm512_setzero_si512();
            for (int step = 0; step < 4; step++) {
                q[step] = _mm512_sub_epi8(q[step], _mm512_set1_epi8(32));
                offset = _mm512_dpwssd_epi32(offset, _mm512_maddubs_epi16(_mm512_set1_epi8((char)128), q[step]), sc[step]);
            }
            quad->offset[4 * sb + i] = offset;
        }
    }
}

/* q6_k_dot4_zmm's steps over a decoded quad: the same integers (each lane's sum of scale *
 * (q - 32) * x, from (x + 128) against q - 32 less the row's offset), so the same bits. */
static void q6_k_dot4_decoded(const Quad *quad, const QX *x, int64_t r, float out[4]) {
    const uint8_t *xu = x->kqu + r * x->k;
    const float *xs = x->ks + r * x->nsb;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int sb = 0; sb < x->nsb; sb++) {
        const __m128 dsx = _mm_mul_ps(_mm_loadu_ps(quad->d + 8 * sb), _mm_set1_ps(xs[sb]));
        __m512i xv[4];
        for (int step = 0; step < 4; step++) xv[step] = _mm512_loadu_si512(xu + sb * KBLOCK + 64 * step);
        for (int i = 0; i < 4; i++) {
            const __m512i *q = quad->w + 16 * sb + 4 * i, *sc = quad->sc + 16 * sb + 4 * i;
            __m512i lanes = _mm512_setzero_si512();
            for (int step = 0; step < 4; step++) lanes = _mm512_dpwssd_epi32(lanes, _mm512_maddubs_epi16(xv[step], q[step]), sc[step]);
            lanes = _mm512_sub_epi32(lanes, quad->offset[4 * sb + i]);
            const __m512 ds = _mm512_permutexvar_ps(_mm512_set1_epi32(i), _mm512_castps128_ps512(dsx));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(ds, _mm512_cvtepi32_ps(lanes)));
        }
    }
    _mm_storeu_ps(out, halve16x4(acc[0], acc[1], acc[2], acc[3]));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TILE 8
/* 8 rows (types of blocks of 32) decoded side by side: their block scales and mins stored
 * [block][row], so one load gives a block's 8 lanes. */
typedef struct {
    Row rows[TILE];
    float *s, *m;
    const uint8_t *raw[TILE]; /* the rows' blocks in the file, read directly (Q8_0) */
    int direct;
} Tile;

/* Block b's 32 unsigned quants of a Q8_0 row read straight from its blocks (q ^ 0x80). */
static inline __m256i direct_quants(const uint8_t *raw, int b) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(raw + (int64_t)b * 34 + 2)), _mm256_set1_epi8((char)0x80));
}

/* Lane r = the sum of v[r]'s 8 lanes. */
static inline __m256i sum_lanes8(const __m256i v[TILE]) {
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* 8 outputs (the tile's rows) for x row r, each lane the scalar row_dot's steps in its order. */
static void tile_dot(int type, const Tile *t, const QX *x, int64_t r, float out[TILE]) {
    const int8_t *xq = x->q + r * x->k;
    const float *xs = x->s + r * x->nb, *xu = x->u + r * x->nb;
    const int32_t *half = x->half + r * 2 * x->nb;
    const int offset = type == T_Q8_0 ? 128 : (type == T_Q5_0 ? 16 : 0);
    const int mins = type == T_Q4_0 || type == T_Q4_1;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < x->nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * MBLOCK));
        __m256i v[TILE];
        if (t->direct) {
            for (int i = 0; i < TILE; i++) v[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), direct_quants(t->raw[i], b), xv);
        } else {
            for (int i = 0; i < TILE; i++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(t->rows[i].u + b * MBLOCK));
                v[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
            }
        }
        __m256i dots = sum_lanes8(v);
        if (offset) {
            dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(offset * (half[2 * b] + half[2 * b + 1])));
        }
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(t->s + b * TILE), _mm256_set1_ps(xs[b]));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(scaled, _mm256_cvtepi32_ps(dots)));
        if (mins) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(t->m + b * TILE), _mm256_set1_ps(xu[b])));
    }
    _mm256_storeu_ps(out, acc);
}

static void tile_decode(int type, const uint8_t *src, int64_t row_bytes, int k, Tile *t) {
    const int nb = k / MBLOCK;
    t->direct = type == T_Q8_0; /* scales decoded, quants read in place */
    for (int i = 0; i < TILE; i++) {
        Row *row = &t->rows[i];
        t->raw[i] = src + i * row_bytes;
        decode_row_part(type, t->raw[i], k, row, !t->direct);
        for (int b = 0; b < nb; b++) {
            t->s[b * TILE + i] = row->s[b];
            if (type == T_Q4_0 || type == T_Q4_1) t->m[b * TILE + i] = row->m[b];
        }
    }
}

static int tile_alloc(Tile *t, int k) {
    const int nb = k / MBLOCK;
    int ok = 1;
    for (int i = 0; i < TILE; i++) {
        Row *row = &t->rows[i];
        row->u = malloc((size_t)k), row->s = malloc((size_t)nb * sizeof(float)), row->m = malloc((size_t)nb * sizeof(float));
        ok = ok && row->u && row->s && row->m;
    }
    t->s = malloc((size_t)nb * TILE * sizeof(float)), t->m = malloc((size_t)nb * TILE * sizeof(float));
    return ok && t->s && t->m;
}

static void tile_free(Tile *t) {
    for (int i = 0; i < TILE; i++) free(t->rows[i].u), free(t->rows[i].s), free(t->rows[i].m);
    free(t->s), free(t->m);
}
#endif

/* A call's activations quantized once (alloc, fill; free with qx_free): rows x[r * x_stride],
 * in the formats its weight types take (types [count]). Returns 0, or 2 where memory ran out. */
static int qx_build(QX *qx, const float *x, int64_t x_stride, int m, int k, const int *types, int count, int num_threads) {
    int with32 = 0, with256 = 0, with_qp = 0, with_pairs = 0;
    for (int i = 0; i < count; i++) {
        const int kquant = types[i] == T_Q4_K || types[i] == T_Q6_K;
        with32 = with32 || !kquant, with256 = with256 || kquant;
        with_qp = with_qp || types[i] == T_Q4_K, with_pairs = with_pairs || types[i] == T_Q6_K;
    }
    const int nb = k / MBLOCK, nsb = k / KBLOCK;
    memset(qx, 0, sizeof *qx);
    qx->k = k, qx->nb = nb, qx->nsb = nsb;
    if (with32) {
        qx->q = malloc((size_t)m * k), qx->s = malloc((size_t)m * nb * sizeof(float)), qx->u = malloc((size_t)m * nb * sizeof(float));
        qx->half = malloc((size_t)m * nb * 2 * sizeof(int32_t));
        if (!(qx->q && qx->s && qx->u && qx->half)) return 2;
    }
    if (with256) {
        qx->kq = malloc((size_t)m * k), qx->ks = malloc((size_t)m * nsb * sizeof(float));
        qx->ksum32 = malloc((size_t)m * nb * sizeof(int32_t));
        qx->kqp = with_qp ? malloc((size_t)m * k) : NULL;
        qx->kpair = with_pairs ? malloc((size_t)m * (k / 2) * sizeof(int16_t)) : NULL;
        qx->kqu = with_pairs ? malloc((size_t)m * k) : NULL;
        if (!(qx->kq && qx->ks && qx->ksum32 && (!with_qp || qx->kqp) && (!with_pairs || (qx->kpair && qx->kqu)))) return 2;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m > 8)
    for (int r = 0; r < m; r++) {
        const float *row = x + (int64_t)r * x_stride;
        if (with32)
            quantize_x_row(row, k, qx->q + (int64_t)r * k, qx->s + (int64_t)r * nb, qx->u + (int64_t)r * nb,
                           qx->half + (int64_t)r * 2 * nb);
        if (with256)
            quantize_x_row256(row, k, qx->kq + (int64_t)r * k, qx->ks + (int64_t)r * nsb, qx->ksum32 + (int64_t)r * nb);
    }
    if (with_qp)
        for (int64_t b = 0; b < (int64_t)m * nb; b++)
            memcpy(qx->kqp + (b - b % 8 + Q4K_ORDER[b % 8]) * MBLOCK, qx->kq + b * MBLOCK, MBLOCK);
    if (with_pairs) {
        for (int64_t g = 0; g < (int64_t)m * (k / 2); g++) qx->kpair[g] = (int16_t)(32 * (qx->kq[2 * g] + qx->kq[2 * g + 1]));
        for (int64_t i = 0; i < (int64_t)m * k; i++) qx->kqu[i] = (uint8_t)(qx->kq[i] + 128);
    }
    return 0;
}

static void qx_free(QX *qx) {
    free(qx->q), free(qx->s), free(qx->u), free(qx->half);
    free(qx->kq), free(qx->kqp), free(qx->ks), free(qx->ksum32), free(qx->kpair), free(qx->kqu);
}

/* One weight of a grouped call: the stacked experts' blocks, their type and shape. */
typedef struct {
    int type, n;
    const uint8_t *weights;
    int64_t expert_bytes, row_bytes;
    float *y; /* output pair p's row at y + p * y_stride, columns [0, n) */
    int64_t y_stride;
} Matrix;

/* Each matrix's rows for every group's expert and x rows (radixkv_moe_grouped's contract), the
 * matrices' (expert, 8 rows) items in one list split over the threads. Returns 0 or 2. */
static int grouped_items(const Matrix *mats, int count, const QX *qx, const int32_t *experts, const int32_t *offsets, int groups,
                         const int32_t *x_rows, int num_threads, int use_vnni) {
    const int k = qx->k, nb = qx->nb;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Row row = {malloc((size_t)k), malloc((size_t)nb * sizeof(float)), malloc((size_t)nb * sizeof(float))};
        int ok = row.u && row.s && row.m;
        int tiled = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        /* K-quant rows decoded once per group of several tokens */
        Quad quad;
        memset(&quad, 0, sizeof quad);
        int quads = 0;
        for (int i = 0; i < count; i++) quads = quads || mats[i].type == T_Q4_K || mats[i].type == T_Q6_K;
        quads = quads && use_vnni && qx->nsb > 0;
        if (quads) ok = quad_alloc(&quad, qx->nsb) && ok;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        /* Tiles of 8 rows: one reduction tree and one vector of sums for 8 outputs. */
        Tile tile;
        memset(&tile, 0, sizeof tile);
        for (int i = 0; i < count; i++) tiled = tiled || (mats[i].type != T_Q4_K && mats[i].type != T_Q6_K);
        tiled = tiled && use_vnni;
        if (tiled) ok = tile_alloc(&tile, k) && ok;
#else
        (void)tiled;
#endif
        if (!ok) {
#pragma omp atomic write
            status = 2;
        }
        /* One list of (matrix, expert, 8 rows) items split over the threads: no barrier between
         * experts, and each output is computed whole by one thread (the same bits for any
         * thread count). */
        int64_t total = 0;
        for (int i = 0; i < count; i++) total += (int64_t)groups * ((mats[i].n + 7) / 8);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < total; item++) {
            int64_t rest = item;
            int mi = 0;
            while (rest >= (int64_t)groups * ((mats[mi].n + 7) / 8)) rest -= (int64_t)groups * ((mats[mi].n + 7) / 8), mi++;
            const Matrix *mat = &mats[mi];
            const int type = mat->type, n = mat->n, tiles = (n + 7) / 8, kquant = type == T_Q4_K || type == T_Q6_K;
            const int g = (int)(rest / tiles), tix = (int)(rest % tiles);
            const uint8_t *expert = mat->weights + (int64_t)experts[g] * mat->expert_bytes;
            const int64_t row_bytes = mat->row_bytes, y_stride = mat->y_stride;
            float *y = mat->y;
            if (!ok) continue;
            const int o0 = tix * 8, live = n - o0 < 8 ? n - o0 : 8;
            if (kquant) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                if (use_vnni) {
                    /* rows four at a time (a tail repeats its first row, its extra sums unused) */
                    for (int o = o0; o < o0 + live; o += 4) {
                        const int count4 = o0 + live - o < 4 ? o0 + live - o : 4;
                        const uint8_t *rows4[4];
                        for (int i = 0; i < 4; i++) rows4[i] = expert + (int64_t)(i < count4 ? o + i : o) * row_bytes;
                        /* the rows four groups on, into L2 (past an expert's last: unused lines, no fault) */
                        const uint8_t *ahead = expert + (int64_t)(o + 16) * row_bytes;
                        if (offsets[g + 1] - offsets[g] >= QUAD_TOKENS) {
                            (type == T_Q4_K ? q4_k_decode4 : q6_k_decode4)(rows4, qx->nsb, ahead, 4 * row_bytes, &quad);
                            for (int p = offsets[g]; p < offsets[g + 1]; p++) {
                                float out4[4];
                                (type == T_Q4_K ? q4_k_dot4_decoded : q6_k_dot4_decoded)(&quad, qx, x_rows[p], out4);
                                memcpy(y + (int64_t)p * y_stride + o, out4, (size_t)count4 * sizeof(float));
                            }
                            continue;
                        }
                        for (int p = offsets[g]; p < offsets[g + 1]; p++) {
                            float out4[4];
                            (type == T_Q4_K ? q4_k_dot4_zmm : q6_k_dot4_zmm)(rows4, qx, x_rows[p], p == offsets[g] ? ahead : NULL,
                                                                               4 * row_bytes, out4);
                            memcpy(y + (int64_t)p * y_stride + o, out4, (size_t)count4 * sizeof(float));
                        }
                    }
                    continue;
                }
#endif
                for (int o = o0; o < o0 + live; o++) {
                    const uint8_t *raw = expert + (int64_t)o * row_bytes;
                    for (int p = offsets[g]; p < offsets[g + 1]; p++)
                        y[(int64_t)p * y_stride + o] = (type == T_Q4_K ? q4_k_dot_scalar : q6_k_dot_scalar)(raw, qx, x_rows[p]);
                }
                continue;
            }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            if (tiled && live == 8) {
                tile_decode(type, expert + (int64_t)o0 * row_bytes, row_bytes, k, &tile);
                for (int p = offsets[g]; p < offsets[g + 1]; p++) {
                    float lanes[8];
                    tile_dot(type, &tile, qx, x_rows[p], lanes);
                    memcpy(y + (int64_t)p * y_stride + o0, lanes, sizeof lanes);
                }
                continue;
            }
#endif
            for (int o = o0; o < o0 + live; o++) {
                decode_row(type, expert + (int64_t)o * row_bytes, k, &row);
                for (int p = offsets[g]; p < offsets[g + 1]; p++)
                    y[(int64_t)p * y_stride + o] = row_dot(type, &row, qx, x_rows[p], use_vnni);
            }
        }
        free(row.u), free(row.s), free(row.m);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (quads) quad_free(&quad);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if (tiled) tile_free(&tile);
#endif
    }
    return status;
}

/* For each group g: expert experts[g]'s weight (weights + experts[g] * expert_bytes, n rows of
 * row_bytes) times x rows x_rows[p] for pairs p in [offsets[g], offsets[g + 1]), into y row p,
 * columns [0, n) (y_stride floats a row). x fp32 [m][x_stride]. Returns 1 for a type or shape
 * it does not take, 2 where memory ran out. */
int radixkv_moe_grouped(int type, const uint8_t *weights, int64_t expert_bytes, int n, int k, const float *x,
                        int64_t x_stride, int m, const int32_t *experts, const int32_t *offsets, int groups,
                        const int32_t *x_rows, float *y, int64_t y_stride, int num_threads, int use_vnni) {
    const int64_t row_bytes = radixkv_moe_row_bytes(type, k);
    if (!row_bytes || n <= 0 || m < 0) return 1;
    if (m == 0 || groups == 0) return 0;
    QX qx;
    int status = qx_build(&qx, x, x_stride, m, k, &type, 1, num_threads);
    const Matrix mat = {type, n, weights, expert_bytes, row_bytes, y, y_stride};
    if (!status) status = grouped_items(&mat, 1, &qx, experts, offsets, groups, x_rows, num_threads, use_vnni);
    qx_free(&qx);
    return status;
}

/* One token's experts (a decode step): its top-k ids (int64, distinct, any order) sorted
 * ascending into experts, with their routing weights (fp32, or bf16 when bf16) in the same
 * order into w; weights and w NULL: the ids alone. */
static void sort_experts(const int64_t *ids, const void *weights, int bf16, int count, int32_t *experts, float *w) {
    for (int i = 0; i < count; i++) {
        int at = i;
        while (at > 0 && experts[at - 1] > ids[i]) {
            experts[at] = experts[at - 1];
            if (w) w[at] = w[at - 1];
            at--;
        }
        experts[at] = (int32_t)ids[i];
        if (w) w[at] = bf16 ? bf16_to_float(((const uint16_t *)weights)[i]) : ((const float *)weights)[i];
    }
}

/* A decode step's gate and up projections over its one token x [k] (fp32), x quantized once
 * (weights stacked [experts][n][row bytes], as radixkv_moe_grouped's with expert_bytes = n rows):
 * for the top-k ids (int64 [count]) in ascending order, y [count][2n] takes the expert's gate
 * row outputs in columns [0, n) and its up outputs in [n, 2n); radixkv_moe_grouped's bits.
 * Returns 1 for a type or shape it does not take, 2 where memory ran out. */
int radixkv_moe_row_gate_up(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int n, int k,
                            const float *x, const int64_t *ids, int count, float *y, int num_threads, int use_vnni) {
    const int64_t gate_bytes = radixkv_moe_row_bytes(gate_type, k), up_bytes = radixkv_moe_row_bytes(up_type, k);
    if (!gate_bytes || !up_bytes || n <= 0 || count <= 0 || count > 64) return 1;
    int32_t experts[64], offsets[65], rows[64];
    sort_experts(ids, NULL, 0, count, experts, NULL);
    for (int i = 0; i <= count; i++) offsets[i] = i;
    memset(rows, 0, sizeof rows);
    QX qx;
    const int types[2] = {gate_type, up_type};
    int status = qx_build(&qx, x, k, 1, k, types, 2, 1);
    const Matrix mats[2] = {{gate_type, n, gate, n * gate_bytes, gate_bytes, y, 2 * (int64_t)n},
                            {up_type, n, up, n * up_bytes, up_bytes, y + n, 2 * (int64_t)n}};
    if (!status) status = grouped_items(mats, 2, &qx, experts, offsets, count, rows, num_threads, use_vnni);
    qx_free(&qx);
    return status;
}

#if defined(__AVX512F__)
/* float_to_bf16's rounding (nearest even, a NaN quieted) of 16 lanes, back as floats. */
static inline __m512 round_bf16x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

/* out[o] = sum over i of y[i][o] * w[i] as radixkv_moe_row_down documents, outputs [0, n): 16
 * at a time where vector (the same roundings lane by lane, so the scalar loop's bits), the rest
 * and use_vnni=0 (tests) in the scalar loop. */
static void weighted_sum(const float *y, const float *w, int count, int n, void *out, int out_bf16, int vector) {
    int o = 0;
#if defined(__AVX512F__)
    for (; vector && o + 16 <= n; o += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < count; i++) {
            const __m512 yi = _mm512_loadu_ps(y + (int64_t)i * n + o), wi = _mm512_set1_ps(w[i]);
            acc = _mm512_add_ps(acc, out_bf16 ? round_bf16x16(_mm512_mul_ps(round_bf16x16(yi), wi)) : _mm512_mul_ps(yi, wi));
        }
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16x16(acc)), 16)));
        else
            _mm512_storeu_ps((float *)out + o, acc);
    }
#else
    (void)vector;
#endif
    for (; o < n; o++) {
        float acc = 0.0f;
        for (int i = 0; i < count; i++) {
            const float yi = y[(int64_t)i * n + o];
            /* bf16: y and y * w rounded as torch's ops round them; index_add_ sums in fp32 */
            const float term = out_bf16 ? bf16_to_float(float_to_bf16(bf16_to_float(float_to_bf16(yi)) * w[i])) : yi * w[i];
            acc = acc + term;
        }
        if (out_bf16) ((uint16_t *)out)[o] = float_to_bf16(acc);
        else ((float *)out)[o] = acc;
    }
}

/* The step's down projections and their weighted sum, as radixkv.model.moe.SparseMoE.combine
 * computes it in the token's dtype (bf16: out_bf16): h [count][k] fp32, the experts' rows in
 * ascending expert order (radixkv_moe_row_gate_up's); each expert's y = down h rounded to the
 * dtype, times its routing weight (rounded), summed in fp32 from 0, experts ascending, rounded
 * once (torch's index_add_ into one bf16 row sums so).
 * weights: the top-k routing weights in ids' order (bf16 or fp32 as out). */
int radixkv_moe_row_down(int type, const uint8_t *down, int n, int k, const float *h, const int64_t *ids, const void *weights, int count,
                         void *out, int out_bf16, int num_threads, int use_vnni) {
    const int64_t row_bytes = radixkv_moe_row_bytes(type, k);
    if (!row_bytes || n <= 0 || count <= 0 || count > 64) return 1;
    int32_t experts[64], offsets[65], rows[64];
    float w[64];
    sort_experts(ids, weights, out_bf16, count, experts, w);
    for (int i = 0; i <= count; i++) offsets[i] = i;
    for (int i = 0; i < count; i++) rows[i] = i;
    float *y = malloc((size_t)count * n * sizeof(float));
    QX qx;
    int status = y ? qx_build(&qx, h, k, count, k, &type, 1, num_threads) : 2;
    const Matrix mat = {type, n, down, n * row_bytes, row_bytes, y, n};
    if (!status) status = grouped_items(&mat, 1, &qx, experts, offsets, count, rows, num_threads, use_vnni);
    if (y) qx_free(&qx);
    if (!status) weighted_sum(y, w, count, n, out, out_bf16, use_vnni);
    free(y);
    return status;
}

/* A decode step's experts block for its one token x [hidden] (bf16 when bf16, else fp32) routed
 * to ids (int64 [top_k], distinct, any order) with weights (x's dtype, ids' order), as
 * radixkv.model.moe.SparseMoE.combine computes it: gate and up (radixkv_moe_row_gate_up, over x
 * widened exactly to fp32), SiLU(gate) * up (radixkv_silu_mul_f32, as MappedExperts.grouped
 * calls it) and the weighted down sum (radixkv_moe_row_down) into out [hidden] in x's dtype: one
 * call for what took two and three torch ops between them. scratch: radixkv_moe_token_floats
 * floats. Returns 1 for a shape or type it does not take, 2 where memory ran out. */
int radixkv_moe_token(const void *x, int bf16, int hidden, const int64_t *ids, const void *weights, int top_k, int gate_type,
                      const uint8_t *gate, int up_type, const uint8_t *up, int down_type, const uint8_t *down, int size,
                      float *scratch, void *out, int num_threads, int use_vnni) {
    float *x32 = scratch, *gate_up = x32 + hidden, *h = gate_up + 2 * (int64_t)top_k * size;
    for (int i = 0; i < hidden; i++) x32[i] = bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const int status = radixkv_moe_row_gate_up(gate_type, gate, up_type, up, size, hidden, x32, ids, top_k, gate_up,
                                               num_threads, use_vnni);
    if (status) return status;
    radixkv_silu_mul_f32(gate_up, 2 * (int64_t)size, h, top_k, size, num_threads);
    return radixkv_moe_row_down(down_type, down, hidden, size, h, ids, weights, top_k, out, bf16, num_threads, use_vnni);
}

/* Floats of scratch radixkv_moe_token takes. */
int64_t radixkv_moe_token_floats(int hidden, int top_k, int size) { return hidden + 3 * (int64_t)top_k * size; }

/* Whether the VNNI dot product is compiled in (else the scalar loop runs, the same integers). */
int radixkv_moe_has_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

/* Float experts (weight_dtype="float", fp32): y[p][o] = sum_j x[x_rows[p]][j] * w_e[o][j] for
 * each group's expert e, w_e at weights + e * expert_floats, [n][k] row-major; 16 lanes with
 * fused multiply-adds (close to, not bitwise, torch's GEMM). */
int radixkv_moe_grouped_f32(const float *weights, int64_t expert_floats, int n, int k, const float *x, int64_t x_stride,
                            const int32_t *experts, const int32_t *offsets, int groups, const int32_t *x_rows, float *y,
                            int64_t y_stride, int num_threads) {
    if (n <= 0 || k <= 0) return 1;
#pragma omp parallel num_threads(num_threads)
    for (int g = 0; g < groups; g++) {
        const float *expert = weights + (int64_t)experts[g] * expert_floats;
#pragma omp for schedule(static)
        for (int o = 0; o < n; o++) {
            const float *w = expert + (int64_t)o * k;
            for (int p = offsets[g]; p < offsets[g + 1]; p++) {
                const float *v = x + (int64_t)x_rows[p] * x_stride;
#if defined(__AVX512F__)
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                int j = 0;
                for (; j + 32 <= k; j += 32) {
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(v + j), a0);
                    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(v + j + 16), a1);
                }
                float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
                float acc = 0.0f;
                int j = 0;
#endif
                for (; j < k; j++) acc += w[j] * v[j];
                y[(int64_t)p * y_stride + o] = acc;
            }
        }
    }
    return 0;
}
