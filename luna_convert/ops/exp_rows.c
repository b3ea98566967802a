/* Exponentials of rows of float32 values in one pass per row (the native path of ops/exp_rows.py, which has
 * the PyTorch reference of each function beside it):
 *
 *     softmax_pair_forward:  y[r] = [e(z - max z) / sum e(z - max z),  e(min z - z) / sum e(min z - z)]
 *                            for z [rows, d] -> y [rows, 2 d] (Hedgehog's map after its projection)
 *     softmax_pair_backward: gz[r] = y+ (g+ - g+.y+) - y- (g- - g-.y-)   with y = [y+ | y-], g = [g+ | g-]
 *     exp_minus_row_max:     x[r] = e(x[r] - max x[r] - offset), in place, rows of any width
 *     exp_minus_shift:       x[r] = e(x[r] - shift[r / rows_per_shift]), in place, rows of any width
 *                            (positive random features: a query's stabiliser is its row's max, a key's one
 *                            value per example and head)
 *     softmax_pair_rows, exp_minus_max_rows, positive_key_rows, pointwise_rows: features made a block of
 *                            tokens at a time inside the core's products (Hedgehog's; Performer's and
 *                            Flexformer's queries' and keys'; ReLU's, ELU + 1's, cosFormer's), below
 *
 * Plain C99 with GCC/Clang vector extensions, no PyTorch headers, compiled on first use by ops/native.py.
 * e is exp_lanes below: exp of r <= 0 to within a few float32 rounding errors (torch's own exp is also a
 * vector approximation; the two agree to float32 rounding, not to the bit). Every argument is <= 0 by
 * construction, so no overflow is possible; below -87.3 (where float32's normal range ends) it gives 0,
 * where torch gives 0 or a subnormal. NaN stays NaN: a NaN anywhere in a row makes the whole row NaN, as in
 * torch, for the softmax pair and exp_minus_row_max (whose max is NaN then).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Floats per vector: 16 where AVX-512 is there (the forward ran 1.2x faster than with 8, measured), else 8
   (AVX's registers, or two SSE2 ones). The softmax pair's d must be a multiple of it: exp_rows_lanes() tells the
   caller; the in-place exps take any width. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

int32_t exp_rows_lanes(void) { return LANES; }

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){0} + x; }

/* a where mask (a comparison's all-ones lanes), else b: C has no vector ?: */
static inline vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* the first `count` (< LANES) floats at p, the other lanes `fill` */
static inline vf load_partial(const float *p, int64_t count, float fill) {
    vf v = splat(fill);
    memcpy(&v, p, (size_t)count * sizeof(float));
    return v;
}

static inline void store_partial(float *p, vf v, int64_t count) { memcpy(p, &v, (size_t)count * sizeof(float)); }

static inline float sum_lanes(vf v) {
    float s = v[0];
    for (int k = 1; k < LANES; ++k) s += v[k];
    return s;
}

/* exp(r) for r <= 0: r = n ln 2 + f with n = round(r / ln 2) and |f| <= ln 2 / 2, then e^f by its Taylor
   series to f^7 (the first term left out is below 6e-9 relative there) and 2^n through the exponent bits.
   n is rounded by adding 1.5 * 2^23, which leaves n in that sum's low mantissa bits; ln 2 is split in two
   (its first part has 9 significant bits, so n * ln2_high is exact for |n| < 2^15). */
static inline vf exp_lanes(vf r) {
    const vf magic = splat(12582912.0f), log2e = splat(1.44269504088896341f);
    const vf ln2_high = splat(0.693359375f), ln2_low = splat(-2.12194440e-4f);
    const vf shifted = r * log2e + magic;
    const vf n = shifted - magic;
    const vf f = (r - n * ln2_high) - n * ln2_low;
    vf p = splat(1.0f / 5040.0f);
    p = p * f + splat(1.0f / 720.0f);
    p = p * f + splat(1.0f / 120.0f);
    p = p * f + splat(1.0f / 24.0f);
    p = p * f + splat(1.0f / 6.0f);
    p = p * f + splat(0.5f);
    p = p * f + splat(1.0f);
    p = p * f + splat(1.0f);
    const vi n_int = (vi)shifted - (vi)magic;
    const vf scale = (vf)((vu)(n_int + 127) << 23);  /* unsigned: below the normal range the shift wraps */
    const vf e = select(r >= splat(-87.3f), p * scale, splat(0.0f));  /* 0 below the normal range, and for NaN */
    return select(r == r, e, r);                                         /* NaN stays NaN */
}

/* The rows [r0, r1) of z [rows, d] -> y [rows, 2 d]. */
void softmax_pair_forward(const float *z, int64_t r0, int64_t r1, int32_t d, float *y) {
    for (int64_t r = r0; r < r1; ++r) {
        const float *zr = z + r * d;
        float *pos = y + r * 2 * d, *neg = pos + d;
        vf high = load(zr), low = high;
        for (int32_t c = LANES; c < d; c += LANES) {
            const vf v = load(zr + c);
            high = select(v > high, v, high);
            low = select(v < low, v, low);
        }
        float max = high[0], min = low[0];
        for (int k = 1; k < LANES; ++k) {
            max = high[k] > max ? high[k] : max;
            min = low[k] < min ? low[k] : min;
        }
        /* a NaN makes its lane's comparisons false, so it may be left out of max and min; it still reaches the
           sums below through its own exp */
        vf pos_sum = {0}, neg_sum = {0};
        for (int32_t c = 0; c < d; c += LANES) {
            const vf v = load(zr + c);
            const vf ep = exp_lanes(v - splat(max)), en = exp_lanes(splat(min) - v);
            store(pos + c, ep);
            store(neg + c, en);
            pos_sum += ep;
            neg_sum += en;
        }
        const vf pos_scale = splat(1.0f / sum_lanes(pos_sum)), neg_scale = splat(1.0f / sum_lanes(neg_sum));
        for (int32_t c = 0; c < d; c += LANES) {
            store(pos + c, load(pos + c) * pos_scale);
            store(neg + c, load(neg + c) * neg_scale);
        }
    }
}

/* The rows [r0, r1) of y and its gradient g [rows, 2 d] -> the gradient of z, gz [rows, d]. */
void softmax_pair_backward(const float *y, const float *g, int64_t r0, int64_t r1, int32_t d, float *gz) {
    for (int64_t r = r0; r < r1; ++r) {
        const float *yp = y + r * 2 * d, *yn = yp + d, *gp = g + r * 2 * d, *gn = gp + d;
        vf pos_dot = {0}, neg_dot = {0};
        for (int32_t c = 0; c < d; c += LANES) {
            pos_dot += load(gp + c) * load(yp + c);
            neg_dot += load(gn + c) * load(yn + c);
        }
        const vf pos_mean = splat(sum_lanes(pos_dot)), neg_mean = splat(sum_lanes(neg_dot));
        for (int32_t c = 0; c < d; c += LANES)
            store(gz + r * d + c, load(yp + c) * (load(gp + c) - pos_mean) - load(yn + c) * (load(gn + c) - neg_mean));
    }
}

/* max that a NaN wins and keeps, as torch's amax: b where b > a or b is NaN, else a (a NaN a stays) */
static inline vf max_nan(vf a, vf b) { return select((b > a) | (b != b), b, a); }

static inline float max_nan_scalar(float a, float b) { return (b > a || b != b) ? b : a; }

static inline float row_max(const float *x, int64_t width) {
    vf high = splat(-INFINITY);
    int64_t c = 0;
    for (; c + LANES <= width; c += LANES) high = max_nan(high, load(x + c));
    if (c < width) high = max_nan(high, load_partial(x + c, width - c, -INFINITY));
    float max = high[0];
    for (int k = 1; k < LANES; ++k) max = max_nan_scalar(max, high[k]);
    return max;
}

/* x[c] = e(x[c] - shift) for the `width` floats of one row, in place */
static inline void exp_minus(float *x, int64_t width, float shift) {
    int64_t c = 0;
    for (; c + LANES <= width; c += LANES) store(x + c, exp_lanes(load(x + c) - splat(shift)));
    if (c < width) store_partial(x + c, exp_lanes(load_partial(x + c, width - c, 0.0f) - splat(shift)), width - c);
}

/* The rows [r0, r1) of x [rows, width], in place. */
void exp_minus_row_max(float *x, int64_t r0, int64_t r1, int64_t width, float offset) {
    for (int64_t r = r0; r < r1; ++r) exp_minus(x + r * width, width, row_max(x + r * width, width) + offset);
}

/* The rows [r0, r1) of x [rows, width], in place; row r takes shift[r / rows_per_shift]. */
void exp_minus_shift(float *x, int64_t r0, int64_t r1, int64_t width, const float *shift, int64_t rows_per_shift) {
    for (int64_t r = r0; r < r1; ++r) exp_minus(x + r * width, width, shift[r / rows_per_shift]);
}

/* Hedgehog's features made a block of tokens at a time for ops/token_products.c's produced_* functions: the
 * logits z [tn, d] from another maker (products' affine_rows, through its pointer), then softmax_pair_forward
 * of the block. The same values to the bit as the stored features: the same logits, the same pass. */
typedef void (*produce_rows)(const void *state, int64_t b, int64_t t0, int64_t tn, float *out);

typedef struct {
    produce_rows logits;
    const void *logits_state;
    int32_t d;
} softmax_pair_rows_state_t;

int softmax_pair_rows_state_size(void) { return (int)sizeof(softmax_pair_rows_state_t); }

void softmax_pair_rows_state(softmax_pair_rows_state_t *s, produce_rows logits, const void *logits_state, int32_t d) {
    const softmax_pair_rows_state_t state = {logits, logits_state, d};
    *s = state;
}

void softmax_pair_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const softmax_pair_rows_state_t *s = state;
    float *z = malloc(sizeof(float) * (size_t)(tn * s->d));
    if (!z) abort(); /* a block's logits, a few tens of KB: without them the result would be wrong */
    s->logits(s->logits_state, b, t0, tn, z);
    softmax_pair_forward(z, 0, tn, s->d, out);
    free(z);
}

/* The fixed elementwise feature maps made a block of tokens at a time for ops/token_products.c's produced_*
 * functions, of a token's x [w]:
 *
 *     POINTWISE_RELU       relu(x)                            [w]     (ReLU's map)
 *     POINTWISE_ELU        e(x - relu(x)) + relu(x)           [w]     (elu(x) + 1, as ELU's map computes it)
 *     POINTWISE_COSFORMER  [relu(x) s, relu(x) c]             [2 w]   (s, c: the token's row of a table)
 *
 * each float operation that of the map's PyTorch forward, so that ReLU's and cosFormer's features are the
 * stored ones to the bit, and ELU's to e's rounding (torch's exp is another approximation). relu keeps NaN,
 * as torch.relu does. */
enum { POINTWISE_RELU = 0, POINTWISE_ELU = 1, POINTWISE_COSFORMER = 2 };

typedef struct {
    const float *x; /* [B, H, N, w] at these strides (floats), the last 1 */
    int64_t heads, stride_b, stride_h, stride_n;
    int32_t width, kind;
    const float *trig;     /* POINTWISE_COSFORMER: (sin, cos) per token, [B or 1, N, 2] */
    int64_t trig_stride_b; /* floats between examples' tables; 0: one table for all */
} pointwise_rows_state_t;

int pointwise_rows_state_size(void) { return (int)sizeof(pointwise_rows_state_t); }

void pointwise_rows_state(pointwise_rows_state_t *s, const float *x, int64_t heads, int64_t stride_b,
                          int64_t stride_h, int64_t stride_n, int32_t width, int32_t kind, const float *trig,
                          int64_t trig_stride_b) {
    const pointwise_rows_state_t state = {x, heads, stride_b, stride_h, stride_n, width, kind, trig, trig_stride_b};
    *s = state;
}

/* The features [tn, w or 2 w] of tokens [t0, t0 + tn) of batch entry b (b = batch * heads + head). */
void pointwise_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const pointwise_rows_state_t *s = state;
    const int32_t w = s->width, kind = s->kind;
    const int64_t example = b / s->heads, width_out = kind == POINTWISE_COSFORMER ? 2 * (int64_t)w : w;
    const float *x0 = s->x + example * s->stride_b + (b % s->heads) * s->stride_h;
    const float *trig = kind == POINTWISE_COSFORMER ? s->trig + example * s->trig_stride_b + 2 * t0 : 0;
    for (int64_t t = 0; t < tn; ++t) {
        const float *x = x0 + (t0 + t) * s->stride_n;
        float *o = out + t * width_out;
        const vf sine = trig ? splat(trig[2 * t]) : splat(0.0f), cosine = trig ? splat(trig[2 * t + 1]) : splat(0.0f);
        for (int32_t c = 0; c < w; c += LANES) {
            const int64_t count = w - c < LANES ? w - c : LANES;
            const vf v = count == LANES ? load(x + c) : load_partial(x + c, count, 0.0f);
            const vf r = select(v < splat(0.0f), splat(0.0f), v); /* NaN < 0 is false: NaN stays */
            vf first = r, second = r;
            if (kind == POINTWISE_ELU) first = exp_lanes(v - r) + r;
            if (kind == POINTWISE_COSFORMER) first = r * sine, second = r * cosine;
            if (count == LANES) {
                store(o + c, first);
                if (kind == POINTWISE_COSFORMER) store(o + w + c, second);
            } else {
                store_partial(o + c, first, count);
                if (kind == POINTWISE_COSFORMER) store_partial(o + w + c, second, count);
            }
        }
    }
}

/* exp_minus_row_max of the rows [tn, width] that another maker (products' affine_rows) makes, in the output
 * itself: Performer's and Flexformer's query features, exp(logits - the row's max - offset), where offset =
 * ln(m) / 2 is the features' m^(-1/2). */
typedef struct {
    produce_rows logits;
    const void *logits_state;
    int64_t width;
    float offset;
} exp_minus_max_rows_state_t;

int exp_minus_max_rows_state_size(void) { return (int)sizeof(exp_minus_max_rows_state_t); }

void exp_minus_max_rows_state(exp_minus_max_rows_state_t *s, produce_rows logits, const void *logits_state,
                              int64_t width, float offset) {
    const exp_minus_max_rows_state_t state = {logits, logits_state, width, offset};
    *s = state;
}

void exp_minus_max_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const exp_minus_max_rows_state_t *s = state;
    s->logits(s->logits_state, b, t0, tn, out);
    exp_minus_row_max(out, 0, tn, s->width, s->offset);
}

/* Performer's and Flexformer's key features made a block of tokens at a time: for key j of batch entry b,
 *
 *     exp(logit_j - |x_j|^2 c - shift[b])     (0 for a pad key)
 *
 * with the logits [tn, width] from another maker (products' affine_rows: the scaled W x), c = 1 / (2 sqrt(d))
 * (`norm_scale` = -c), and shift[b] = the largest logit_j - |x_j|^2 c over the real keys of b, plus ln(m) / 2:
 * one stabiliser per example and head, which positive_key_shift computes in a pass of its own over the same
 * logits (a block of tokens does not see all keys). A pad key's row is 0, as the stored features' exp(-inf). */
typedef struct {
    produce_rows logits;
    const void *logits_state;
    const float *x; /* [B, H, N, d] at these strides (floats), the last 1 */
    int64_t heads, stride_b, stride_h, stride_n, depth, width;
    float norm_scale, offset;
    const uint8_t *mask; /* [B, N] at mask_stride_b, 1 = real; or NULL: all real */
    int64_t mask_stride_b;
    const float *shift; /* [B H], for positive_key_rows */
} positive_key_state_t;

int positive_key_rows_state_size(void) { return (int)sizeof(positive_key_state_t); }

void positive_key_rows_state(positive_key_state_t *s, produce_rows logits, const void *logits_state, const float *x,
                             int64_t heads, int64_t stride_b, int64_t stride_h, int64_t stride_n, int64_t depth,
                             int64_t width, float norm_scale, float offset, const uint8_t *mask,
                             int64_t mask_stride_b, const float *shift) {
    const positive_key_state_t state = {logits, logits_state, x, heads, stride_b, stride_h, stride_n, depth, width,
                                        norm_scale, offset, mask, mask_stride_b, shift};
    *s = state;
}

/* Tokens per block of the stabiliser's pass (its logits, a few tens of KB, stay in cache). */
#define KEY_BLOCK 256

/* logit - |x|^2 c for the block's rows, in place in out (the shift not yet taken) */
static void key_logits_block(const positive_key_state_t *s, int64_t b, int64_t t0, int64_t tn, float *out) {
    const float *x0 = s->x + (b / s->heads) * s->stride_b + (b % s->heads) * s->stride_h + t0 * s->stride_n;
    s->logits(s->logits_state, b, t0, tn, out);
    for (int64_t t = 0; t < tn; ++t) {
        const float *x = x0 + t * s->stride_n;
        float square = 0.0f;
        for (int64_t i = 0; i < s->depth; ++i) square += x[i] * x[i];
        const float term = square * s->norm_scale;
        float *o = out + t * s->width;
        for (int64_t c = 0; c < s->width; ++c) o[c] += term;
    }
}

static inline int key_is_real(const positive_key_state_t *s, int64_t b, int64_t t) {
    return !s->mask || s->mask[(b / s->heads) * s->mask_stride_b + t];
}

/* shift[b] for the batch entries [b0, b1): the largest logit - |x|^2 c over real keys and features, plus the
 * offset; 0 where an entry has no real key (its features are all 0 then). */
void positive_key_shift(const positive_key_state_t *s, int64_t b0, int64_t b1, int64_t n, float *shift) {
    float *block = malloc(sizeof(float) * (size_t)(KEY_BLOCK * s->width));
    if (!block) abort(); /* a block of logits: without it the result would be wrong */
    for (int64_t b = b0; b < b1; ++b) {
        float high = -INFINITY;
        for (int64_t t0 = 0; t0 < n; t0 += KEY_BLOCK) {
            const int64_t tn = n - t0 < KEY_BLOCK ? n - t0 : KEY_BLOCK;
            key_logits_block(s, b, t0, tn, block);
            for (int64_t t = 0; t < tn; ++t)
                if (key_is_real(s, b, t0 + t)) high = max_nan_scalar(high, row_max(block + t * s->width, s->width));
        }
        shift[b] = high == -INFINITY ? 0.0f : high + s->offset;
    }
    free(block);
}

void positive_key_rows(const void *state, int64_t b, int64_t t0, int64_t tn, float *out) {
    const positive_key_state_t *s = state;
    key_logits_block(s, b, t0, tn, out);
    for (int64_t t = 0; t < tn; ++t) {
        float *o = out + t * s->width;
        if (key_is_real(s, b, t0 + t))
            exp_minus(o, s->width, s->shift[b]);
        else
            memset(o, 0, sizeof(float) * (size_t)s->width);
    }
}
