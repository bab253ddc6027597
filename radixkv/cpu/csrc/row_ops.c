/* The row-wise glue of a decoder layer for bf16 on CPU, one call each instead of five to ten
 * small torch ops: residual add + RMSNorm, rotary embedding in place, and SiLU(gate) * up.
 *
 * Each kernel rounds to bf16 where the torch ops it replaces round (radixkv/model/llama.py),
 * so the results match them bit for bit except where a reduction or exp is ordered or
 * approximated differently (the RMSNorm sum of squares, SiLU's exp): a last-bit difference
 * now and then, never one that depends on the other rows of the batch.
 */
#include "bf16.h"

#ifdef HAVE_AVX512_BF16
/* vcvtneps2bf16 rounds to nearest even, as torch does (NaN payloads aside). */
static inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 rounded16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(x)), 16)); }
static inline void store16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, round16(x)); }
#endif

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_ELEMENTS 16384

/* residual += delta (when delta is not NULL), then out = weight * bf16(residual * rsqrt(mean
 * of squares + eps)): transformers' LlamaRMSNorm after the layer's residual add. [rows][dim]. */
void radixkv_add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                               uint16_t *out, int rows, int dim, float eps, int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        uint16_t *x = residual + (int64_t)r * dim;
        uint16_t *y = out + (int64_t)r * dim;
#ifdef HAVE_AVX512_BF16
        if (dim % 16 == 0) {
            __m512 squares = _mm512_setzero_ps();
            for (int i = 0; i < dim; i += 16) {
                __m512 v = load16(x + i);
                if (delta) {
                    v = rounded16(_mm512_add_ps(v, load16(delta + (int64_t)r * dim + i)));
                    _mm256_storeu_si256((__m256i *)(x + i), round16(v));
                }
                squares = _mm512_fmadd_ps(v, v, squares);
            }
            const __m512 inv_rms = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
            for (int i = 0; i < dim; i += 16)
                store16(y + i, _mm512_mul_ps(load16(weight + i), rounded16(_mm512_mul_ps(load16(x + i), inv_rms))));
            continue;
        }
#endif
        if (delta) {
            const uint16_t *d = delta + (int64_t)r * dim;
            for (int i = 0; i < dim; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(d[i]));
        }
        float squares = 0.0f;
#pragma omp simd reduction(+:squares)
        for (int i = 0; i < dim; i++) squares += bf16_to_float(x[i]) * bf16_to_float(x[i]);
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int i = 0; i < dim; i++) {
            const float normed = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * inv_rms));
            y[i] = float_to_bf16(bf16_to_float(weight[i]) * normed);
        }
    }
}

/* Rotate `heads` heads of each row in place: x = x * cos + swap_halves(x) * signed_sin, each
 * product and the sum rounded to bf16 like torch's ops. x: [rows][row_stride], heads side by
 * side from the row's start; cos, signed_sin: [rows][head_dim]. */
void radixkv_rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim,
                       const uint16_t *cos, const uint16_t *signed_sin, int num_threads) {
    const int half = head_dim / 2;
    if (head_dim > 1024) return;
    const int threads = (int64_t)rows * heads * head_dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *c = cos + (int64_t)r * head_dim, *s = signed_sin + (int64_t)r * head_dim;
        uint16_t *row = x + (int64_t)r * row_stride;
#ifdef HAVE_AVX512_BF16
        if (half % 16 == 0) {
            for (int i = 0; i < half; i += 16) { /* cos and sin once per row, for every head */
                const __m512 c_lo = load16(c + i), c_hi = load16(c + half + i);
                const __m512 s_lo = load16(s + i), s_hi = load16(s + half + i);
                for (int h = 0; h < heads; h++) {
                    uint16_t *v = row + (int64_t)h * head_dim;
                    const __m512 lo = load16(v + i), hi = load16(v + half + i);
                    store16(v + i, _mm512_add_ps(rounded16(_mm512_mul_ps(lo, c_lo)), rounded16(_mm512_mul_ps(hi, s_lo))));
                    store16(v + half + i, _mm512_add_ps(rounded16(_mm512_mul_ps(hi, c_hi)), rounded16(_mm512_mul_ps(lo, s_hi))));
                }
            }
            continue;
        }
#endif
        uint16_t rotated[1024];
        for (int h = 0; h < heads; h++) {
            uint16_t *v = row + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; i++) {
                const float swapped = bf16_to_float(v[i < half ? i + half : i - half]);
                const float a = bf16_to_float(float_to_bf16(bf16_to_float(v[i]) * bf16_to_float(c[i])));
                const float b = bf16_to_float(float_to_bf16(swapped * bf16_to_float(s[i])));
                rotated[i] = float_to_bf16(a + b);
            }
            memcpy(v, rotated, sizeof(uint16_t) * head_dim);
        }
    }
}

/* out = bf16(silu(gate)) * up, rounded like torch's F.silu(gate) * up. gate_up: [rows][row_stride]
 * with gate in columns [0, dim) and up in [dim, 2 dim); out: [rows][dim]. */
void radixkv_silu_mul_bf16(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int rows, int dim,
                           int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (int64_t)r * row_stride, *up = gate + dim;
        uint16_t *y = out + (int64_t)r * dim;
#ifdef HAVE_AVX512_BF16
        if (dim % 16 == 0) {
            for (int i = 0; i < dim; i += 16) {
                const __m512 g = load16(gate + i);
                const __m512 activated = rounded16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                store16(y + i, _mm512_mul_ps(activated, load16(up + i)));
            }
            continue;
        }
#endif
        for (int i = 0; i < dim; i++) {
            const float g = bf16_to_float(gate[i]);
            const float activated = bf16_to_float(float_to_bf16(g / (1.0f + expf(-g))));
            y[i] = float_to_bf16(activated * bf16_to_float(up[i]));
        }
    }
}
