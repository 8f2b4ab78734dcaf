/* Switchyard's CPU matrix product at "high" float32 precision, on Intel's tile unit (AMX).
 *
 * torch.set_float32_matmul_precision("high") lets float32 products "treat each float32 number as
 * the sum of two bfloat16 numbers". Here each value v becomes hi = bf16(v) and lo = bf16(v - hi),
 * 16 of float32's 24 significand bits, and
 *
 *     x . w  =  x_hi . w_hi  +  x_hi . w_lo  +  x_lo . w_hi        (x_lo . w_lo and the rest of
 *                                                                   each value, ~2^-16, dropped)
 *
 * summed in float32 by the tile unit's bfloat16 dot products (TDPBF16PS: 16 x 16 outputs, 32
 * multiply-adds deep, sixteen times the vector unit's multiply-adds per cycle). Three products
 * for one still leave about five times the arithmetic rate of float32 multiply-adds on paper
 * (measured: 1.3-1.5 times panel_gemm.c for 64 and 512 rows): prefills and large batches, which
 * float32 arithmetic bounds, run faster; the results carry a relative error of ~5e-6 instead of
 * ~1e-6 (the float32 kernel's, from summation order).
 *
 * The weight W (n, k) is split once, when it is packed (sy_tile_pack): per panel of 32 outputs,
 * per step of 32 input features, the hi then the lo tile of each 16-output half, a tile being 16
 * rows of 16 pairs (w[2j][o], w[2j + 1][o]) as TDPBF16PS reads them: 4 bytes per weight, as
 * float32. Each product splits its input rows into blocks of 16 ([block][step][hi, lo][16][32]
 * bf16), then every panel multiplies every block, in chunks of CHUNK_STEPS steps that each block
 * multiplies while the chunk is in L1 (one block streams the panel from memory instead). A block
 * is one row block x one panel in four accumulator tiles, its three products always in the same
 * order, so a row's result does not depend on how many rows share the product: the same tokens
 * whether a request runs alone or in a batch, as with the float32 kernel. (Two blocks sharing
 * each weight tile measured 10-15 % faster for large products but leave no tile to sum x_lo .
 * w_hi apart: a lone block would then wait on one chain of dependent sums, or sum in another
 * order than blocks in pairs.) A product of fewer than 16 rows (decode steps) configures tiles
 * of that many rows, whose dot products take time in proportion: the same sums, and the weights
 * streamed at about the float32 kernel's rate.
 *
 * Built where the compiler targets a CPU with AMX-BF16 (-march=native on Sapphire Rapids and
 * later); elsewhere sy_tile_available() is 0 and the worker keeps the float32 kernel. Linux lends
 * a process the tile registers on request (arch_prctl ARCH_REQ_XCOMP_PERM), once. The greedy
 * head (below) also runs where the CPU has AVX512-BF16 but no tiles (AMD Zen 4 and later): its
 * estimates then come from the vector unit's bfloat16 dot products (VDPBF16PS, twice its float32
 * multiply-adds a cycle), from the same tiles in memory; sy_greedy_available() says where.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512BF16__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0 /* the greedy head on the vector unit; no tile product */
#endif
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 32      /* outputs per panel, as panel_gemm.c */
#define TILE_ROWS 16  /* rows of an input or accumulator tile; input pairs of a weight tile */
#define TILE_K 32     /* input features per step */
#define TILE_ELEMS (TILE_ROWS * TILE_K) /* bf16 per tile: 1 KB */
#define STEP_ELEMS (4 * TILE_ELEMS)     /* a panel's step: hi and lo of both halves */
#define CHUNK_STEPS 4 /* steps of a panel (16 KB) every row block multiplies while in L1 */
#define PASS_BYTES (1 << 20) /* split input rows of one pass (4 B per feature), kept in L2 */
#define MAX_PASS_ROWS 256

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} TileConfig;

#if HAVE_TILES
int sy_tile_available(void) {
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                     18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

/* Tiles 0-3: `rows` x 16 float32 accumulators; 4-5: `rows` input rows; 6-7: weight tiles (16
 * pairs of inputs). */
static void configure_tiles(int rows) {
  TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = t < 6 ? rows : TILE_ROWS;
    config.bytes_per_row[t] = 64;
  }
  /* GCC does not see ldtilecfg read the struct and drops the memset of tiles 8-15, whose
   * garbage then faults: make the stores happen first. */
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#else
int sy_tile_available(void) { return 0; }
#endif

/* hi bfloat16 of 32 floats (v0 then v1). */
static inline __m512i hi32(__m512 v0, __m512 v1) {
  return (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
}

/* hi and lo bfloat16 of 32 floats (v0 then v1): lo holds what rounding to hi lost. */
static inline void split32(__m512 v0, __m512 v1, __m512i* hi, __m512i* lo) {
  const __m512i h = hi32(v0, v1);
  const __m512 h0 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 h1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  *hi = h;
  *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0));
}

/* 16 floats at p, zeros past `valid` of them. */
static inline __m512 load_part(const float* p, int64_t valid) {
  if (valid >= 16) return _mm512_loadu_ps(p);
  if (valid <= 0) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps((__mmask16)((1u << valid) - 1), p);
}

/* Row j of a weight tile of step s, outputs 16 half .. 16 half + 15, of a panel (k, 32 floats,
 * as panel_gemm packs it): the pairs (w[2j][o], w[2j + 1][o]) of its 16 outputs as 32 floats
 * (zeros past k), in v0 (outputs 0-7) and v1 (8-15). */
static inline void weight_pairs(const float* panel, int64_t k, int64_t s, int half, int j,
                                __m512* v0, __m512* v1) {
  const __m512i low_pairs =
      _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high_pairs =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const int64_t i = s * TILE_K + 2 * j;
  const __m512 w0 = i < k ? _mm512_loadu_ps(panel + i * PANEL + 16 * half) : _mm512_setzero_ps();
  const __m512 w1 =
      i + 1 < k ? _mm512_loadu_ps(panel + (i + 1) * PANEL + 16 * half) : _mm512_setzero_ps();
  *v0 = _mm512_permutex2var_ps(w0, low_pairs, w1);
  *v1 = _mm512_permutex2var_ps(w0, high_pairs, w1);
}

/* Panel p (k, 32 floats, as panel_gemm packs it) in tile form at `tiles`. */
static void pack_panel(const float* panel, int64_t k, int64_t steps, uint16_t* tiles) {
  for (int64_t s = 0; s < steps; s++) {
    for (int half = 0; half < 2; half++) {
      for (int j = 0; j < TILE_ROWS; j++) {
        __m512 v0, v1;
        __m512i hi, lo;
        weight_pairs(panel, k, s, half, j, &v0, &v1);
        split32(v0, v1, &hi, &lo);
        uint16_t* row = tiles + s * STEP_ELEMS + half * TILE_ELEMS + j * TILE_K;
        _mm512_storeu_si512(row, hi);
        _mm512_storeu_si512(row + 2 * TILE_ELEMS, lo);
      }
    }
  }
}

/* Tile form of a weight packed in panels (ceil(n / 32), k, 32): ceil(n / 32) x ceil(k / 32) x
 * 4 KB at `tiles`. */
void sy_tile_pack(const float* panels, int64_t k, int64_t n, uint16_t* tiles) {
  const int64_t steps = (k + TILE_K - 1) / TILE_K;
  const int64_t num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < num_panels; p++)
    pack_panel(panels + p * k * PANEL, k, steps, tiles + p * steps * STEP_ELEMS);
}

#if HAVE_TILES
/* Input rows 16 block .. 16 block + 15 of x (zero past m) at their place in a. */
static void split_block(const float* x, int64_t m, int64_t k, int64_t steps, int64_t block,
                        uint16_t* a) {
  uint16_t* out = a + block * steps * 2 * TILE_ELEMS;
  for (int r = 0; r < TILE_ROWS; r++) {
    const int64_t row = block * TILE_ROWS + r;
    for (int64_t s = 0; s < steps; s++) {
      __m512i hi = _mm512_setzero_si512(), lo = hi;
      if (row < m) {
        const float* p = x + row * k + s * TILE_K;
        const int64_t valid = k - s * TILE_K;
        split32(load_part(p, valid), load_part(p + 16, valid - 16), &hi, &lo);
      }
      _mm512_storeu_si512(out + 2 * s * TILE_ELEMS + r * TILE_K, hi);
      _mm512_storeu_si512(out + (2 * s + 1) * TILE_ELEMS + r * TILE_K, lo);
    }
  }
}

/* Request all 64 cache lines of a step of the weights from memory at once, before its tile
 * loads ask for them 16 at a time: more reads in flight (measured: one row's product reads
 * the weights up to twice as fast; fetching steps further ahead did not help). Always inlined,
 * as every helper made of prefetches alone: GCC takes such a function for "const" (a prefetch
 * has no effect it models) and drops a call to it that it has not inlined yet. */
static inline __attribute__((always_inline)) void fetch_step(const uint16_t* ws) {
  for (int i = 0; i < STEP_ELEMS * (int)sizeof(uint16_t); i += 64)
    _mm_prefetch((const char*)ws + i, _MM_HINT_T0);
}

/* One step's three products for a row block (x: its hi tile, then its lo tile): x_hi . w_hi
 * then x_hi . w_lo into accumulator tiles 0 (outputs 0-15) and 1 (16-31), x_lo . w_hi into
 * tiles 2 and 3, so four independent chains of sums overlap the tile unit's latency. Every
 * path takes them in this order. */
static inline __attribute__((always_inline)) void step_products(const uint16_t* x,
                                                                const uint16_t* ws) {
  _tile_loadd(4, x, 64);              /* x hi */
  _tile_loadd(5, x + TILE_ELEMS, 64); /* x lo */
  _tile_loadd(6, ws, 64);             /* w hi, outputs 0-15 */
  _tile_loadd(7, ws + TILE_ELEMS, 64); /* w hi, outputs 16-31 */
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
  _tile_loadd(6, ws + 2 * TILE_ELEMS, 64); /* w lo */
  _tile_loadd(7, ws + 3 * TILE_ELEMS, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
}

/* acc = the row blocks of a times one panel in tile form. acc holds, per block, 16 rows x 32
 * outputs of x_hi . w_hi + x_hi . w_lo sums, then 16 x 32 of x_lo . w_hi sums (added with the
 * bias when copied out). A product of more than one block goes in chunks of `chunk` steps that
 * every block multiplies while the chunk is in L1, its accumulator tiles stored to acc between
 * chunks. Every row's sums are taken in the same order whatever the number of rows, so a row's
 * result does not depend on the others in the product (as in panel_gemm.c). */
static void panel_product(const uint16_t* a, const uint16_t* w, int64_t steps, int64_t blocks,
                          int64_t chunk, int fetch, float* acc) {
  const int stride = PANEL * sizeof(float);
  for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
    const int64_t s1 = s0 + chunk < steps ? s0 + chunk : steps;
    for (int64_t block = 0; block < blocks; block++) {
      const uint16_t* x = a + block * steps * 2 * TILE_ELEMS;
      float* high = acc + block * 2 * TILE_ROWS * PANEL; /* hi . hi + hi . lo */
      float* low = high + TILE_ROWS * PANEL;                /* lo . hi */
      if (s0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, high, stride);
        _tile_loadd(1, high + 16, stride);
        _tile_loadd(2, low, stride);
        _tile_loadd(3, low + 16, stride);
      }
      for (int64_t s = s0; s < s1; s++) {
        if (fetch) fetch_step(w + s * STEP_ELEMS);
        step_products(x + 2 * s * TILE_ELEMS, w + s * STEP_ELEMS);
      }
      _tile_stored(0, high, stride);
      _tile_stored(1, high + 16, stride);
      _tile_stored(2, low, stride);
      _tile_stored(3, low + 16, stride);
    }
  }
}

#endif /* HAVE_TILES */

/* A buffer of the calling thread, kept for its next calls (no fresh pages to fault in). */
typedef struct {
  void* data;
  size_t size;
} Kept;

/* `kept` grown to at least `bytes`; NULL when out of memory (the call then fails, and the next
 * one tries again). */
static void* grown(Kept* kept, size_t bytes) {
  if (kept->size < bytes) {
    free(kept->data);
    bytes = (bytes + 4095) & ~(size_t)4095;
    kept->data = aligned_alloc(64, bytes);
    kept->size = kept->data == NULL ? 0 : bytes;
  }
  return kept->data;
}

/* The calling thread's buffer for split inputs (at most a few MB). */
static uint16_t* input_buffer(size_t bytes) {
  static __thread Kept inputs;
  return grown(&inputs, bytes);
}

#if HAVE_TILES
/* Rows [0, m) of y (m <= MAX_PASS_ROWS), their inputs split into a. */
static void tile_pass(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                      const float* bias, float* y, uint16_t* a) {
  const int64_t steps = (k + TILE_K - 1) / TILE_K;
  const int64_t blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t num_panels = (n + PANEL - 1) / PANEL;
  const int64_t chunk = blocks > 1 ? CHUNK_STEPS : steps; /* one block: nothing to reuse */
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) split_block(x, m, k, steps, block, a);
    /* the implicit barrier: every row block is split */
    float acc[2 * MAX_PASS_ROWS * PANEL] __attribute__((aligned(64))); /* 64 KB */
    /* A product of fewer than 16 rows (decodes) multiplies only those: the tile unit's time
     * goes with the rows, and each row's sums are the same whatever the tile's height. */
    configure_tiles(m < TILE_ROWS ? (int)m : TILE_ROWS);
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < num_panels; p++) {
      const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
      float panel_bias[PANEL] __attribute__((aligned(64))) = {0};
      if (bias) memcpy(panel_bias, bias + p * PANEL, (size_t)cols * sizeof(float));
      const uint16_t* w = tiles + p * steps * STEP_ELEMS;
      /* one block streams the weights from memory; more reuse a chunk from L1 */
      panel_product(a, w, steps, blocks, chunk, blocks == 1, acc);
      const __m512 b0 = _mm512_load_ps(panel_bias), b1 = _mm512_load_ps(panel_bias + 16);
      for (int64_t r = 0; r < m; r++) { /* (high + low) + bias */
        float* high = acc + (r / TILE_ROWS * 2 * TILE_ROWS + r % TILE_ROWS) * PANEL;
        const float* low = high + TILE_ROWS * PANEL;
        _mm512_store_ps(high, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(high),
                                                          _mm512_load_ps(low)), b0));
        _mm512_store_ps(high + 16, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(high + 16),
                                                               _mm512_load_ps(low + 16)), b1));
        memcpy(y + r * n + p * PANEL, high, (size_t)cols * sizeof(float));
      }
    }
    _tile_release();
  }
}

/* y (m, n) = x (m, k) W^T + bias (n, or NULL), W in tile form (sy_tile_pack); all row-major,
 * contiguous. In passes of as many rows as PASS_BYTES of split inputs hold. Returns 0, -1 when
 * out of memory, -2 where this process may not use the tile registers (callers check
 * tile_gemm.available first); y is then unset. k = 0 (no inputs) gives the bias, or zeros. */
int sy_tile_linear(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                   const float* bias, float* y) {
  if (k <= 0) { /* no split inputs to hold: a pass's row count would divide by zero */
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) y[r * n + c] = bias != NULL ? bias[c] : 0.0f;
    return 0;
  }
  const int64_t steps = (k + TILE_K - 1) / TILE_K;
  const int64_t row_bytes = steps * 2 * TILE_K * sizeof(uint16_t);
  int64_t pass_rows = PASS_BYTES / row_bytes / (2 * TILE_ROWS) * (2 * TILE_ROWS);
  pass_rows = pass_rows < 2 * TILE_ROWS   ? 2 * TILE_ROWS
              : pass_rows > MAX_PASS_ROWS ? MAX_PASS_ROWS
                                          : pass_rows;
  const int64_t rows = m < pass_rows ? m : pass_rows;
  if (!sy_tile_available()) return -2;
  uint16_t* a = input_buffer((size_t)((rows + TILE_ROWS - 1) / TILE_ROWS) * TILE_ROWS * row_bytes);
  if (a == NULL) return -1;
  for (int64_t start = 0; start < m; start += pass_rows) {
    const int64_t pass = m - start < pass_rows ? m - start : pass_rows;
    tile_pass(x + start * k, pass, k, tiles, n, bias, y + start * n, a);
  }
  return 0;
}
#else
int sy_tile_linear(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                   const float* bias, float* y) {
  (void)x, (void)m, (void)k, (void)tiles, (void)n, (void)bias, (void)y;
  return -2; /* no tiles: tile_gemm.available() is False and nothing calls it */
}
#endif

/* Greedy tokens from bfloat16 estimates ---------------------------------------------------
 * A greedy request needs the index of its largest logit, not 49,152 logits. The LM head's
 * weight is kept a second time as bfloat16 tiles (sy_tile_pack_hi: 2 bytes a weight), the rows
 * are rounded to bfloat16 too, and one tile product estimates every logit: half the float32
 * kernel's read and a small part of its arithmetic. With x~, w~ the rounded row and weight row
 * and dx = x - x~, dw = w - w~ what rounding lost,
 *
 *     x . w  =  x~ . w~  +  x~ . dw  +  dx . w~  +  dx . dw,
 *
 * so by Cauchy-Schwarz the estimate is within |x~| |dw| + |dx| |w~| + |dx| |dw| (2-norms; |w~|
 * and |dw| of every weight row computed once) of x . w, and each float32 sum, the estimate's
 * and the float32 kernel's, within (k + 2) 2^-24 of the sum of |products| of x . w. A token
 * whose estimate plus its bound is below another's estimate minus that one's bound (the row's
 * floor) cannot have the largest logit. Each panel's estimates are screened as they leave the
 * tile unit, while in L1: a row keeps its floor and, per panel, the largest estimate + bound
 * (the panel's ceiling), never the m x n estimates themselves. The panels whose ceiling reaches
 * the floor (those holding the few tokens left: a median of 3 a row for SmolLM2) are computed
 * exactly, each logit summed as panel_gemm.c sums it (from 0, features 0, 1, ... by fused
 * multiply-adds), and the largest wins, ties to the lower index: the token that the float32
 * logits give. */

#define HI_STEP_ELEMS (2 * TILE_ELEMS) /* a panel's step in hi-only form: both halves */
#define FETCH_AHEAD 2 /* steps (2 KB each) the vector unit's estimates fetch ahead into L1 */
#define FETCH_FAR 16  /* and into L2 */

/* The weight packed in panels (ceil(n / 32), k, 32) as bfloat16 tiles: per panel, per step of
 * 32 input features, the tiles of outputs 0-15 and 16-31 (ceil(n / 32) x ceil(k / 32) x 2 KB).
 */
void sy_tile_pack_hi(const float* panels, int64_t k, int64_t n, uint16_t* tiles) {
  const int64_t steps = (k + TILE_K - 1) / TILE_K;
  const int64_t num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < num_panels; p++)
    for (int64_t s = 0; s < steps; s++)
      for (int half = 0; half < 2; half++)
        for (int j = 0; j < TILE_ROWS; j++) {
          __m512 v0, v1;
          weight_pairs(panels + p * k * PANEL, k, s, half, j, &v0, &v1);
          _mm512_storeu_si512(
              tiles + (p * steps + s) * HI_STEP_ELEMS + half * TILE_ELEMS + j * TILE_K,
              hi32(v0, v1));
        }
}

/* The calling thread's buffer for a greedy call's screening state (see below). */
static float* screen_buffer(size_t bytes) {
  static __thread Kept screens;
  return grown(&screens, bytes);
}

/* Rows 16 block .. 16 block + 15 of x rounded to bfloat16 (zero past m), as tiles per step at
 * a; norms[2 r], norms[2 r + 1] = |x~_r|, |dx_r| for those rows (inf where x_r is not finite). */
static void split_hi_block(const float* x, int64_t m, int64_t k, int64_t steps, int64_t block,
                           uint16_t* a, float* norms) {
  uint16_t* out = a + block * steps * TILE_ELEMS;
  for (int r = 0; r < TILE_ROWS; r++) {
    const int64_t row = block * TILE_ROWS + r;
    double rounded = 0.0, lost = 0.0;
    for (int64_t s = 0; s < steps; s++) {
      __m512i hi = _mm512_setzero_si512();
      if (row < m) {
        const float* p = x + row * k + s * TILE_K;
        const int64_t valid = k - s * TILE_K;
        const __m512 v0 = load_part(p, valid), v1 = load_part(p + 16, valid - 16);
        hi = hi32(v0, v1);
        float h[32], v[32];
        _mm512_storeu_ps(h, _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16)));
        _mm512_storeu_ps(h + 16, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16)));
        _mm512_storeu_ps(v, v0);
        _mm512_storeu_ps(v + 16, v1);
        for (int i = 0; i < 32; i++) {
          rounded += (double)h[i] * h[i];
          lost += ((double)v[i] - h[i]) * ((double)v[i] - h[i]);
        }
      }
      _mm512_storeu_si512(out + s * TILE_ELEMS + r * TILE_K, hi);
    }
    if (row < m) {
      const int finite = isfinite(rounded) && isfinite(lost);
      norms[2 * row] = finite ? (float)sqrt(rounded) : INFINITY;
      norms[2 * row + 1] = finite ? (float)sqrt(lost) : INFINITY;
    }
  }
}

/* The bound of 16 estimates e (weight norms |w~| w_hi, |dw| w_lo): the terms above in float32,
 * then a margin for their own rounding, |e| 2^-22 for the rounding of e +- bound, and
 * 1e-30 (1 + |x~| + |w~|) for the tile unit counting bfloat16 values below 2^-126 as zero
 * (and for the weight norms, which torch's rounding took without flushing them). */
static inline __m512 bounds16(__m512 e, __m512 w_hi, __m512 w_lo, __m512 a_hi, __m512 a_lo,
                              __m512 rounded) {
  const __m512 terms = _mm512_fmadd_ps(a_hi, w_hi, _mm512_mul_ps(a_lo, w_lo));
  const __m512 tiny = _mm512_mul_ps(_mm512_set1_ps(1e-30f),
                                    _mm512_add_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), rounded),
                                                  w_hi));
  return _mm512_add_ps(
      _mm512_fmadd_ps(terms, _mm512_set1_ps(1.0f + 0x1p-10f),
                      _mm512_mul_ps(_mm512_abs_ps(e), _mm512_set1_ps(0x1p-22f))),
      tiny);
}

/* Where a greedy call keeps what the screening of each row has found so far: per thread, each
 * row's running floor (the largest estimate - bound among its tokens seen, lane by lane) and
 * whether a value it met refuses the row; per row and panel, the largest estimate + bound of
 * the panel's tokens (its candidates' ceiling). */
typedef struct {
  float* floors;       /* [thread][row][16] */
  uint8_t* refused;    /* [thread][row] */
  float* ceilings;     /* [row][panel] */
  int64_t num_panels;
} Screen;

/* Fetch a panel's step from memory at once (32 cache lines), before its loads ask for them:
 * the first row block reads the panel from memory, the others from L1. Always inlined (see
 * fetch_step: GCC 12 for Zen 4 dropped every call to it). */
static inline __attribute__((always_inline)) void fetch_hi_step(const uint16_t* ws) {
  for (int i = 0; i < HI_STEP_ELEMS * (int)sizeof(uint16_t); i += 64)
    _mm_prefetch((const char*)ws + i, _MM_HINT_T0);
}

#if HAVE_TILES
/* part (16 x 32) = estimates x~_r . w~ of a row block (at a, tiles per step) against panel w,
 * on the tile unit (its rows configured by the caller); rows past `rows` are the block's
 * zero rows. */
static void estimate_block(const uint16_t* a, const uint16_t* w, int64_t steps, int64_t rows,
                           int fetch, float* part) {
  (void)rows;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < steps; s++) {
    const uint16_t* ws = w + s * HI_STEP_ELEMS;
    if (fetch) fetch_hi_step(ws);
    _tile_loadd(4, a + s * TILE_ELEMS, 64);
    _tile_loadd(6, ws, 64);
    _tile_loadd(7, ws + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, part, PANEL * sizeof(float));
  _tile_stored(1, part + 16, PANEL * sizeof(float));
}
#else
/* Rows [r0, r0 + R) of part: the vector unit's bfloat16 dot products (VDPBF16PS: each lane of
 * a weight tile's row holds one output's pair of inputs, as TDPBF16PS reads it; the row's pair
 * broadcast), R rows x 2 halves x C chains of accumulators in registers: a few rows split their
 * sums over chains (pair j into chain j mod C) so that the dot products' latency overlaps. */
static inline __attribute__((always_inline)) void estimate_rows(const uint16_t* a,
                                                                const uint16_t* w, int64_t steps,
                                                                int r0, int R, int C, int fetch,
                                                                float* part) {
  __m512 acc[8][2][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) acc[r][0][c] = acc[r][1][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; s++) {
    const uint16_t* ws = w + s * HI_STEP_ELEMS;
    const uint16_t* xs = a + s * TILE_ELEMS + r0 * TILE_K;
    if (fetch) { /* into L1 a few steps ahead, into L2 32 KB ahead; past the end: dropped */
      fetch_hi_step(ws + FETCH_AHEAD * HI_STEP_ELEMS);
      for (int i = 0; i < HI_STEP_ELEMS * (int)sizeof(uint16_t); i += 64)
        _mm_prefetch((const char*)(ws + FETCH_FAR * HI_STEP_ELEMS) + i, _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int j = 0; j < TILE_ROWS; j++) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(ws + j * TILE_K);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(ws + TILE_ELEMS + j * TILE_K);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        int32_t pair;
        memcpy(&pair, xs + r * TILE_K + 2 * j, sizeof pair);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0][j % C] = _mm512_dpbf16_ps(acc[r][0][j % C], x, w0);
        acc[r][1][j % C] = _mm512_dpbf16_ps(acc[r][1][j % C], x, w1);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
    for (int c = 1; c < C; c++) {
      acc[r][0][0] = _mm512_add_ps(acc[r][0][0], acc[r][0][c]);
      acc[r][1][0] = _mm512_add_ps(acc[r][1][0], acc[r][1][c]);
    }
    _mm512_store_ps(part + (r0 + r) * PANEL, acc[r][0][0]);
    _mm512_store_ps(part + (r0 + r) * PANEL + 16, acc[r][1][0]);
  }
}

/* part = estimates of the block's first `rows` rows against panel w, on the vector unit: 8 rows
 * at a time (16 accumulators), then the rest. */
static void estimate_block(const uint16_t* a, const uint16_t* w, int64_t steps, int64_t rows,
                           int fetch, float* part) {
  int r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8, fetch = 0) estimate_rows(a, w, steps, r0, 8, 1, fetch, part);
  switch (rows - r0) {
    case 7: estimate_rows(a, w, steps, r0, 7, 1, fetch, part); break;
    case 6: estimate_rows(a, w, steps, r0, 6, 1, fetch, part); break;
    case 5: estimate_rows(a, w, steps, r0, 5, 1, fetch, part); break;
    case 4: estimate_rows(a, w, steps, r0, 4, 1, fetch, part); break;
    case 3: estimate_rows(a, w, steps, r0, 3, 2, fetch, part); break;
    case 2: estimate_rows(a, w, steps, r0, 2, 2, fetch, part); break;
    case 1: estimate_rows(a, w, steps, r0, 1, 2, fetch, part); break;
    default: break;
  }
}
#endif

/* Panel p's estimates x~_r . w~ of every row r < m (all blocks, estimate_block), each block's
 * screened while in L1 (see above): its tokens below n_valid fold into the rows' floors in
 * `floors` (this thread's, m x 16) and refusals in `refused`, and each row's largest estimate +
 * bound over the panel goes to the screen's ceilings. A row is refused where an estimate is not
 * finite, a bound is NaN, or |x| |w_j| reaches 1e37 (a float32 sum might overflow; the bounds
 * assume none does). */
static void screen_panel(const uint16_t* a, const uint16_t* w, int64_t m, int64_t k,
                         int64_t steps, int64_t n_valid, int64_t p, const float* norms,
                         const float* weight_norms, float* floors, uint8_t* refused,
                         const Screen* screen) {
  const int64_t blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
  /* the panel's columns below n_valid, as the masks of its two halves */
  const int64_t first = p * PANEL;
  const float *norms_hi = weight_norms, *norms_lo = weight_norms + (n_valid + 15) / 16 * 16;
  __mmask16 valid[2];
  __m512 w_hi[2], w_lo[2];
  for (int h = 0; h < 2; h++) {
    const int64_t left = n_valid - first - 16 * h;
    valid[h] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    w_hi[h] = _mm512_maskz_loadu_ps(valid[h], norms_hi + first + 16 * h);
    w_lo[h] = _mm512_maskz_loadu_ps(valid[h], norms_lo + first + 16 * h);
  }
  const float g = (float)(k + 2) * 0x1p-24f * 1.01f;
  const __m512 zero = _mm512_setzero_ps(), large = _mm512_set1_ps(1e37f);
  float part[TILE_ROWS * PANEL] __attribute__((aligned(64)));
  for (int64_t block = 0; block < blocks; block++) {
    const int64_t rows = m - block * TILE_ROWS < TILE_ROWS ? m - block * TILE_ROWS : TILE_ROWS;
    estimate_block(a + block * steps * TILE_ELEMS, w, steps, rows, block == 0, part);
    for (int64_t r = 0; r < rows; r++) {
      const int64_t row = block * TILE_ROWS + r;
      /* bound_j = |w~_j| (B + g (2A + B)) + |dw_j| (A + B + g (A + B)), A = |x~|, B = |dx|, g
       * the float32 rounding of a sum of k products, (k + 2) 2^-24 */
      const float rounded = norms[2 * row], lost = norms[2 * row + 1];
      const __m512 a_hi = _mm512_set1_ps(lost + g * (2 * rounded + lost));
      const __m512 a_lo = _mm512_set1_ps(rounded + lost + g * (rounded + lost));
      const __m512 x_norm = _mm512_set1_ps(rounded), x_whole = _mm512_set1_ps(rounded + lost);
      __m512 floor = _mm512_load_ps(floors + row * 16);
      __m512 ceiling = _mm512_set1_ps(-INFINITY);
      __mmask16 refuse = 0;
      for (int h = 0; h < 2; h++) {
        const __m512 e = _mm512_maskz_loadu_ps(valid[h], part + r * PANEL + 16 * h);
        const __m512 bound = bounds16(e, w_hi[h], w_lo[h], a_hi, a_lo, x_norm);
        const __m512 low = _mm512_sub_ps(e, bound), high = _mm512_add_ps(e, bound);
        refuse |= _mm512_mask_cmp_ps_mask(valid[h], _mm512_sub_ps(e, e), zero, _CMP_NEQ_UQ);
        refuse |= _mm512_mask_cmp_ps_mask(
            valid[h], _mm512_mul_ps(x_whole, _mm512_add_ps(w_hi[h], w_lo[h])), large, _CMP_NLT_UQ);
        refuse |= _mm512_mask_cmp_ps_mask(valid[h], low, high, _CMP_UNORD_Q);
        floor = _mm512_mask_max_ps(floor, valid[h], floor, low);
        ceiling = _mm512_mask_max_ps(ceiling, valid[h], ceiling, high);
      }
      _mm512_store_ps(floors + row * 16, floor);
      refused[row] |= refuse != 0;
      screen->ceilings[row * screen->num_panels + p] = _mm512_reduce_max_ps(ceiling);
    }
  }
}

/* Row r's token: every panel whose ceiling reaches the row's floor has its tokens below n_valid
 * computed exactly, each summed as panel_gemm.c sums it (from 0, features 0, 1, ... by fused
 * multiply-adds, here sixteen lanes at once), and the largest wins, ties to the lower index.
 * A token left out has logit <= its estimate + bound < floor <= the logit of the token whose
 * estimate - bound is the floor, which is in; one taken beside the candidates is below the
 * floor too, so it neither wins nor ties. -2 where a logit computed exactly is not finite. */
static int64_t chosen_token(const float* x, int64_t k, const float* ceilings, int64_t num_panels,
                            float floor, int64_t n_valid, const float* panels) {
  float best = -INFINITY;
  int64_t token = -1;
  for (int64_t p = 0; p < num_panels; p++) {
    if (!(ceilings[p] >= floor)) continue;
    const float* w = panels + p * k * PANEL;
    __m512 l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
      const __m512 xi = _mm512_set1_ps(x[i]);
      l0 = _mm512_fmadd_ps(xi, _mm512_loadu_ps(w + i * PANEL), l0);
      l1 = _mm512_fmadd_ps(xi, _mm512_loadu_ps(w + i * PANEL + 16), l1);
    }
    float logits[PANEL];
    _mm512_storeu_ps(logits, l0);
    _mm512_storeu_ps(logits + 16, l1);
    const int64_t cols = n_valid - p * PANEL < PANEL ? n_valid - p * PANEL : PANEL;
    for (int64_t c = 0; c < cols; c++) { /* ascending: a tie keeps the lower index */
      if (!isfinite(logits[c])) return -2;
      if (logits[c] > best) {
        best = logits[c];
        token = p * PANEL + c;
      }
    }
  }
  return token;
}

/* Whether sy_tile_greedy_tokens runs here: on the tile unit where this process may use it, on
 * the vector unit where there is none. */
int sy_greedy_available(void) { return HAVE_TILES ? sy_tile_available() : 1; }

/* tokens[r] = the index of the largest of x_r W^T's first n_valid outputs (the vocabulary,
 * before padding), for x (m, k) and W (n, k) given twice: as bfloat16 tiles (sy_tile_pack_hi)
 * and as float32 panels (panel_gemm.c's, summed there without a bias). weight_norms: |w~_j|
 * for every j < n_valid, zeros up to a multiple of 16, then |dw_j| the same way. tokens[r] =
 * -2 where the row needs its float32 logits: values not finite, so large that a float32 sum
 * might overflow, a bound that is NaN, or a floor that is not finite. The panels are shared among the threads, each
 * keeping its own floors and refusals, combined row by row at the end. Returns 0, -1 when out
 * of memory, -2 where the tile registers are not granted. */
int sy_tile_greedy_tokens(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                          int64_t n_valid, const float* weight_norms, const float* panels,
                          int64_t* tokens) {
  if (m <= 0) return 0;
  if (!sy_greedy_available()) return -2;
  const int64_t steps = (k + TILE_K - 1) / TILE_K;
  const int64_t blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t num_panels = (n + PANEL - 1) / PANEL;
  const int64_t threads = omp_get_max_threads();
  uint16_t* a = input_buffer((size_t)(blocks * steps * TILE_ELEMS) * sizeof(uint16_t) +
                             (size_t)(2 * m) * sizeof(float));
  float* kept = screen_buffer((size_t)(threads * m * 16 + m * num_panels) * sizeof(float) +
                              (size_t)(threads * m));
  if (a == NULL || kept == NULL) return -1;
  float* norms = (float*)(a + blocks * steps * TILE_ELEMS); /* |x~_r|, |dx_r| */
  const Screen screen = {kept, (uint8_t*)(kept + threads * m * 16 + m * num_panels),
                         kept + threads * m * 16, num_panels};
#pragma omp parallel num_threads(threads)
  {
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    float* floors = screen.floors + thread * m * 16;
    uint8_t* refused = screen.refused + thread * m;
    for (int64_t i = 0; i < m * 16; i++) floors[i] = -INFINITY;
    memset(refused, 0, (size_t)m);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++)
      split_hi_block(x, m, k, steps, block, a, norms);
#if HAVE_TILES
    configure_tiles(m < TILE_ROWS ? (int)m : TILE_ROWS);
#endif
#pragma omp for schedule(static)
    for (int64_t p = 0; p < num_panels; p++)
      screen_panel(a, tiles + p * steps * HI_STEP_ELEMS, m, k, steps, n_valid, p, norms,
                   weight_norms, floors, refused, &screen);
#if HAVE_TILES
    _tile_release();
#endif
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
      __m512 floor = _mm512_set1_ps(-INFINITY);
      int refuse = !isfinite(norms[2 * r]) || !isfinite(norms[2 * r + 1]);
      for (int64_t t = 0; t < team; t++) {
        floor = _mm512_max_ps(floor, _mm512_load_ps(screen.floors + (t * m + r) * 16));
        refuse |= screen.refused[t * m + r];
      }
      const float lowest = _mm512_reduce_max_ps(floor);
      tokens[r] = refuse || !isfinite(lowest)
                      ? -2
                      : chosen_token(x + r * k, k, screen.ceilings + r * num_panels, num_panels,
                                     lowest, n_valid, panels);
    }
  }
  return 0;
}

#else /* no bfloat16 dot products here: nothing to call but the two availabilities */
int sy_tile_available(void) { return 0; }
int sy_greedy_available(void) { return 0; }
void sy_tile_pack(const float* panels, int64_t k, int64_t n, uint16_t* tiles) {
  (void)panels, (void)k, (void)n, (void)tiles; /* tile_gemm.pack never calls it here */
}
int sy_tile_linear(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                   const float* bias, float* y) {
  (void)x, (void)m, (void)k, (void)tiles, (void)n, (void)bias, (void)y;
  return -2;
}
void sy_tile_pack_hi(const float* panels, int64_t k, int64_t n, uint16_t* tiles) {
  (void)panels, (void)k, (void)n, (void)tiles; /* tile_gemm.pack_hi never calls it here */
}
int sy_tile_greedy_tokens(const float* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t n,
                          int64_t n_valid, const float* weight_norms, const float* panels,
                          int64_t* tokens) {
  (void)x, (void)m, (void)k, (void)tiles, (void)n, (void)n_valid, (void)weight_norms;
  (void)panels, (void)tokens;
  return -2;
}
#endif
