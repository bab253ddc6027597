/* The row-wise glue of a decoder layer for bf16 on CPU, one call each instead of five to ten
 * small torch ops: residual add + RMSNorm, rotary embedding in place, and SiLU(gate) * up.
 *
 * Each kernel rounds to bf16 where the torch ops it replaces round (radixkv/model/llama.py),
 * so the results match them bit for bit except where a reduction or exp is ordered or
 * approximated differently (the RMSNorm sum of squares, SiLU's exp): a last-bit difference
 * now and then, never one that depends on the other rows of the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* vcvtneps2bf16 rounds to nearest even, as torch does (NaN payloads aside). */
static inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 rounded16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(x)), 16)); }
static inline void store16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, round16(x)); }

/* e^x, Cephes' expf (about 1 ulp), 16 lanes; inputs clamped to [-87, 88]. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_ELEMENTS 65536

static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch converts float to bfloat16. */
static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

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
            for (int i = 0; i < dim; i++) x[i] = bf16_round(bf16_value(x[i]) + bf16_value(d[i]));
        }
        float squares = 0.0f;
#pragma omp simd reduction(+:squares)
        for (int i = 0; i < dim; i++) squares += bf16_value(x[i]) * bf16_value(x[i]);
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int i = 0; i < dim; i++) {
            const float normed = bf16_value(bf16_round(bf16_value(x[i]) * inv_rms));
            y[i] = bf16_round(bf16_value(weight[i]) * normed);
        }
    }
}

/* Rotate `heads` heads of each row in place: x = x * cos + swap_halves(x) * signed_sin, each
 * product and the sum rounded to bf16 like torch's ops. x: [rows][row_stride], heads side by
 * side from the row's start; cos, signed_sin: [rows][head_dim]. */
void radixkv_rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim,
                       const uint16_t *cos, const uint16_t *signed_sin) {
    const int half = head_dim / 2;
    uint16_t rotated[1024];
    if (head_dim > 1024) return;
    for (int r = 0; r < rows; r++) {
        const uint16_t *c = cos + (int64_t)r * head_dim, *s = signed_sin + (int64_t)r * head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + (int64_t)r * row_stride + (int64_t)h * head_dim;
#ifdef HAVE_AVX512_BF16
            if (half % 16 == 0) {
                for (int i = 0; i < half; i += 16) {
                    const __m512 lo = load16(v + i), hi = load16(v + half + i);
                    const __m512 new_lo = _mm512_add_ps(rounded16(_mm512_mul_ps(lo, load16(c + i))),
                                                        rounded16(_mm512_mul_ps(hi, load16(s + i))));
                    const __m512 new_hi = _mm512_add_ps(rounded16(_mm512_mul_ps(hi, load16(c + half + i))),
                                                        rounded16(_mm512_mul_ps(lo, load16(s + half + i))));
                    store16(v + i, new_lo);
                    store16(v + half + i, new_hi);
                }
                continue;
            }
#endif
            for (int i = 0; i < head_dim; i++) {
                const float swapped = bf16_value(v[i < half ? i + half : i - half]);
                const float a = bf16_value(bf16_round(bf16_value(v[i]) * bf16_value(c[i])));
                const float b = bf16_value(bf16_round(swapped * bf16_value(s[i])));
                rotated[i] = bf16_round(a + b);
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
            const float g = bf16_value(gate[i]);
            const float activated = bf16_value(bf16_round(g / (1.0f + expf(-g))));
            y[i] = bf16_round(activated * bf16_value(up[i]));
        }
    }
}
