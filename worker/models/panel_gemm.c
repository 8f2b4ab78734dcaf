/* Switchyard's CPU matrix product for float32 linear layers: y = x W^T + b.
 *
 * The weight W (n, k) is stored as column panels, (ceil(n / 32), k, 32): panel p holds output
 * features 32p .. 32p + 31, one row of 32 per input feature (rows past n are zero). A panel
 * is then one sequential read, and a register block of up to 8 input rows x 32 outputs
 * (16 vector accumulators) multiplies it by broadcasting one input value per row per step:
 *
 *     for i in 0..k:  acc[r][0..32] += x[r][i] * panel[i][0..32]    for the block's rows r
 *
 * On the 2-core AVX-512 machine this project is benchmarked on, this streams weights at
 * ~30 GB/s for one to four rows (oneDNN's kernels: 19-23, MKL's: 8-12) and reaches 194-215
 * GFLOP/s for 64-512 rows, about what oneDNN reaches; see benchmarks/gemv_bench.py and
 * docs/performance.md.
 *
 * Plain C with GCC/Clang vector extensions (16 x float, lowered to whatever -march=native
 * offers) and OpenMP; worker/models/panel_gemm.py compiles it on first use. The OpenMP runtime
 * is the one torch already loaded (same soname), so torch.set_num_threads applies here too.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 32     /* output features per panel: two 16-float vectors */
#define BLOCK 8      /* input rows per register block */
#define CHUNK 64     /* input rows per parallel task, a multiple of BLOCK */

typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load(const float* p) {
  vec16 v;
  memcpy(&v, p, sizeof v); /* an unaligned vector load */
  return v;
}

static inline void store(float* p, vec16 v) { memcpy(p, &v, sizeof v); }

/* y[r][0..cols) = x[r] . panel + bias for rows r < ROWS (a constant after inlining). */
static inline __attribute__((always_inline)) void block(
    const float* x, int64_t k, const float* panel, const float* bias, float* y, int64_t n,
    int64_t cols, const int rows) {
  vec16 acc[BLOCK][2];
  const vec16 b0 = load(bias), b1 = load(bias + 16);
  for (int r = 0; r < rows; r++) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  for (int64_t i = 0; i < k; i++) {
    const vec16 w0 = load(panel + i * PANEL), w1 = load(panel + i * PANEL + 16);
    for (int r = 0; r < rows; r++) {
      const float xi = x[r * k + i];
      acc[r][0] += xi * w0;
      acc[r][1] += xi * w1;
    }
  }
  for (int r = 0; r < rows; r++) {
    if (cols == PANEL) {
      store(y + r * n, acc[r][0]);
      store(y + r * n + 16, acc[r][1]);
    } else { /* the last panel of an n that is not a multiple of 32 */
      float full[PANEL];
      store(full, acc[r][0]);
      store(full + 16, acc[r][1]);
      memcpy(y + r * n, full, (size_t)cols * sizeof(float));
    }
  }
}

/* Rows [start, end) of y against one panel, in blocks of BLOCK rows. */
static void rows_of_panel(const float* x, int64_t start, int64_t end, int64_t k,
                          const float* panel, const float* bias, float* y, int64_t n,
                          int64_t cols) {
  int64_t r = start;
  for (; r + BLOCK <= end; r += BLOCK) block(x + r * k, k, panel, bias, y + r * n, n, cols, BLOCK);
  const float* xr = x + r * k;
  float* yr = y + r * n;
  switch (end - r) { /* one specialised copy per remainder */
    case 1: block(xr, k, panel, bias, yr, n, cols, 1); break;
    case 2: block(xr, k, panel, bias, yr, n, cols, 2); break;
    case 3: block(xr, k, panel, bias, yr, n, cols, 3); break;
    case 4: block(xr, k, panel, bias, yr, n, cols, 4); break;
    case 5: block(xr, k, panel, bias, yr, n, cols, 5); break;
    case 6: block(xr, k, panel, bias, yr, n, cols, 6); break;
    case 7: block(xr, k, panel, bias, yr, n, cols, 7); break;
    default: break;
  }
}

/* y (m, n) = x (m, k) W^T + bias (n, or NULL), W given as panels; all row-major, contiguous. */
void sy_panel_linear(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                     const float* bias, float* y) {
  const int64_t num_panels = (n + PANEL - 1) / PANEL;
  const int64_t num_chunks = (m + CHUNK - 1) / CHUNK;
  /* Tasks run panel-major, so consecutive tasks of a thread reuse a panel from its cache. */
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < num_panels * num_chunks; task++) {
    const int64_t p = task / num_chunks, chunk = task % num_chunks;
    const int64_t start = chunk * CHUNK, end = start + CHUNK < m ? start + CHUNK : m;
    const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
    float panel_bias[PANEL] = {0};
    if (bias) memcpy(panel_bias, bias + p * PANEL, (size_t)cols * sizeof(float));
    rows_of_panel(x, start, end, k, panels + p * k * PANEL, panel_bias, y + p * PANEL, n, cols);
  }
}
