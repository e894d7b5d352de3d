/*
 * The speed-ups layer's CPU kernels, for float32 tensors that torch hands over by pointer.
 * Built for the machine it runs on (-O3 -march=native -fopenmp) and loaded with ctypes by
 * native.py, after torch, so that this library's libgomp.so.1 resolves to the copy torch has
 * loaded: both share one OpenMP thread pool, sized by torch.set_num_threads. Every caller has
 * a torch-op path for where the library is not built. The entry points, by their callers:
 *
 * arches.py, DotInteraction (DLRM's pairwise dot interaction over the dense row and the F
 * pooled embeddings; order[i], or NULL for i, is the column of feature i as the sharded
 * tables deliver them, so they are read, and their gradient written, in place):
 *   dot_interaction_forward   out[b] = [dense[b], dot(r_i, r_j) for i < j, row-major]
 *                             (torch.triu_indices(n, n, offset=1), as TorchRec's InteractionArch)
 *   dot_interaction_backward  grad r_i = sum_{j != i} w_ij r_j, w_ij the gradient of pair (i, j),
 *                             plus the pass-through gradient of the dense row
 * arches.py, ReLUPerceptron (an MLP layer's bias and ReLU around torch's matmul):
 *   bias_relu_forward         y = relu(y + bias), in place
 *   relu_bias_backward        the gradient masked where y > 0, and its column sums (the bias's)
 * rowwise_adagrad.py (the tables' lookup and update, all tables of a TBE at once):
 *   pooled_lookup             each bag's (weighted, or mean) sum of its rows
 *   bag_rows                  each id's table row and the place of its pooled gradient
 *   rowwise_adagrad_update    fbgemm's exact row-wise Adagrad on the rows a batch touched
 * shm_group.py (the shared-memory collectives' signals between ranks):
 *   shm_publish               a counter stored after every earlier store, and a futex wake
 *   shm_wait                  a futex sleep until a counter reaches a value, or a timeout
 *
 * Why C rather than torch ops: the interaction's per-sample products are small (27 rows of
 * 64), which batched GEMMs run far below the machine's matmul rate, and they compute the
 * whole symmetric matrix, after a concatenated copy of the rows, with a gather of its upper
 * triangle after; here each sample's rows stay in L1 and only the pairs are computed. The
 * bias, ReLU and their backward are passes over the same memory that torch makes separately.
 * fbgemm's CPU lookup and update open a parallel region and sort per table; here one region
 * serves all tables, and repeated rows are merged in a hash table. docs/cpu-performance.md
 * has the reasoning in full; bench/RESULTS.md what each change measured.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Dot products of row i with every later row, four at a time so each load of row i is shared. */
static inline __attribute__((always_inline)) void sample_pairs(const float* const* rows, int64_t n, int64_t d,
                                                               float* restrict p) {
  for (int64_t i = 0; i < n; ++i) {
    const float* restrict ri = rows[i];
    int64_t j = i + 1;
    for (; j + 4 <= n; j += 4) {
      const float *r0 = rows[j], *r1 = rows[j + 1], *r2 = rows[j + 2], *r3 = rows[j + 3];
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < d; ++k) {
        const float x = ri[k];
        s0 += x * r0[k];
        s1 += x * r1[k];
        s2 += x * r2[k];
        s3 += x * r3[k];
      }
      p[0] = s0;
      p[1] = s1;
      p[2] = s2;
      p[3] = s3;
      p += 4;
    }
    for (; j < n; ++j) {
      const float* restrict rj = rows[j];
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < d; ++k) s += ri[k] * rj[k];
      *p++ = s;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_PAIR_BLOCKS 1

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: one reduction tree for four accumulators. */
static inline __attribute__((always_inline)) __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline __attribute__((always_inline)) float sum1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) float dot1(const float* x, const float* y, int64_t d) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t k = 0; k < d; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(y + k), a);
  return sum1(a);
}

/* Rows i .. i + R - 1 (R = 2 or 3) against every later row, four rows j at a time. */
#define DEFINE_ROW_GROUP(R)                                                                             \
  static inline __attribute__((always_inline)) void row_group_##R(const float* const* rows, int64_t n,  \
                                                                  int64_t d, const int64_t* base,       \
                                                                  float* restrict p, int64_t i) {       \
    const float* x[R];                                                                                  \
    _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q) x[q] = rows[i + q];                             \
    _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q)                                                 \
      _Pragma("GCC unroll 3") for (int r = q + 1; r < R; ++r) p[base[i + q] + i + r] = dot1(x[q], x[r], d); \
    int64_t j = i + R;                                                                                  \
    for (; j + 4 <= n; j += 4) {                                                                        \
      const float* y[4] = {rows[j], rows[j + 1], rows[j + 2], rows[j + 3]};                             \
      __m256 s[R][4];                                                                                   \
      _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q)                                               \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) s[q][c] = _mm256_setzero_ps();              \
      for (int64_t k = 0; k < d; k += 8) {                                                              \
        __m256 u[R];                                                                                    \
        _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q) u[q] = _mm256_loadu_ps(x[q] + k);           \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {                                           \
          const __m256 v = _mm256_loadu_ps(y[c] + k);                                                   \
          _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q) s[q][c] = _mm256_fmadd_ps(u[q], v, s[q][c]); \
        }                                                                                               \
      }                                                                                                 \
      _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q)                                               \
        _mm_storeu_ps(p + base[i + q] + j, sum4(s[q][0], s[q][1], s[q][2], s[q][3]));                   \
    }                                                                                                   \
    for (; j < n; ++j) {                                                                                \
      __m256 s[R];                                                                                      \
      _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q) s[q] = _mm256_setzero_ps();                   \
      for (int64_t k = 0; k < d; k += 8) {                                                              \
        const __m256 v = _mm256_loadu_ps(rows[j] + k);                                                  \
        _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q)                                             \
          s[q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + k), v, s[q]);                                   \
      }                                                                                                 \
      _Pragma("GCC unroll 3") for (int q = 0; q < R; ++q) p[base[i + q] + j] = sum1(s[q]);              \
    }                                                                                                   \
  }
DEFINE_ROW_GROUP(2)
DEFINE_ROW_GROUP(3)

/*
 * The pairs of one sample, three rows against four later rows at a time: twelve independent
 * sums (the FMAs' latency is hidden), seven loads per twelve FMAs, and one reduction tree per
 * row's four sums, stored as four adjacent outputs. sample_pairs, one row against four, waits
 * on its four sums' FMA chains and reduces each sum alone, so it is bound by the FMA's
 * latency rather than its throughput. d is a multiple of 8; p[base[i] + j] is pair (i, j),
 * i < j.
 */
static inline __attribute__((always_inline)) void sample_pair_blocks(const float* const* rows, int64_t n, int64_t d,
                                                                     const int64_t* base, float* restrict p) {
  int64_t i = 0;
  for (; i + 3 <= n; i += 3) row_group_3(rows, n, d, base, p, i);
  if (i + 2 == n) row_group_2(rows, n, d, base, p, i);
  /* One row left: its pairs were all made as an earlier row's j. */
}
#endif

static inline __attribute__((always_inline)) void forward_samples(const float* dense, const float* sparse,
                                                                  const int64_t* order, float* out,
                                                                  int64_t out_stride, int64_t b0, int64_t b1,
                                                                  int64_t f, int64_t d) {
  const int64_t n = f + 1;
  const float* rows[n];
#ifdef HAVE_PAIR_BLOCKS
  int64_t base[n];
  for (int64_t i = 0; i < n; ++i) base[i] = i * n - i * (i + 1) / 2 - i - 1;
#endif
  for (int64_t b = b0; b < b1; ++b) {
    rows[0] = dense + b * d;
    for (int64_t i = 1; i < n; ++i) rows[i] = sparse + (b * f + (order ? order[i - 1] : i - 1)) * d;
    float* o = out + b * out_stride;
    memcpy(o, rows[0], d * sizeof(float));
#ifdef HAVE_PAIR_BLOCKS
    if (d % 8 == 0) {
      sample_pair_blocks(rows, n, d, base, o + d);
      continue;
    }
#endif
    sample_pairs(rows, n, d, o + d);
  }
}

/* Any width: each pair adds to both of its rows' gradients (row i's accumulator stays hot across j). */
static inline __attribute__((always_inline)) void backward_pairs(const float* const* rows, float* const* grads,
                                                                 const float* g, int64_t n, int64_t d) {
  memcpy(grads[0], g, d * sizeof(float));
  for (int64_t i = 1; i < n; ++i) memset(grads[i], 0, d * sizeof(float));
  const float* w = g + d;
  for (int64_t i = 0; i < n; ++i) {
    float* restrict ai = grads[i];
    const float* restrict ri = rows[i];
    for (int64_t j = i + 1; j < n; ++j) {
      const float wij = *w++;
      float* restrict aj = grads[j];
      const float* restrict rj = rows[j];
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) {
        ai[k] += wij * rj[k];
        aj[k] += wij * ri[k];
      }
    }
  }
}

/*
 * Widths of 4 or 8 vectors (64 or 128 floats with AVX-512): grad r_i = sum_j w_ij r_j as a
 * product of the symmetric pair-gradient matrix with the rows, a block of rows' sums at a
 * time. The sums stay in registers while each r_j is loaded once per block, and each gradient
 * row is stored once, with no zeroing and no read-modify-write: the pair-at-a-time loop above
 * is bound by its two stores per pair.
 */
#if defined(__AVX512F__)
#define VECTOR_FLOATS 16
#define SUM_REGISTERS 16
#else
#define VECTOR_FLOATS 8
#define SUM_REGISTERS 8
#endif
typedef float vfloat __attribute__((vector_size(VECTOR_FLOATS * sizeof(float)), aligned(sizeof(float))));

/* w_ij of pair (i, j): pair (i, j), i < j, is w[base[i] + j] (the pairs are numbered row by row). */
#define PAIR_GRAD(i, j) ((i) < (j) ? w[base[i] + (j)] : (i) > (j) ? w[base[j] + (i)] : 0.f)

/* The gradients of rows i0 .. i0 + RB - 1, C vectors wide; row 0 (dense) adds its pass-through. */
#define DEFINE_ROW_BLOCK(RB, C)                                                                          \
  static inline __attribute__((always_inline)) void row_block_##RB##_##C(                               \
      const float* w, const int64_t* base, int64_t n, const float* const* rows, float* const* grads,    \
      const float* pass, int64_t i0) {                                                                  \
    vfloat sum[RB][C];                                                                                  \
    _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q)                                                \
      _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) sum[q][c] = (vfloat){0};                      \
    for (int64_t j = 0; j < n; ++j) {                                                                   \
      const vfloat* r = (const vfloat*)rows[j];                                                         \
      vfloat rj[C];                                                                                     \
      _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) rj[c] = r[c];                                 \
      float wq[RB];                                                                                     \
      if (j < i0) {                                                                                     \
        _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q) wq[q] = w[base[j] + i0 + q];               \
      } else if (j >= i0 + RB) {                                                                        \
        _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q) wq[q] = w[base[i0 + q] + j];               \
      } else {                                                                                          \
        _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q) wq[q] = PAIR_GRAD(i0 + q, j);              \
      }                                                                                                 \
      _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q)                                              \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) sum[q][c] += wq[q] * rj[c];                 \
    }                                                                                                   \
    _Pragma("GCC unroll 8") for (int q = 0; q < RB; ++q) {                                              \
      vfloat* out = (vfloat*)grads[i0 + q];                                                             \
      if (i0 + q == 0) {                                                                                \
        const vfloat* p = (const vfloat*)pass;                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) out[c] = sum[q][c] + p[c];                  \
      } else {                                                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) out[c] = sum[q][c];                         \
      }                                                                                                 \
    }                                                                                                   \
  }
DEFINE_ROW_BLOCK(1, 4)
DEFINE_ROW_BLOCK(2, 4)
DEFINE_ROW_BLOCK(3, 4)
DEFINE_ROW_BLOCK(4, 4)
DEFINE_ROW_BLOCK(1, 8)
DEFINE_ROW_BLOCK(2, 8)

static inline __attribute__((always_inline)) void backward_blocked(const float* const* rows, float* const* grads,
                                                                   const float* g, const int64_t* base, int64_t n,
                                                                   int64_t d) {
  const float* w = g + d;
  int64_t i = 0;
  if (d == 4 * VECTOR_FLOATS) {
    for (; i + SUM_REGISTERS / 4 <= n; i += SUM_REGISTERS / 4) {
      if (SUM_REGISTERS / 4 == 4) row_block_4_4(w, base, n, rows, grads, g, i);
      else row_block_2_4(w, base, n, rows, grads, g, i);
    }
    const int64_t left = n - i; /* fewer than a block: one block of them */
    if (left == 3) row_block_3_4(w, base, n, rows, grads, g, i);
    else if (left == 2) row_block_2_4(w, base, n, rows, grads, g, i);
    else if (left == 1) row_block_1_4(w, base, n, rows, grads, g, i);
  } else {
    for (; i + SUM_REGISTERS / 8 <= n; i += SUM_REGISTERS / 8) {
      if (SUM_REGISTERS / 8 == 2) row_block_2_8(w, base, n, rows, grads, g, i);
      else row_block_1_8(w, base, n, rows, grads, g, i);
    }
    if (i < n) row_block_1_8(w, base, n, rows, grads, g, i);
  }
}

static void backward_samples(const float* grad_out, int64_t grad_stride, const float* dense, const float* sparse,
                             const int64_t* order, float* grad_dense, float* grad_sparse, int64_t b0, int64_t b1,
                             int64_t f, int64_t d) {
  const int64_t n = f + 1;
  const int blocked = d == 4 * VECTOR_FLOATS || d == 8 * VECTOR_FLOATS;
  const float* rows[n];
  float* grads[n];
  int64_t base[n];
  for (int64_t i = 0; i < n; ++i) base[i] = i * n - i * (i + 1) / 2 - i - 1;
  for (int64_t b = b0; b < b1; ++b) {
    rows[0] = dense + b * d;
    grads[0] = grad_dense + b * d;
    for (int64_t i = 1; i < n; ++i) {
      const int64_t column = order ? order[i - 1] : i - 1;
      rows[i] = sparse + (b * f + column) * d;
      grads[i] = grad_sparse + (b * f + column) * d;
    }
    if (blocked)
      backward_blocked(rows, grads, grad_out + b * grad_stride, base, n, d);
    else if (d == 128) /* without AVX-512: a constant width still unrolls, as before the blocks */
      backward_pairs(rows, grads, grad_out + b * grad_stride, n, 128);
    else
      backward_pairs(rows, grads, grad_out + b * grad_stride, n, d);
  }
}

/* Inside a parallel region: how many threads run it, and which one this is. */
static void this_thread(int64_t* threads, int64_t* t) {
  *threads = 1;
  *t = 0;
#ifdef _OPENMP
  *threads = omp_get_num_threads();
  *t = omp_get_thread_num();
#endif
}

/* This thread's share of the batch, contiguous so each thread streams its own rows. */
static void thread_share(int64_t batch, int64_t* b0, int64_t* b1) {
  int64_t threads, t;
  this_thread(&threads, &t);
  *b0 = batch * t / threads;
  *b1 = batch * (t + 1) / threads;
}

/*
 * Sample b's output row starts at out + b * out_stride (and its gradient's at grad_out + b *
 * grad_stride): a stride above the row's d + n(n-1)/2 floats leaves columns the caller pads.
 * The common widths are compile-time constants, so their inner loops unroll into whole vectors.
 */
void dot_interaction_forward(const float* dense, const float* sparse, const int64_t* order, float* out,
                             int64_t out_stride, int64_t batch, int64_t f, int64_t d) {
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(batch, &b0, &b1);
    if (d == 64)
      forward_samples(dense, sparse, order, out, out_stride, b0, b1, f, 64);
    else if (d == 128)
      forward_samples(dense, sparse, order, out, out_stride, b0, b1, f, 128);
    else
      forward_samples(dense, sparse, order, out, out_stride, b0, b1, f, d);
  }
}

void dot_interaction_backward(const float* grad_out, int64_t grad_stride, const float* dense, const float* sparse,
                              const int64_t* order, float* grad_dense, float* grad_sparse, int64_t batch, int64_t f,
                              int64_t d) {
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(batch, &b0, &b1);
    backward_samples(grad_out, grad_stride, dense, sparse, order, grad_dense, grad_sparse, b0, b1, f, d);
  }
}

/*
 * The epilogues of an MLP layer with a ReLU (y = relu(x W^T + b)) around torch's matmuls:
 * forward adds the bias and applies the ReLU in one pass over the matmul's output, in place;
 * backward masks the gradient and sums its columns (the bias's gradient) in one pass. Rows
 * are split between threads; each thread sums its rows into its own slot of partial, and the
 * slots are added in thread order, so the result does not depend on timing.
 */
void bias_relu_forward(float* y, const float* bias, int64_t rows, int64_t cols) {
#pragma omp parallel
  {
    int64_t r0, r1;
    thread_share(rows, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      float* restrict yr = y + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float v = yr[c] + bias[c];
        yr[c] = v < 0.f ? 0.f : v; /* NaN stays NaN, as torch.relu */
      }
    }
  }
}

int relu_bias_backward(const float* grad_y, int64_t grad_stride, const float* y, float* grad, float* grad_bias,
                       int64_t rows, int64_t cols) {
  int64_t slots = 1;
#ifdef _OPENMP
  slots = omp_get_max_threads();
#endif
  float* partial = calloc(slots * cols, sizeof(float));
  if (!partial) return -1;
  int64_t used = 1;
#pragma omp parallel
  {
    int64_t r0, r1, threads, t;
    thread_share(rows, &r0, &r1);
    this_thread(&threads, &t);
#pragma omp single
    used = threads;
    float* restrict acc = partial + t * cols;
    for (int64_t r = r0; r < r1; ++r) {
      const float* restrict gy = grad_y + r * grad_stride;
      const float* restrict yr = y + r * cols;
      float* restrict g = grad + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float v = yr[c] <= 0.f ? 0.f : gy[c]; /* as threshold_backward */
        g[c] = v;
        acc[c] += v;
      }
    }
  }
  for (int64_t c = 0; c < cols; ++c) grad_bias[c] = partial[c];
  for (int64_t t = 1; t < used; ++t)
    for (int64_t c = 0; c < cols; ++c) grad_bias[c] += partial[t * cols + c];
  free(partial);
  return 0;
}

/*
 * Exact row-wise Adagrad for the rows one batch touched (rowwise_adagrad.py prepares the
 * arguments): id i adds scale[i] * grads[src[i] : src[i] + d] to row rows[i]'s gradient g; then
 * for each distinct row, h += mean(g^2) and w -= lr * g / (sqrt(h) + eps), as fbgemm's kernel.
 *
 * No sort: thread t owns the rows with row % threads == t (no two threads write one row). A
 * hash table chains each distinct row's ids in id order (the order fbgemm sums them in); a
 * row seen once, most of them, is then updated straight from its gradient. The table rows
 * are random reads and writes across the whole table, so the next ones are prefetched, with
 * their momentum entries (one float each, but as random a read as the row).
 */

#define PREFETCH_AHEAD 16

static inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

static inline void prefetch_row(const float* p, int64_t d, int write) {
  for (int64_t k = 0; k < d; k += 16) {
    if (write)
      __builtin_prefetch(p + k, 1, 0);
    else
      __builtin_prefetch(p + k, 0, 0);
  }
}

static inline __attribute__((always_inline)) void update_rows(float* weights, float* momentum, int64_t d,
    const int64_t* rows, const int64_t* src, const float* scale, const float* grads, const int64_t* first,
    const int64_t* next, int64_t distinct, float lr, float eps) {
  float acc[d];
  for (int64_t u = 0; u < distinct; ++u) {
    if (u + PREFETCH_AHEAD < distinct) {
      const int64_t ahead = first[u + PREFETCH_AHEAD];
      prefetch_row(weights + rows[ahead] * d, d, 1);
      prefetch_row(grads + src[ahead], d, 0);
      __builtin_prefetch(momentum + rows[ahead], 1, 0);
    }
    int64_t i = first[u];
    const int64_t row = rows[i];
    const float* restrict g;
    if (next[i] < 0 && !scale) {
      g = grads + src[i];
    } else {
      const float c0 = scale ? scale[i] : 1.f;
      const float* restrict g0 = grads + src[i];
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) acc[k] = c0 * g0[k];
      for (i = next[i]; i >= 0; i = next[i]) {
        const float c = scale ? scale[i] : 1.f;
        const float* restrict gi = grads + src[i];
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) acc[k] += c * gi[k];
      }
      g = acc;
    }
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t k = 0; k < d; ++k) sq += g[k] * g[k];
    const float h = momentum[row] + sq / (float)d;
    momentum[row] = h;
    const float step = -lr / (sqrtf(h) + eps);
    float* restrict w = weights + row * d;
#pragma omp simd
    for (int64_t k = 0; k < d; ++k) w[k] += step * g[k];
  }
}

int rowwise_adagrad_update(float* weights, float* momentum, int64_t num_rows, int64_t d, const int64_t* rows,
                           const int64_t* src, const float* scale, const float* grads, int64_t n, float lr, float eps) {
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] < 0 || rows[i] >= num_rows) return -2;
  int64_t* next = malloc((n + 1) * sizeof(int64_t)); /* next id of the same row, or -1 */
  if (!next) return -1;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    int64_t threads, t;
    this_thread(&threads, &t);
    int64_t mine = 0;
    for (int64_t i = 0; i < n; ++i) mine += (int64_t)((uint64_t)rows[i] % (uint64_t)threads) == t;
    int64_t slots = 16;
    while (slots < 2 * mine) slots <<= 1;
    int64_t* slot_row = malloc(slots * sizeof(int64_t));
    int64_t* slot_last = malloc(slots * sizeof(int64_t)); /* last id seen of the slot's row */
    int64_t* first = malloc((mine + 1) * sizeof(int64_t)); /* first id of each distinct row */
    if (!slot_row || !slot_last || !first) {
      failed = 1;
    } else {
      for (int64_t s = 0; s < slots; ++s) slot_row[s] = -1;
      int64_t distinct = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = rows[i];
        if ((int64_t)((uint64_t)row % (uint64_t)threads) != t) continue;
        next[i] = -1;
        uint64_t s = mix((uint64_t)row) & (uint64_t)(slots - 1);
        while (slot_row[s] != -1 && slot_row[s] != row) s = (s + 1) & (uint64_t)(slots - 1);
        if (slot_row[s] == -1) {
          slot_row[s] = row;
          first[distinct++] = i;
        } else {
          next[slot_last[s]] = i;
        }
        slot_last[s] = i;
      }
      if (d == 64)
        update_rows(weights, momentum, 64, rows, src, scale, grads, first, next, distinct, lr, eps);
      else if (d == 128)
        update_rows(weights, momentum, 128, rows, src, scale, grads, first, next, distinct, lr, eps);
      else
        update_rows(weights, momentum, d, rows, src, scale, grads, first, next, distinct, lr, eps);
    }
    free(slot_row);
    free(slot_last);
    free(first);
  }
  free(next);
  return failed ? -1 : 0;
}

/*
 * What the update needs of each id of feature-major bags (offsets has features * batch + 1
 * entries, from 0 to n): rows[i] = row_base[t] + indices[i], its row in the tables, and
 * src[i] = sample * grad_stride + t * d, where its bag's pooled gradient starts. One pass,
 * bags split between threads, instead of the nine whole-batch torch ops that derived them.
 * Returns -3, with nothing written, if the offsets do not run from 0 to n without decreasing.
 */
int bag_rows(const int64_t* indices, const int64_t* offsets, int64_t n, const int64_t* row_base, int64_t features,
             int64_t batch, int64_t d, int64_t grad_stride, int64_t* rows, int64_t* src) {
  const int64_t bags = features * batch;
  if (offsets[0] != 0 || offsets[bags] != n) return -3;
  for (int64_t b = 0; b < bags; ++b)
    if (offsets[b] > offsets[b + 1]) return -3;
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(bags, &b0, &b1);
    for (int64_t bag = b0; bag < b1; ++bag) {
      const int64_t t = bag / batch, sample = bag - t * batch;
      const int64_t base = row_base[t], start = sample * grad_stride + t * d;
      for (int64_t i = offsets[bag]; i < offsets[bag + 1]; ++i) {
        rows[i] = base + indices[i];
        src[i] = start;
      }
    }
  }
  return 0;
}

/*
 * The same tables' pooled lookup (forward): out[b, t*d : (t+1)*d] = sum over the ids of bag
 * (t, b) of c * weights[row_base[t] + id], c = the id's per-sample weight (or 1), divided by the
 * bag's length for mean pooling; an empty bag gives zeros. Bags are feature-major (offsets has
 * features * batch + 1 entries) and each bag's ids are summed in order, as fbgemm's CPU kernel
 * does. The samples are split between the threads, and each thread goes table by table: a
 * row is a random read from tables far larger than the caches, and within one table the page
 * table entries of its rows stay cached, where sample by sample across all tables nearly
 * every row would also miss the TLB and wait for a page walk from memory (on machines whose
 * tables sit on 4 KiB pages). The rows of the bag PREFETCH_AHEAD samples ahead are prefetched.
 * Returns -2, with out partly written, if an id's row lies outside the num_rows rows.
 */
static inline __attribute__((always_inline)) int lookup_samples(const float* weights, int64_t num_rows, int64_t d,
    const int64_t* row_base, int64_t features, int64_t batch, const int64_t* indices, const int64_t* offsets,
    const float* indice_weights, int mean, float* out, int64_t b0, int64_t b1) {
  for (int64_t t = 0; t < features; ++t) {
    const int64_t base = row_base[t];
    const int64_t* restrict off = offsets + t * batch;
    for (int64_t b = b0; b < b1; ++b) {
      if (b + PREFETCH_AHEAD < b1) {
        const int64_t first = off[b + PREFETCH_AHEAD], end = off[b + PREFETCH_AHEAD + 1];
        for (int64_t i = first; i < end && i < first + 4; ++i) {
          const int64_t row = base + indices[i];
          if (row >= 0 && row < num_rows) prefetch_row(weights + row * d, d, 0);
        }
      }
      const int64_t start = off[b], end = off[b + 1];
      float* restrict o = out + (b * features + t) * d;
      for (int64_t x = 0; x < d; ++x) o[x] = 0.f;
      const float norm = mean && end > start ? 1.f / (float)(end - start) : 1.f;
      for (int64_t i = start; i < end; ++i) {
        const int64_t row = base + indices[i];
        if (row < 0 || row >= num_rows) return -2;
        if (i + 4 < end) {
          const int64_t later = base + indices[i + 4];
          if (later >= 0 && later < num_rows) prefetch_row(weights + later * d, d, 0);
        }
        const float c = (indice_weights ? indice_weights[i] : 1.f) * norm;
        const float* restrict w = weights + row * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) o[x] += c * w[x];
      }
    }
  }
  return 0;
}

int pooled_lookup(const float* weights, int64_t num_rows, int64_t d, const int64_t* row_base, int64_t features,
                  int64_t batch, const int64_t* indices, const int64_t* offsets, const float* indice_weights, int mean,
                  float* out) {
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    int64_t b0, b1;
    thread_share(batch, &b0, &b1);
    int status;
    if (d == 64)
      status = lookup_samples(weights, num_rows, 64, row_base, features, batch, indices, offsets, indice_weights, mean,
                              out, b0, b1);
    else if (d == 128)
      status = lookup_samples(weights, num_rows, 128, row_base, features, batch, indices, offsets, indice_weights,
                              mean, out, b0, b1);
    else
      status = lookup_samples(weights, num_rows, d, row_base, features, batch, indices, offsets, indice_weights, mean,
                              out, b0, b1);
    failed = status != 0;
  }
  return failed ? -2 : 0;
}

/*
 * Signals between ranks on one host (shm_group.py): a rank writes a collective's data into
 * shared memory, then publishes the collective's number in a 32-bit counter that the other
 * ranks sleep on (a futex in the shared mapping). Counters wrap; comparisons are modular.
 */
#ifdef __linux__
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* Publish value: every earlier store, non-temporal copies included, is visible first. */
int shm_publish(int32_t* word, int32_t value) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
  return 0;
}

/* Sleep until *word has reached target: 0, or -1 once timeout_ms have passed. Called through
   ctypes, which releases the GIL, so the process's other threads run meanwhile. */
int shm_wait(int32_t* word, int32_t target, int64_t timeout_ms) {
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int spin = 0;; ++spin) {
    const int32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if ((int32_t)((uint32_t)seen - (uint32_t)target) >= 0) return 0;
    if (spin < 200) {
      cpu_relax();
      continue;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    const int64_t waited_ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
    if (waited_ms >= timeout_ms) return -1;
    /* Wake up at least every 100 ms to re-check the clock. */
    struct timespec nap = {0, 100 * 1000 * 1000};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &nap, NULL, 0);
  }
}
#else /* no futex: shm_group.py does not use shared memory here */
int shm_publish(int32_t* word, int32_t value) { (void)word; (void)value; return -2; }
int shm_wait(int32_t* word, int32_t target, int64_t timeout_ms) { (void)word; (void)target; (void)timeout_ms; return -2; }
#endif
