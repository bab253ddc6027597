/* A decode step's decoder layers in one call: for each layer, the same kernels the Python
 * forward (radixkv/model/llama.py) calls one by one on this path, in the same order, so the
 * results are bit-identical; only the ~100 us of Python between them per layer is gone.
 *
 * For bf16 or fp32 Llama-family layers whose linears are packed for one of
 * the native kernels (AMX or AVX512_BF16 for bf16, AVX2 for fp32: shape.linear_kernel), or
 * quantized (quant_linear.c: shape.quant_kernel, each linear's format in its layer record); one
 * query row per request. fp32 layers also read and write bf16 or int8 pages, bf16 layers int8
 * pages (shape.kv_kind), through the same store and decode kernels the layer-by-layer forward
 * calls for them. The caller checks page tables, lengths and slots once per step.
 *
 * Qwen3: plain per-head q/k norms (layer.q_norm without shape.gemma), the add_rms_norm kernel
 * over a row's heads, as the layer-by-layer forward calls it for them on this path.
 * Mixture-of-experts layers (Qwen3-MoE: layer.gate_up NULL): the call stops after such a layer's
 * MLP input norm, which must be its last layer, and leaves that input in scratch.h; the caller
 * runs the router and experts (torch's routing bits) and passes their output as the next call's
 * delta.
 *
 * Gemma 3 (shape.gemma): its (1 + w) norms before and after each block and on each q and k head,
 * GeGLU (gemma_ops.c, the kernels its layer-by-layer forward calls), and per layer a window
 * (only the last W keys), the page tables of the layer's group (a window group keeps its own
 * pages) and the RoPE of the layer's kind (local layers' own base).
 */
#include "kernels.h"

#include <omp.h>
#include <stddef.h>

/* One layer's weights and KV pages, in the model's dtype or the shape's kv_kind.
 * Linear weights are packed (packed_linear.c, linear_f32.c, or quant_linear.c's records);
 * biases fp32 or NULL; scales: int8 pages' fp16 scales (NULL otherwise). */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias;
    void *k_cache, *v_cache;
    uint16_t *k_scales, *v_scales;
    int formats[4]; /* quantized layers: qkv, o, gate_up and down's formats (quant_linear.c's FORMAT_*) */
    /* Per-head q and k norms (Gemma 3's or Qwen3's; NULL otherwise); Gemma 3 only (shape.gemma):
     * the MLP's norms; its post_norm above norms attention's output, the MLP's input is pre_ff_norm's. */
    const void *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm;
    int window; /* the layer's sliding window in keys (counting the query's own), 0: every key */
    int group;  /* which of the step's tables (DecodeStep) it reads: 0 the full layers', 1 the window group's */
    int rope;   /* which of the step's rotations: 0 the model's, 1 the local layers' own base */
} DecodeLayer;

/* What a step gives every layer, twice: [0] for full layers and the model's RoPE, [1] for a
 * window group's pages and the local RoPE (the same as [0] where the model has none). cos,
 * signed_sin: [rows][head_dim]; slots [rows]; page_table [rows][stride]; seq_lens [rows]; plan:
 * the cascade plan (radixkv_cascade_plan), or NULL, never read by a window layer. */
typedef struct {
    const void *cos[2], *signed_sin[2];
    const int64_t *slots[2];
    const int32_t *page_table[2];
    int64_t page_table_stride[2];
    const int32_t *seq_lens[2];
    const int32_t *plan[2];
} DecodeStep;

typedef struct {
    int rows, hidden, intermediate, num_q_heads, num_kv_heads, head_dim, page_size, num_threads;
    int linear_kernel; /* RADIXKV_LINEAR_*: RADIXKV_LINEAR_AVX2 runs fp32 layers, the others bf16 */
    float eps, scale;
    int quant_kernel; /* 0, or RADIXKV_QUANT_*: the linears are quantized (linear_kernel then names the dtype only) */
    int kv_kind; /* 0: pages in the model's dtype; fp32 layers: 2 bf16 pages, 3 int8 pages; bf16 layers: 3 */
    int gemma;   /* Gemma 3's layer: its norms (DecodeLayer's), GeGLU in place of SwiGLU */
    /* 1: each thread runs every layer for its own share of the rows, one thread a kernel (no
     * join between kernels, and one thread's attention overlaps another's linears; each thread
     * reads every layer's weights, so this pays where a layer's weights stay in the shared
     * cache). 0: each kernel splits its own work over the threads. */
    int split_rows;
} DecodeShape;

/* A step's phases, in the order fused_decode.py's PHASES names them. */
enum { PHASE_NORMS, PHASE_QKV, PHASE_ROPE_STORE, PHASE_ATTENTION, PHASE_O, PHASE_GATE_UP, PHASE_DOWN };

/* Scratch rows, each [rows][width] in the model's dtype: h (hidden), qkv (q + 2 kv), attention
 * (q), projected (hidden), gate_up (2 intermediate), activated (intermediate). */
typedef struct {
    void *h, *qkv, *attention, *projected, *gate_up, *activated;
    float *work;           /* radixkv_decode_work_floats floats */
    double *phase_seconds; /* NULL, or one sum per phase that each call adds its seconds to */
} DecodeScratch;

/* Adds the time since `since` to phase_seconds[phase], where the caller asked for timing, and
 * returns the time now (0 where not). The wall clock of the calling thread, which every kernel
 * joins before it returns: a phase's time is its kernel's, threads included. */
static inline double lap(double *phase_seconds, int phase, double since) {
    if (phase_seconds == NULL) return 0.0;
    const double now = omp_get_wtime();
    phase_seconds[phase] += now - since;
    return now;
}

/* The kernels of either dtype, called with the shape's threads. */
static inline int fp32(const DecodeShape *sh) { return sh->linear_kernel == RADIXKV_LINEAR_AVX2; }

static void add_rms_norm(const DecodeShape *sh, void *x, const void *delta, const void *weight, void *out) {
    if (fp32(sh)) radixkv_add_rms_norm_f32(x, delta, weight, out, sh->rows, sh->hidden, sh->eps, sh->num_threads);
    else radixkv_add_rms_norm_bf16(x, delta, weight, out, sh->rows, sh->hidden, sh->eps, sh->num_threads);
}

/* y [rows][n] = x [rows][k] W^T (+ bias), rows packed side by side. */
static int linear(const DecodeShape *sh, const void *x, int k, const void *packed, int format, int n, const float *bias,
                  void *y) {
    if (sh->quant_kernel)
        return radixkv_quant_linear(sh->quant_kernel, format, x, !fp32(sh), k, sh->rows, k, packed, n, bias, y, n,
                                    sh->num_threads);
    if (fp32(sh)) return radixkv_packed_linear_f32(x, k, sh->rows, k, packed, n, bias, y, n, sh->num_threads);
    return radixkv_packed_linear(sh->linear_kernel, x, k, sh->rows, k, packed, n, bias, y, n, sh->num_threads);
}

static void rope(const DecodeShape *sh, void *qkv, int64_t row_stride, const void *cos, const void *signed_sin) {
    const int heads = sh->num_q_heads + sh->num_kv_heads;
    if (fp32(sh)) radixkv_rope_f32(qkv, row_stride, sh->rows, heads, sh->head_dim, cos, signed_sin, sh->num_threads);
    else radixkv_rope_bf16(qkv, row_stride, sh->rows, heads, sh->head_dim, cos, signed_sin, sh->num_threads);
}

static int attend(const DecodeShape *sh, const DecodeLayer *layer, const void *qkv, int64_t qkv_size, void *out,
                  float *work, const int32_t *page_table, int64_t page_table_stride, const int32_t *seq_lens,
                  const int32_t *plan) {
    const int window = layer->window;
    if (fp32(sh) && sh->kv_kind)
        return radixkv_paged_decode_f32_kv(qkv, qkv_size, layer->k_cache, layer->v_cache, page_table, page_table_stride,
                                           seq_lens, NULL, sh->rows, sh->num_q_heads, sh->num_kv_heads, sh->head_dim,
                                           sh->page_size, sh->scale, out, work, plan, sh->num_threads, window, layer->k_scales,
                                           layer->v_scales, sh->kv_kind);
    if (sh->kv_kind)
        return radixkv_paged_decode_bf16_kv(qkv, qkv_size, layer->k_cache, layer->v_cache, page_table, page_table_stride,
                                            seq_lens, NULL, sh->rows, sh->num_q_heads, sh->num_kv_heads, sh->head_dim,
                                            sh->page_size, sh->scale, out, work, plan, sh->num_threads, window,
                                            layer->k_scales, layer->v_scales, sh->kv_kind);
    if (fp32(sh))
        return radixkv_paged_decode_f32(qkv, qkv_size, layer->k_cache, layer->v_cache, page_table, page_table_stride,
                                        seq_lens, NULL, sh->rows, sh->num_q_heads, sh->num_kv_heads, sh->head_dim,
                                        sh->page_size, sh->scale, out, work, plan, sh->num_threads, window);
    return radixkv_paged_decode_bf16(qkv, qkv_size, layer->k_cache, layer->v_cache, page_table, page_table_stride,
                                     seq_lens, NULL, sh->rows, sh->num_q_heads, sh->num_kv_heads, sh->head_dim,
                                     sh->page_size, sh->scale, out, work, plan, sh->num_threads, window);
}

static void silu_mul(const DecodeShape *sh, const void *gate_up, void *out) {
    if (sh->gemma && fp32(sh)) radixkv_gelu_mul_f32(gate_up, 2 * sh->intermediate, out, sh->rows, sh->intermediate, sh->num_threads);
    else if (sh->gemma) radixkv_gelu_mul_bf16(gate_up, 2 * sh->intermediate, out, sh->rows, sh->intermediate, sh->num_threads);
    else if (fp32(sh)) radixkv_silu_mul_f32(gate_up, 2 * sh->intermediate, out, sh->rows, sh->intermediate, sh->num_threads);
    else radixkv_silu_mul_bf16(gate_up, 2 * sh->intermediate, out, sh->rows, sh->intermediate, sh->num_threads);
}

/* Gemma's norm of `heads` vectors of `dim` per row (x_stride, out_stride in elements), after
 * x += delta where delta is not NULL; out may be x. */
static void gemma_norm(const DecodeShape *sh, void *x, int64_t x_stride, const void *delta, const void *weight,
                       void *out, int64_t out_stride, int heads, int dim) {
    if (fp32(sh))
        radixkv_gemma_norm_f32(x, x_stride, delta, weight, out, out_stride, sh->rows, heads, dim, sh->eps, sh->num_threads);
    else
        radixkv_gemma_norm_bf16(x, x_stride, delta, weight, out, out_stride, sh->rows, heads, dim, sh->eps, sh->num_threads);
}

/* Qwen3's norm of each of `heads` heads of each row in place (row_stride in elements): the
 * add_rms_norm kernel with a row's heads as its rows, one call a row (its heads lie side by
 * side, the rows apart), which gives each head the bits one call over all rows gives; the rows
 * split over the threads as that one call would split them (at 16,384 values and up). */
static void head_norm(const DecodeShape *sh, void *x, int64_t row_stride, const void *weight, int heads) {
    const int bytes = fp32(sh) ? 4 : 2;
    const int threads = (int64_t)sh->rows * heads * sh->head_dim >= 16384 ? sh->num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < sh->rows; r++) {
        char *row = (char *)x + (int64_t)r * row_stride * bytes;
        if (fp32(sh)) radixkv_add_rms_norm_f32((float *)row, NULL, weight, (float *)row, heads, sh->head_dim, sh->eps, 1);
        else radixkv_add_rms_norm_bf16((uint16_t *)row, NULL, weight, (uint16_t *)row, heads, sh->head_dim, sh->eps, 1);
    }
}

/* radixkv_decode_layers over sh->rows rows with sh->num_threads threads a kernel. work_offsets:
 * NULL, or per layer where its softmax work starts in scratch->work. */
static int decode_rows(const DecodeLayer *layers, int num_layers, int first_layer, const DecodeShape *sh,
                       const DecodeScratch *scratch, void *x, void *delta, const DecodeStep *step,
                       const int64_t *work_offsets) {
    const int hidden = sh->hidden, inter = sh->intermediate, bytes = fp32(sh) ? 4 : 2, hd = sh->head_dim;
    const int q_size = sh->num_q_heads * hd, kv_size = sh->num_kv_heads * hd;
    const int qkv_size = q_size + 2 * kv_size;
    double *timed = scratch->phase_seconds;
    double t = timed ? omp_get_wtime() : 0.0;
    for (int i = 0; i < num_layers; i++) {
        const DecodeLayer *layer = layers + i;
        const int g = layer->group, r = layer->rope;
        const void *residual_in = (first_layer && i == 0) ? NULL : delta;
        if (sh->gemma) gemma_norm(sh, x, hidden, residual_in, layer->input_norm, scratch->h, hidden, 1, hidden);
        else add_rms_norm(sh, x, residual_in, layer->input_norm, scratch->h);
        t = lap(timed, PHASE_NORMS, t);
        if (linear(sh, scratch->h, hidden, layer->qkv, layer->formats[0], qkv_size, layer->qkv_bias, scratch->qkv)) return 1;
        t = lap(timed, PHASE_QKV, t);
        char *q = scratch->qkv;
        char *k = q + (int64_t)q_size * bytes, *v = k + (int64_t)kv_size * bytes;
        if (sh->gemma) { /* each head normed in place, then q and k rotated side by side */
            gemma_norm(sh, q, qkv_size, NULL, layer->q_norm, q, qkv_size, sh->num_q_heads, hd);
            gemma_norm(sh, k, qkv_size, NULL, layer->k_norm, k, qkv_size, sh->num_kv_heads, hd);
        } else if (layer->q_norm) {
            head_norm(sh, q, qkv_size, layer->q_norm, sh->num_q_heads);
            head_norm(sh, k, qkv_size, layer->k_norm, sh->num_kv_heads);
        }
        rope(sh, scratch->qkv, qkv_size, step->cos[r], step->signed_sin[r]);
        if (!sh->kv_kind)
            radixkv_store_kv(layer->k_cache, layer->v_cache, k, v, (int64_t)qkv_size * bytes, (int64_t)qkv_size * bytes,
                             step->slots[g], sh->rows, (int64_t)kv_size * bytes);
        else if (fp32(sh))
            radixkv_store_kv_narrow(layer->k_cache, layer->v_cache, layer->k_scales, layer->v_scales, (const float *)k,
                                    (const float *)v, qkv_size, qkv_size, step->slots[g], sh->rows, sh->num_kv_heads,
                                    hd, sh->kv_kind);
        else
            radixkv_store_kv_narrow_bf16(layer->k_cache, layer->v_cache, layer->k_scales, layer->v_scales,
                                         (const uint16_t *)k, (const uint16_t *)v, qkv_size, qkv_size, step->slots[g],
                                         sh->rows, sh->num_kv_heads, hd);
        t = lap(timed, PHASE_ROPE_STORE, t);
        float *work = scratch->work + (work_offsets ? work_offsets[i] : 0);
        if (attend(sh, layer, scratch->qkv, qkv_size, scratch->attention, work, step->page_table[g],
                   step->page_table_stride[g], step->seq_lens[g], layer->window ? NULL : step->plan[g]))
            return 1;
        t = lap(timed, PHASE_ATTENTION, t);
        if (linear(sh, scratch->attention, q_size, layer->o, layer->formats[1], hidden, layer->o_bias, scratch->projected)) return 1;
        t = lap(timed, PHASE_O, t);
        if (sh->gemma) { /* attention's output normed, added, and the sum normed for the MLP */
            gemma_norm(sh, scratch->projected, hidden, NULL, layer->post_norm, scratch->projected, hidden, 1, hidden);
            gemma_norm(sh, x, hidden, scratch->projected, layer->pre_ff_norm, scratch->h, hidden, 1, hidden);
        } else {
            add_rms_norm(sh, x, scratch->projected, layer->post_norm, scratch->h);
        }
        t = lap(timed, PHASE_NORMS, t);
        if (layer->gate_up == NULL) return i == num_layers - 1 ? 0 : 1; /* the caller's experts */
        if (linear(sh, scratch->h, hidden, layer->gate_up, layer->formats[2], 2 * inter, NULL, scratch->gate_up)) return 1;
        t = lap(timed, PHASE_GATE_UP, t);
        silu_mul(sh, scratch->gate_up, scratch->activated);
        t = lap(timed, PHASE_NORMS, t);
        if (linear(sh, scratch->activated, inter, layer->down, layer->formats[3], hidden, NULL, delta)) return 1;
        t = lap(timed, PHASE_DOWN, t);
        if (sh->gemma) {
            gemma_norm(sh, delta, hidden, NULL, layer->post_ff_norm, delta, hidden, 1, hidden);
            t = lap(timed, PHASE_NORMS, t);
        }
    }
    return 0;
}

/* Runs the layers for rows [first, first + count) on the calling thread: every pointer moved to
 * the share's first row, each layer's softmax work past the earlier rows' (a request's work
 * depends only on its own length and the layer's window, so the shares add up to what the
 * caller sized for the whole step). Phases are timed by the share that starts at row 0. */
static int decode_share(const DecodeLayer *layers, int num_layers, int first_layer, const DecodeShape *sh,
                        const DecodeScratch *scratch, void *x, void *delta, const DecodeStep *step, int first, int count) {
    const int bytes = fp32(sh) ? 4 : 2, hd = sh->head_dim;
    const int q_size = sh->num_q_heads * hd, qkv_size = q_size + 2 * sh->num_kv_heads * hd;
    DecodeShape own = *sh;
    own.rows = count, own.num_threads = 1;
    int64_t offsets[num_layers];
    for (int i = 0; i < num_layers; i++)
        offsets[i] = radixkv_decode_work_floats(step->seq_lens[layers[i].group], first, NULL, sh->num_q_heads, hd, layers[i].window);
#define ROWS_AT(p, width) ((p) ? (void *)((char *)(p) + (int64_t)first * (width) * bytes) : NULL)
    const int inter = sh->intermediate;
    const DecodeScratch mine = {ROWS_AT(scratch->h, sh->hidden), ROWS_AT(scratch->qkv, qkv_size),
                                ROWS_AT(scratch->attention, q_size), ROWS_AT(scratch->projected, sh->hidden),
                                ROWS_AT(scratch->gate_up, 2 * inter), ROWS_AT(scratch->activated, inter),
                                scratch->work, first ? NULL : scratch->phase_seconds};
    DecodeStep part = *step;
    for (int g = 0; g < 2; g++) {
        part.cos[g] = ROWS_AT(step->cos[g], hd);
        part.signed_sin[g] = ROWS_AT(step->signed_sin[g], hd);
        part.slots[g] = step->slots[g] + first;
        part.page_table[g] = step->page_table[g] + first * step->page_table_stride[g];
        part.seq_lens[g] = step->seq_lens[g] + first;
    }
    const int status = decode_rows(layers, num_layers, first_layer, &own, &mine, ROWS_AT(x, sh->hidden),
                                   ROWS_AT(delta, sh->hidden), &part, offsets);
#undef ROWS_AT
    return status;
}

/* x [rows][hidden]: the residual stream, updated in place; delta [rows][hidden]: the MLP output
 * of the layer before the first one run here (ignored when first_layer is 1), replaced by the
 * last layer's, unless that layer's MLP is the caller's (gate_up NULL): then scratch.h holds
 * its input and delta is left as it was. step: the tables and rotations (DecodeStep). Returns 0,
 * or 1 where a kernel refused its shapes or a layer with the caller's MLP is not the last.
 * Every kernel computes each row alone, so a step split by rows (sh->split_rows) has the bits
 * of the step run whole; a cascade plan, which groups rows, keeps it whole. */
int radixkv_decode_layers(const DecodeLayer *layers, int num_layers, int first_layer, const DecodeShape *sh,
                          const DecodeScratch *scratch, void *x, void *delta, const DecodeStep *step) {
    const int parts = sh->num_threads < sh->rows ? sh->num_threads : sh->rows;
    if (!sh->split_rows || parts < 2 || step->plan[0] || step->plan[1])
        return decode_rows(layers, num_layers, first_layer, sh, scratch, x, delta, step, NULL);
    int failed = 0, team = 0;
#pragma omp parallel num_threads(parts) reduction(| : failed)
    {
#pragma omp single
        team = omp_get_num_threads();
        /* A smaller team than asked (OpenMP's limits) runs the step whole below. */
        const int self = omp_get_thread_num();
        if (team == parts) {
            const int first = (int)((int64_t)sh->rows * self / parts), end = (int)((int64_t)sh->rows * (self + 1) / parts);
            failed |= decode_share(layers, num_layers, first_layer, sh, scratch, x, delta, step, first, end - first);
        }
    }
    if (team != parts) return decode_rows(layers, num_layers, first_layer, sh, scratch, x, delta, step, NULL);
    return failed;
}
