/* The exported kernels of radixkv's native library, for the C code that chains them
 * (decode_layers.c); Python reaches the same functions through ctypes (radixkv/cpu/native.py). */
#ifndef RADIXKV_KERNELS_H
#define RADIXKV_KERNELS_H

#include <stdint.h>

int64_t radixkv_decode_work_floats(const int32_t *seq_lens, int num_seqs, const int32_t *plan_buffer, int num_q_heads,
                                   int head_dim, int window);
int radixkv_paged_decode_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k, const uint16_t *v,
                              const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                              const int32_t *rows, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                              int page_size, float scale, uint16_t *out, float *work, const int32_t *plan,
                              int num_threads, int window);
void radixkv_store_kv(char *k_cache, char *v_cache, const char *k, const char *v, int64_t k_row_stride,
                      int64_t v_row_stride, const int64_t *slots, int rows, int64_t row_bytes);
/* The packed linears' kernels, as bits of radixkv_linear_kernels() (radixkv/cpu/linear.py names them). */
#define RADIXKV_LINEAR_AMX 1
#define RADIXKV_LINEAR_AVX512_BF16 2
#define RADIXKV_LINEAR_AVX2 4 /* fp32 weights (linear_f32.c) */
int radixkv_linear_kernels(void);
int radixkv_packed_linear(int kernel, const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                          const float *bias, uint16_t *y, int64_t y_stride, int num_threads);
void radixkv_add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                               int rows, int dim, float eps, int num_threads);
void radixkv_rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim, const uint16_t *cos,
                       const uint16_t *signed_sin, int num_threads);
void radixkv_silu_mul_bf16(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int rows, int dim,
                           int num_threads);
void radixkv_add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int rows, int dim,
                              float eps, int num_threads);
void radixkv_rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim, const float *cos,
                      const float *signed_sin, int num_threads);
void radixkv_silu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int rows, int dim, int num_threads);
int radixkv_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k, const float *v,
                             const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                             const int32_t *rows, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                             int page_size, float scale, float *out, float *work, const int32_t *plan, int num_threads,
                             int window);
/* fp32 compute over bf16 (kv_kind 2) or int8 (3) pages, and stores into them (paged_decode.c). */
int radixkv_paged_decode_f32_kv(const float *q, int64_t q_row_stride, const void *k, const void *v,
                                const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                                const int32_t *rows, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                int page_size, float scale, float *out, float *work, const int32_t *plan,
                                int num_threads, int window, const uint16_t *k_scales, const uint16_t *v_scales,
                                int kv_kind);
void radixkv_store_kv_narrow(void *k_cache, void *v_cache, uint16_t *k_scales, uint16_t *v_scales, const float *k,
                             const float *v, int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots, int rows,
                             int num_kv_heads, int head_dim, int kind);
int radixkv_paged_decode_bf16_kv(const uint16_t *q, int64_t q_row_stride, const void *k, const void *v,
                                 const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                                 const int32_t *rows, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                 int page_size, float scale, uint16_t *out, float *work, const int32_t *plan,
                                 int num_threads, int window, const uint16_t *k_scales, const uint16_t *v_scales,
                                 int kv_kind);
void radixkv_store_kv_narrow_bf16(void *k_cache, void *v_cache, uint16_t *k_scales, uint16_t *v_scales, const uint16_t *k,
                                  const uint16_t *v, int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots,
                                  int rows, int num_kv_heads, int head_dim);
int radixkv_packed_linear_f32(const float *x, int64_t x_stride, int m, int k, const float *packed, int n,
                              const float *bias, float *y, int64_t y_stride, int num_threads);
/* The quantized linears' kernels (quant_linear.c), as bits of radixkv_quant_linear_kernels()
 * (radixkv/cpu/quant_linear.py names them). */
#define RADIXKV_QUANT_AMX_INT8 1 /* reserved: no AMX-INT8 kernel yet */
#define RADIXKV_QUANT_AVX512_VNNI 2
#define RADIXKV_QUANT_AVX2 4
#define RADIXKV_QUANT_AVX512_ZMM 8 /* 512-bit VNNI over its own 16-row records (quant_linear_zmm.c) */
#define RADIXKV_QUANT_PARTS 15 /* a format: row ranges packed in their own formats (quant_linear.py's "parts") */
int radixkv_quant_linear_kernels(void);
int radixkv_quant_super_blocks(void);
int radixkv_quant_linear(int kernel, int format, const void *x, int x_bf16, int64_t x_stride, int m, int k,
                         const uint8_t *packed, int n, const float *bias, void *y, int64_t y_stride, int num_threads);
int radixkv_quant_zmm_runs(void);
/* A Q4_K (format 2) or Q6_K (3) super-block's quants, codes and d, dmin (quant_linear_zmm.c). */
void radixkv_quant_decode_super(int format, const uint8_t *src, uint8_t u[256], int codes[16], float *d, float *dmin);
int radixkv_quant_zmm_linear(int format, const void *x, int x_bf16, int64_t x_stride, int m, int k,
                             const uint8_t *packed, int n, const float *bias, void *y, int64_t y_stride,
                             int num_threads);

/* Gemma 3's row glue (gemma_ops.c): its (1 + w) RMSNorm over heads of strided rows, with the
 * residual add where delta is not NULL, and GeGLU. */
void radixkv_gemma_norm_bf16(uint16_t *x, int64_t x_stride, const uint16_t *delta, const uint16_t *weight,
                             uint16_t *out, int64_t out_stride, int rows, int heads, int dim, float eps,
                             int num_threads);
void radixkv_gemma_norm_f32(float *x, int64_t x_stride, const float *delta, const float *weight, float *out,
                            int64_t out_stride, int rows, int heads, int dim, float eps, int num_threads);
void radixkv_gelu_mul_bf16(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int rows, int dim,
                           int num_threads);
void radixkv_gelu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int rows, int dim, int num_threads);

#endif
