/* Switchyard's CPU kernels for a float32 decoder layer, besides the matrix product
 * (panel_gemm.c): attention that reads the paged KV cache in place, rotary embedding fused with
 * the KV cache write, RMSNorm fused with the residual add, and SiLU-and-multiply.
 *
 * Attention. A step's query tokens are every request's scheduled tokens, concatenated; request
 * r's tokens are rows [query_starts[r], query_starts[r + 1]) and sit at positions
 * context_starts[r], context_starts[r] + 1, ...; each attends to the keys at positions up to
 * its own, read from the cache through the request's block table (slot = block * block_size +
 * position % block_size), already holding the step's own keys. Keys are read in chunks of up
 * to 16 with an online softmax (a running max and sum per query row, Milakov & Gimelshein
 * 2018), so nothing is gathered or padded:
 *   - a decode is one task over all its heads: each chunk's keys and values for every head
 *     are one contiguous stretch of the cache, read once (the next chunk prefetched into L1,
 *     the one three ahead into L2);
 *   - a prefill is a task per key-value head and tile of 48 / group tokens, whose rows are
 *     the lanes of up to three vectors, so scores and weighted values are broadcast
 *     multiply-adds, as in a matrix product, each key and value element loaded once for all
 *     of them (the next chunk prefetched);
 *   - a lone decode over a long context (threads to spare) is split into parts of the context
 *     whose results are merged at the end (split-K, as flash-decoding does);
 *   - decodes whose block tables begin with the same blocks (a prefix-cache hit) read those
 *     keys once for all of them, as the lanes of prefill tiles, and their own keys after them
 *     one by one; each row's parts are merged as a split decode's are ("Shared prefixes").
 *
 * Plain C with GCC/Clang vector extensions (16 x float) and OpenMP; worker/models/cpu_ops.py
 * compiles it on first use and checks every shape before calling in: these functions trust
 * their arguments.
 */
#include <float.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LANES 16
#define MAX_HEAD_DIM 256 /* a multiple of LANES; cpu_ops.py checks both */
#define MAX_ROW_TASK_ROWS 64 /* query heads of a decode read in one task; more: one per kv head */
#define TILE_VECTORS 3 /* vectors of query rows in a prefill tile at most */
#define TILE_ROWS (TILE_VECTORS * LANES) /* query rows of a prefill tile at most: their lanes */
#define FEW_ROWS 4       /* a prefill tile of at most this many rows goes row by row */
#define MASKED -1e30f    /* the score of a key a row cannot see (finite: no inf - inf) */
#define MIN_PART_KEYS 512 /* keys per context part when a decode's context is split */
#define MAX_SPLIT_PARTS 64 /* parts of a lone decode's context at most */

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

static inline vec16 load(const float* p) {
  vec16 v;
  memcpy(&v, p, sizeof v); /* an unaligned vector load */
  return v;
}

static inline void store(float* p, vec16 v) { memcpy(p, &v, sizeof v); }

static inline vec16 splat(float x) { return (vec16){0} + x; }

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros). */
static inline vec16 blend(ivec16 mask, vec16 a, vec16 b) {
  return (vec16)(((ivec16)a & mask) | ((ivec16)b & ~mask));
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* x rounded to the nearest integer, ties to even, and p * 2^n: one instruction each. */
static inline vec16 round_even(vec16 x) {
  return (vec16)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec16 times_pow2(vec16 p, vec16 n) {
  return (vec16)_mm512_scalef_ps((__m512)p, (__m512)n);
}
/* The larger of a and b, lane by lane; b where either is NaN (as vmaxps does). */
static inline vec16 vmax(vec16 a, vec16 b) { return (vec16)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline vec16 round_even(vec16 x) { /* |x| <= 2^22: adding 1.5 * 2^23 rounds */
  const vec16 round = splat(12582912.0f);
  return (x + round) - round;
}
static inline vec16 times_pow2(vec16 p, vec16 n) { /* n an integer of at least -127 */
  n = blend(n > splat(127.0f), splat(127.0f), n);     /* 2^127 p: as near inf as it gets */
  const ivec16 exponent = (__builtin_convertvector(n, ivec16) + 127) << 23;
  return p * (vec16)exponent;
}
static inline vec16 vmax(vec16 a, vec16 b) { return blend(a > b, a, b); } /* b where NaN */
#endif

#define LOG2E 1.44269504088896341f

/* 2^t for every lane: 2^n 2^f, n = round(t), |f| <= 1/2, 2^f by Cephes' exp2f polynomial (a
 * relative error of ~2e-7). t is held at -127 or more: 2^t is 0 below it (a subnormal nobody
 * needs), and -inf gives 0, not NaN; NaN stays NaN (vmax returns its second operand where
 * either is NaN). Ten vector instructions with AVX-512. */
static inline vec16 vexp2(vec16 t) {
  t = vmax(splat(-127.0f), t);
  const vec16 n = round_even(t), f = t - n;
  vec16 p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.0f);
  return times_pow2(p, n);
}

/* e^x for every lane, as 2^(x log2 e): the rounding of the product adds a relative error of
 * |x| * 6e-8 (softmax weights: the largest terms, where x is near 0, are the exact ones). */
static inline vec16 vexp(vec16 x) { return vexp2(x * splat(LOG2E)); }

/* The sum and the largest of v's lanes, by halves: four shuffles each. */
static inline float hsum(vec16 v) {
  v += __builtin_shuffle(v, (ivec16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, (ivec16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, (ivec16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, (ivec16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

static inline float hmax(vec16 v) {
  v = vmax(v, __builtin_shuffle(v, (ivec16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, (ivec16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmax(v, __builtin_shuffle(v, (ivec16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmax(v, __builtin_shuffle(v, (ivec16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

/* Lane j of the result is the sum of p[j]'s lanes: 16 horizontal sums in 15 shuffle-adds. */
static inline vec16 sum_each(const vec16 p[LANES]) {
  const ivec16 halves_a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const ivec16 halves_b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const ivec16 quarters_a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const ivec16 quarters_b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const ivec16 pairs_a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const ivec16 pairs_b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const ivec16 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const ivec16 odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vec16 c[8], d[4], e[2];
  for (int i = 0; i < 8; i++) /* c[i]: 8 partial sums each of p[2i], p[2i + 1] */
    c[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], halves_a) +
           __builtin_shuffle(p[2 * i], p[2 * i + 1], halves_b);
  for (int i = 0; i < 4; i++) /* d[i]: 4 each of p[4i .. 4i + 3] */
    d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], quarters_a) +
           __builtin_shuffle(c[2 * i], c[2 * i + 1], quarters_b);
  for (int i = 0; i < 2; i++) /* e[i]: 2 each of p[8i .. 8i + 7] */
    e[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], pairs_a) +
           __builtin_shuffle(d[2 * i], d[2 * i + 1], pairs_b);
  return __builtin_shuffle(e[0], e[1], even) + __builtin_shuffle(e[0], e[1], odd);
}

/* What every task needs to know of the whole step. */
typedef struct {
  const float* key_cache;   /* (num_blocks, block_size, num_kv_heads, head_dim) */
  const float* value_cache; /* same */
  int64_t block_size, num_heads, num_kv_heads, head_dim;
  float scale;
  int next_into_l1; /* decodes fetch the next chunk into L1, else into L2 (next_chunk_into_l1) */
} Cache;

/* Whether L1 holds a chunk's keys and values (16 keys of every key-value head) twice over, the
 * chunk being folded and the next: only then do decodes fetch the next into L1. Where it does
 * not (Zen 4's 32 KB against SmolLM2's 2 x 12 KB chunks; any model with 8 heads of 128), the
 * fetched lines evict lines still to be read, and fetched into L2 instead the keys and values
 * read 4-14 % faster on the AMD host (benchmarks/attention_bench.py, docs/performance.md).
 * An L1 size the C library does not know (0) counts as too small. */
static int next_chunk_into_l1(int64_t num_kv_heads, int64_t head_dim) {
  long l1_bytes = 0;
#ifdef _SC_LEVEL1_DCACHE_SIZE
  l1_bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#endif
  const int64_t chunk_bytes = 2 * LANES * num_kv_heads * head_dim * (int64_t)sizeof(float);
  return l1_bytes > 0 && 2 * chunk_bytes <= (int64_t)l1_bytes;
}

/* Where keys [first, first + n) of a request lie: one chunk, never across a block; n <= 16.
 * k and v point at the first key's slot (all heads); slots are `stride` floats apart. */
typedef struct {
  const float *k, *v;
  int64_t first, n;
} Chunk;

static inline Chunk chunk_at(const Cache* c, const int64_t* table, int64_t first,
                             int64_t key_end) {
  const int64_t offset = first % c->block_size;
  int64_t n = c->block_size - offset;
  if (n > LANES) n = LANES;
  if (n > key_end - first) n = key_end - first;
  const int64_t slot = table[first / c->block_size] * c->block_size + offset;
  const int64_t floats = slot * c->num_kv_heads * c->head_dim;
  return (Chunk){c->key_cache + floats, c->value_cache + floats, first, n};
}

/* The chunk after `chunk`, no keys (n = 0) past key_end. */
static inline Chunk chunk_after(const Cache* c, const int64_t* table, Chunk chunk,
                                int64_t key_end) {
  if (chunk.n == 0 || chunk.first + chunk.n >= key_end) return (Chunk){chunk.k, chunk.v, 0, 0};
  return chunk_at(c, table, chunk.first + chunk.n, key_end);
}

/* The running softmax of one task's rows: max score m, sum of e^(score - m) l, and the
 * weighted sum of values acc, per row. */
typedef struct {
  float acc[MAX_ROW_TASK_ROWS][MAX_HEAD_DIM];
  float m[MAX_ROW_TASK_ROWS], l[MAX_ROW_TASK_ROWS];
} Softmax;

/* Cache lines to prefetch while a group is folded: `floats` floats from k and from v (the next
 * chunk's), into L1 if into_l1 and into L2 otherwise; far_floats from far_k and far_v into L2
 * (the chunk three ahead's). */
typedef struct {
  const float *k, *v;
  int64_t floats;
  const float *far_k, *far_v;
  int64_t far_floats;
  int into_l1;
  const float *near_k, *near_v; /* near_n keys (of every `stride` floats, one head's) into L1,
                                   one a key folded: the next group's in this chunk or the next
                                   (where the next chunk goes to L2, not L1) */
  int near_n;
} Ahead;

/* The most rows of one key-value head folded together (GQA: the query heads that share it):
 * their queries and sums stay in registers, 32 vectors of them at most. */
#define MAX_GROUP_ROWS(dims) ((dims) <= 64 ? 4 : (dims) <= 128 ? 2 : 1)

/* Fold the n <= 16 keys at k / v (one every `stride` floats) into the softmax of rows
 * [row0, row0 + R), which read the same key-value head at the same position and see `visible`
 * of the keys (1..n): each key and value vector is loaded once for all R rows. Scores are
 * dot products (16 of a row summed at once by sum_each); weighted values are broadcast
 * multiply-adds into each row's sums. */
static inline __attribute__((always_inline)) void fold_group(Softmax* s, int row0,
                                                             const float (*q)[MAX_HEAD_DIM],
                                                             const float* k, const float* v,
                                                             int64_t stride, int n,
                                                             int visible, Ahead ahead,
                                                             const int R, const int dims) {
  const int vectors = dims / LANES;
  /* a sixteenth of the lines ahead at each key: a few at a time, so that the prefetches never
   * wait for free line fill buffers while there is arithmetic to do */
  const int64_t per_key = (ahead.floats + LANES * LANES - 1) / (LANES * LANES) * LANES;
  const int64_t far_per_key = (ahead.far_floats + LANES * LANES - 1) / (LANES * LANES) * LANES;
  vec16 scores[4];
  {
    vec16 products[4][LANES];
    for (int t = 0; t < LANES; t++) {
      for (int64_t i = t * per_key; i < (t + 1) * per_key && i < ahead.floats; i += LANES) {
        if (ahead.into_l1) {
          __builtin_prefetch(ahead.k + i);
          __builtin_prefetch(ahead.v + i);
        } else {
          __builtin_prefetch(ahead.k + i, 0, 2);
          __builtin_prefetch(ahead.v + i, 0, 2);
        }
      }
      for (int64_t i = t * far_per_key; i < (t + 1) * far_per_key && i < ahead.far_floats;
           i += LANES) {
        __builtin_prefetch(ahead.far_k + i, 0, 2);
        __builtin_prefetch(ahead.far_v + i, 0, 2);
      }
      if (t < ahead.near_n)
        for (int x = 0; x < vectors; x++) {
          __builtin_prefetch(ahead.near_k + t * stride + x * LANES);
          __builtin_prefetch(ahead.near_v + t * stride + x * LANES);
        }
      vec16 sums[4] = {{0}};
      if (t < n)
        for (int x = 0; x < vectors; x++) {
          const vec16 key = load(k + t * stride + x * LANES);
          for (int r = 0; r < R; r++) sums[r] += load(q[row0 + r] + x * LANES) * key;
        }
      for (int r = 0; r < R; r++) products[r][t] = sums[r];
    }
    for (int r = 0; r < R; r++) scores[r] = sum_each(products[r]);
  }
  const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const ivec16 seen = lane < visible;
  float weights[4][LANES], correction[4];
  for (int r = 0; r < R; r++) {
    const int row = row0 + r;
    scores[r] = blend(seen, scores[r], splat(-INFINITY));
    const float chunk_max = hmax(scores[r]);
    correction[r] = 1.0f;
    if (chunk_max > s->m[row]) { /* rescale what was summed under the old max */
      correction[r] = expf(s->m[row] - chunk_max);
      s->l[row] *= correction[r];
      s->m[row] = chunk_max;
    }
    const vec16 w = blend(seen, vexp(scores[r] - s->m[row]), splat(0.0f));
    s->l[row] += hsum(w);
    store(weights[r], w);
  }
  vec16 acc[4][MAX_HEAD_DIM / LANES];
  for (int r = 0; r < R; r++)
    for (int x = 0; x < vectors; x++)
      acc[r][x] = load(s->acc[row0 + r] + x * LANES) * correction[r];
  for (int t = 0; t < visible; t++)
    for (int x = 0; x < vectors; x++) {
      const vec16 value = load(v + t * stride + x * LANES);
      for (int r = 0; r < R; r++) acc[r][x] += weights[r][t] * value;
    }
  for (int r = 0; r < R; r++)
    for (int x = 0; x < vectors; x++) store(s->acc[row0 + r] + x * LANES, acc[r][x]);
}

/* The rows of a row-by-row task: row i is query q[i] (scaled), at position pos[i], reading
 * key-value head head[i]. */
typedef struct {
  float q[MAX_ROW_TASK_ROWS][MAX_HEAD_DIM];
  int64_t pos[MAX_ROW_TASK_ROWS], head[MAX_ROW_TASK_ROWS];
  int count;
} Rows;

/* Keys [key_first, key_end) into every row's softmax, chunk by chunk: a chunk's keys of all
 * the rows' heads are one contiguous stretch of the cache, read once. */
static inline __attribute__((always_inline)) void attend_rows(const Cache* c,
                                                              const int64_t* table,
                                                              const Rows* rows,
                                                              int64_t key_first,
                                                              int64_t key_end, Softmax* s,
                                                              const int dims) {
  const int64_t stride = c->num_kv_heads * c->head_dim;
  for (int64_t first = key_first; first < key_end;) {
    const Chunk chunk = chunk_at(c, table, first, key_end);
    /* the next chunk (all heads) into L1 (where it fits beside this one: Cache) and the chunk
     * three ahead into L2, prefetched in shares as the rows' groups are folded: with the far
     * chunk on its way to L2, a fill buffer held by an L1 prefetch waits for L2, not memory
     * (decodes at 4,096 tokens read 5-10 % faster than with the L1 prefetches alone). Where
     * the next chunk goes to L2, each group brings the next group's keys and values from L2
     * into L1 as it folds its own (7-14 % faster on Zen 4's 32 KB L1). */
    const Chunk next = chunk_after(c, table, chunk, key_end);
    const Chunk far = chunk_after(c, table, chunk_after(c, table, next, key_end), key_end);
    int64_t prefetched = 0, far_prefetched = 0;
    for (int row = 0; row < rows->count;) {
      int group = 1; /* the rows after this one that read its head at its position */
      while (group < MAX_GROUP_ROWS(dims) && row + group < rows->count &&
             rows->head[row + group] == rows->head[row] &&
             rows->pos[row + group] == rows->pos[row])
        group++;
      int64_t visible = rows->pos[row] + 1 - first;
      if (visible > chunk.n) visible = chunk.n;
      const int64_t share = next.n * stride * (row + group) / rows->count - prefetched;
      const int64_t far_share = far.n * stride * (row + group) / rows->count - far_prefetched;
      /* the next group's head in this chunk, or the first group's in the next */
      const int after = row + group;
      const Chunk* near = after < rows->count ? &chunk : &next;
      const int64_t near_head = rows->head[after < rows->count ? after : 0] * c->head_dim;
      const Ahead ahead = {next.k + prefetched,
                           next.v + prefetched,
                           share,
                           far.k + far_prefetched,
                           far.v + far_prefetched,
                           far_share,
                           c->next_into_l1,
                           near->k + near_head,
                           near->v + near_head,
                           c->next_into_l1 ? 0 : (int)near->n};
      prefetched += share;
      far_prefetched += far_share;
      if (visible > 0) {
        const int64_t head = rows->head[row] * c->head_dim;
        const float *k = chunk.k + head, *v = chunk.v + head;
        const int n = (int)chunk.n, seen = (int)visible;
        switch (group) { /* constant group sizes keep the rows' sums in registers */
          case 4: fold_group(s, row, rows->q, k, v, stride, n, seen, ahead, 4, dims); break;
          case 3: fold_group(s, row, rows->q, k, v, stride, n, seen, ahead, 3, dims); break;
          case 2: fold_group(s, row, rows->q, k, v, stride, n, seen, ahead, 2, dims); break;
          default: fold_group(s, row, rows->q, k, v, stride, n, seen, ahead, 1, dims);
        }
      }
      row += group;
    }
    first += chunk.n;
  }
}

/* Every row's softmax state in s from keys [key_first, key_end) (none: l = 0). */
static void fold_rows(const Cache* c, const int64_t* table, const Rows* rows, int64_t key_first,
                      int64_t key_end, Softmax* s) {
  for (int row = 0; row < rows->count; row++) {
    s->m[row] = -INFINITY;
    s->l[row] = 0.0f;
    memset(s->acc[row], 0, (size_t)c->head_dim * sizeof(float));
  }
  switch (c->head_dim) { /* constant head sizes unroll the inner loops */
    case 64: attend_rows(c, table, rows, key_first, key_end, s, 64); break;
    case 128: attend_rows(c, table, rows, key_first, key_end, s, 128); break;
    default: attend_rows(c, table, rows, key_first, key_end, s, (int)c->head_dim);
  }
}

/* A row-by-row task: tokens [token_first, token_first + num_tokens) of the flat batch at
 * positions from position_first, key-value heads [h_first, h_first + h_count), keys
 * [key_first, key_end). Leaves each row's softmax state in s, and writes the normalised rows
 * to out unless it is NULL. */
static void run_row_task(const Cache* c, const float* q, const int64_t* table,
                         int64_t token_first, int64_t num_tokens, int64_t position_first,
                         int64_t h_first, int64_t h_count, int64_t key_first, int64_t key_end,
                         Softmax* s, float* out) {
  const int64_t group = c->num_heads / c->num_kv_heads, dims = c->head_dim;
  const int64_t heads = h_count * group; /* query heads per token */
  Rows rows;
  rows.count = (int)(num_tokens * heads);
  for (int row = 0; row < rows.count; row++) {
    const int64_t token = token_first + row / heads, head = h_first * group + row % heads;
    const float* query = q + (token * c->num_heads + head) * dims;
    for (int64_t d = 0; d < dims; d++) rows.q[row][d] = query[d] * c->scale;
    rows.pos[row] = position_first + row / heads;
    rows.head[row] = head / group;
  }
  fold_rows(c, table, &rows, key_first, key_end, s);
  if (out == NULL) return;
  for (int row = 0; row < rows.count; row++) {
    const int64_t token = token_first + row / heads, head = h_first * group + row % heads;
    float* o = out + (token * c->num_heads + head) * dims;
    const float inverse = 1.0f / s->l[row];
    for (int64_t d = 0; d < dims; d++) o[d] = s->acc[row][d] * inverse;
  }
}

/* Many rows (a prefill tile): the rows are the lanes of V vectors, 16 each. Queries are held
 * transposed, qt[d][v] = (row 16v's q[d], row 16v + 1's q[d], ...), so a key's scores for all
 * rows are sum_d k[d] * qt[d]: broadcast multiply-adds over eight keys at once, as in a matrix
 * product, each key element loaded once for the V vectors, with no horizontal sums; the
 * softmax statistics are vectors over the rows, and so is the output, ot[d][v] += p_t * v_t[d].
 * Row i sees keys up to position pos[i], and every row of the tile at least up to all_see:
 * only the chunks past it are masked. Rows past the tile's have position -1 (masked chunks
 * hide every key from them; their lanes are never read). Keys [key_first, key_end); each row's
 * softmax state (max, sum, weighted values) is left in m_out, l_out and ot. */
static inline __attribute__((always_inline)) void attend_lanes(
    const Cache* c, const int64_t* table, int64_t h, const float* qt, const ivec16* pos,
    int64_t all_see, int64_t key_first, int64_t key_end, float* ot, vec16* m_out, vec16* l_out,
    const int dims, const int V) {
  const int64_t stride = c->num_kv_heads * c->head_dim;
  vec16 m[TILE_VECTORS], l[TILE_VECTORS];
  for (int x = 0; x < V; x++) m[x] = splat(MASKED), l[x] = (vec16){0};
  for (int d = 0; d < dims * V; d++) store(ot + d * LANES, (vec16){0});
  for (int64_t first = key_first; first < key_end;) {
    const Chunk chunk = chunk_at(c, table, first, key_end);
    const float* k = chunk.k + h * c->head_dim;
    const float* v = chunk.v + h * c->head_dim;
    const int n = (int)chunk.n;
    vec16 scores[TILE_VECTORS][LANES], correction[TILE_VECTORS];
    /* the next chunk's keys and values of this head, a cache line a step of the scores */
    const Chunk next = chunk_after(c, table, chunk, key_end);
    const float* next_k = next.k + h * c->head_dim;
    const float* next_v = next.v + h * c->head_dim;
    const int key_lines = dims / LANES, next_lines = (int)next.n * key_lines;
    for (int group = 0; group < n; group += 8) { /* eight independent sums a vector */
      const float* keys[8];
      for (int j = 0; j < 8; j++) keys[j] = k + (group + j < n ? group + j : n - 1) * stride;
      vec16 sums[TILE_VECTORS][8];
      for (int x = 0; x < V; x++)
        for (int j = 0; j < 8; j++) sums[x][j] = (vec16){0};
      for (int d = 0; d < dims; d++) {
        const int line = group / 8 * dims + d;
        if (line < next_lines)
          __builtin_prefetch(next_k + line / key_lines * stride + line % key_lines * LANES);
        else if (line < 2 * next_lines)
          __builtin_prefetch(next_v + (line - next_lines) / key_lines * stride +
                             (line - next_lines) % key_lines * LANES);
        vec16 column[TILE_VECTORS];
        for (int x = 0; x < V; x++) column[x] = load(qt + (d * V + x) * LANES);
        for (int j = 0; j < 8; j++) {
          const float key = keys[j][d];
          for (int x = 0; x < V; x++) sums[x][j] += key * column[x];
        }
      }
      for (int x = 0; x < V; x++)
        for (int j = 0; j < 8 && group + j < n; j++) scores[x][group + j] = sums[x][j];
    }
    const int masked = first + n - 1 > all_see; /* a chunk on the diagonal, or past a row */
    for (int x = 0; x < V; x++) {
      vec16* score = scores[x];
      if (masked)
        for (int t = 0; t < n; t++)
          score[t] = blend(pos[x] >= (int32_t)(first + t), score[t], splat(MASKED));
      vec16 top[LANES]; /* the chunk's largest score a row: a tree of maxes, not a chain */
      for (int t = 0; t < LANES; t++) top[t] = t < n ? score[t] : m[x];
      for (int width = LANES / 2; width > 0; width /= 2)
        for (int t = 0; t < width; t++) top[t] = vmax(top[t], top[t + width]);
      const vec16 chunk_max = vmax(m[x], top[0]);
      correction[x] = vexp(m[x] - chunk_max);
      m[x] = chunk_max;
      l[x] *= correction[x];
      const vec16 m2 = chunk_max * splat(LOG2E); /* e^(s - m) = 2^(s log2 e - m log2 e) */
      for (int t = 0; t < n; t++) score[t] = vexp2(score[t] * splat(LOG2E) - m2);
      if (masked)
        for (int t = 0; t < n; t++)
          score[t] = blend(pos[x] >= (int32_t)(first + t), score[t], splat(0.0f));
      for (int t = 0; t < n; t++) l[x] += score[t];
    }
    for (int d0 = 0; d0 < dims; d0 += 8) {
      vec16 sums[TILE_VECTORS][8];
      for (int x = 0; x < V; x++)
        for (int j = 0; j < 8; j++)
          sums[x][j] = load(ot + ((d0 + j) * V + x) * LANES) * correction[x];
      for (int t = 0; t < n; t++) {
        const float* value = v + t * stride + d0;
        for (int j = 0; j < 8; j++) {
          const float element = value[j];
          for (int x = 0; x < V; x++) sums[x][j] += element * scores[x][t];
        }
      }
      for (int x = 0; x < V; x++)
        for (int j = 0; j < 8; j++) store(ot + ((d0 + j) * V + x) * LANES, sums[x][j]);
    }
    first += n;
  }
  for (int x = 0; x < V; x++) m_out[x] = m[x], l_out[x] = l[x];
}

/* attend_lanes for any head size, the common ones unrolled, over one to TILE_VECTORS vectors
 * of rows. */
static void attend_lanes_any(const Cache* c, const int64_t* table, int64_t h, const float* qt,
                             const ivec16* pos, int64_t all_see, int64_t key_first,
                             int64_t key_end, float* ot, vec16* m, vec16* l, int vectors) {
  const int64_t a = all_see, f = key_first, e = key_end;
#define ATTEND_LANES_OF(V)                                                                    \
  switch (c->head_dim) {                                                                     \
    case 64: attend_lanes(c, table, h, qt, pos, a, f, e, ot, m, l, 64, V); break;            \
    case 128: attend_lanes(c, table, h, qt, pos, a, f, e, ot, m, l, 128, V); break;          \
    default: attend_lanes(c, table, h, qt, pos, a, f, e, ot, m, l, (int)c->head_dim, V);     \
  }
  switch (vectors) {
    case 3: ATTEND_LANES_OF(3); break;
    case 2: ATTEND_LANES_OF(2); break;
    default: ATTEND_LANES_OF(1);
  }
#undef ATTEND_LANES_OF
}

/* A lane task: tokens [token_first, token_first + num_tokens) of the flat batch (at most
 * TILE_ROWS / group) at positions from position_first, key-value head h, every key up to the
 * last; its rows in one vector, two where they are more than 16, three where more than 32. */
static void run_lane_task(const Cache* c, const float* q, const int64_t* table,
                          int64_t token_first, int64_t num_tokens, int64_t position_first,
                          int64_t h, float* out) {
  const int64_t group = c->num_heads / c->num_kv_heads, dims = c->head_dim;
  const int rows = (int)(num_tokens * group), vectors = (rows + LANES - 1) / LANES;
  const int width = vectors * LANES; /* of a transposed row of qt and ot */
  float qt[MAX_HEAD_DIM * TILE_ROWS], ot[MAX_HEAD_DIM * TILE_ROWS];
  int32_t positions[TILE_ROWS];
  memset(qt, 0, sizeof qt);
  for (int row = 0; row < TILE_ROWS; row++) positions[row] = -1;
  for (int row = 0; row < rows; row++) {
    const int64_t token = token_first + row / group, head = h * group + row % group;
    const float* query = q + (token * c->num_heads + head) * dims;
    for (int64_t d = 0; d < dims; d++) qt[d * width + row] = query[d] * c->scale;
    positions[row] = (int32_t)(position_first + row / group);
  }
  ivec16 pos[TILE_VECTORS];
  memcpy(pos, positions, sizeof pos);
  vec16 m[TILE_VECTORS], l[TILE_VECTORS];
  attend_lanes_any(c, table, h, qt, pos, position_first, 0, position_first + num_tokens, ot, m,
                   l, vectors);
  float sums[TILE_ROWS];
  for (int x = 0; x < vectors; x++) store(sums + x * LANES, l[x]);
  for (int row = 0; row < rows; row++) {
    const int64_t token = token_first + row / group, head = h * group + row % group;
    float* o = out + (token * c->num_heads + head) * dims;
    for (int64_t d = 0; d < dims; d++) o[d] = ot[d * width + row] / sums[row];
  }
}

/* Merge n softmax states of one row (max m[i], sum l[i], weighted values acc[i]) into its
 * normalised output (the flash-decoding reduction); states with no keys (l = 0) add nothing. */
static void merge_states(int64_t n, const float* m, const float* l, const float* const* acc,
                         int64_t dims, float* out) {
  float top = -INFINITY, sum = 0.0f;
  for (int64_t i = 0; i < n; i++) top = m[i] > top ? m[i] : top;
  for (int64_t d = 0; d < dims; d++) out[d] = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    if (l[i] == 0.0f) continue;
    const float weight = expf(m[i] - top);
    sum += l[i] * weight;
    for (int64_t d = 0; d < dims; d++) out[d] += acc[i][d] * weight;
  }
  for (int64_t d = 0; d < dims; d++) out[d] /= sum;
}

/* One request decoding over a long context, with threads to spare: each of num_parts tasks
 * reads one part of the keys for every head, and the parts are merged (split-K, as
 * flash-decoding does). Returns -1 when the parts' memory cannot be had. */
static int split_decode(const Cache* c, const float* q, const int64_t* table, int64_t position,
                        int64_t num_parts, float* out) {
  Softmax* parts = malloc((size_t)num_parts * sizeof(Softmax));
  if (parts == NULL) return -1;
  const int64_t context = position + 1, keys_per_part = (context + num_parts - 1) / num_parts;
#pragma omp parallel for schedule(static, 1)
  for (int64_t part = 0; part < num_parts; part++) {
    const int64_t first = part * keys_per_part;
    const int64_t end = first + keys_per_part < context ? first + keys_per_part : context;
    run_row_task(c, q, table, 0, 1, position, 0, c->num_kv_heads, first, end, &parts[part],
                 NULL);
  }
  for (int64_t head = 0; head < c->num_heads; head++) {
    float m[MAX_SPLIT_PARTS], l[MAX_SPLIT_PARTS];
    const float* acc[MAX_SPLIT_PARTS];
    for (int64_t part = 0; part < num_parts; part++) {
      m[part] = parts[part].m[head];
      l[part] = parts[part].l[head];
      acc[part] = parts[part].acc[head];
    }
    merge_states(num_parts, m, l, acc, c->head_dim, out + head * c->head_dim);
  }
  free(parts);
  return 0;
}

/* Shared prefixes. Decodes whose block tables begin with the same blocks (prefix-cache hits:
 * the same system prompt, say) form a group, whose rows read those keys once for all of them.
 * A SHARED task takes up to 48 of the group's rows (its members' query heads of one key-value
 * head) as the lanes of up to three vectors, as a prefill tile does, over one part of the
 * shared keys; an OWN task folds one member's keys after the prefix into all its heads, as a
 * decode does. Their softmax states are kept (STATE floats each) and merged row by row at the
 * end. For 16 decodes after a 512-token prompt the prompt's keys are read once a layer
 * instead of 16 times, and their arithmetic runs at the prefill tiles' rate, over twice the
 * decode's. */
#define MIN_SHARED_KEYS 64       /* a prefix shorter than this is read by each decode alone */
#define MIN_SHARED_ROWS 8        /* nor by fewer rows a key-value head: a tile's lanes, mostly idle,
                                    would cost more than the reads they save */
#define MIN_SHARED_PART_KEYS 128 /* keys per part when a shared prefix is split into tasks */
#define MAX_SHARED_PARTS 16
#define MAX_SPLIT_DEPTH 8 /* how often decodes sharing a prefix are split into groups at most */
#define STATE(dims) ((dims) + 2) /* m, l and the weighted values of one row */

typedef enum { DECODE, TILE, SHARED, OWN } TaskKind;

typedef struct {
  TaskKind kind;
  int64_t r;     /* DECODE, TILE: the request; OWN: the member; SHARED: the group */
  int64_t h;     /* TILE, SHARED: the key-value head */
  int64_t first; /* TILE: the tile's first token in its request; SHARED: its first row */
  int64_t count; /* SHARED: rows (at most TILE_ROWS) */
  int64_t part;  /* SHARED: which part of the prefix */
} Task;

typedef struct {
  int64_t first, count;    /* its members: members[first .. first + count) */
  int64_t shared_keys;     /* keys [0, shared_keys) lie in blocks every member holds */
  int64_t num_parts, keys_per_part;
  int64_t states;          /* its first shared state: part p, member i, head x at
                              states + (p * count + i) * num_heads + x */
} Group;

/* How a step's attention is split into tasks; the same for every layer. */
typedef struct {
  Task* tasks;
  int64_t num_tasks;
  Group* groups;
  int64_t num_groups;
  int64_t *members, *group_of; /* request of each member; group of each member */
  int64_t num_members;
  int64_t own_states; /* member i's head x: state own_states + i * num_heads + x */
  float* states;
} Plan;

/* The decodes' tables as they are sorted: blocks [0, full) of a request are full and seen. */
typedef struct {
  const int64_t* tables;
  int64_t max_blocks;
  const int64_t* full;
} Tables;

static int64_t common_blocks(const Tables* t, int64_t a, int64_t b) {
  const int64_t n = t->full[a] < t->full[b] ? t->full[a] : t->full[b];
  const int64_t *x = t->tables + a * t->max_blocks, *y = t->tables + b * t->max_blocks;
  int64_t i = 0;
  while (i < n && x[i] == y[i]) i++;
  return i;
}

static int tables_before(const Tables* t, int64_t a, int64_t b) { /* lexicographic order */
  const int64_t i = common_blocks(t, a, b);
  if (i < t->full[a] && i < t->full[b])
    return t->tables[a * t->max_blocks + i] < t->tables[b * t->max_blocks + i];
  return t->full[a] < t->full[b] || (t->full[a] == t->full[b] && a < b);
}

/* Sort requests idx[0 .. n) by their tables (merge sort, scratch of n). */
static void sort_by_table(const Tables* t, int64_t* idx, int64_t* scratch, int64_t n) {
  if (n < 2) return;
  const int64_t half = n / 2;
  sort_by_table(t, idx, scratch, half);
  sort_by_table(t, idx + half, scratch, n - half);
  int64_t i = 0, j = half, k = 0;
  while (i < half && j < n) scratch[k++] = tables_before(t, idx[j], idx[i]) ? idx[j++] : idx[i++];
  while (i < half) scratch[k++] = idx[i++];
  while (j < n) scratch[k++] = idx[j++];
  memcpy(idx, scratch, (size_t)n * sizeof(int64_t));
}

/* Split sorted decodes [a, b) into groups, common[i] being the blocks decodes i - 1 and i
 * share: one group over all of them, sharing their least common prefix, or (where that reads
 * more) groups on either side of the places where it is least; a group has min_members at
 * least. Returns the keys a grouping saves (the shared blocks each member but the first does
 * not read) and, with out set, appends its groups there. */
static int64_t split_groups(const int64_t* common, int64_t a, int64_t b, int64_t min_blocks,
                            int64_t min_members, int depth, Group* out, int64_t* num_out) {
  if (b - a < min_members) return 0;
  int64_t least = common[a + 1];
  for (int64_t i = a + 2; i < b; i++) least = common[i] < least ? common[i] : least;
  const int64_t whole = least >= min_blocks ? (b - a - 1) * least : 0;
  int64_t parts = 0; /* each piece is shorter: the least is at one place at least */
  if (depth > 0)
    for (int64_t i = a, j = a + 1; j <= b; j++)
      if (j == b || common[j] == least) {
        parts += split_groups(common, i, j, min_blocks, min_members, depth - 1, NULL, NULL);
        i = j;
      }
  if (out == NULL) return whole > parts ? whole : parts;
  if (whole >= parts) {
    if (whole > 0) out[(*num_out)++] = (Group){a, b - a, least, 0, 0, 0};
    return whole;
  }
  for (int64_t i = a, j = a + 1; j <= b; j++)
    if (j == b || common[j] == least) {
      split_groups(common, i, j, min_blocks, min_members, depth - 1, out, num_out);
      i = j;
    }
  return parts;
}

static void free_plan(Plan* p) { /* and leave it empty: freeing it again does nothing */
  free(p->tasks);
  free(p->groups);
  free(p->members);
  free(p->group_of);
  free(p->states);
  memset(p, 0, sizeof *p);
}

/* The step's tasks: decodes one task each (or grouped by their shared prefix), prefills a
 * task per key-value head and tile of 48 / group tokens. Returns -1 when out of memory. */
static int plan_step(const Cache* c, const int64_t* block_tables, int64_t max_blocks,
                     const int64_t* query_starts, const int64_t* context_starts,
                     int64_t num_requests, int64_t num_threads, Plan* p) {
  memset(p, 0, sizeof *p);
  const int64_t group = c->num_heads / c->num_kv_heads, tile = TILE_ROWS / group;
  const int whole_decodes = c->num_heads <= MAX_ROW_TASK_ROWS;
  const size_t n = (size_t)(num_requests > 0 ? num_requests : 1);
  int64_t* full = malloc(n * sizeof(int64_t));
  int64_t* scratch = malloc(n * sizeof(int64_t));
  int64_t* common = malloc(n * sizeof(int64_t));
  p->members = malloc(n * sizeof(int64_t));
  p->group_of = malloc(n * sizeof(int64_t));
  p->groups = malloc(n * sizeof(Group));
  int status = -1;
  if (!full || !scratch || !common || !p->members || !p->group_of || !p->groups) goto done;

  /* decodes that could share: sorted by their tables, neighbours' common blocks counted */
  const int64_t min_blocks = (MIN_SHARED_KEYS + c->block_size - 1) / c->block_size;
  int64_t num_candidates = 0;
  for (int64_t r = 0; r < num_requests; r++) {
    full[r] = (context_starts[r] + 1) / c->block_size;
    if (whole_decodes && query_starts[r + 1] - query_starts[r] == 1 && full[r] >= min_blocks)
      p->members[num_candidates++] = r;
  }
  const Tables tables = {block_tables, max_blocks, full};
  sort_by_table(&tables, p->members, scratch, num_candidates);
  for (int64_t i = 1; i < num_candidates; i++)
    common[i] = common_blocks(&tables, p->members[i - 1], p->members[i]);
  const int64_t min_members = (MIN_SHARED_ROWS + group - 1) / group > 2
                                  ? (MIN_SHARED_ROWS + group - 1) / group
                                  : 2;
  split_groups(common, 0, num_candidates, min_blocks, min_members, MAX_SPLIT_DEPTH, p->groups,
               &p->num_groups);

  /* keep the grouped decodes only, group by group */
  for (int64_t r = 0; r < num_requests; r++) scratch[r] = -1; /* each request's member index */
  int64_t num_states = 0, num_tasks = 0;
  for (int64_t g = 0; g < p->num_groups; g++) {
    Group* x = &p->groups[g];
    const int64_t first = p->num_members;
    for (int64_t i = 0; i < x->count; i++) {
      const int64_t r = p->members[x->first + i];
      scratch[r] = first + i;
    }
    x->first = first; /* members are rewritten below, in this order */
    p->num_members += x->count;
    const int64_t blocks = x->shared_keys; /* split_groups left the shared blocks here */
    x->shared_keys = blocks * c->block_size;
    const int64_t tiles = (x->count * group + TILE_ROWS - 1) / TILE_ROWS; /* a key-value head */
    x->num_parts = 1;
    while (x->num_parts < MAX_SHARED_PARTS && x->num_parts * 2 <= blocks &&
           c->num_kv_heads * tiles * x->num_parts < 4 * num_threads &&
           x->shared_keys / (2 * x->num_parts) >= MIN_SHARED_PART_KEYS)
      x->num_parts *= 2;
    const int64_t blocks_per_part = (blocks + x->num_parts - 1) / x->num_parts;
    x->num_parts = (blocks + blocks_per_part - 1) / blocks_per_part; /* none of them empty */
    x->keys_per_part = blocks_per_part * c->block_size;
    x->states = num_states;
    num_states += x->num_parts * x->count * c->num_heads;
    num_tasks += x->num_parts * c->num_kv_heads * tiles;
  }
  for (int64_t r = 0; r < num_requests; r++)
    if (scratch[r] >= 0) p->members[scratch[r]] = r;
  for (int64_t g = 0; g < p->num_groups; g++)
    for (int64_t i = 0; i < p->groups[g].count; i++) p->group_of[p->groups[g].first + i] = g;
  p->own_states = num_states;
  num_states += p->num_members * c->num_heads;
  for (int64_t r = 0; r < num_requests; r++) {
    const int64_t num_tokens = query_starts[r + 1] - query_starts[r];
    num_tasks += num_tokens == 1 && whole_decodes
                     ? 1
                     : (num_tokens + tile - 1) / tile * c->num_kv_heads;
  }
  p->tasks = malloc((size_t)(num_tasks > 0 ? num_tasks : 1) * sizeof(Task));
  p->states = malloc((size_t)(num_states > 0 ? num_states : 1) * STATE(c->head_dim) *
                     sizeof(float));
  if (!p->tasks || !p->states) goto done;

  /* the shared prefixes' tasks first (the longest), then each request's */
  for (int64_t g = 0; g < p->num_groups; g++) {
    const Group* x = &p->groups[g];
    for (int64_t part = 0; part < x->num_parts; part++)
      for (int64_t h = 0; h < c->num_kv_heads; h++)
        for (int64_t row = 0; row < x->count * group; row += TILE_ROWS) {
          const int64_t rows =
              x->count * group - row < TILE_ROWS ? x->count * group - row : TILE_ROWS;
          p->tasks[p->num_tasks++] = (Task){SHARED, g, h, row, rows, part};
        }
  }
  for (int64_t r = 0; r < num_requests; r++) {
    const int64_t num_tokens = query_starts[r + 1] - query_starts[r];
    if (num_tokens == 1 && whole_decodes) {
      p->tasks[p->num_tasks++] = scratch[r] >= 0 ? (Task){OWN, scratch[r], 0, 0, 0, 0}
                                                 : (Task){DECODE, r, 0, 0, 0, 0};
      continue;
    }
    for (int64_t offset = 0; offset < num_tokens; offset += tile)
      for (int64_t h = 0; h < c->num_kv_heads; h++)
        p->tasks[p->num_tasks++] = (Task){TILE, r, h, offset, 0, 0};
  }
  status = 0;
done:
  free(full);
  free(scratch);
  free(common);
  if (status != 0) free_plan(p);
  return status;
}

/* Keep rows [row_first, row_first + count) of s as consecutive states from `states`. */
static void keep_states(const Softmax* s, int64_t row_first, int64_t count, int64_t dims,
                        float* states) {
  for (int64_t i = 0; i < count; i++) {
    float* state = states + i * STATE(dims);
    state[0] = s->m[row_first + i];
    state[1] = s->l[row_first + i];
    memcpy(state + 2, s->acc[row_first + i], (size_t)dims * sizeof(float));
  }
}

/* A SHARED task: rows [first, first + count) (row i: member i / group's query head
 * h * group + i % group) of a group, as the lanes of one to three vectors, over one part of the
 * keys the group shares, all of which every row sees; their softmax states kept. */
static void run_shared_task(const Cache* c, const Plan* p, const Task* t, const float* q,
                            const int64_t* block_tables, int64_t max_blocks,
                            const int64_t* query_starts) {
  const Group* x = &p->groups[t->r];
  const int64_t group = c->num_heads / c->num_kv_heads, dims = c->head_dim;
  const int vectors = (int)((t->count + LANES - 1) / LANES), width = vectors * LANES;
  float qt[MAX_HEAD_DIM * TILE_ROWS], ot[MAX_HEAD_DIM * TILE_ROWS];
  int32_t positions[TILE_ROWS];
  memset(qt, 0, sizeof qt);
  for (int lane = 0; lane < TILE_ROWS; lane++) positions[lane] = -1;
  for (int64_t lane = 0; lane < t->count; lane++) {
    const int64_t row = t->first + lane;
    const int64_t r = p->members[x->first + row / group], head = t->h * group + row % group;
    const float* query = q + (query_starts[r] * c->num_heads + head) * dims;
    for (int64_t d = 0; d < dims; d++) qt[d * width + lane] = query[d] * c->scale;
    positions[lane] = (int32_t)x->shared_keys; /* past every shared key */
  }
  ivec16 pos[TILE_VECTORS];
  memcpy(pos, positions, sizeof pos);
  const int64_t key_first = t->part * x->keys_per_part;
  const int64_t key_end = key_first + x->keys_per_part < x->shared_keys
                              ? key_first + x->keys_per_part
                              : x->shared_keys;
  vec16 m[TILE_VECTORS], l[TILE_VECTORS];
  attend_lanes_any(c, block_tables + p->members[x->first] * max_blocks, t->h, qt, pos,
                   x->shared_keys, key_first, key_end, ot, m, l, vectors);
  float ms[TILE_ROWS], ls[TILE_ROWS];
  for (int v = 0; v < vectors; v++) store(ms + v * LANES, m[v]), store(ls + v * LANES, l[v]);
  for (int64_t lane = 0; lane < t->count; lane++) {
    const int64_t row = t->first + lane, i = row / group, head = t->h * group + row % group;
    float* state =
        p->states + (x->states + (t->part * x->count + i) * c->num_heads + head) * STATE(dims);
    state[0] = ls[lane] > 0.0f ? ms[lane] : -INFINITY;
    state[1] = ls[lane];
    for (int64_t d = 0; d < dims; d++) state[2 + d] = ot[d * width + lane];
  }
}

static void run_task(const Cache* c, const Plan* p, const Task* t, const float* q,
                     const int64_t* block_tables, int64_t max_blocks,
                     const int64_t* query_starts, const int64_t* context_starts, float* out) {
  const int64_t group = c->num_heads / c->num_kv_heads, tile = TILE_ROWS / group;
  const int64_t dims = c->head_dim;
  Softmax s; /* with run_row_task's Rows, ~210 KB of this thread's stack at most (of 8 MB) */
  if (t->kind == SHARED) {
    run_shared_task(c, p, t, q, block_tables, max_blocks, query_starts);
    return;
  }
  if (t->kind == OWN) {
    const int64_t r = p->members[t->r];
    const Group* x = &p->groups[p->group_of[t->r]];
    run_row_task(c, q, block_tables + r * max_blocks, query_starts[r], 1, context_starts[r], 0,
                 c->num_kv_heads, x->shared_keys, context_starts[r] + 1, &s, NULL);
    keep_states(&s, 0, c->num_heads, dims,
                p->states + (p->own_states + t->r * c->num_heads) * STATE(dims));
    return;
  }
  const int64_t r = t->r, num_tokens = query_starts[r + 1] - query_starts[r];
  const int64_t* table = block_tables + r * max_blocks;
  if (t->kind == DECODE) {
    run_row_task(c, q, table, query_starts[r], 1, context_starts[r], 0, c->num_kv_heads, 0,
                 context_starts[r] + 1, &s, out);
    return;
  }
  const int64_t tile_tokens = num_tokens - t->first < tile ? num_tokens - t->first : tile;
  const int64_t position = context_starts[r] + t->first;
  if (tile_tokens * group <= FEW_ROWS)
    run_row_task(c, q, table, query_starts[r] + t->first, tile_tokens, position, t->h, 1, 0,
                 position + tile_tokens, &s, out);
  else
    run_lane_task(c, q, table, query_starts[r] + t->first, tile_tokens, position, t->h, out);
}

/* A grouped decode's rows: its shared parts' states and its own, merged. */
static void merge_member(const Cache* c, const Plan* p, int64_t member,
                         const int64_t* query_starts, float* out) {
  const Group* x = &p->groups[p->group_of[member]];
  const int64_t dims = c->head_dim, i = member - x->first, r = p->members[member];
  for (int64_t head = 0; head < c->num_heads; head++) {
    float m[MAX_SHARED_PARTS + 1], l[MAX_SHARED_PARTS + 1];
    const float* acc[MAX_SHARED_PARTS + 1];
    for (int64_t part = 0; part <= x->num_parts; part++) {
      const int64_t state = part < x->num_parts
                                ? x->states + (part * x->count + i) * c->num_heads + head
                                : p->own_states + member * c->num_heads + head;
      const float* kept = p->states + state * STATE(dims);
      m[part] = kept[0];
      l[part] = kept[1];
      acc[part] = kept + 2;
    }
    merge_states(x->num_parts + 1, m, l, acc, dims,
                 out + (query_starts[r] * c->num_heads + head) * dims);
  }
}

static void attend_planned(const Cache* c, const Plan* p, const float* q,
                           const int64_t* block_tables, int64_t max_blocks,
                           const int64_t* query_starts, const int64_t* context_starts,
                           float* out) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < p->num_tasks; task++)
    run_task(c, p, &p->tasks[task], q, block_tables, max_blocks, query_starts, context_starts,
             out);
  if (p->num_members == 0) return;
#pragma omp parallel for schedule(static)
  for (int64_t member = 0; member < p->num_members; member++)
    merge_member(c, p, member, query_starts, out);
}

/* A lone decode over many keys, threads to spare: the number of parts to split it into. */
static int64_t lone_decode_parts(const int64_t* query_starts, const int64_t* context_starts,
                                 int64_t num_requests, int64_t num_heads, int64_t num_threads) {
  if (num_requests != 1 || query_starts[1] != 1 || num_heads > MAX_ROW_TASK_ROWS) return 1;
  int64_t num_parts = 1;
  while (num_parts < num_threads && num_parts < MAX_SPLIT_PARTS &&
         (context_starts[0] + 1) / (2 * num_parts) >= MIN_PART_KEYS)
    num_parts *= 2;
  return num_parts;
}

/* How sy_paged_attention would group a step's decodes by shared prefix: group_of[r] is the
 * group of request r (-1: not grouped) and shared_keys[r] the keys its group shares (0).
 * Returns the number of groups, or -1 when out of memory. */
int64_t sy_shared_prefix_groups(const int64_t* block_tables, int64_t max_blocks,
                                const int64_t* query_starts, const int64_t* context_starts,
                                int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                                int64_t block_size, int64_t num_threads, int64_t* group_of,
                                int64_t* shared_keys) {
  const Cache c = {NULL, NULL, block_size, num_heads, num_kv_heads, 0, 0.0f, 0};
  Plan plan;
  if (plan_step(&c, block_tables, max_blocks, query_starts, context_starts, num_requests,
                num_threads, &plan) != 0)
    return -1;
  for (int64_t r = 0; r < num_requests; r++) group_of[r] = -1, shared_keys[r] = 0;
  for (int64_t i = 0; i < plan.num_members; i++) {
    group_of[plan.members[i]] = plan.group_of[i];
    shared_keys[plan.members[i]] = plan.groups[plan.group_of[i]].shared_keys;
  }
  const int64_t num_groups = plan.num_groups;
  free_plan(&plan);
  return num_groups;
}

/* out (num_tokens, num_heads, head_dim) = attention of q (same shape) over the paged cache.
 * block_tables (num_requests, max_blocks) int64; query_starts (num_requests + 1) int64, the
 * requests' first rows and then num_tokens; context_starts (num_requests) int64, each
 * request's first query position. Returns 0, or -1 when out of memory (out is then unset).
 *
 * Tasks: a decode is one task over all its heads (its keys are read once, as they lie), or,
 * where decodes share a prefix, a SHARED task per part of it and key-value head and an OWN
 * task each (above); a prefill is a task per key-value head and tile of 48 / group tokens, a
 * lane task unless the tile has FEW_ROWS rows or fewer. */
int sy_paged_attention(const float* q, const float* key_cache, const float* value_cache,
                       const int64_t* block_tables, int64_t max_blocks,
                       const int64_t* query_starts, const int64_t* context_starts,
                       int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, int64_t num_threads,
                       float* out) {
  const Cache c = {key_cache, value_cache, block_size, num_heads, num_kv_heads, head_dim, scale,
                   next_chunk_into_l1(num_kv_heads, head_dim)};
  const int64_t parts =
      lone_decode_parts(query_starts, context_starts, num_requests, num_heads, num_threads);
  if (parts > 1) return split_decode(&c, q, block_tables, context_starts[0], parts, out);
  Plan plan;
  if (plan_step(&c, block_tables, max_blocks, query_starts, context_starts, num_requests,
                num_threads, &plan) != 0)
    return -1;
  attend_planned(&c, &plan, q, block_tables, max_blocks, query_starts, context_starts, out);
  free_plan(&plan);
  return 0;
}

/* Rotate a head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), Hugging Face's rotate_half form:
 * cos and sin hold head_dim values, the two halves alike. */
static inline void rotate(const float* x, const float* cos, const float* sin, int64_t dims,
                          float* out) {
  const int64_t half = dims / 2;
  for (int64_t d = 0; d < half; d++) {
    out[d] = x[d] * cos[d] - x[d + half] * sin[d];
    out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half];
  }
}

/* From qkv (num_tokens, (num_heads + 2 num_kv_heads) head_dim): rotated queries into
 * q_out (num_tokens, num_heads, head_dim); rotated keys and the values into cache slot
 * slots[t] of key_cache / value_cache (num_slots, num_kv_heads, head_dim). cos, sin:
 * (num_tokens, head_dim). */
void sy_rope_write_kv(const float* qkv, int64_t num_tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
                      const int64_t* slots, float* key_cache, float* value_cache, float* q_out) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; t++) {
    const float* row = qkv + t * width;
    const float *c = cos + t * head_dim, *s = sin + t * head_dim;
    for (int64_t h = 0; h < num_heads; h++)
      rotate(row + h * head_dim, c, s, head_dim, q_out + (t * num_heads + h) * head_dim);
    float* key = key_cache + slots[t] * kv_width;
    for (int64_t h = 0; h < num_kv_heads; h++)
      rotate(row + (num_heads + h) * head_dim, c, s, head_dim, key + h * head_dim);
    memcpy(value_cache + slots[t] * kv_width, row + num_heads * head_dim + kv_width,
           (size_t)kv_width * sizeof(float));
  }
}

/* For each of num_tokens rows of hidden floats: residual += x (unless x is NULL), then
 * out = residual / rms(residual) * weight, rms = sqrt(mean(residual^2) + eps). */
void sy_add_rms_norm(const float* x, float* residual, const float* weight, int64_t num_tokens,
                     int64_t hidden, float eps, float* out) {
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; t++) {
    float* r = residual + t * hidden;
    float* o = out + t * hidden;
    int64_t d = 0;
    vec16 squares = {0};
    for (; d + LANES <= hidden; d += LANES) {
      vec16 value = load(r + d);
      if (x) {
        value += load(x + t * hidden + d);
        store(r + d, value);
      }
      squares += value * value;
    }
    float sum = hsum(squares);
    for (; d < hidden; d++) {
      if (x) r[d] += x[t * hidden + d];
      sum += r[d] * r[d];
    }
    const float inverse = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (d = 0; d + LANES <= hidden; d += LANES)
      store(o + d, load(r + d) * inverse * load(weight + d));
    for (; d < hidden; d++) o[d] = r[d] * inverse * weight[d];
  }
}

/* out (num_tokens, inner) = silu(gate) * up for gate_up (num_tokens, 2 inner) = [gate | up];
 * silu(g) = g / (1 + e^-g). */
void sy_silu_mul(const float* gate_up, int64_t num_tokens, int64_t inner, float* out) {
#pragma omp parallel for schedule(static) if (num_tokens >= 16)
  for (int64_t t = 0; t < num_tokens; t++) {
    const float* gate = gate_up + t * 2 * inner;
    const float* up = gate + inner;
    float* o = out + t * inner;
    int64_t d = 0;
    for (; d + LANES <= inner; d += LANES) {
      const vec16 g = load(gate + d);
      store(o + d, g / (splat(1.0f) + vexp(-g)) * load(up + d));
    }
    for (; d < inner; d++) o[d] = gate[d] / (1.0f + expf(-gate[d])) * up[d];
  }
}

/* Greedy sampling ---------------------------------------------------------------------------
 * tokens[r] = the first index of the largest logit of row r, as the sampler's torch code picks
 * it (torch.argmax after finite_logits): NaN counts as -inf, and +inf as the largest float32
 * (so it ties with FLT_MAX); -1 where every logit of the row is -inf or NaN. One pass over the
 * logits where nan_to_num, isneginf().all() and argmax made four. Each lane keeps the first
 * index of its largest value (a later equal value does not replace it), and the lanes' results
 * are merged by value, then by the lower index. vocab < 2^31. */

/* The best of a stretch of a row: its largest value and that value's first index (-1: none). */
typedef struct {
  float value;
  int64_t index;
} Best;

/* Best of a and b: the larger value, then the lower index (b's index is never -1 where its
 * value could win: an empty stretch has value -inf and index -1). */
static inline Best better(Best a, Best b) {
  if (b.index >= 0 && (a.index < 0 || b.value > a.value || (b.value == a.value && b.index < a.index)))
    return b;
  return a;
}

/* The greedy token of row[first, end) (first a multiple of LANES), as above. */
static Best greedy_part(const float* row, int64_t first, int64_t end) {
  vec16 best = splat(-INFINITY);
  ivec16 at = (ivec16){0} - 1, index = (ivec16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  index += (int32_t)first;
  int64_t v = first;
  for (; v + LANES <= end; v += LANES) {
    vec16 x = load(row + v);
    x = blend(x > splat(FLT_MAX), splat(FLT_MAX), x); /* +inf as FLT_MAX; NaN stays NaN */
    const ivec16 greater = x > best;                   /* never for NaN */
    best = blend(greater, x, best);
    at = (index & greater) | (at & ~greater);
    index += LANES;
  }
  Best found = {-INFINITY, -1};
  for (int lane = 0; lane < LANES; lane++)
    if (at[lane] >= 0) found = better(found, (Best){best[lane], at[lane]});
  for (; v < end; v++) { /* the tail: later indices, so only a larger value wins */
    const float x = row[v] > FLT_MAX ? FLT_MAX : row[v];
    if (x > found.value) found = (Best){x, v};
  }
  return found;
}

void sy_greedy_tokens(const float* logits, int64_t num_rows, int64_t vocab, int64_t* tokens) {
#pragma omp parallel for schedule(static) if (num_rows > 1)
  for (int64_t r = 0; r < num_rows; r++) tokens[r] = greedy_part(logits + r * vocab, 0, vocab).index;
}

/* Log probabilities -------------------------------------------------------------------------
 * Each row's log-sum-exp, the log probability of its token and its num_top likeliest tokens
 * with theirs, most likely first and the lower index first among equals: what torch's
 * log_softmax, gather and topk give (within float32 rounding), in two passes over the row (the
 * second from cache) and no copy of it. The first pass keeps the row's largest value and its
 * num_top best in a sorted list, which a vector of 16 logits enters only where one beats the
 * list's last; the second sums exp(x - max). A row holding NaN or an infinity is flagged and
 * left alone (torch's ops say what those give; the caller asks them). */

#define MAX_TOP 64 /* cpu_ops.py checks num_top against it */

typedef struct {
  float value;
  int64_t index;
} Ranked;

/* Enter (value, index) into best[0, *count) (sorted, largest first; at most num_top), after
 * the entries equal to it: they came first. */
static inline void rank_in(Ranked* best, int* count, int num_top, float value, int64_t index) {
  int at = *count;
  while (at > 0 && best[at - 1].value < value) at--;
  if (at >= num_top) return;
  const int last = *count < num_top ? *count : num_top - 1;
  memmove(best + at + 1, best + at, sizeof *best * (size_t)(last - at));
  best[at] = (Ranked){value, index};
  if (*count < num_top) (*count)++;
}

/* Row ``row``'s log probabilities (see above); 1 where it holds NaN or an infinity. */
static int row_logprobs(const float* row, int64_t vocab, int64_t token, int num_top, float* chosen,
                        float* top_values, int64_t* top_ids) {
  Ranked best[MAX_TOP];
  int count = 0;
  float last = -INFINITY; /* what a logit must beat to enter best: its last, once full */
  vec16 largest = splat(-INFINITY), odd = splat(0.0f);
  int64_t v = 0;
  for (; v + LANES <= vocab; v += LANES) {
    const vec16 x = load(row + v);
    largest = vmax(largest, x);
    odd += x - x; /* NaN from here on if x holds NaN or an infinity */
    const ivec16 enters = x > splat(last);
    ivec16 any = enters;
    any |= __builtin_shuffle(any, (ivec16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    any |= __builtin_shuffle(any, (ivec16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    any |= __builtin_shuffle(any, (ivec16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    any |= __builtin_shuffle(any, (ivec16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    if (num_top > 0 && any[0]) {
      for (int lane = 0; lane < LANES; lane++) {
        if (x[lane] > last) {
          rank_in(best, &count, num_top, x[lane], v + lane);
          if (count == num_top) last = best[num_top - 1].value;
        }
      }
    }
  }
  float top = hmax(largest), nonfinite = hsum(odd);
  for (; v < vocab; v++) {
    const float x = row[v];
    top = x > top ? x : top;
    nonfinite += x - x;
    if (num_top > 0 && x > last) {
      rank_in(best, &count, num_top, x, v);
      if (count == num_top) last = best[num_top - 1].value;
    }
  }
  if (nonfinite != 0.0f) return 1; /* NaN: never equal to 0 */
  vec16 sums = splat(0.0f);
  v = 0;
  for (; v + LANES <= vocab; v += LANES) sums += vexp(load(row + v) - splat(top));
  float sum = hsum(sums);
  for (; v < vocab; v++) sum += expf(row[v] - top);
  const float log_sum = logf(sum); /* x - top - log_sum, in log_softmax's order */
  *chosen = (row[token] - top) - log_sum;
  for (int i = 0; i < count; i++) {
    top_values[i] = (best[i].value - top) - log_sum;
    top_ids[i] = best[i].index;
  }
  return 0;
}

/* Every row's log probabilities: chosen[r], and top_values / top_ids[r * num_top, + num_top);
 * nonfinite[r] is 1 for a row left alone. tokens[r] is in [0, vocab), 0 <= num_top <= MAX_TOP
 * and num_top <= vocab (cpu_ops.py checks). */
void sy_token_logprobs(const float* logits, int64_t num_rows, int64_t vocab, const int64_t* tokens,
                       int64_t num_top, float* chosen, float* top_values, int64_t* top_ids,
                       uint8_t* nonfinite) {
#pragma omp parallel for schedule(static) if (num_rows > 1)
  for (int64_t r = 0; r < num_rows; r++) {
    nonfinite[r] = (uint8_t)row_logprobs(logits + r * vocab, vocab, tokens[r], (int)num_top,
                                         chosen + r, top_values + r * num_top,
                                         top_ids + r * num_top);
  }
}

/* Random sampling ---------------------------------------------------------------------------
 * The exponential race of worker/sampler.py in one pass over each row: token v of a row with
 * temperature T wins where exp(x_v - max x) / E_v is largest (first index on ties), x_v =
 * finite(finite(logit_v) / T) (NaN as -inf, +inf as FLT_MAX, as finite_logits does before and
 * after the division) and E_v = -log(u_v) the row's counter-based Exp(1) noise:
 *     u_v = (2 (mix64(key + (v + 1) gamma) >> 12) + 1) 2^-53,
 * mix64 splitmix64's finaliser, gamma its increment, -log in float64 (fdlibm's log, within an
 * ulp), then rounded to float32: the noise exponential_noise makes with torch ops. Where the
 * torch code takes probs / noise with probs = softmax(x), the sum that normalises them is left
 * out (it scales every score of the row alike), so the same tokens but for scores within
 * float32 rounding of one another. 16 logits a step; the noise in two halves of 8 float64s. */

typedef double dvec8 __attribute__((vector_size(64)));
typedef int64_t lvec8 __attribute__((vector_size(64)));
typedef uint64_t uvec8 __attribute__((vector_size(64)));
typedef float fvec8 __attribute__((vector_size(32)));

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ull

static inline dvec8 dsplat(double x) { return (dvec8){0} + x; }

/* mask ? a : b for float64 lanes (mask lanes all ones or all zeros). */
static inline dvec8 dblend(lvec8 mask, dvec8 a, dvec8 b) {
  return (dvec8)(((lvec8)a & mask) | ((lvec8)b & ~mask));
}

/* splitmix64's finaliser on 8 counters. */
static inline uvec8 mix64(uvec8 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* -log(u) for u = (2 j + 1) 2^-53 (j < 2^52: u in (0, 1), exact in float64), by fdlibm's
 * e_log.c: u = 2^k (1 + f) with sqrt(2)/2 <= 1 + f < sqrt(2), log(1 + f) = f - s (f - R(s)),
 * s = f / (2 + f); within an ulp. */
static inline dvec8 neg_log_unit(uvec8 j) {
  const dvec8 u = __builtin_convertvector((lvec8)(j + j + 1), dvec8) * dsplat(0x1p-53);
  lvec8 bits;
  memcpy(&bits, &u, sizeof bits);
  lvec8 k = (bits >> 52) - 1023; /* u is positive and normal */
  const lvec8 mantissa = (bits & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll;
  dvec8 m;
  memcpy(&m, &mantissa, sizeof m); /* in [1, 2) */
  const lvec8 high = m > dsplat(1.41421356237309504880);
  m = dblend(high, m * dsplat(0.5), m);
  k -= high; /* high lanes are -1 */
  const dvec8 f = m - dsplat(1.0);
  const dvec8 s = f / (dsplat(2.0) + f), z = s * s, w = z * z;
  const dvec8 t1 = w * (dsplat(3.999999999940941908e-01) +
                        w * (dsplat(2.222219843214978396e-01) + w * dsplat(1.531383769920937332e-01)));
  const dvec8 t2 =
      z * (dsplat(6.666666666666735130e-01) +
           w * (dsplat(2.857142874366239149e-01) +
                w * (dsplat(1.818357216161805012e-01) + w * dsplat(1.479819860511658591e-01))));
  const dvec8 r = t2 + t1, hfsq = dsplat(0.5) * f * f;
  const dvec8 dk = __builtin_convertvector(k, dvec8);
  const dvec8 log = dk * dsplat(6.93147180369123816490e-01) -
                    ((hfsq - (s * (hfsq + r) + dk * dsplat(1.90821492927058770002e-10))) - f);
  return -log;
}

/* The row's Exp(1) noise for vocab ids v .. v + 15 (float32). */
static inline vec16 noise16(uint64_t key, int64_t v) {
  const uvec8 lanes = {1, 2, 3, 4, 5, 6, 7, 8};
  const uvec8 lo = (uvec8){0} + (key + (uint64_t)v * GOLDEN_GAMMA) + lanes * GOLDEN_GAMMA;
  const uvec8 hi = lo + 8 * GOLDEN_GAMMA;
  const fvec8 a = __builtin_convertvector(neg_log_unit(mix64(lo) >> 12), fvec8);
  const fvec8 b = __builtin_convertvector(neg_log_unit(mix64(hi) >> 12), fvec8);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* x_v as above for 16 logits. */
static inline vec16 scaled16(vec16 logits, vec16 temperature) {
  vec16 x = blend(logits > splat(FLT_MAX), splat(FLT_MAX), logits);
  x = blend(x != x, splat(-INFINITY), x); /* NaN */
  x = x / temperature;
  return blend(x > splat(FLT_MAX), splat(FLT_MAX), x);
}

/* exp(x - m) for 16 x (m the row's largest), 0 for x = -inf. x - m is held at -86 or more,
 * so that no lane makes a subnormal (each costs the vector unit a slow assist: a row of
 * 49,132 forbidden tokens ran 7 times slower): a token that far below the largest weighs
 * ~4e-38 instead of less, which neither wins a race against the largest's 1 nor moves a top-p
 * mass of at least 1, and fails a min-p only below that. */
static inline vec16 weights16(vec16 x, vec16 m) {
  return blend(x == splat(-INFINITY), splat(0.0f), vexp(vmax(x - m, splat(-86.0f))));
}

/* The 16 logits of row from v on, those at or past end as -inf (they then neither win nor
 * weigh). */
static inline vec16 logits16(const float* row, int64_t v, int64_t end) {
  if (v + LANES <= end) return load(row + v);
  float part[LANES];
  for (int lane = 0; lane < LANES; lane++) part[lane] = v + lane < end ? row[v + lane] : -INFINITY;
  return load(part);
}

/* The largest x_v of row[first, end) (-inf: none finite). */
static float max_part(const float* row, int64_t first, int64_t end, float temperature) {
  vec16 best = splat(-INFINITY);
  const vec16 t = splat(temperature);
  for (int64_t v = first; v < end; v += LANES) best = vmax(scaled16(logits16(row, v, end), t), best);
  float found = -INFINITY;
  for (int lane = 0; lane < LANES; lane++) found = best[lane] > found ? best[lane] : found;
  return found;
}

/* Top-k, top-p and min-p. They keep a prefix of the row's tokens in rank order (x descending,
 * then the lower index first, where the torch code's sort breaks ties as it likes): top-k the
 * first k; top-p, of the distribution restricted by top-k, the ranks whose mass before them is
 * at most top_p (so at least the first); min-p the ranks whose weight exp(x - max) is at least
 * min_p, the largest's being 1. The kept prefix is the shortest of the three, described by its
 * last token (Cutoff): a token is kept where its order key is above the last one's, or equal
 * with an index at most the last one's. Ranks are found without sorting the row: a histogram
 * of the order keys' top 12 bits (counts and masses) is walked from the top, and only the
 * bucket a rank or mass falls in is put in order (a stable radix sort of the keys' other 20
 * bits, so equal keys keep index order; the last bucket sorted is kept for the next query of
 * the row). -inf tokens rank last and weigh nothing, so the kept prefix never reaches past the
 * row's finite tokens (which would only add tokens that cannot win). */

typedef uint32_t uvec16 __attribute__((vector_size(64)));

typedef struct {
  uint32_t key;
  int32_t index;
} Cutoff;

static const Cutoff KEEP_ALL = {0, INT32_MAX}; /* every key is above 0: -inf's is 0x007FFFFF */

#define BUCKET_BITS 12
#define NUM_BUCKETS (1 << BUCKET_BITS)

/* An order key of each x: larger x, larger key (as unsigned); x is never NaN here, and -0 is
 * taken as +0 (adding +0 turns -0 into +0), so that the two tie as equal floats do. */
static inline uvec16 order_keys(vec16 x) {
  x = x + splat(0.0f);
  const uvec16 bits = (uvec16)x, negative = (uvec16)((ivec16)bits >> 31);
  return bits ^ (negative | 0x80000000u);
}

#define DIGIT_BITS 10 /* the radix sort's digit: two passes over the 20 bits below a bucket's */
#define NUM_DIGITS (1 << DIGIT_BITS)

/* A thread's scratch for one row: its order keys and weights, the histogram, one bucket's
 * members in rank order (and which bucket that is: -1 none yet), a buffer for sorting them;
 * kept for the thread's next calls. */
typedef struct {
  uint32_t* keys;
  float* weights;
  int32_t* members;
  int32_t* spare;
  int32_t* counts;
  double* masses;
  int64_t vocab, sorted_bucket, num_members;
} Ranking;

static __thread Ranking thread_ranking;

static void free_ranking(Ranking* r) {
  free(r->keys), free(r->weights), free(r->members), free(r->spare), free(r->counts);
  free(r->masses);
  memset(r, 0, sizeof *r);
}

/* This thread's ranking scratch for rows of `vocab` tokens, or NULL when out of memory. */
static Ranking* ranking_for(int64_t vocab) {
  Ranking* r = &thread_ranking;
  if (r->vocab < vocab || r->counts == NULL) {
    free_ranking(r);
    r->keys = malloc((size_t)vocab * sizeof *r->keys);
    r->weights = malloc((size_t)vocab * sizeof *r->weights);
    r->members = malloc((size_t)vocab * sizeof *r->members);
    r->spare = malloc((size_t)vocab * sizeof *r->spare);
    r->counts = malloc(NUM_BUCKETS * sizeof *r->counts);
    r->masses = malloc(NUM_BUCKETS * sizeof *r->masses);
    r->vocab = vocab;
    if (!r->keys || !r->weights || !r->members || !r->spare || !r->counts || !r->masses) {
      free_ranking(r);
      return NULL;
    }
  }
  return r;
}

/* Bucket b's tokens into r->members in rank order (key descending, index ascending); their
 * number. Collected in index order, then a stable radix sort by the key's low 20 bits,
 * descending, in two passes of DIGIT_BITS; the bucket stays sorted for the row's next query. */
static int64_t bucket_members(Ranking* r, int64_t vocab, int64_t b) {
  if (r->sorted_bucket == b) return r->num_members;
  int64_t n = 0;
  for (int64_t v = 0; v < vocab; v++)
    if ((int64_t)(r->keys[v] >> (32 - BUCKET_BITS)) == b) r->members[n++] = (int32_t)v;
  for (int shift = 0; shift < 32 - BUCKET_BITS; shift += DIGIT_BITS) {
    int64_t starts[NUM_DIGITS + 1] = {0};
    for (int64_t i = 0; i < n; i++) /* digits counted descending: NUM_DIGITS - 1 - digit */
      starts[NUM_DIGITS - ((r->keys[r->members[i]] >> shift) & (NUM_DIGITS - 1))]++;
    for (int d = 1; d <= NUM_DIGITS; d++) starts[d] += starts[d - 1];
    for (int64_t i = 0; i < n; i++) {
      const int32_t v = r->members[i];
      r->spare[starts[NUM_DIGITS - 1 - ((r->keys[v] >> shift) & (NUM_DIGITS - 1))]++] = v;
    }
    int32_t* sorted = r->spare;
    r->spare = r->members;
    r->members = sorted;
  }
  r->sorted_bucket = b;
  r->num_members = n;
  return n;
}

/* The token at rank `rank` (< vocab) and the mass of the ranks before it. */
static int32_t at_rank(Ranking* r, int64_t vocab, int64_t rank, double* mass_before) {
  int64_t above = 0;
  double mass = 0.0;
  for (int64_t b = NUM_BUCKETS - 1; b >= 0; b--) {
    if (above + r->counts[b] > rank) {
      bucket_members(r, vocab, b);
      for (int64_t i = 0; i < rank - above; i++) mass += r->weights[r->members[i]];
      *mass_before = mass;
      return r->members[rank - above];
    }
    above += r->counts[b];
    mass += r->masses[b];
  }
  *mass_before = mass;
  return -1; /* (no such rank) */
}

/* The first rank whose mass before it is above `limit`; vocab if none is. */
static int64_t rank_past_mass(Ranking* r, int64_t vocab, double limit) {
  int64_t above = 0;
  double mass = 0.0;
  for (int64_t b = NUM_BUCKETS - 1; b >= 0; b--) {
    if (r->counts[b] == 0) continue;
    if (mass > limit) return above;
    if (mass + r->masses[b] <= limit) { /* the whole bucket's ranks are kept */
      above += r->counts[b];
      mass += r->masses[b];
      continue;
    }
    const int64_t n = bucket_members(r, vocab, b);
    for (int64_t i = 0; i < n; i++) {
      if (mass > limit) return above + i;
      mass += r->weights[r->members[i]];
    }
    above += n;
  }
  return above;
}

/* The last token that row's top-k, top-p and min-p keep (see above), given its largest x;
 * KEEP_ALL where none applies; `failed` set when out of memory. */
static Cutoff filter_cutoff(const float* row, int64_t vocab, float temperature, float top,
                            int64_t top_k, float top_p, float min_p, int* failed) {
  if (top_k < 1 || top_k > vocab) top_k = vocab; /* off */
  if (top_k == vocab && !(top_p < 1.0f) && !(min_p > 0.0f)) return KEEP_ALL;
  Ranking* r = ranking_for(vocab);
  if (r == NULL) {
#pragma omp atomic write
    *failed = 1;
    return KEEP_ALL;
  }
  memset(r->counts, 0, NUM_BUCKETS * sizeof *r->counts);
  memset(r->masses, 0, NUM_BUCKETS * sizeof *r->masses);
  r->sorted_bucket = -1;
  const vec16 t = splat(temperature), m = splat(top);
  int64_t above_min_p = 0, finite = 0;
  for (int64_t v = 0; v < vocab; v += LANES) {
    const int64_t lanes = vocab - v < LANES ? vocab - v : LANES;
    const vec16 x = scaled16(logits16(row, v, vocab), t);
    const vec16 weight = weights16(x, m);
    const uvec16 keys = order_keys(x);
    for (int lane = 0; lane < lanes; lane++) {
      const uint32_t bucket = keys[lane] >> (32 - BUCKET_BITS);
      r->keys[v + lane] = keys[lane];
      r->weights[v + lane] = weight[lane];
      r->counts[bucket]++;
      r->masses[bucket] += weight[lane];
      above_min_p += weight[lane] >= min_p;
      finite += x[lane] != -INFINITY;
    }
  }
  int64_t keep = top_k < finite ? top_k : finite; /* at least 1: the row's max is finite */
  double mass = 0.0;
  if (top_p < 1.0f) {
    if (keep < finite)
      at_rank(r, vocab, keep, &mass); /* the mass of the first `keep` ranks */
    else /* every finite token's (the others weigh nothing) */
      for (int64_t b = 0; b < NUM_BUCKETS; b++) mass += r->masses[b];
    const int64_t by_mass = rank_past_mass(r, vocab, (double)top_p * mass);
    keep = by_mass < keep ? by_mass : keep;
  }
  if (min_p > 0.0f && above_min_p < keep) keep = above_min_p;
  if (keep < 1) keep = 1; /* the first rank is always kept */
  double unused;
  const int32_t last = at_rank(r, vocab, keep - 1, &unused);
  return (Cutoff){r->keys[last], last};
}

/* The race's winner among row[first, end) given the row's largest x (finite): the largest
 * score, first index on ties; tokens whose x is -inf, or that the cutoff drops, never win. */
static Best race_part(const float* row, int64_t first, int64_t end, float temperature,
                      float top, uint64_t key, Cutoff cut) {
  const vec16 t = splat(temperature), m = splat(top);
  const uvec16 cut_key = (uvec16){0} + cut.key;
  const ivec16 cut_index = (ivec16){0} + cut.index;
  vec16 best = splat(-1.0f);
  ivec16 at = (ivec16){0} - 1, index = (ivec16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  index += (int32_t)first;
  for (int64_t v = first; v < end; v += LANES) {
    const vec16 x = scaled16(logits16(row, v, end), t);
    const uvec16 keys = order_keys(x);
    const ivec16 kept = (ivec16)(keys > cut_key) | ((ivec16)(keys == cut_key) & (index <= cut_index));
    const vec16 weight = blend(~kept, splat(0.0f), weights16(x, m));
    const vec16 score = weight / noise16(key, v);
    const ivec16 greater = score > best;
    best = blend(greater, score, best);
    at = (index & greater) | (at & ~greater);
    index += LANES;
  }
  Best found = {-1.0f, -1};
  for (int lane = 0; lane < LANES; lane++)
    if (at[lane] >= 0 && best[lane] > 0.0f) found = better(found, (Best){best[lane], at[lane]});
  return found;
}

/* tokens[r] for every row r of logits (num_rows, vocab): row r samples with temperatures[r]
 * (finite and positive: cpu_ops.sample_tokens checks), top_ks[r] (vocab or more: off),
 * top_ps[r] (1 or more: off), min_ps[r] (0: off) and noise key keys[r] where sampled[r], else
 * takes its greedy token (greedy_part). A sampled
 * row whose logits are all -inf or NaN gets -1; one whose x_v all came out -inf (finite logits
 * so negative that dividing by a tiny temperature overflows) takes its greedy token, the
 * race's limit as the temperature falls. A batch of fewer rows than threads splits each row
 * into parts whose bests are merged as the lanes' are, so a row's token does not depend on how
 * it was split. vocab < 2^31. Returns 0, or -1 when out of memory. */
int sy_sample_tokens(const float* logits, int64_t num_rows, int64_t vocab,
                     const float* temperatures, const int64_t* top_ks, const float* top_ps,
                     const float* min_ps, const int64_t* keys, const uint8_t* sampled,
                     int64_t* tokens) {
  if (num_rows <= 0) return 0;
  const int64_t threads = omp_get_max_threads();
  int64_t parts = num_rows >= threads ? 1 : (threads + num_rows - 1) / num_rows;
  const int64_t part_len = ((vocab + parts - 1) / parts + LANES - 1) / LANES * LANES;
  parts = (vocab + part_len - 1) / part_len;
  const int64_t units = num_rows * parts;
  Best* bests = malloc((size_t)units * sizeof(Best));
  float* tops = malloc((size_t)units * sizeof(float));
  Cutoff* cuts = malloc((size_t)num_rows * sizeof(Cutoff));
  if (bests == NULL || tops == NULL || cuts == NULL) {
    free(bests), free(tops), free(cuts);
    return -1;
  }
  int failed = 0;
#pragma omp parallel if (units > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; unit++) {
      const int64_t r = unit / parts, first = unit % parts * part_len;
      const int64_t end = first + part_len < vocab ? first + part_len : vocab;
      const float* row = logits + r * vocab;
      if (sampled[r]) {
        tops[unit] = max_part(row, first, end, temperatures[r]);
      } else {
        bests[unit] = greedy_part(row, first, end);
        tops[unit] = -INFINITY;
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < num_rows; r++) {
      float top = -INFINITY;
      for (int64_t p = 0; p < parts; p++) top = tops[r * parts + p] > top ? tops[r * parts + p] : top;
      tops[r * parts] = top;
      cuts[r] = sampled[r] && top != -INFINITY
                    ? filter_cutoff(logits + r * vocab, vocab, temperatures[r], top, top_ks[r],
                                    top_ps[r], min_ps[r], &failed)
                    : KEEP_ALL;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; unit++) {
      const int64_t r = unit / parts, first = unit % parts * part_len;
      const int64_t end = first + part_len < vocab ? first + part_len : vocab;
      const float top = tops[r * parts];
      if (!sampled[r]) continue; /* its greedy best is in */
      bests[unit] = top != -INFINITY ? race_part(logits + r * vocab, first, end, temperatures[r],
                                                 top, (uint64_t)keys[r], cuts[r])
                                     : greedy_part(logits + r * vocab, first, end);
    }
  }
  for (int64_t r = 0; r < num_rows; r++) {
    Best found = {-INFINITY, -1};
    for (int64_t p = 0; p < parts; p++) found = better(found, bests[r * parts + p]);
    tokens[r] = found.index;
  }
  free(bests), free(tops), free(cuts);
  return failed ? -1 : 0;
}

/* The fused layer stack ---------------------------------------------------------------------
 * Every decoder layer of a step in one call, so no Python runs between the kernels: at batch
 * 1 the wrappers, module calls and allocations between the nine kernels of a layer took a
 * quarter of a decode step, while the other thread waited. The matrix product is panel_gemm's
 * sy_panel_linear, passed in as a pointer (it is built as a library of its own). Each layer:
 *   normed = rms_norm(residual += x)          (the first layer: residual is the embeddings)
 *   q = rope(qkv = normed W_qkv), keys and values rotated into the cache
 *   x = attention(q) W_o;  normed = rms_norm(residual += x)
 *   x = silu_mul(normed W_gate_up) W_down
 * the same kernels in the same order as the layer modules call them, so the result is the
 * same to the bit. */

/* A linear layer's product (sy_panel_linear, sy_tile_linear): 0, or nonzero where it failed. */
typedef int (*LinearFn)(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                        const float* bias, float* y);

/* One decoder layer's weights (the linear layers' packed panels and biases, NULL for none)
 * and its KV cache. */
typedef struct {
  const float *input_norm, *post_norm;
  const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
  float *key_cache, *value_cache;
} LayerWeights;

/* x_out (num_tokens, hidden) = the last layer's output, residual (num_tokens, hidden; the
 * embeddings on entry) the residual stream before it, as the module loop leaves them. The step
 * (cos, sin, slots, block tables, starts) is as sy_rope_write_kv and sy_paged_attention take
 * it. Where keep is not NULL, only its num_kept rows (strictly increasing, each below
 * num_tokens) go on past the last layer's attention, and become rows 0 .. num_kept of x_out
 * and residual: the rows whose logits the step takes. The others' keys and values are in the
 * cache by then, and nothing else reads the rest of their last layer (a 512-token prompt chunk
 * skips ~3 % of its products). Returns 0, or -1 when out of memory or a product failed (x_out
 * and residual are then unset). */
int sy_decoder_layers(LinearFn linear, const LayerWeights* layers, int64_t num_layers,
                      int64_t num_tokens, int64_t hidden, int64_t inner, float eps,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const float* cos, const float* sin, const int64_t* slots,
                      const int64_t* block_tables, int64_t max_blocks,
                      const int64_t* query_starts, const int64_t* context_starts,
                      int64_t num_requests, int64_t block_size, float scale,
                      int64_t num_threads, const int64_t* keep, int64_t num_kept,
                      float* residual, float* x_out) {
  if (num_tokens == 0) return 0; /* nothing to compute (and malloc(0) may return NULL) */
  const int64_t heads_width = num_heads * head_dim;
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
  const size_t row = sizeof(float) * (size_t)num_tokens;
  float* normed = malloc(row * (size_t)hidden);
  float* qkv = malloc(row * (size_t)qkv_width);
  float* q = malloc(row * (size_t)heads_width);
  float* attended = malloc(row * (size_t)heads_width);
  float* gate_up = malloc(row * 2 * (size_t)inner);
  float* activated = malloc(row * (size_t)inner);
  int status = -1;
  Plan plan = {0}; /* the attention's tasks, the same for every layer */
  const int64_t parts =
      lone_decode_parts(query_starts, context_starts, num_requests, num_heads, num_threads);
  const int into_l1 = next_chunk_into_l1(num_kv_heads, head_dim);
  if (!normed || !qkv || !q || !attended || !gate_up || !activated) goto done;
  const Cache shape = {NULL, NULL, block_size, num_heads, num_kv_heads, head_dim, scale, 0};
  if (parts == 1 && plan_step(&shape, block_tables, max_blocks, query_starts, context_starts,
                              num_requests, num_threads, &plan) != 0)
    goto done;
  for (int64_t l = 0; l < num_layers; l++) {
    const LayerWeights* w = &layers[l];
    sy_add_rms_norm(l == 0 ? NULL : x_out, residual, w->input_norm, num_tokens, hidden, eps,
                    normed);
    if (linear(normed, num_tokens, hidden, w->qkv, qkv_width, w->qkv_bias, qkv) != 0) goto done;
    sy_rope_write_kv(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, sin, slots,
                     w->key_cache, w->value_cache, q);
    const Cache c = {w->key_cache, w->value_cache, block_size, num_heads, num_kv_heads,
                     head_dim, scale, into_l1};
    if (parts > 1) {
      if (split_decode(&c, q, block_tables, context_starts[0], parts, attended) != 0) goto done;
    } else {
      attend_planned(&c, &plan, q, block_tables, max_blocks, query_starts, context_starts,
                     attended);
    }
    int64_t rows = num_tokens;
    if (keep && l == num_layers - 1) { /* the kept rows, moved to the front in order */
      for (int64_t i = 0; i < num_kept; i++) {
        memmove(attended + i * heads_width, attended + keep[i] * heads_width,
                sizeof(float) * (size_t)heads_width);
        memmove(residual + i * hidden, residual + keep[i] * hidden, sizeof(float) * (size_t)hidden);
      }
      rows = num_kept;
      if (rows == 0) break; /* no row's logits this step */
    }
    if (linear(attended, rows, heads_width, w->o, hidden, w->o_bias, x_out) != 0) goto done;
    sy_add_rms_norm(x_out, residual, w->post_norm, rows, hidden, eps, normed);
    if (linear(normed, rows, hidden, w->gate_up, 2 * inner, w->gate_up_bias, gate_up) != 0)
      goto done;
    sy_silu_mul(gate_up, rows, inner, activated);
    if (linear(activated, rows, inner, w->down, hidden, w->down_bias, x_out) != 0) goto done;
  }
  status = 0;
done:
  free_plan(&plan);
  free(normed);
  free(qkv);
  free(q);
  free(attended);
  free(gate_up);
  free(activated);
  return status;
}
