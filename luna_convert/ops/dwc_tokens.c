/* The DWC branch plus the attention output in one pass over the tokens (the native path of
 * ops.dwc.depthwise_conv_tokens_plus; the reference is ops.dwc.depthwise_conv_tokens followed by the add).
 *
 * Plain C99, no PyTorch headers, float32, compiled on first use by ops/native.py. The tokens of a sequence
 * are `prefix` tokens (CLS, registers: no branch there) and then a grid_h x grid_w grid of positions in
 * row-major order; text is the grid 1 x n without prefix. For every token r = b n + t of the rows [r0, r1)
 * and each of its heads h (token-major, the order in which the heads split from [B, n, H C] lie in memory):
 *
 *     out[b, t, h, :] = addend[b, h, t, :] + keep_t (bias + sum_tap w[tap, :] x[b, h, s(t, tap), :] keep_s)
 *
 * over the kh x kw taps whose position s lies on the grid (zero padding), keep = 1 without a key mask. The
 * sum runs in the reference's order: the bias plus the centre tap first, then the other taps in row-major
 * order. Compiled with -ffp-contract=off, so no product is fused into an add the reference rounds
 * separately.
 *
 * x is [B, H, n, C] with strides (sb, sh, sn, 1) in floats (the heads split from [B, n, H C] as they lie),
 * w is [kh kw, C] (the conv weight transposed), bias [C] or NULL, keep [B, n] bytes or NULL; out is
 * contiguous [B, n, H, C], token-major as the loop writes it and as the heads merge back into [B, n, H C]
 * (written in the [B, H, n, C] order, the merge would copy it); addend is contiguous [B, H, n, C] (divide 0)
 * or [B, H, n, C + 1] (divide 1 or 2): the linear attention's numerator and its denominator den in the
 * last column, added as numerator * q with q = 1 / (den + eps) (divide 1) or 1 / max(den, eps) (divide 2),
 * as ops.linear divides.
 */
#include <stdint.h>

#define MAX_C 4096

void dwc_tokens_forward(const float *x, int64_t r0, int64_t r1, int64_t heads, int64_t n, int64_t channels,
                        int64_t sb, int64_t sh, int64_t sn, int64_t prefix, int64_t grid_h, int64_t grid_w,
                        const float *w, int32_t kh, int32_t kw, const float *bias, const uint8_t *keep,
                        const float *addend, int32_t divide, float eps, float *out) {
    const int32_t centre = (kh / 2) * kw + kw / 2;
    float acc[MAX_C];
    for (int64_t r = r0; r < r1; ++r) { /* r = b n + t: a token of one sequence, all its heads */
        const int64_t b = r / n, t = r % n, p = t - prefix, pi = p / grid_w, pj = p % grid_w;
        const uint8_t *kr = keep ? keep + b * n : 0;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xr = x + b * sb + h * sh;
            const int64_t row = (b * heads + h) * n + t;
            const float *ad = addend + row * (divide ? channels + 1 : channels);
            float *o = out + (r * heads + h) * channels, q = 1.0f;
            if (divide) {
                const float den = ad[channels];
                q = 1.0f / (divide == 2 ? (den < eps ? eps : den) : den + eps);
            }
            if (p < 0 || (kr && !kr[t])) { /* a prefix token or a pad: the branch is zero there, the addend passes */
                for (int64_t c = 0; c < channels; ++c) o[c] = divide ? ad[c] * q : ad[c];
                continue;
            }
            const float *xc = xr + t * sn, *wc = w + (int64_t)centre * channels;
            for (int64_t c = 0; c < channels; ++c) {
                float v = xc[c] * wc[c];
                acc[c] = bias ? bias[c] + v : v;
            }
            for (int32_t tap = 0; tap < kh * kw; ++tap) {
                const int64_t si = pi + tap / kw - kh / 2, sj = pj + tap % kw - kw / 2, s = prefix + si * grid_w + sj;
                if (tap == centre || si < 0 || si >= grid_h || sj < 0 || sj >= grid_w || (kr && !kr[s])) continue;
                const float *xs = xr + s * sn, *wj = w + (int64_t)tap * channels;
                for (int64_t c = 0; c < channels; ++c) acc[c] += xs[c] * wj[c];
            }
            if (divide)
                for (int64_t c = 0; c < channels; ++c) o[c] = acc[c] + ad[c] * q;
            else
                for (int64_t c = 0; c < channels; ++c) o[c] = acc[c] + ad[c];
        }
    }
}

/* The backward of dwc_tokens_forward without division (divide 0), for the rows [r0, r1) of tokens s = r % n
 * of sequence b = r / n, all heads: with G the output's gradient ([B, n, H, C] contiguous, token-major),
 *
 *     grad_x[b, s, h, :] = keep_s sum_tap w[tap, :] G[b, t, h, :] keep_t      (t: the token whose tap reads s)
 *     grad_w[tap, :]    += x[b, h, s, :] G[b, t, h, :] keep_s keep_t
 *     grad_b            += G[b, s, h, :] keep_s                                  (s not a prefix token)
 *
 * grad_x is written token-major like G; grad_w [kh kw, C] and grad_b [C] are this call's own double sums (the
 * caller gives each thread chunk zeroed ones and adds them up). The addend's gradient is G itself. */
void dwc_tokens_backward(const float *x, int64_t r0, int64_t r1, int64_t heads, int64_t n, int64_t channels,
                         int64_t sb, int64_t sh, int64_t sn, int64_t prefix, int64_t grid_h, int64_t grid_w,
                         const float *w, int32_t kh, int32_t kw, const uint8_t *keep, const float *grad_out,
                         float *grad_x, double *grad_w, double *grad_b) {
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / n, s = r % n, p = s - prefix, pi = p / grid_w, pj = p % grid_w;
        const uint8_t *kr = keep ? keep + b * n : 0;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xs = x + b * sb + h * sh + s * sn, *gs = grad_out + (r * heads + h) * channels;
            float *gx = grad_x + (r * heads + h) * channels;
            for (int64_t c = 0; c < channels; ++c) gx[c] = 0.0f;
            if (p < 0 || (kr && !kr[s])) continue; /* a prefix token or a pad: no branch reads it or writes it */
            for (int64_t c = 0; c < channels; ++c) grad_b[c] += gs[c];
            for (int32_t tap = 0; tap < kh * kw; ++tap) {
                /* the token t whose tap `tap` reads s: t's position is s's minus the tap's offset */
                const int64_t ti = pi - (tap / kw - kh / 2), tj = pj - (tap % kw - kw / 2), t = prefix + ti * grid_w + tj;
                if (ti < 0 || ti >= grid_h || tj < 0 || tj >= grid_w || (kr && !kr[t])) continue;
                const float *gt = grad_out + ((b * n + t) * heads + h) * channels, *wt = w + (int64_t)tap * channels;
                double *gw = grad_w + (int64_t)tap * channels;
                for (int64_t c = 0; c < channels; ++c) {
                    gx[c] += wt[c] * gt[c];
                    gw[c] += (double)xs[c] * (double)gt[c];
                }
            }
        }
    }
}
