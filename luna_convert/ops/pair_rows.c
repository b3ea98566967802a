/* Pair features of a token's vector x [w], made a block of tokens at a time inside the core's native
 * products (ops/token_products.c's produced_* functions call pair_rows through a pointer; pair_rows.py):
 *
 *     [1 (if constant), x_i a (i < w; if linear), then for each i: (x_i s) x_i, (x_i p) x_j (j > i)]
 *
 * the pairs row by row of the upper triangle, each one product of two floats. Taylor's map (constant,
 * linear, a = d^(-1/4), s = (2 d)^(-1/2), p = d^(-1/2)) and LLoPS's (the pairs of its sketch psi, s = 1,
 * p = sqrt(2)) are these; their PyTorch forwards, the references, compute the same float operations in
 * this order, so the features are the same to the bit. Stored, Taylor's are 33 times the memory of its
 * inputs at d = 64. x is read from memory, or made by another maker (LLoPS's sketch psi, by
 * factor_product_rows below from its projections), so that nothing is stored. Plain C99, compiled by ops/native.py (-ffp-contract=off: no fused multiply-adds, which
 * would round otherwise).
 */
#include <stdint.h>
#include <stdlib.h>

/* A maker of rows (ops/token_products.c's convention): rows [t0, t0 + tn) of batch entry b to out [tn, width]. */
typedef void (*produce_rows)(const void *state, int64_t b, int64_t t0, int64_t tn, float *out);

/* A block's rows from `source` into a buffer of tn x width floats (the caller frees it). */
static float *made_block(produce_rows source, const void *source_state, int64_t b, int64_t t0, int64_t tn,
                         int64_t width) {
    float *block = malloc(sizeof(float) * (size_t)(tn * width));
    if (!block) abort(); /* a block of a few tens of KB: without it the result would be wrong */
    source(source_state, b, t0, tn, block);
    return block;
}

typedef struct {
    const float *x; /* [B, H, N, w] at these strides (floats), the last 1; or NULL: made by source */
    int64_t heads, stride_b, stride_h, stride_n;
    int32_t width, constant, linear;
    float linear_scale, square_scale, pair_scale;
    produce_rows source; /* where x is NULL: x's rows [tn, w], made a block at a time */
    const void *source_state;
} pair_state_t;

int pair_rows_state_size(void) { return (int)sizeof(pair_state_t); }

void pair_rows_state(pair_state_t *s, const float *x, int64_t heads, int64_t stride_b, int64_t stride_h,
                     int64_t stride_n, int32_t width, int32_t constant, int32_t linear, float linear_scale,
                     float square_scale, float pair_scale, produce_rows source, const void *source_state) {
    const pair_state_t state = {x, heads, stride_b, stride_h, stride_n, width, constant, linear, linear_scale,
                                square_scale, pair_scale, source, source_state};
    *s = state;
}

/* The features [tn, D] of tokens [t0, t0 + tn) of batch entry b (b = batch * heads + head). */
void pair_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const pair_state_t *s = state;
    const int32_t w = s->width;
    float *made = s->x ? 0 : made_block(s->source, s->source_state, b, t0, tn, w);
    const float *x0 = made ? made : s->x + (b / s->heads) * s->stride_b + (b % s->heads) * s->stride_h + t0 * s->stride_n;
    const int64_t stride_n = made ? w : s->stride_n;
    float *o = out;
    for (int64_t t = 0; t < tn; ++t) {
        const float *x = x0 + t * stride_n;
        if (s->constant) *o++ = 1.0f;
        if (s->linear)
            for (int32_t i = 0; i < w; ++i) *o++ = x[i] * s->linear_scale;
        for (int32_t i = 0; i < w; ++i) {
            *o++ = (x[i] * s->square_scale) * x[i];
            const float left = x[i] * s->pair_scale;
            for (int32_t j = i + 1; j < w; ++j) *o++ = left * x[j];
        }
    }
    free(made);
}

/* psi[t, l] = (z[t, l] z[t, w + l] ... z[t, (factors - 1) w + l]) scale for the rows z [tn, factors w] that
 * `source` makes: LLoPS's CP sketch from its projections (products' affine_rows, one W per head), multiplied
 * in factor order and then scaled, as its PyTorch forward's prod and product compute it. */
typedef struct {
    produce_rows source;
    const void *source_state;
    int32_t factors, width;
    float scale;
} factor_product_state_t;

int factor_product_rows_state_size(void) { return (int)sizeof(factor_product_state_t); }

void factor_product_rows_state(factor_product_state_t *s, produce_rows source, const void *source_state,
                               int32_t factors, int32_t width, float scale) {
    const factor_product_state_t state = {source, source_state, factors, width, scale};
    *s = state;
}

void factor_product_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const factor_product_state_t *s = state;
    const int32_t w = s->width, factors = s->factors;
    float *z = made_block(s->source, s->source_state, b, t0, tn, (int64_t)factors * w);
    for (int64_t t = 0; t < tn; ++t) {
        const float *zt = z + t * factors * w;
        for (int32_t l = 0; l < w; ++l) {
            float p = zt[l];
            for (int32_t f = 1; f < factors; ++f) p *= zt[f * w + l];
            out[t * w + l] = p * s->scale;
        }
    }
    free(z);
}
