/* LUNA's channel bank and its feature norm in one pass over the tokens (the native path of
 * luna_native.py; the reference is ScalarChannels.forward followed by ops.normalize.sum_normalize).
 *
 * Plain C99, no PyTorch headers: compiled on first use by the machine's C compiler into a cached
 * shared library and called through ctypes on float32 CPU buffers. Each call handles the rows
 * [r0, r1) of a [rows, M] input, so Python threads (ctypes releases the GIL) split one call's rows.
 *
 * Per scalar u: its interval i among the sorted knots (a grid of cells, then at most `most`
 * comparisons), then every channel l is relu(slope[i, l] u + intercept[i, l]). With eps >= 0 each
 * channel of a row is divided by (its sum over the row's M projections + eps) while the row is still
 * in cache. The backward recomputes the same values from u, so nothing but u is kept for it.
 *
 * Compiled with -ffp-contract=off: the cell of a knot and the cell of an input go through the same
 * float operations here (luna_cells for the knots), which is what keeps the grid search exact.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define BLOCK 1024      /* scalars located per pass; their features stay in cache for the norm */
#define MAX_CHANNELS 64 /* L; the caller checks it */
#define MAX_ROW 8192    /* M * L; the caller checks it */

static inline int32_t cell_of(float x, int mapping, float low, float scale, int32_t cells) {
    /* mapping 0: equal cells from low on, (x - low) * scale; 1: (x / (1 + |x|) + 1) * cells / 2.
       Monotone non-decreasing in x, clamped to 0..cells-1, NaN -> 0. */
    float v;
    if (mapping == 0) {
        v = (x - low) * scale;
    } else {
        float a = fabsf(x);
        if (a > 1e30f) a = 1e30f;
        v = (x / (a + 1.0f) + 1.0f) * ((float)cells * 0.5f);
    }
    if (!(v >= 0.0f)) v = 0.0f;
    if (v > (float)(cells - 1)) v = (float)(cells - 1);
    return (int32_t)v;
}

void luna_cells(const float *x, int64_t n, int mapping, float low, float scale, int32_t cells, int32_t *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = cell_of(x[i], mapping, low, scale, cells);
}

typedef struct {
    int mapping;
    float low, scale;
    int32_t cells, most;
    const int32_t *start; /* [cells]: how many knots lie in lower cells */
    const float *kpad;    /* [most, cells]: each cell's knots, padded with +inf */
} grid_t;

/* For each x[i] of x[0..e), the number of knots < x[i], into idx: its cell, then one comparison per knot
   slot of that cell. Separate loops over the block (the cells; the knots below each cell; each slot),
   without branches, which the compiler vectorises; one scalar at a time with a branch per slot ran
   several times slower. */
static inline void locate_block(const grid_t *g, const float *x, int64_t e, int32_t *idx) {
    int32_t cell[BLOCK];
    if (g->mapping == 0)
        for (int64_t i = 0; i < e; ++i) cell[i] = cell_of(x[i], 0, g->low, g->scale, g->cells);
    else
        for (int64_t i = 0; i < e; ++i) cell[i] = cell_of(x[i], 1, g->low, g->scale, g->cells);
    for (int64_t i = 0; i < e; ++i) idx[i] = g->start[cell[i]];
    for (int32_t j = 0; j < g->most; ++j) {
        const float *kp = g->kpad + (int64_t)j * g->cells;
        for (int64_t i = 0; i < e; ++i) idx[i] += x[i] > kp[cell[i]];
    }
}

/* Whether 32-byte vectors are native (AVX). The paths below that build vectors from scattered pairs, or take
   floats to doubles, ran 2-5x slower than the scalar loops in the portable build (SSE2 alone): they are
   taken only where WIDE. Either way the float operations are the same, so are the results. */
#if defined(__AVX__)
#define WIDE 1
#else
#define WIDE 0
#endif

/* Eight floats (or ints) as one value (GCC and Clang vector extensions): eight channels or projections in one
   vector register. Plain loops let the compiler vectorise along the wrong axis, or not at all. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* Four floats and four doubles, for the backward's float-to-double table sums. */
typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));

static inline v4d load4d(const double *p) {
    v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store4d(double *p, v4d v) { memcpy(p, &v, sizeof v); }

/* max(f, 0) per lane as the scalar f < 0 ? 0 : f (-0 gives -0; NaN stays NaN, as in torch.relu: a diverged model
   must not look healthy): f's bits unless f < 0, where zero bits. */
static inline v8f relu8(v8f f) {
    const v8f zero = {0};
    return (v8f)((v8i)f & ~(f < zero));
}

/* relu(slope[idx[i]] x[i] + intercept[idx[i]]) for the e scalars of x: out [e, L]. `lanes8`: eight channels per
   vector op where L >= 8 (the same float operations as the scalar loop). In the portable build that loop is faster
   writing the forward's output, and 1.4x slower filling the backward's buffer (M = L = 8), so the backward
   passes WIDE. */
static inline void channel_features(const float *x, int64_t e, const int32_t L, const int32_t *idx,
                                    const float *slope, const float *intercept, int lanes8, float *out) {
    int64_t i = 0;
    /* L = 2: four scalars' eight features per vector op (each scalar's two table entries are adjacent) */
    if (WIDE && L == 2)
        for (; i + 4 <= e; i += 4) {
            int64_t s0, s1, s2, s3, c0, c1, c2, c3;
            memcpy(&s0, slope + (int64_t)idx[i] * 2, 8); memcpy(&c0, intercept + (int64_t)idx[i] * 2, 8);
            memcpy(&s1, slope + (int64_t)idx[i + 1] * 2, 8); memcpy(&c1, intercept + (int64_t)idx[i + 1] * 2, 8);
            memcpy(&s2, slope + (int64_t)idx[i + 2] * 2, 8); memcpy(&c2, intercept + (int64_t)idx[i + 2] * 2, 8);
            memcpy(&s3, slope + (int64_t)idx[i + 3] * 2, 8); memcpy(&c3, intercept + (int64_t)idx[i + 3] * 2, 8);
            const v4l sl = {s0, s1, s2, s3}, ic = {c0, c1, c2, c3};
            const v8f u = {x[i], x[i], x[i + 1], x[i + 1], x[i + 2], x[i + 2], x[i + 3], x[i + 3]};
            store8(out + i * 2, relu8((v8f)sl * u + (v8f)ic));
        }
    for (; i < e; ++i) {
        const float u = x[i];
        const float *sl = slope + (int64_t)idx[i] * L, *ic = intercept + (int64_t)idx[i] * L;
        float *o = out + i * L;
        int32_t l = 0;
        for (; lanes8 && l + 8 <= L; l += 8)
            store8(o + l, relu8(load8(sl + l) * u + load8(ic + l)));
        for (; l < L; ++l) {
            float f = sl[l] * u + ic[l];
            o[l] = f < 0.0f ? 0.0f : f; /* NaN stays NaN */
        }
    }
}

/* Pairs (two channels) of four rows of features [4, M, 2] as one vector: lane 2a + l of the m-th is row a's channel l
   of projection m. */
static inline v8f pairs_of_four_rows(const float *o, int64_t row, int32_t m) {
    int64_t p0, p1, p2, p3;
    memcpy(&p0, o + m * 2, 8); memcpy(&p1, o + row + m * 2, 8);
    memcpy(&p2, o + 2 * row + m * 2, 8); memcpy(&p3, o + 3 * row + m * 2, 8);
    return (v8f)(v4l){p0, p1, p2, p3};
}

/* The feature norm's 1 / (sum_m f[m, l] + eps), each channel's sum over m in order: of four rows of features
   [4, M, 2] at once (lane 2a + l: row a, channel l), and of one row [M, L] into r [L]. */
static inline v8f reciprocal_sums_of_four_rows(const float *f, int64_t row, int32_t M, float eps) {
    v8f acc = {0};
    for (int32_t m = 0; m < M; ++m) acc += pairs_of_four_rows(f, row, m);
    const v8f one = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    return one / (acc + eps);
}

static inline void reciprocal_sums_of_row(const float *f, int32_t M, const int32_t L, float eps, float *r) {
    for (int32_t l = 0; l < L; ++l) r[l] = 0.0f;
    for (int32_t m = 0; m < M; ++m)
        for (int32_t l = 0; l < L; ++l) r[l] += f[m * L + l];
    for (int32_t l = 0; l < L; ++l) r[l] = 1.0f / (r[l] + eps);
}

/* The features of `rows` rows of u [rows, M] (rows * M <= BLOCK), then the norm while they are in cache. */
static inline void forward_block(const float *x, int64_t rows, int32_t M, const int32_t L, const grid_t *g,
                                 const float *slope, const float *intercept, float eps, float *out) {
    int32_t idx[BLOCK];
    float sums[MAX_CHANNELS];
    locate_block(g, x, rows * M, idx);
    channel_features(x, rows * M, L, idx, slope, intercept, 1, out);
    if (eps < 0.0f) return;
    int64_t q = 0;
    /* L = 2: four rows at a time, lane (row, channel) summing its row's M features in order, as below */
    if (WIDE && L == 2)
        for (; q + 4 <= rows; q += 4) {
            float *o = out + q * (int64_t)M * 2;
            const int64_t row = (int64_t)M * 2;
            const v8f r = reciprocal_sums_of_four_rows(o, row, M, eps);
            for (int a = 0; a < 4; ++a) {
                const v8f scale = {r[2 * a], r[2 * a + 1], r[2 * a], r[2 * a + 1], r[2 * a], r[2 * a + 1],
                                   r[2 * a], r[2 * a + 1]};
                float *oa = o + a * row;
                for (int32_t m = 0; m + 4 <= M; m += 4) store8(oa + m * 2, load8(oa + m * 2) * scale);
                for (int32_t m = M - M % 4; m < M; ++m) {
                    oa[m * 2] *= r[2 * a];
                    oa[m * 2 + 1] *= r[2 * a + 1];
                }
            }
        }
    for (; q < rows; ++q) {
        float *o = out + q * (int64_t)M * L;
        reciprocal_sums_of_row(o, M, L, eps, sums);
        for (int32_t m = 0; m < M; ++m)
            for (int32_t l = 0; l < L; ++l) o[m * L + l] *= sums[l];
    }
}

static inline void forward_rows(const float *x, int64_t rows, int32_t M, const int32_t L, const grid_t *g,
                                const float *slope, const float *intercept, float eps, float *out) {
    const int64_t per = BLOCK / M; /* rows per block; M <= BLOCK is checked by the caller */
    for (int64_t r = 0; r < rows; r += per) {
        const int64_t n = r + per < rows ? per : rows - r;
        forward_block(x + r * M, n, M, L, g, slope, intercept, eps, out + r * (int64_t)M * L);
    }
}

/* Where the rows of x [B, H, N, d] lie (any strides but the last, which is 1) and the projection
   u = x W^T + b that LUNA's shared map puts before its channels: wt is W^T [d, M], bias [M]. */
typedef struct {
    const float *x;
    int64_t heads, tokens, stride_b, stride_h, stride_n;
    int32_t d;
    const float *wt, *bias;
} projection_t;

/* u [ROWS_AT_ONCE, M] of that many rows (x[a] the a-th row), M a multiple of 8: each u[m] = b[m] + x[0] W^T[0, m]
   + x[1] W^T[1, m] + ... in this order. Eight rows at a time: eight independent chains of adds (one row's
   chain alone would wait on each add's latency; four still waited on it). */
#define ROWS_AT_ONCE 8
static inline void project_rows(const float *const *x, int32_t d, int32_t M, const float *wt, const float *bias,
                                float *u) {
    for (int32_t m = 0; m < M; m += 8) {
        v8f acc[ROWS_AT_ONCE];
        for (int a = 0; a < ROWS_AT_ONCE; ++a) acc[a] = load8(bias + m);
        for (int32_t j = 0; j < d; ++j) {
            const v8f w = load8(wt + (int64_t)j * M + m);
            for (int a = 0; a < ROWS_AT_ONCE; ++a) acc[a] += x[a][j] * w;
        }
        for (int a = 0; a < ROWS_AT_ONCE; ++a) store8(u + a * M + m, acc[a]);
    }
}

static inline const float *row_of(const projection_t *p, int64_t row) {
    const int64_t n = row % p->tokens, bh = row / p->tokens;
    return p->x + (bh / p->heads) * p->stride_b + (bh % p->heads) * p->stride_h + n * p->stride_n;
}

static inline void project_block(const projection_t *p, int64_t r, int64_t rows, const int32_t M, float *u) {
    int64_t q = 0;
    if (M % 8 == 0)
        for (; q + ROWS_AT_ONCE <= rows; q += ROWS_AT_ONCE) {
            const float *x[ROWS_AT_ONCE];
            for (int a = 0; a < ROWS_AT_ONCE; ++a) x[a] = row_of(p, r + q + a);
            project_rows(x, p->d, M, p->wt, p->bias, u + q * M);
        }
    for (; q < rows; ++q) { /* the last rows of the block, one by one, in the same order */
        const float *x = row_of(p, r + q);
        float *o = u + q * M;
        for (int32_t m = 0; m < M; ++m) o[m] = p->bias[m];
        for (int32_t j = 0; j < p->d; ++j)
            for (int32_t m = 0; m < M; ++m) o[m] += x[j] * p->wt[(int64_t)j * M + m];
    }
}

static inline void projected_forward_rows(const projection_t *p, int64_t r0, int64_t rows, int32_t M, const int32_t L,
                                          const grid_t *g, const float *slope, const float *intercept, float eps,
                                          float *out) {
    float u[BLOCK];
    const int64_t per = BLOCK / M;
    for (int64_t r = 0; r < rows; r += per) {
        const int64_t n = r + per < rows ? per : rows - r;
        project_block(p, r0 + r, n, M, u);
        forward_block(u, n, M, L, g, slope, intercept, eps, out + r * (int64_t)M * L);
    }
}

/* Per block of rows: recompute f = relu(a), a = slope u + intercept; with the norm, y = f r, r = 1 / (sum f + eps)
   and df = r (g - sum_m g y); then da = df where f > 0, grad_x = sum_l da slope, and the per-interval sums
   of da u (slope) and da (intercept) in double. */
static inline void backward_block(const float *x, int64_t rows, int32_t M, const int32_t L, const grid_t *g,
                                  const float *slope, const float *intercept, float eps, const float *grad_out,
                                  float *grad_x, double *grad_slope, double *grad_intercept) {
    int32_t idx[BLOCK];
    float f[MAX_ROW];                       /* the block's features, rows * M * L <= MAX_ROW */
    float recip[BLOCK], dot[BLOCK];         /* r and dot per row and channel, rows * L <= BLOCK */
    const int64_t row = (int64_t)M * L;
    locate_block(g, x, rows * M, idx);
    channel_features(x, rows * M, L, idx, slope, intercept, WIDE, f);
    int64_t q = 0;
    if (eps < 0.0f) {
        for (int64_t l = 0; l < rows * L; ++l) { recip[l] = 1.0f; dot[l] = 0.0f; } /* no norm: df = g */
    } else {
        /* r as the forward computes it */
        if (WIDE && L == 2)
            for (; q + 4 <= rows; q += 4) store8(recip + q * 2, reciprocal_sums_of_four_rows(f + q * row, row, M, eps));
        for (; q < rows; ++q) reciprocal_sums_of_row(f + q * row, M, L, eps, recip + q * L);
        /* dot = sum_m g y. L = 2, M a multiple of 4: four partial sums (m mod 4), then (0 + 1) + (2 + 3), eight lanes
           over a row's features at once, in every build (summed in order over m, each row was a chain of M
           dependent adds) */
        for (q = 0; q < rows; ++q) {
            const float *fq = f + q * row, *gq = grad_out + q * row, *rq = recip + q * L;
            float *dq = dot + q * L;
            if (L == 2 && M % 4 == 0) {
                const v8f r = {rq[0], rq[1], rq[0], rq[1], rq[0], rq[1], rq[0], rq[1]};
                v8f d = {0};
                for (int64_t j = 0; j < row; j += 8) d += load8(gq + j) * (load8(fq + j) * r);
                dq[0] = (d[0] + d[2]) + (d[4] + d[6]);
                dq[1] = (d[1] + d[3]) + (d[5] + d[7]);
            } else {
                for (int32_t l = 0; l < L; ++l) dq[l] = 0.0f;
                for (int32_t m = 0; m < M; ++m)
                    for (int32_t l = 0; l < L; ++l) dq[l] += gq[m * L + l] * (fq[m * L + l] * rq[l]);
            }
        }
    }
    for (q = 0; q < rows; ++q) {
        const float *xr = x + q * M, *gr = grad_out + q * row, *fr = f + q * row, *rq = recip + q * L, *dq = dot + q * L;
        const int32_t *iq = idx + q * M;
        int32_t m = 0;
        /* L = 2: four scalars' two channels per vector op (the forward's pairs), each lane's ops as below */
        if (WIDE && L == 2)
            for (; m + 4 <= M; m += 4) {
                const v8f zero = {0}, dot2 = {dq[0], dq[1], dq[0], dq[1], dq[0], dq[1], dq[0], dq[1]},
                          r2 = {rq[0], rq[1], rq[0], rq[1], rq[0], rq[1], rq[0], rq[1]};
                v8f d = (load8(gr + m * 2) - dot2) * r2;
                d = (v8f)((v8i)d & (load8(fr + m * 2) > zero));
                int64_t s0, s1, s2, s3;
                memcpy(&s0, slope + (int64_t)iq[m] * 2, 8); memcpy(&s1, slope + (int64_t)iq[m + 1] * 2, 8);
                memcpy(&s2, slope + (int64_t)iq[m + 2] * 2, 8); memcpy(&s3, slope + (int64_t)iq[m + 3] * 2, 8);
                const v8f part = d * (v8f)(v4l){s0, s1, s2, s3};
                for (int a = 0; a < 4; ++a) {
                    const float gu = (0.0f + part[2 * a]) + part[2 * a + 1];
                    const double u = xr[m + a], d0 = d[2 * a], d1 = d[2 * a + 1];
                    double *gs = grad_slope + (int64_t)iq[m + a] * 2, *gi = grad_intercept + (int64_t)iq[m + a] * 2;
                    gs[0] += d0 * u; gs[1] += d1 * u;
                    gi[0] += d0; gi[1] += d1;
                    grad_x[q * M + m + a] = gu;
                }
            }
        for (; m < M; ++m) {
            const float u = xr[m];
            const int64_t i = (int64_t)iq[m] * L;
            float gu = 0.0f;
            int32_t l = 0;
            /* eight channels per vector op, each lane's float and double operations as below */
            for (; WIDE && l + 8 <= L; l += 8) {
                const v8f zero = {0};
                v8f d = (load8(gr + m * L + l) - load8(dq + l)) * load8(rq + l);
                d = (v8f)((v8i)d & (load8(fr + m * L + l) > zero));
                const v8f part = d * load8(slope + i + l);
                for (int a = 0; a < 8; ++a) gu += part[a]; /* in channel order */
                const v4d u4 = {u, u, u, u};
                const v4d d_lo = __builtin_convertvector(((v4f){d[0], d[1], d[2], d[3]}), v4d);
                const v4d d_hi = __builtin_convertvector(((v4f){d[4], d[5], d[6], d[7]}), v4d);
                store4d(grad_slope + i + l, load4d(grad_slope + i + l) + d_lo * u4);
                store4d(grad_slope + i + l + 4, load4d(grad_slope + i + l + 4) + d_hi * u4);
                store4d(grad_intercept + i + l, load4d(grad_intercept + i + l) + d_lo);
                store4d(grad_intercept + i + l + 4, load4d(grad_intercept + i + l + 4) + d_hi);
            }
            for (; l < L; ++l) {
                float d = (gr[m * L + l] - dq[l]) * rq[l];
                if (!(fr[m * L + l] > 0.0f)) d = 0.0f;
                gu += d * slope[i + l];
                grad_slope[i + l] += (double)d * (double)u;
                grad_intercept[i + l] += (double)d;
            }
            grad_x[q * M + m] = gu;
        }
    }
}

static inline void backward_rows(const float *x, int64_t rows, int32_t M, const int32_t L, const grid_t *g,
                                 const float *slope, const float *intercept, float eps, const float *grad_out,
                                 float *grad_x, double *grad_slope, double *grad_intercept) {
    /* rows per block: their scalars fit the search (BLOCK), their features f, their r and dot */
    int64_t per = BLOCK / M;
    if (per > MAX_ROW / ((int64_t)M * L)) per = MAX_ROW / ((int64_t)M * L);
    if (per > BLOCK / L) per = BLOCK / L;
    for (int64_t r = 0; r < rows; r += per) {
        const int64_t n = r + per < rows ? per : rows - r;
        backward_block(x + r * M, n, M, L, g, slope, intercept, eps, grad_out + r * (int64_t)M * L, grad_x + r * M,
                       grad_slope, grad_intercept);
    }
}

#define DISPATCH(L, CALL) \
    switch (L) { \
        case 1: { const int32_t LL = 1; CALL; break; } \
        case 2: { const int32_t LL = 2; CALL; break; } \
        case 4: { const int32_t LL = 4; CALL; break; } \
        case 8: { const int32_t LL = 8; CALL; break; } \
        default: { const int32_t LL = L; CALL; } \
    }

void luna_channels_forward(const float *x, int64_t r0, int64_t r1, int32_t M, int32_t L, int mapping, float low,
                           float scale, int32_t cells, int32_t most, const int32_t *start, const float *kpad,
                           const float *slope, const float *intercept, float eps, float *out) {
    grid_t g = {mapping, low, scale, cells, most, start, kpad};
    DISPATCH(L, forward_rows(x + r0 * M, r1 - r0, M, LL, &g, slope, intercept, eps, out + r0 * (int64_t)M * L))
}

/* luna_channels_forward of u = x W^T + b (see projection_t), computed here block by block: no u in memory. */
void luna_channels_forward_projected(const float *x, int64_t heads, int64_t tokens, int64_t stride_b,
                                     int64_t stride_h, int64_t stride_n, int32_t d, const float *wt,
                                     const float *bias, int64_t r0, int64_t r1, int32_t M, int32_t L, int mapping,
                                     float low, float scale, int32_t cells, int32_t most, const int32_t *start,
                                     const float *kpad, const float *slope, const float *intercept, float eps,
                                     float *out) {
    grid_t g = {mapping, low, scale, cells, most, start, kpad};
    projection_t p = {x, heads, tokens, stride_b, stride_h, stride_n, d, wt, bias};
    DISPATCH(L, projected_forward_rows(&p, r0, r1 - r0, M, LL, &g, slope, intercept, eps, out + r0 * (int64_t)M * L))
}

void luna_channels_backward(const float *x, int64_t r0, int64_t r1, int32_t M, int32_t L, int mapping, float low,
                            float scale, int32_t cells, int32_t most, const int32_t *start, const float *kpad,
                            const float *slope, const float *intercept, float eps, const float *grad_out,
                            float *grad_x, double *grad_slope, double *grad_intercept) {
    grid_t g = {mapping, low, scale, cells, most, start, kpad};
    DISPATCH(L, backward_rows(x + r0 * M, r1 - r0, M, LL, &g, slope, intercept, eps,
                              grad_out + r0 * (int64_t)M * L, grad_x + r0 * M, grad_slope, grad_intercept))
}
