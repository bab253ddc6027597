/* The row-wise glue of a decoder layer on CPU, one call each instead of five to ten small
 * torch ops: residual add + RMSNorm, rotary embedding in place, and SiLU(gate) * up; in bf16
 * and in fp32.
 *
 * Each kernel rounds where the torch ops it replaces round (radixkv/model/llama.py: to bf16
 * after each op in bf16, every op once in fp32), so the results match them bit for bit except
 * where a reduction or exp is ordered or approximated differently (the RMSNorm sum of squares,
 * SiLU's exp): a last-bit difference now and then, never one that depends on the other rows
 * of the batch.
 */
#include "bf16.h"
#include "kernels.h"

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

/* fp32 versions of the three kernels above. No product is fused into an add (the file builds
 * as ISO C, where GCC does not contract): x * x, then the sum, as torch's pow and mean. */

/* Lane 0 of the result: the sum of v's 8 lanes. */
#ifdef HAVE_AVX2
static inline float sum8(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

void radixkv_add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int rows, int dim,
                              float eps, int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        float *x = residual + (int64_t)r * dim, *y = out + (int64_t)r * dim;
        const float *d = delta ? delta + (int64_t)r * dim : NULL;
        int i = 0;
        float squares = 0.0f;
#ifdef HAVE_AVX2
        __m256 lanes = _mm256_setzero_ps();
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (d) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(d + i));
                _mm256_storeu_ps(x + i, v);
            }
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
        }
        squares = sum8(lanes);
#endif
        for (; i < dim; i++) {
            if (d) x[i] += d[i];
            squares += x[i] * x[i];
        }
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
        i = 0;
#ifdef HAVE_AVX2
        const __m256 scale = _mm256_set1_ps(inv_rms);
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), scale)));
#endif
        for (; i < dim; i++) y[i] = weight[i] * (x[i] * inv_rms);
    }
}

void radixkv_rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim, const float *cos,
                      const float *signed_sin, int num_threads) {
    const int half = head_dim / 2;
    const int threads = (int64_t)rows * heads * head_dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * head_dim, *s = signed_sin + (int64_t)r * head_dim;
        float *row = x + (int64_t)r * row_stride;
        int i = 0;
#ifdef HAVE_AVX2
        for (; i + 8 <= half; i += 8) { /* cos and sin once per row, for every head */
            const __m256 c_lo = _mm256_loadu_ps(c + i), c_hi = _mm256_loadu_ps(c + half + i);
            const __m256 s_lo = _mm256_loadu_ps(s + i), s_hi = _mm256_loadu_ps(s + half + i);
            for (int h = 0; h < heads; h++) {
                float *v = row + (int64_t)h * head_dim;
                const __m256 lo = _mm256_loadu_ps(v + i), hi = _mm256_loadu_ps(v + half + i);
                _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_mul_ps(lo, c_lo), _mm256_mul_ps(hi, s_lo)));
                _mm256_storeu_ps(v + half + i, _mm256_add_ps(_mm256_mul_ps(hi, c_hi), _mm256_mul_ps(lo, s_hi)));
            }
        }
#endif
        for (int h = 0; h < heads; h++) /* the dims past the last full vector, each pair once */
            for (int j = i; j < half; j++) {
                float *v = row + (int64_t)h * head_dim;
                const float lo = v[j], hi = v[half + j];
                v[j] = lo * c[j] + hi * s[j];
                v[half + j] = hi * c[half + j] + lo * s[half + j];
            }
    }
}

void radixkv_silu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int rows, int dim, int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (int64_t)r * row_stride, *up = gate + dim;
        float *y = out + (int64_t)r * dim;
        int i = 0;
#ifdef HAVE_AVX2
        for (; i + 8 <= dim; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 activated = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(activated, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < dim; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
