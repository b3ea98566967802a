/* Hedgehog's pair of softmaxes in one pass over the rows (the native path of hedgehog_native.py; the
 * reference is hedgehog.py's softmax_pair_features, torch.cat([softmax(z), softmax(-z)], -1)).
 *
 * Plain C99 with GCC/Clang vector extensions, no PyTorch headers, float32, compiled on first use by
 * ops/native.py. Rows are d wide, d a multiple of LANES below (the caller checks it):
 *
 *     forward:  y[r] = [e(z - max z) / sum e(z - max z),  e(min z - z) / sum e(min z - z)]      [rows, 2 d]
 *     backward: gz[r] = y+ (g+ - g+.y+) - y- (g- - g-.y-)   with y = [y+ | y-], g = [g+ | g-]   [rows, d]
 *
 * e is exp_lanes below: exp of r <= 0 to within a few float32 ulps (torch's own exp is also a vector
 * approximation; the two agree to float32 rounding, not to the bit). Each half's arguments are <= 0 by
 * construction, so no overflow is possible; below -87.3 (where float32's normal range ends) it gives 0, as
 * the softmax's sums make no difference between 0 and a subnormal. A NaN anywhere in a row makes the
 * whole row NaN, as in torch.
 */
#include <stdint.h>
#include <string.h>

/* Floats per vector: 16 where AVX-512 is there (the forward ran 1.2x faster than with 8, measured), else 8
   (AVX's registers, or two SSE2 ones). d must be a multiple of it: hedgehog_softmax_lanes() tells the caller. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

int32_t hedgehog_softmax_lanes(void) { return LANES; }

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){0} + x; }

/* a where mask (a comparison's all-ones lanes), else b: C has no vector ?: */
static inline vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

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
void hedgehog_softmax_forward(const float *z, int64_t r0, int64_t r1, int32_t d, float *y) {
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
void hedgehog_softmax_backward(const float *y, const float *g, int64_t r0, int64_t r1, int32_t d, float *gz) {
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
