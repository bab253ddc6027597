/* A decode step's decoder layers in one call: for each layer, the same kernels the Python
 * forward (radixkv/model/llama.py) calls one by one on this path, in the same order, so the
 * results are bit-identical; only the ~100 us of Python between them per layer is gone.
 *
 * For bf16 Llama-family layers without q/k norms whose linears are packed for one of the
 * native kernels (AMX or AVX512_BF16, shape.linear_kernel); one query row per request. The caller checks page tables, lengths and slots once per step.
 */
#include "kernels.h"

#include <stddef.h>

/* One layer's weights and KV pages. Linear weights are packed (packed_linear.c); biases fp32 or NULL. */
typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias;
    uint16_t *k_cache, *v_cache;
} DecodeLayer;

typedef struct {
    int rows, hidden, intermediate, num_q_heads, num_kv_heads, head_dim, page_size, num_threads;
    int linear_kernel; /* RADIXKV_LINEAR_* */
    float eps, scale;
} DecodeShape;

/* Scratch rows, each [rows][width] bf16: h (hidden), qkv (q + 2 kv), attention (q),
 * projected (hidden), gate_up (2 intermediate), activated (intermediate). */
typedef struct {
    uint16_t *h, *qkv, *attention, *projected, *gate_up, *activated;
    float *work; /* radixkv_decode_work_floats floats */
} DecodeScratch;

/* x [rows][hidden]: the residual stream, updated in place; delta [rows][hidden]: the MLP output
 * of the layer before the first one run here (ignored when first_layer is 1), replaced by the
 * last layer's. plan: the step's cascade plan (radixkv_cascade_plan), or NULL. Returns 0,
 * or 1 where a kernel refused its shapes. */
int radixkv_decode_layers_bf16(const DecodeLayer *layers, int num_layers, int first_layer, const DecodeShape *sh,
                               const DecodeScratch *scratch, uint16_t *x, uint16_t *delta, const uint16_t *cos,
                               const uint16_t *signed_sin, const int64_t *slots, const int32_t *page_table,
                               int64_t page_table_stride, const int32_t *seq_lens, const int32_t *plan) {
    const int rows = sh->rows, threads = sh->num_threads, hidden = sh->hidden, inter = sh->intermediate;
    const int q_size = sh->num_q_heads * sh->head_dim, kv_size = sh->num_kv_heads * sh->head_dim;
    const int qkv_size = q_size + 2 * kv_size;
    for (int i = 0; i < num_layers; i++) {
        const DecodeLayer *layer = layers + i;
        radixkv_add_rms_norm_bf16(x, (first_layer && i == 0) ? NULL : delta, layer->input_norm, scratch->h, rows,
                                  hidden, sh->eps, threads);
        if (radixkv_packed_linear(sh->linear_kernel, scratch->h, hidden, rows, hidden, layer->qkv, qkv_size, layer->qkv_bias, scratch->qkv,
                               qkv_size, threads))
            return 1;
        radixkv_rope_bf16(scratch->qkv, qkv_size, rows, sh->num_q_heads + sh->num_kv_heads, sh->head_dim, cos,
                          signed_sin, threads);
        const uint16_t *k = scratch->qkv + q_size, *v = scratch->qkv + q_size + kv_size;
        radixkv_store_kv((char *)layer->k_cache, (char *)layer->v_cache, (const char *)k, (const char *)v,
                         (int64_t)qkv_size * 2, (int64_t)qkv_size * 2, slots, rows, (int64_t)kv_size * 2);
        if (radixkv_paged_decode_bf16(scratch->qkv, qkv_size, layer->k_cache, layer->v_cache, page_table,
                                      page_table_stride, seq_lens, NULL, rows, sh->num_q_heads, sh->num_kv_heads,
                                      sh->head_dim, sh->page_size, sh->scale, scratch->attention, scratch->work, plan,
                                      threads))
            return 1;
        if (radixkv_packed_linear(sh->linear_kernel, scratch->attention, q_size, rows, q_size, layer->o, hidden, layer->o_bias,
                               scratch->projected, hidden, threads))
            return 1;
        radixkv_add_rms_norm_bf16(x, scratch->projected, layer->post_norm, scratch->h, rows, hidden, sh->eps, threads);
        if (radixkv_packed_linear(sh->linear_kernel, scratch->h, hidden, rows, hidden, layer->gate_up, 2 * inter, NULL, scratch->gate_up,
                               2 * inter, threads))
            return 1;
        radixkv_silu_mul_bf16(scratch->gate_up, 2 * inter, scratch->activated, rows, inter, threads);
        if (radixkv_packed_linear(sh->linear_kernel, scratch->activated, inter, rows, inter, layer->down, hidden, NULL, delta, hidden,
                               threads))
            return 1;
    }
    return 0;
}
