/* The additive sorting kernel's attention, float32, one (batch, head) row at a time: the forward pass and
   its backward.

   Kernel: k(q_i, k_j) = c0 + sum_r w_r kappa(x_ri - y_rj), with x_r and y_r the queries' and keys'
   projections already divided by the bandwidth, kappa(t) = e^{-|t|} (laplace) or (1 + |t|) e^{-|t|}
   (matern32). With u_j = m_j [v_j, 1] (m_j the key mask): acc_i = sum_j k(q_i, k_j) u_j, and
   out_i = acc_i[:-1] / D_i with D_i = acc_i[-1] + eps.

   One projection's sum S(x) = sum_j kappa(x - y_j) u_j over sorted keys: scans
     left:  L0_p = sum_{j<=p} e^{-(y_p - y_j)} u_j           (and L1_p with the factor (y_p - y_j))
     right: R0_p = sum_{j>=p} e^{-(y_j - y_p)} u_j           (and R1_p with the factor (y_j - y_p))
   each step M_p = e^{-(y_p - y_{p-1})} M_{p-1} + u_p: every exponent is <= 0, so no value of the
   projections can overflow. A query x reads its two neighbours, the last key <= x (p, gap g = x - y_p)
   and the first key > x (p + 1, gap h = y_{p+1} - x):
     laplace:   S = e^{-g} L0_p + e^{-h} R0_{p+1}
     matern32:  S = e^{-g}((1 + g) L0_p + L1_p) + e^{-h}((1 + h) R0_{p+1} + R1_{p+1})
   and the derivative sum S'(x) = sum_j kappa'(x - y_j) u_j from the same neighbours:
     laplace:   S' = -e^{-g} L0_p + e^{-h} R0_{p+1} + sum_{y_j = x} u_j
                (kappa'(0) = 0 at a tie, as the explicit form's |t|' = sign(t): the tied keys, counted in L0_p
                with -1, are added back; ``tied_dot``)
     matern32:  S' = -e^{-g}(g L0_p + L1_p) + e^{-h}(h R0_{p+1} + R1_{p+1})
   Keys and queries are sorted here (a radix sort) and the queries walked in sorted order, so finding
   their neighbours is one merge, not a search per query.

   Backward, with G_i = [dL/dout_i / D_i, -(dL/dout_i . out_i) / D_i] (dL/dacc_i):
     dL/dw_r = sum_i G_i . S_r(x_ri)           dL/dx_ri = w_r G_i . S'_r(x_ri)
     dL/du_j = c0 sum_i G_i + sum_r w_r T_r(y_rj),  dL/dy_rj = w_r u_j . T'_r(y_rj)
     dL/dc0  = sum_i G_i . sum_j u_j
   where T_r(y) = sum_i kappa(y - x_ri) G_i is the same kind of sum with the roles swapped (the queries
   scanned, the keys walked; kappa is even and kappa' odd, so d kappa(x - y)/dy = kappa'(y - x)).

   The reference is ``sorted_kernel_sums`` in sorting.py (the same sums by blocked prefix sums in PyTorch,
   differentiated by autograd) and, in the tests, the explicit N x N kernel. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The points scanned: row j is m_j rows[j] (width floats), and with ``ones`` a last column m_j. */
typedef struct {
    const float *rows;
    int64_t stride;           /* floats between rows */
    int64_t width;
    int ones;
    const uint8_t *keep;      /* [N] or NULL */
} Points;

static inline float point_weight(const Points *points, int64_t j) {
    return points->keep == NULL || points->keep[j] ? 1.0f : 0.0f;
}

/* One direction's scan over the sorted points (step +1 from the first, -1 from the last), writing the
   sums at every point: sums0 [n, C], and sums1 for matern32 (C = width + ones). decays[t] = e^{-(y_{t+1} - y_t)}. */
static void scan(const Points *points, const float *y, const float *decays, const int32_t *order, int64_t n,
                 int matern, int step, float *sums0, float *sums1) {
    int64_t width = points->width, channels = width + points->ones;
    int64_t p = step > 0 ? 0 : n - 1;
    float m = point_weight(points, order[p]);
    const float *src = points->rows + order[p] * points->stride;
    float *s0 = sums0 + p * channels, *s1 = matern ? sums1 + p * channels : NULL;
    for (int64_t c = 0; c < width; c++) s0[c] = m * src[c];
    if (points->ones) s0[width] = m;
    if (matern)
        for (int64_t c = 0; c < channels; c++) s1[c] = 0.0f;
    for (int64_t t = 1; t < n; t++) {
        int64_t next = p + step;
        float gap = step > 0 ? y[next] - y[p] : y[p] - y[next];  /* >= 0 */
        float decay = decays[step > 0 ? p : next];
        const float *prev0 = s0, *prev1 = s1;
        s0 = sums0 + next * channels;
        if (matern) {
            s1 = sums1 + next * channels;
            for (int64_t c = 0; c < channels; c++) s1[c] = decay * (prev1[c] + gap * prev0[c]);
        }
        m = point_weight(points, order[next]);
        src = points->rows + order[next] * points->stride;
        for (int64_t c = 0; c < width; c++) s0[c] = decay * prev0[c] + m * src[c];
        if (points->ones) s0[width] = decay * prev0[width] + m;
        p = next;
    }
}

/* A projection's four (or two) scans over one set of sorted points. */
typedef struct {
    float *left0, *right0, *left1, *right1;
} Sums;

/* Both directions' scans; ``decays`` [n] is scratch (the two share each step's e^{-gap}). */
static void scan_both_ways(const Points *points, const float *y, const int32_t *order, int64_t n, int matern,
                           float *decays, Sums *sums) {
    for (int64_t t = 0; t + 1 < n; t++) decays[t] = expf(-(y[t + 1] - y[t]));
    scan(points, y, decays, order, n, matern, 1, sums->left0, sums->left1);
    scan(points, y, decays, order, n, matern, -1, sums->right0, sums->right1);
}

/* A query's view of one side: the neighbour's row of sums and its gap (present = 0: no neighbour). */
typedef struct {
    int present;
    const float *s0, *s1;
    float gap;
} Side;

/* The two neighbours of x among n sorted points whose first ``above`` are <= x. */
static inline void neighbours(float x, const float *ys, int64_t n, int64_t above, const Sums *sums,
                              int64_t channels, int matern, Side *left, Side *right) {
    *left = (Side){0, NULL, NULL, 0.0f};
    *right = *left;
    left->present = above > 0;
    if (left->present) {
        int64_t p = above - 1;
        left->s0 = sums->left0 + p * channels;
        left->s1 = matern ? sums->left1 + p * channels : NULL;
        left->gap = x - ys[p];
    }
    right->present = above < n;
    if (right->present) {
        right->s0 = sums->right0 + above * channels;
        right->s1 = matern ? sums->right1 + above * channels : NULL;
        right->gap = ys[above] - x;
    }
}

/* sum over the sorted points p = above - 1, above - 2, ... equal to x of g . u_p (u_p: the scanned point's row with
   its ones column), the laplace slope's tie term (see the header); 0 where none equals x. */
static float tied_dot(const float *g, const Points *points, const float *ys, const int32_t *order, int64_t above,
                      float x, float *point) {
    float sum = 0.0f;
    int64_t width = points->width;
    for (int64_t p = above - 1; p >= 0 && ys[p] == x; p--) {
        const float *src = points->rows + (int64_t)order[p] * points->stride;
        float m = point_weight(points, order[p]);
        for (int64_t c = 0; c < width; c++) point[c] = m * src[c];
        if (points->ones) point[width] = m;
        for (int64_t c = 0; c < width + points->ones; c++) sum += g[c] * point[c];
    }
    return sum;
}

/* acc += weight * (a side's part of S): e^{-g} s0, or e^{-g}((1 + g) s0 + s1). */
static void add_value(float *acc, const Side *side, int64_t channels, int matern, float weight) {
    if (!side->present) return;
    float e = weight * expf(-side->gap);
    if (matern) {
        float a = e * (1.0f + side->gap);
        for (int64_t c = 0; c < channels; c++) acc[c] += a * side->s0[c] + e * side->s1[c];
    } else {
        for (int64_t c = 0; c < channels; c++) acc[c] += e * side->s0[c];
    }
}

/* a . b in sixteen partial sums (one vector register: a single running sum would be a chain of dependent
   adds, which the compiler may not reorder; the backward spent a sixth of its time there). */
static inline float dot(const float *a, const float *b, int64_t channels) {
    float part[16] = {0.0f};
    int64_t c = 0;
    for (; c + 16 <= channels; c += 16)
        for (int lane = 0; lane < 16; lane++) part[lane] += a[c + lane] * b[c + lane];
    float total = 0.0f;
    for (; c < channels; c++) total += a[c] * b[c];
    for (int lane = 0; lane < 16; lane++) total += part[lane];
    return total;
}

/* g . (a side's part of S) and g . (its part of S', sign included) in *value and *slope. */
static void side_dots(const float *g, const Side *side, int64_t channels, int matern, float sign, float *value,
                      float *slope) {
    if (!side->present) return;
    float e = expf(-side->gap), d0 = dot(g, side->s0, channels);
    if (matern) {
        float d1 = dot(g, side->s1, channels);
        *value += e * ((1.0f + side->gap) * d0 + d1);
        *slope += sign * e * (side->gap * d0 + d1);
    } else {
        *value += e * d0;
        *slope += sign * e * d0;
    }
}

/* Scratch of one sort of up to n values: two key and two index buffers (ping-pong). */
typedef struct {
    uint32_t *keys[2];
    int32_t *index[2];
} SortScratch;

/* The float's bits as an unsigned integer whose order is the floats' order (negatives reversed). */
static inline uint32_t ordered_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

/* sorted[i] = x[order[i]] ascending, by a least-significant-digit radix sort on the bits (four passes of
   eight bits, each stable; a pass whose digit is the same for every value is skipped). torch.sort on rows
   of 4,096 took 60 % of the forward's time. */
static void sort_values(const float *x, int64_t n, float *sorted, int32_t *order, SortScratch *scratch) {
    uint32_t *keys = scratch->keys[0], *keys_out = scratch->keys[1];
    int32_t *index = scratch->index[0], *index_out = scratch->index[1];
    for (int64_t i = 0; i < n; i++) {
        keys[i] = ordered_bits(x[i]);
        index[i] = (int32_t)i;
    }
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[256] = {0};
        for (int64_t i = 0; i < n; i++) count[(keys[i] >> shift) & 255u]++;
        if (count[(keys[0] >> shift) & 255u] == n) continue;
        int64_t start = 0;
        for (int d = 0; d < 256; d++) {
            int64_t c = count[d];
            count[d] = start;
            start += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t at = count[(keys[i] >> shift) & 255u]++;
            keys_out[at] = keys[i];
            index_out[at] = index[i];
        }
        uint32_t *kt = keys; keys = keys_out; keys_out = kt;
        int32_t *it = index; index = index_out; index_out = it;
    }
    for (int64_t i = 0; i < n; i++) {
        order[i] = index[i];
        sorted[i] = x[index[i]];
    }
}

/* Everything one chunk of rows needs besides its inputs, taken in one allocation. */
typedef struct {
    void *block;
    Sums keys, queries;          /* scans over the keys (values u) and, backward, over the queries (G) */
    float *acc, *ys, *xs, *grad_u, *g, *point, *tie, *decays;
    int32_t *yo, *xo;
    double *total, *total_g;
    SortScratch sort;
} Scratch;

/* The chunk's scratch in one allocation; without memory, *failed = 1 and 0 (the caller then writes nothing). */
static int take_scratch(Scratch *s, int64_t nq, int64_t n, int64_t channels, int matern, int backward,
                        int32_t *failed) {
    int64_t sides = matern ? 4 : 2, most = nq > n ? nq : n;
    int64_t floats = sides * n * channels + nq * channels + n + nq + 2 * channels + most
                     + (backward ? sides * nq * channels + n * channels : 0);
    size_t bytes = sizeof(float) * (size_t)floats + sizeof(int32_t) * (size_t)(n + nq + 2 * most)
                   + sizeof(uint32_t) * (size_t)(2 * most) + sizeof(double) * (size_t)(2 * channels);
    s->block = malloc(bytes);
    if (!s->block) {
        *failed = 1;
        return 0;
    }
    double *d = s->block;
    s->total = d;
    s->total_g = d + channels;
    float *f = (float *)(d + 2 * channels);
    float **key_sums[4] = {&s->keys.left0, &s->keys.right0, &s->keys.left1, &s->keys.right1};
    float **query_sums[4] = {&s->queries.left0, &s->queries.right0, &s->queries.left1, &s->queries.right1};
    for (int i = 0; i < 4; i++) {
        *key_sums[i] = i < sides ? f : NULL;
        f += i < sides ? n * channels : 0;
        *query_sums[i] = backward && i < sides ? f : NULL;
        f += backward && i < sides ? nq * channels : 0;
    }
    s->acc = f; f += nq * channels;  /* forward: acc; backward: G */
    s->g = s->acc;
    s->grad_u = backward ? f : NULL; f += backward ? n * channels : 0;
    s->point = f; f += channels;
    s->tie = f; f += channels;
    s->decays = f; f += most;
    s->ys = f; f += n;
    s->xs = f; f += nq;
    int32_t *i32 = (int32_t *)f;
    s->yo = i32; i32 += n;
    s->xo = i32; i32 += nq;
    s->sort.index[0] = i32; i32 += most;
    s->sort.index[1] = i32; i32 += most;
    uint32_t *u32 = (uint32_t *)i32;
    s->sort.keys[0] = u32;
    s->sort.keys[1] = u32 + most;
    return 1;
}

/* The points u_j = m_j [v_j, 1] of row b H + h. */
static Points key_points(const float *v, int64_t batch_stride, int64_t head_stride, int64_t token_stride,
                         const uint8_t *keep, int64_t row, int64_t heads, int64_t n, int64_t values) {
    int64_t b = row / heads, h = row % heads;
    Points points = {v + b * batch_stride + h * head_stride, token_stride, values, 1, keep ? keep + b * n : NULL};
    return points;
}

/* total = sum_j u_j, in double. */
static void sum_points(const Points *points, int64_t n, double *total) {
    int64_t width = points->width;
    for (int64_t c = 0; c < width + points->ones; c++) total[c] = 0.0;
    for (int64_t j = 0; j < n; j++) {
        float m = point_weight(points, j);
        const float *src = points->rows + j * points->stride;
        for (int64_t c = 0; c < width; c++) total[c] += m * src[c];
        if (points->ones) total[width] += m;
    }
}

/* Rows [row0, row1) of B x H. x [BH, R, NQ] and y [BH, R, N] (contiguous), v [B, H, N, DV] by its strides
   (channels contiguous), keep uint8 [B, N] or NULL, w [H, R], c0 [H]; out [BH, NQ, DV] and, unless NULL,
   den [BH, NQ] (the D_i the backward needs), contiguous. If its scratch memory cannot be had it sets
   *failed to 1 and writes nothing. */
void sorting_attention_forward(const float *x, const float *y, const float *v, int64_t v_batch_stride,
                               int64_t v_head_stride, int64_t v_token_stride, const uint8_t *keep,
                               const float *w, const float *c0, int64_t heads, int64_t projections, int64_t nq,
                               int64_t n, int64_t values, int32_t matern, float eps, int64_t row0, int64_t row1,
                               float *out, float *den, int32_t *failed) {
    int64_t channels = values + 1;
    Scratch s;
    if (!take_scratch(&s, nq, n, channels, matern, 0, failed)) return;
    for (int64_t row = row0; row < row1; row++) {
        int64_t h = row % heads;
        Points keys = key_points(v, v_batch_stride, v_head_stride, v_token_stride, keep, row, heads, n, values);
        sum_points(&keys, n, s.total);  /* the background: c0 sum_j u_j for every query */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t c = 0; c < channels; c++) s.acc[i * channels + c] = (float)(c0[h] * s.total[c]);
        for (int64_t r = 0; r < projections; r++) {
            sort_values(y + (row * projections + r) * n, n, s.ys, s.yo, &s.sort);
            sort_values(x + (row * projections + r) * nq, nq, s.xs, s.xo, &s.sort);
            scan_both_ways(&keys, s.ys, s.yo, n, matern, s.decays, &s.keys);
            float weight = w[h * projections + r];
            int64_t above = 0;  /* keys <= the query: sorted positions < above */
            for (int64_t i = 0; i < nq; i++) {
                Side left, right;
                while (above < n && s.ys[above] <= s.xs[i]) above++;
                neighbours(s.xs[i], s.ys, n, above, &s.keys, channels, matern, &left, &right);
                float *a = s.acc + (int64_t)s.xo[i] * channels;
                add_value(a, &left, channels, matern, weight);
                add_value(a, &right, channels, matern, weight);
            }
        }
        float *o = out + row * nq * values;
        for (int64_t i = 0; i < nq; i++) {
            const float *a = s.acc + i * channels;
            float d = a[values] + eps;
            for (int64_t c = 0; c < values; c++) o[i * values + c] = a[c] / d;
            if (den) den[row * nq + i] = d;
        }
    }
    free(s.block);
}

/* The gradients of rows [row0, row1): grad_out, out and den as the forward wrote them ([BH, NQ, DV],
   [BH, NQ, DV], [BH, NQ], contiguous). Writes grad_x [BH, R, NQ], grad_y [BH, R, N], grad_v [BH, N, DV],
   and per row grad_w [BH, R] and grad_c0 [BH] (the caller sums them over the batch). */
void sorting_attention_backward(const float *x, const float *y, const float *v, int64_t v_batch_stride,
                                int64_t v_head_stride, int64_t v_token_stride, const uint8_t *keep,
                                const float *w, const float *c0, int64_t heads, int64_t projections, int64_t nq,
                                int64_t n, int64_t values, int32_t matern, const float *grad_out,
                                const float *out, const float *den, int64_t row0, int64_t row1, float *grad_x,
                                float *grad_y, float *grad_v, float *grad_w, float *grad_c0, int32_t *failed) {
    int64_t channels = values + 1;
    Scratch s;
    if (!take_scratch(&s, nq, n, channels, matern, 1, failed)) return;
    for (int64_t row = row0; row < row1; row++) {
        int64_t h = row % heads;
        Points keys = key_points(v, v_batch_stride, v_head_stride, v_token_stride, keep, row, heads, n, values);
        /* G_i = dL/dacc_i, and the part every key gets through c0: c0 sum_i G_i. */
        for (int64_t i = 0; i < nq; i++) {
            const float *go = grad_out + (row * nq + i) * values, *o = out + (row * nq + i) * values;
            float inv = 1.0f / den[row * nq + i], *g = s.g + i * channels;
            for (int64_t c = 0; c < values; c++) g[c] = go[c] * inv;
            g[values] = -dot(go, o, values) * inv;
        }
        Points grads = {s.g, channels, channels, 0, NULL};
        sum_points(&grads, nq, s.total_g);
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < channels; c++) s.grad_u[j * channels + c] = (float)(c0[h] * s.total_g[c]);
        sum_points(&keys, n, s.total);
        double background = 0.0;  /* dL/dc0 = (sum_i G_i) . (sum_j u_j) */
        for (int64_t c = 0; c < channels; c++) background += s.total_g[c] * s.total[c];
        grad_c0[row] = (float)background;
        for (int64_t r = 0; r < projections; r++) {
            const float *yr = y + (row * projections + r) * n, *xr = x + (row * projections + r) * nq;
            float *gx = grad_x + (row * projections + r) * nq, *gy = grad_y + (row * projections + r) * n;
            float weight = w[h * projections + r];
            sort_values(yr, n, s.ys, s.yo, &s.sort);
            sort_values(xr, nq, s.xs, s.xo, &s.sort);
            /* Queries walk the keys' sums: G_i . S_r(x_i) for w_r, w_r G_i . S'_r(x_i) for x_i. */
            scan_both_ways(&keys, s.ys, s.yo, n, matern, s.decays, &s.keys);
            double grad_weight = 0.0;
            int64_t above = 0;
            for (int64_t i = 0; i < nq; i++) {
                Side left, right;
                while (above < n && s.ys[above] <= s.xs[i]) above++;
                neighbours(s.xs[i], s.ys, n, above, &s.keys, channels, matern, &left, &right);
                const float *g = s.g + (int64_t)s.xo[i] * channels;
                float value = 0.0f, slope = 0.0f;
                side_dots(g, &left, channels, matern, -1.0f, &value, &slope);
                side_dots(g, &right, channels, matern, 1.0f, &value, &slope);
                if (!matern && left.present && left.gap == 0.0f)
                    slope += tied_dot(g, &keys, s.ys, s.yo, above, s.xs[i], s.tie);
                grad_weight += value;
                gx[s.xo[i]] = weight * slope;
            }
            grad_w[row * projections + r] = (float)grad_weight;
            /* Keys walk the queries' sums: w_r T_r(y_j) for u_j, w_r u_j . T'_r(y_j) for y_j. */
            scan_both_ways(&grads, s.xs, s.xo, nq, matern, s.decays, &s.queries);
            above = 0;  /* queries <= the key */
            for (int64_t j = 0; j < n; j++) {
                Side left, right;
                while (above < nq && s.xs[above] <= s.ys[j]) above++;
                neighbours(s.ys[j], s.xs, nq, above, &s.queries, channels, matern, &left, &right);
                int64_t key = s.yo[j];
                add_value(s.grad_u + key * channels, &left, channels, matern, weight);
                add_value(s.grad_u + key * channels, &right, channels, matern, weight);
                float m = point_weight(&keys, key), value = 0.0f, slope = 0.0f;
                if (m == 0.0f) {
                    gy[key] = 0.0f;
                    continue;
                }
                /* u_j . T'(y_j) (value is not needed) */
                const float *src = keys.rows + key * keys.stride;
                for (int64_t c = 0; c < values; c++) s.point[c] = src[c];
                s.point[values] = 1.0f;
                side_dots(s.point, &left, channels, matern, -1.0f, &value, &slope);
                side_dots(s.point, &right, channels, matern, 1.0f, &value, &slope);
                if (!matern && left.present && left.gap == 0.0f)
                    slope += tied_dot(s.point, &grads, s.xs, s.xo, above, s.ys[j], s.tie);
                gy[key] = weight * slope;
            }
        }
        float *gv = grad_v + row * n * values;
        for (int64_t j = 0; j < n; j++) {
            float m = point_weight(&keys, j);
            for (int64_t c = 0; c < values; c++) gv[j * values + c] = m * s.grad_u[j * channels + c];
        }
    }
    free(s.block);
}
