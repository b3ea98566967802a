/* Pair features of a token's vector x [w], made a block of tokens at a time inside the core's native
 * products (ops/token_products.c's produced_* functions call pair_rows through a pointer; pair_rows.py):
 *
 *     [1 (if constant), x_i a (i < w; if linear), then for each i: (x_i s) x_i, (x_i p) x_j (j > i)]
 *
 * the pairs row by row of the upper triangle, each one product of two floats. Taylor's map (constant,
 * linear, a = d^(-1/4), s = (2 d)^(-1/2), p = d^(-1/2)) is this; its PyTorch forward, the reference, computes
 * the same float operations in this order, so the features are the same to the bit. Stored, they are 33 times
 * the memory of its inputs at d = 64. Plain C99, compiled by ops/native.py (-ffp-contract=off: no fused
 * multiply-adds, which would round otherwise).
 */
#include <stdint.h>

typedef struct {
    const float *x; /* [B, H, N, w] at these strides (floats), the last 1 */
    int64_t heads, stride_b, stride_h, stride_n;
    int32_t width, constant, linear;
    float linear_scale, square_scale, pair_scale;
} pair_state_t;

int pair_rows_state_size(void) { return (int)sizeof(pair_state_t); }

void pair_rows_state(pair_state_t *s, const float *x, int64_t heads, int64_t stride_b, int64_t stride_h,
                     int64_t stride_n, int32_t width, int32_t constant, int32_t linear, float linear_scale,
                     float square_scale, float pair_scale) {
    const pair_state_t state = {x, heads, stride_b, stride_h, stride_n, width, constant, linear, linear_scale,
                                square_scale, pair_scale};
    *s = state;
}

/* The features [tn, D] of tokens [t0, t0 + tn) of batch entry b (b = batch * heads + head). */
void pair_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const pair_state_t *s = state;
    const int32_t w = s->width;
    const float *x0 = s->x + (b / s->heads) * s->stride_b + (b % s->heads) * s->stride_h + t0 * s->stride_n;
    float *o = out;
    for (int64_t t = 0; t < tn; ++t) {
        const float *x = x0 + t * s->stride_n;
        if (s->constant) *o++ = 1.0f;
        if (s->linear)
            for (int32_t i = 0; i < w; ++i) *o++ = x[i] * s->linear_scale;
        for (int32_t i = 0; i < w; ++i) {
            *o++ = (x[i] * s->square_scale) * x[i];
            const float left = x[i] * s->pair_scale;
            for (int32_t j = i + 1; j < w; ++j) *o++ = left * x[j];
        }
    }
}
