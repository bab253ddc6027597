/* Gemma 3's row glue on CPU, in bf16 and fp32: its RMSNorm (normalized in fp32, times (1 + w)
 * in fp32, rounded once), with or without the residual add before it and over heads of a row
 * (the per-head q/k norms), and GeGLU (gelu with the tanh approximation, times up).
 *
 * The layer-by-layer forward (radixkv/model/llama.py) and the fused decode step
 * (decode_layers.c) call these same functions, so the two are bit-identical. Against
 * transformers' torch ops they round at the same points; the sum of squares and tanh are
 * ordered or approximated differently (a last-bit difference now and then).
 */
#include "bf16.h"
#include "kernels.h"

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_ELEMENTS 16384

/* sqrt(2 / pi) and the cubic's coefficient of gelu's tanh approximation. */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

/* For each row r and head h, the `dim` values v at x + r * x_stride + h * dim: when delta is not
 * NULL, v += delta (same layout; the sum rounded to the dtype and stored back into x, the
 * residual stream); then out (same layout at out_stride) = v * rsqrt(mean(v^2) + eps) * (1 + w),
 * in fp32, rounded once. out may be x (in place). */
void radixkv_gemma_norm_bf16(uint16_t *x, int64_t x_stride, const uint16_t *delta, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int rows, int heads, int dim, float eps,
                             int num_threads) {
    const int threads = (int64_t)rows * heads * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + (int64_t)r * x_stride + (int64_t)h * dim;
            uint16_t *y = out + (int64_t)r * out_stride + (int64_t)h * dim;
            if (delta) {
                const uint16_t *d = delta + (int64_t)r * x_stride + (int64_t)h * dim;
                for (int i = 0; i < dim; i++) v[i] = float_to_bf16(bf16_to_float(v[i]) + bf16_to_float(d[i]));
            }
            float squares = 0.0f;
#pragma omp simd reduction(+:squares)
            for (int i = 0; i < dim; i++) squares += bf16_to_float(v[i]) * bf16_to_float(v[i]);
            const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
            for (int i = 0; i < dim; i++) {
                const float normed = bf16_to_float(v[i]) * inv_rms;
                y[i] = float_to_bf16(normed * (1.0f + bf16_to_float(weight[i])));
            }
        }
}

void radixkv_gemma_norm_f32(float *x, int64_t x_stride, const float *delta, const float *weight, float *out,
                            int64_t out_stride, int rows, int heads, int dim, float eps, int num_threads) {
    const int threads = (int64_t)rows * heads * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (int64_t)r * x_stride + (int64_t)h * dim;
            float *y = out + (int64_t)r * out_stride + (int64_t)h * dim;
            if (delta) {
                const float *d = delta + (int64_t)r * x_stride + (int64_t)h * dim;
                for (int i = 0; i < dim; i++) v[i] += d[i];
            }
            float squares = 0.0f;
#pragma omp simd reduction(+:squares)
            for (int i = 0; i < dim; i++) squares += v[i] * v[i];
            const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
            for (int i = 0; i < dim; i++) y[i] = (v[i] * inv_rms) * (1.0f + weight[i]);
        }
}

/* gelu_tanh(g) = 0.5 g (1 + tanh(beta (g + kappa g^3))), tanh(u) = 1 - 2 / (e^(2u) + 1): exp
 * saturates cleanly at both ends (the vector exps clamp their input), so no NaN. */
static inline float gelu_tanh(float g) {
    const float u = GELU_BETA * (g + GELU_KAPPA * g * g * g);
    const float e = expf(fminf(fmaxf(2.0f * u, -87.0f), 88.0f));
    return 0.5f * g * (1.0f + (1.0f - 2.0f / (e + 1.0f)));
}

#ifdef HAVE_AVX512
static inline __m512 gelu_tanh16(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(GELU_BETA), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), cube)));
    const __m512 e = exp16(_mm512_add_ps(u, u));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.0f), t));
}
#endif

#ifdef HAVE_AVX2
static inline __m256 gelu_tanh8(__m256 g) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(GELU_BETA), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), cube)));
    const __m256 e = exp8(_mm256_add_ps(u, u));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}
#endif

/* out = bf16(gelu_tanh(gate)) * up, rounded like torch's F.gelu(gate, approximate="tanh") * up.
 * gate_up: [rows][row_stride], gate in columns [0, dim), up in [dim, 2 dim); out: [rows][dim].
 * Which path a value takes depends on dim only, never on the rows beside it. */
void radixkv_gelu_mul_bf16(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int rows, int dim,
                           int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (int64_t)r * row_stride, *up = gate + dim;
        uint16_t *y = out + (int64_t)r * dim;
        int i = 0;
#ifdef HAVE_AVX512
        for (; i + 16 <= dim; i += 16) {
            float lanes[16];
            _mm512_storeu_ps(lanes, gelu_tanh16(load16(gate + i)));
            for (int j = 0; j < 16; j++)
                y[i + j] = float_to_bf16(bf16_to_float(float_to_bf16(lanes[j])) * bf16_to_float(up[i + j]));
        }
#endif
        for (; i < dim; i++)
            y[i] = float_to_bf16(bf16_to_float(float_to_bf16(gelu_tanh(bf16_to_float(gate[i])))) * bf16_to_float(up[i]));
    }
}

void radixkv_gelu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int rows, int dim, int num_threads) {
    const int threads = (int64_t)rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (int64_t)r * row_stride, *up = gate + dim;
        float *y = out + (int64_t)r * dim;
        int i = 0;
#ifdef HAVE_AVX2
        for (; i + 8 <= dim; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
#endif
        for (; i < dim; i++) y[i] = gelu_tanh(gate[i]) * up[i];
    }
}
