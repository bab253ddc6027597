/* Kernels over a step's fp32 logits rows, before and at sampling: a grammar's token bitmask
 * (disallowed tokens to -inf) and the greedy argmax.
 *
 * Bitmask: bit j of word i allows token 32 * i + j (xgrammar's layout). xgrammar's own CPU
 * apply took ~4.3 ms for 32 rows of a 49k vocabulary, a tenth of a decode step; a word at a
 * time, with whole words of 0 (the common case inside a JSON value) written as one run, this
 * is a pass over the logits at memory speed.
 *
 * Argmax: torch's max(dim=-1).indices tracks the index lane by lane and took ~0.7-1.3 ms for
 * 32 rows of a 49k vocabulary on 2 cores, where the max alone takes 0.05 ms: here a pass finds
 * the max and a second, stopping at it, its first index.
 *
 * Non-finite rows: whether a row holds a NaN or an infinity, in one pass over its bits (the
 * runner's guard before sampling; torch took a sum, an isfinite, a not and an any, four ops).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* logits [rows of logits_stride floats]; bitmask [rows of mask_stride int32]; row_ids: the
 * nrows logits rows to mask, each masked by the bitmask row of the same index. */
void radixkv_apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask, int64_t mask_stride,
                                     const int32_t *row_ids, int nrows, int vocab) {
    const int words = (vocab + 31) / 32;
    for (int r = 0; r < nrows; r++) {
        float *row = logits + (int64_t)row_ids[r] * logits_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + (int64_t)row_ids[r] * mask_stride);
        for (int w = 0; w < words; w++) {
            const uint32_t bits = mask[w];
            if (bits == 0xffffffffu) continue;
            const int first = 32 * w, count = vocab - first < 32 ? vocab - first : 32;
            for (int j = 0; j < count; j++)
                if (!((bits >> j) & 1u)) row[first + j] = -INFINITY;
        }
    }
}

/* The first index of row's maximum; a NaN counts above every number, as in torch's max. */
static int64_t row_argmax(const float *row, int64_t n) {
    int64_t i = 0;
    float top = row[0];
#ifdef HAVE_AVX512
    if (n >= 16) {
        __m512 tops = _mm512_loadu_ps(row);
        __mmask16 nan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 x = _mm512_loadu_ps(row + i);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            tops = _mm512_max_ps(tops, x);
        }
        if (nan) { /* the first NaN */
            for (int64_t j = 0; j < n; j++)
                if (row[j] != row[j]) return j;
        }
        top = _mm512_reduce_max_ps(tops);
        for (; i < n; i++) /* the tail past the last full vector */
            if (row[i] != row[i]) return i;
            else if (row[i] > top) top = row[i];
        const __m512 wanted = _mm512_set1_ps(top);
        for (int64_t j = 0; j + 16 <= n; j += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), wanted, _CMP_EQ_OQ);
            if (hit) return j + __builtin_ctz(hit);
        }
        for (int64_t j = n - n % 16; j < n; j++)
            if (row[j] == top) return j;
        return 0; /* not reached: top is one of the row's values */
    }
#endif
    int64_t best = 0;
    for (i = 0; i < n; i++) {
        if (row[i] != row[i]) return i;
        if (row[i] > top) top = row[i], best = i;
    }
    return best;
}

/* out[r] = the first index of row r's maximum, for rows [rows][stride] of n floats. */
void radixkv_argmax_rows_f32(const float *logits, int64_t stride, int rows, int64_t n, int64_t *out,
                             int num_threads) {
    const int threads = (int64_t)rows * n >= 65536 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) out[r] = n > 0 ? row_argmax(logits + (int64_t)r * stride, n) : 0;
}

/* bad[r] = 1 where row r of n floats holds a NaN or an infinity (all exponent bits set), else 0. */
void radixkv_nonfinite_rows_f32(const float *logits, int64_t stride, int rows, int64_t n, uint8_t *bad, int num_threads) {
    const int threads = (int64_t)rows * n >= 65536 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint32_t *row = (const uint32_t *)(logits + (int64_t)r * stride);
        uint32_t found = 0;
        for (int64_t i = 0; i < n; i++) found |= (row[i] & 0x7f800000u) == 0x7f800000u;
        bad[r] = (uint8_t)found;
    }
}
