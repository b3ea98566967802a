/* The linear-attention core's two matrix products on the CPU in float32, for an x [n, D] that a maker makes a
 * block of tokens at a time instead of reading it from memory (Taylor's pair features, ops/pair_rows.c), per
 * batch entry b of [b0, b1) (the native path of ops.products' produced products; the reference is torch.bmm of
 * the stored features):
 *
 *     produced_transposed_product:   c[b] = x[b]^T y[b]   y [n, e] -> c [D, e (+ 1)]
 *                                    (with `with_sum`, c's column e holds x[b]'s sum over the n tokens: z)
 *     produced_product:              c[b] = x[b] w[b]     w [D, e] -> c [n, e]
 *
 * Each tile of the result stays in registers while the made block streams through, with no packing copies.
 *
 * Plain C99 with x86 intrinsics, no PyTorch headers, compiled by ops/native.py with -march=native. It has
 * code for AVX-512 (16 lanes) and for AVX2 with FMA (8 lanes); elsewhere `product_lanes` returns 0 and the
 * maps store their features. The fused multiply-adds are written out (the build's -ffp-contract=off
 * forbids the compiler to choose them), so the sums round as a fused sum does, not as BLAS's order does:
 * the values agree with torch.bmm to float32 rounding, not to the bit.
 *
 * The batch is two axes, [B, H] (batch and heads): entry b of [b0, b1) is (b / inner, b % inner) with
 * inner = H. Each read operand's layout is three strides in floats, {outer, inner, row}, and unit column
 * stride. Columns beyond the last full vector of LANES, and the sum column, go through vector code of their
 * own: scaled adds over the tokens (transposed product), dot products of several rows at once (product).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define TILE_ROWS 6
#define TILE_VECS 4
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, a) _mm512_storeu_ps((p), (a))
#define vbroadcast(s) _mm512_set1_ps(s)
#define vfma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define TILE_ROWS 4
#define TILE_VECS 3
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, a) _mm256_storeu_ps((p), (a))
#define vbroadcast(s) _mm256_set1_ps(s)
#define vfma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
#define LANES 0
#endif

/* Lanes of the vector code built here; 0: none, the caller keeps torch.bmm. */
int product_lanes(void) { return LANES; }

#if LANES

/* Tokens per block of the transposed product: a block of x and y (64 KB each at 64 columns) stays in L2
 * while every tile of c passes over it. */
#define TOKEN_BLOCK 256

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* c[rows, vecs LANES] = start + sum over `steps` rank-one updates a[s, r] b[s, :], the tile in registers.
 * a's element (s, r) is at a[s a_step + r a_row], b's row s at b + s b_step; `start` is a tile with row
 * stride start_row, or NULL for zeros. Both products are this loop:
 * x^T y steps over tokens (a = x read along a row), x w over the depth (a = x read down a column). */
ALWAYS_INLINE void tile(const float *a, int64_t a_step, int64_t a_row, const float *b, int64_t b_step,
                        const float *start, int64_t start_row, float *c, int64_t ldc, int64_t steps,
                        const int rows, const int vecs) {
    vec acc[TILE_ROWS][TILE_VECS];
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v) acc[r][v] = start ? vload(start + r * start_row + v * LANES) : vzero();
    for (int64_t s = 0; s < steps; ++s) {
        vec bv[TILE_VECS];
        for (int v = 0; v < vecs; ++v) bv[v] = vload(b + s * b_step + v * LANES);
        for (int r = 0; r < rows; ++r) {
            const vec ab = vbroadcast(a[s * a_step + r * a_row]);
            for (int v = 0; v < vecs; ++v) acc[r][v] = vfma(ab, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v) vstore(c + r * ldc + v * LANES, acc[r][v]);
}

/* The tile with constant shapes, so that each is compiled with its accumulators in registers. */
#define TILE_CASES(rows)                                                                                \
    switch (vecs) {                                                                                     \
    case 1: TILE_CALL(rows, 1); break;                                                                  \
    case 2: TILE_CALL(rows, 2); break;                                                                  \
    case 3: TILE_CALL(rows, 3); break;                                                                  \
    default: TILE_CALL(rows, TILE_VECS); break;                                                         \
    }
#define TILE_CALL(r, v) tile(a, a_step, a_row, b, b_step, start, start_row, c, ldc, steps, r, v)

static void tile_any(const float *a, int64_t a_step, int64_t a_row, const float *b, int64_t b_step,
                     const float *start, int64_t start_row, float *c, int64_t ldc, int64_t steps, int rows, int vecs) {
    switch (rows) {
    case 1: TILE_CASES(1) break;
    case 2: TILE_CASES(2) break;
    case 3: TILE_CASES(3) break;
    case 4: TILE_CASES(4) break;
#if TILE_ROWS > 5 /* not in the AVX2 build (4 rows): a 5-row tile would overrun its accumulators */
    case 5: TILE_CASES(5) break;
#endif
    default: TILE_CASES(TILE_ROWS) break;
    }
}

/* c[r] = sum_i x[r, i] w[i] for the tile's rows: the dots side by side, so that no row waits for
 * the previous row's chain of adds. */
ALWAYS_INLINE void dots_tile(const float *x, int64_t ldx, const float *w, float *c, int64_t ldc,
                             int64_t depth, const int rows) {
    vec acc[TILE_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = vzero();
    int64_t i = 0;
    for (; i + LANES <= depth; i += LANES) {
        const vec wv = vload(w + i);
        for (int r = 0; r < rows; ++r) acc[r] = vfma(vload(x + r * ldx + i), wv, acc[r]);
    }
    for (int r = 0; r < rows; ++r) {
        float s = vsum(acc[r]);
        for (int64_t k = i; k < depth; ++k) s += x[r * ldx + k] * w[k];
        c[r * ldc] = s;
    }
}

static void dots_tile_any(const float *x, int64_t ldx, const float *w, float *c, int64_t ldc,
                          int64_t depth, int rows) {
    switch (rows) {
    case 1: dots_tile(x, ldx, w, c, ldc, depth, 1); break;
    case 2: dots_tile(x, ldx, w, c, ldc, depth, 2); break;
    case 3: dots_tile(x, ldx, w, c, ldc, depth, 3); break;
    case 4: dots_tile(x, ldx, w, c, ldc, depth, 4); break;
#if TILE_ROWS > 5
    case 5: dots_tile(x, ldx, w, c, ldc, depth, 5); break;
#endif
    default: dots_tile(x, ldx, w, c, ldc, depth, TILE_ROWS); break;
    }
}

/* acc[D] += s x[D] (s = 1: acc += x). */
static void scaled_add(float *acc, const float *x, float s, int64_t n) {
    const vec sb = vbroadcast(s);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) vstore(acc + i, vfma(sb, vload(x + i), vload(acc + i)));
    for (; i < n; ++i) acc[i] += s * x[i];
}

/* out[j, :] = w[:, first + j] for j < count: columns of w [depth, ldw] made contiguous, for the dot tile. */
static void columns_of(const float *w, int64_t ldw, int64_t depth, int64_t first, int64_t count, float *out) {
    for (int64_t j = 0; j < count; ++j)
        for (int64_t i = 0; i < depth; ++i) out[j * depth + i] = w[i * ldw + first + j];
}

/* Where batch entry b starts in an operand of layout s. */
static inline int64_t entry(const int64_t *s, int64_t b, int64_t inner) { return (b / inner) * s[0] + (b % inner) * s[1]; }

#endif /* LANES */

/* Rows [t0, t0 + tn) of batch entry b of an operand x [n, depth] that is made block by block instead of read
 * from memory, written to out [tn, depth]. */
typedef void (*produce_rows)(const void *state, int64_t b, int64_t t0, int64_t tn, float *out);

/* x^T y for the x that produce(state, ...) makes TOKEN_BLOCK tokens at a time into a buffer that stays in
 * cache while every tile of c passes over it. */
void produced_transposed_product(produce_rows produce, const void *state, const float *y, float *c, int64_t b0,
                                 int64_t b1, int64_t inner, int64_t n, int64_t depth, int64_t columns, int32_t with_sum,
                                 const int64_t *sy, const int64_t *sc) {
#if LANES
    const int64_t full = columns / LANES, rest = columns - full * LANES, extra = rest + (with_sum ? 1 : 0);
    const int64_t ldy = sy[2], ldc = sc[2];
    float *sums = extra ? malloc(sizeof(float) * extra * depth) : 0; /* the columns past the vectors, by row */
    float *made = malloc(sizeof(float) * TOKEN_BLOCK * depth);
    if ((extra && !sums) || !made) abort(); /* without them the result would be wrong */
    for (int64_t b = b0; b < b1; ++b) {
        const float *yb = y + entry(sy, b, inner);
        float *cb = c + entry(sc, b, inner);
        for (int64_t i = 0; i < depth; ++i) memset(cb + i * ldc, 0, sizeof(float) * full * LANES);
        if (extra) memset(sums, 0, sizeof(float) * extra * depth);
        for (int64_t t0 = 0; t0 < n; t0 += TOKEN_BLOCK) {
            const int64_t tn = n - t0 < TOKEN_BLOCK ? n - t0 : TOKEN_BLOCK;
            produce(state, b, t0, tn, made);
            for (int64_t i0 = 0; i0 < depth; i0 += TILE_ROWS) {
                const int rows = depth - i0 < TILE_ROWS ? (int)(depth - i0) : TILE_ROWS;
                for (int64_t v0 = 0; v0 < full; v0 += TILE_VECS) {
                    const int vecs = full - v0 < TILE_VECS ? (int)(full - v0) : TILE_VECS;
                    float *ct = cb + i0 * ldc + v0 * LANES; /* accumulates over the token blocks */
                    tile_any(made + i0, depth, 1, yb + t0 * ldy + v0 * LANES, ldy, ct, ldc, ct, ldc, tn, rows, vecs);
                }
            }
            for (int64_t t = 0; t < tn; ++t) {
                const float *xr = made + t * depth, *yr = yb + (t0 + t) * ldy;
                for (int64_t j = 0; j < rest; ++j) scaled_add(sums + j * depth, xr, yr[full * LANES + j], depth);
                if (with_sum) scaled_add(sums + rest * depth, xr, 1.0f, depth);
            }
        }
        for (int64_t j = 0; j < extra; ++j)
            for (int64_t i = 0; i < depth; ++i) cb[i * ldc + full * LANES + j] = sums[j * depth + i];
    }
    free(sums);
    free(made);
#else
    (void)produce, (void)state, (void)y, (void)c, (void)b0, (void)b1, (void)inner, (void)n, (void)depth;
    (void)columns, (void)with_sum, (void)sy, (void)sc;
#endif
}

/* x w for the x that produce(state, ...) makes TOKEN_BLOCK rows at a time. */
void produced_product(produce_rows produce, const void *state, const float *w, float *c, int64_t b0, int64_t b1,
                      int64_t inner, int64_t n, int64_t depth, int64_t columns, const int64_t *sw, const int64_t *sc) {
#if LANES
    const int64_t full = columns / LANES, rest = columns - full * LANES, ldw = sw[2], ldc = sc[2];
    float *w_rest = rest ? malloc(sizeof(float) * rest * depth) : 0; /* w's last columns, each contiguous */
    float *made = malloc(sizeof(float) * TOKEN_BLOCK * depth);
    if ((rest && !w_rest) || !made) abort(); /* without them the result would be wrong */
    for (int64_t b = b0; b < b1; ++b) {
        const float *wb = w + entry(sw, b, inner);
        float *cb = c + entry(sc, b, inner);
        columns_of(wb, ldw, depth, full * LANES, rest, w_rest);
        for (int64_t s0 = 0; s0 < n; s0 += TOKEN_BLOCK) {
            const int64_t sn = n - s0 < TOKEN_BLOCK ? n - s0 : TOKEN_BLOCK;
            produce(state, b, s0, sn, made);
            for (int64_t t0 = 0; t0 < sn; t0 += TILE_ROWS) {
                const int rows = sn - t0 < TILE_ROWS ? (int)(sn - t0) : TILE_ROWS;
                float *ct = cb + (s0 + t0) * ldc;
                for (int64_t v0 = 0; v0 < full; v0 += TILE_VECS) {
                    const int vecs = full - v0 < TILE_VECS ? (int)(full - v0) : TILE_VECS;
                    tile_any(made + t0 * depth, 1, depth, wb + v0 * LANES, ldw, 0, 0, ct + v0 * LANES, ldc, depth, rows,
                             vecs);
                }
                for (int64_t j = 0; j < rest; ++j)
                    dots_tile_any(made + t0 * depth, depth, w_rest + j * depth, ct + full * LANES + j, ldc, depth, rows);
            }
        }
    }
    free(w_rest);
    free(made);
#else
    (void)produce, (void)state, (void)w, (void)c, (void)b0, (void)b1, (void)inner, (void)n, (void)depth;
    (void)columns, (void)sw, (void)sc;
#endif
}
