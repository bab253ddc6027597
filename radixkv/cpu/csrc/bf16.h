/* bf16 <-> float and fp16 <-> float conversions and a vector exp, shared by radixkv's CPU kernels. */
#ifndef RADIXKV_BF16_H
#define RADIXKV_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch converts float to bfloat16. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* fp16 (IEEE binary16, int8 pages' scales: radixkv.cache.kv_dtype.SCALE_DTYPE) to float, exact. */
#ifdef __F16C__
#include <immintrin.h>
#endif
static inline float fp16_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        const float magnitude = (float)mantissa * 0x1p-24f; /* zero or subnormal */
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Float to fp16, round to nearest even, as torch's .to(torch.float16) converts. */
static inline uint16_t float_to_fp16(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;     /* NaN */
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;    /* 65520 and above round to inf */
    if (magnitude < 0x38800000u) {                          /* below 2^-14: subnormal or zero */
        float below;
        memcpy(&below, &magnitude, sizeof below);
        return sign | (uint16_t)nearbyintf(below * 0x1p24f); /* exact product, ties to even */
    }
    magnitude += 0xfffu + ((magnitude >> 13) & 1u);
    return sign | (uint16_t)((magnitude - 0x38000000u) >> 13);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1 /* 8-lane fp32 vectors with FMA: Haswell and later, AMD Zen */

/* e^x, 8 lanes: exp16's Cephes expf for AVX2, which has no scalef: 2^n goes into the exponent
 * bits directly (n is in [-126, 127] after the clamp, so the result is a normal float). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}
#endif

/* Every AVX-512 CPU has AVX2 and FMA too, so the AVX-512 paths may use 8-lane helpers. */
#if defined(HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1 /* AVX-512 F/BW: fp32 vectors, bf16 only as loads and shifts */
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1 /* vdpbf16ps and rounding to bf16 in hardware */
#endif

/* 16 bf16 values as floats. */
static inline __m512 load16(const uint16_t *src) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* e^x, 16 lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial, about 1 ulp).
 * Inputs are clamped to [-87, 88]: below e^-87 (1e-38) results would be denormal anyway. */
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

#endif
