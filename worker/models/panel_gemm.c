/* Switchyard's CPU matrix product for float32 linear layers: y = x W^T + b.
 *
 * The weight W (n, k) is stored as column panels, (ceil(n / 32), k, 32): panel p holds output
 * features 32p .. 32p + 31, one row of 32 per input feature (rows past n are zero). A panel
 * is then one sequential read, and a register block of up to 8 input rows x 32 outputs
 * (16 vector accumulators) multiplies it by broadcasting one input value per row per step:
 *
 *     for i in 0..k:  acc[r][0..32] += x[r][i] * panel[i][0..32]    for the block's rows r
 *
 * Up to 32 rows, each pass fetches the panel rows it will need next with software prefetches,
 * and with 9 to 32 the panel goes in chunks of 64 input features that every row block
 * multiplies while the chunk is in L1, so reading the weights overlaps the arithmetic
 * (chunked_rows). With more than 32 rows (large decode batches, prefill chunks, mixed steps)
 * two panels go together under blocks of 6 rows x 64 outputs (24 accumulators, pair_block):
 * each broadcast input feeds four multiply-adds instead of two, and the hardware prefetcher
 * follows the pair's two sequential reads. A pair's first pass would wait on memory, so the
 * passes after it fetch the next pair into L2, a share each, spread evenly over their steps
 * (rows_of_pair). Every output's sum is taken in the same order on every path, so a row's
 * result does not depend on how many rows its product has. On the 2-core AVX-512 machine this
 * project is benchmarked on, this streams weights at ~29 GB/s for one row, sum()'s rate
 * (oneDNN's kernels: 23, MKL's: 8-12), and in one run over the default model's matrices
 * reached 266 GFLOP/s for 64 rows and 296 for 128 where oneDNN's packed kernel reached 194
 * and 248. See benchmarks/gemv_bench.py and docs/performance.md.
 *
 * Plain C with GCC/Clang vector extensions (16 x float, lowered to whatever -march=native
 * offers) and OpenMP; worker/models/panel_gemm.py compiles it on first use. The OpenMP runtime
 * is the one torch already loaded (same soname), so torch.set_num_threads applies here too.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PANEL 32     /* output features per panel: two 16-float vectors */
#define BLOCK 8      /* input rows per register block */
#define CHUNK 64     /* input rows per parallel task of pairs */
#define LINE 16      /* floats per 64-byte cache line */
#define LINES_PER_ROW (PANEL / LINE)
#define AHEAD 32     /* panel rows (128 B each) a one-block pass fetches ahead into L1 */
#define FAR 256      /* and into L2 (32 KB ahead) */
#define KC 64        /* input features per chunk of a panel (8 KB) when rows > BLOCK */
#define KC_AHEAD 4   /* chunks ahead (32 KB) that chunked_rows' passes fetch into L2 */
#define PAIR_MIN 32  /* products of more rows than this go in pairs of panels */
#define PAIR_BLOCK 6 /* input rows per register block over two panels */

typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load(const float* p) {
  vec16 v;
  memcpy(&v, p, sizeof v); /* an unaligned vector load */
  return v;
}

static inline void store(float* p, vec16 v) { memcpy(p, &v, sizeof v); }

/* v, held in a vector register: an empty assembly statement that GCC must assume reads and
 * changes it, so that it cannot fold the load that made v into every multiply-add as a memory
 * operand instead. In chunk_block's blocks of 2 to 4 rows (what is left of 10-12, 18-20 and
 * 26-28 rows after the 8-row blocks) GCC did, reading each weight vector once per row from L1;
 * held, whole decode steps of 10, 11, 12 and 20 requests run 2-5 % faster (bit for bit the
 * same sums; block's passes from memory run faster with the folded loads: left as they are).
 * AVX-512 only: elsewhere a 64-byte vector is not one register. */
static inline vec16 in_register(vec16 v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#endif
  return v;
}

/* y[r][0..cols) = x[r] . panel + bias for rows r < ROWS (a constant after inlining), fetching
 * the panel AHEAD rows ahead of its use into L1 and FAR rows ahead into L2, within the `lines`
 * cache lines that follow the panel's start (an L1 fetch then waits for L2, not memory: 2 to 8
 * rows 6-15 % faster than with the L1 fetches alone). */
static inline __attribute__((always_inline)) void block(const float* x, int64_t k,
                                                        const float* panel, const float* bias,
                                                        float* y, int64_t n, int64_t cols,
                                                        int64_t lines, const int rows) {
  vec16 acc[BLOCK][2];
  const vec16 b0 = load(bias), b1 = load(bias + 16);
  for (int r = 0; r < rows; r++) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  for (int64_t i = 0; i < k; i++) {
    if ((i + AHEAD) * LINES_PER_ROW < lines) {
      __builtin_prefetch(panel + (i + AHEAD) * PANEL, 0, 3);
      __builtin_prefetch(panel + (i + AHEAD) * PANEL + LINE, 0, 3);
      if ((i + FAR) * LINES_PER_ROW < lines) {
        __builtin_prefetch(panel + (i + FAR) * PANEL, 0, 2);
        __builtin_prefetch(panel + (i + FAR) * PANEL + LINE, 0, 2);
      }
    }
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

/* acc[r][0..32) += x[r][0..len) . panel rows 0..len for rows r < ROWS (a constant after
 * inlining), where the panel rows are already in cache; meanwhile fetch into L2, one per
 * step, the cache lines first, first + 1, ... after the panel's start that are below lines. */
static inline __attribute__((always_inline)) void chunk_block(
    const float* x, int64_t k, const float* panel, int64_t len, float* acc, int64_t first,
    int64_t lines, const int rows) {
  vec16 a[BLOCK][2];
  for (int r = 0; r < rows; r++) {
    a[r][0] = load(acc + r * PANEL);
    a[r][1] = load(acc + r * PANEL + 16);
  }
  for (int64_t i = 0; i < len; i++) {
    if (first + i < lines) __builtin_prefetch(panel + (first + i) * LINE, 0, 2);
    const vec16 w0 = in_register(load(panel + i * PANEL));
    const vec16 w1 = in_register(load(panel + i * PANEL + 16));
    for (int r = 0; r < rows; r++) {
      const float xi = x[r * k + i];
      a[r][0] += xi * w0;
      a[r][1] += xi * w1;
    }
  }
  for (int r = 0; r < rows; r++) {
    store(acc + r * PANEL, a[r][0]);
    store(acc + r * PANEL + 16, a[r][1]);
  }
}

/* Rows xr[0..rows) (9 to PAIR_MIN of them) of y against one panel, where `lines` cache lines
 * from the panel's start on may be fetched (the panels after it included): the panel in
 * chunks of KC input features (8 KB), each multiplied by every block of BLOCK rows while it is
 * in L1, the accumulators kept in a small table between chunks. The block passes over a chunk
 * fetch the chunk KC_AHEAD chunks on into L2 (the first pass its first half, the second pass
 * the rest, later passes further ahead), so reading the weights from memory overlaps the
 * arithmetic instead of preceding it: one block's pass alone is memory-bound, every further
 * pass compute-bound. Into L2 32 KB ahead measured 3-9 % faster a decode step of 12 to 32
 * rows than into L1 8 KB ahead, whose fetches each hold one of the core's few L1 fill buffers
 * until memory answers; no fetches at all, 25-35 % slower. */
static void chunked_rows(const float* xr, int64_t rows, int64_t k, const float* panel,
                         const float* bias, float* yr, int64_t n, int64_t cols, int64_t lines) {
  float acc[PAIR_MIN][PANEL] __attribute__((aligned(64)));
  for (int64_t r = 0; r < rows; r++) memcpy(acc[r], bias, sizeof acc[r]);
  for (int64_t kc = 0; kc < k; kc += KC) {
    const int64_t len = k - kc < KC ? k - kc : KC;
    const float* w = panel + kc * PANEL;
    for (int64_t r = 0, pass = 0; r < rows; r += BLOCK, pass++) {
      const float* xb = xr + r * k + kc;
      const int64_t first = KC_AHEAD * KC * LINES_PER_ROW + pass * len; /* lines from w */
      const int64_t fetchable = lines - kc * LINES_PER_ROW;
      switch (rows - r < BLOCK ? rows - r : BLOCK) {
        case 1: chunk_block(xb, k, w, len, acc[r], first, fetchable, 1); break;
        case 2: chunk_block(xb, k, w, len, acc[r], first, fetchable, 2); break;
        case 3: chunk_block(xb, k, w, len, acc[r], first, fetchable, 3); break;
        case 4: chunk_block(xb, k, w, len, acc[r], first, fetchable, 4); break;
        case 5: chunk_block(xb, k, w, len, acc[r], first, fetchable, 5); break;
        case 6: chunk_block(xb, k, w, len, acc[r], first, fetchable, 6); break;
        case 7: chunk_block(xb, k, w, len, acc[r], first, fetchable, 7); break;
        default: chunk_block(xb, k, w, len, acc[r], first, fetchable, 8); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; r++) memcpy(yr + r * n, acc[r], (size_t)cols * sizeof(float));
}

/* Rows [start, end) of y against one panel: chunked_rows where `chunked` and there are more
 * than BLOCK rows; else blocks of BLOCK rows that each make one pass over the panel (a
 * product's last, odd panel when its other panels go in pairs). */
static void rows_of_panel(const float* x, int64_t start, int64_t end, int64_t k,
                          const float* panel, const float* bias, float* y, int64_t n,
                          int64_t cols, int64_t lines, int chunked) {
  const float* xr = x + start * k;
  float* yr = y + start * n;
  const int64_t rows = end - start;
  if (rows > BLOCK && chunked) {
    chunked_rows(xr, rows, k, panel, bias, yr, n, cols, lines);
    return;
  }
  for (int64_t r = 0; r < rows; r += BLOCK) {
    const float* xb = xr + r * k;
    float* yb = yr + r * n;
    switch (rows - r < BLOCK ? rows - r : BLOCK) { /* one specialised copy per size */
      case 1: block(xb, k, panel, bias, yb, n, cols, lines, 1); break;
      case 2: block(xb, k, panel, bias, yb, n, cols, lines, 2); break;
      case 3: block(xb, k, panel, bias, yb, n, cols, lines, 3); break;
      case 4: block(xb, k, panel, bias, yb, n, cols, lines, 4); break;
      case 5: block(xb, k, panel, bias, yb, n, cols, lines, 5); break;
      case 6: block(xb, k, panel, bias, yb, n, cols, lines, 6); break;
      case 7: block(xb, k, panel, bias, yb, n, cols, lines, 7); break;
      default: block(xb, k, panel, bias, yb, n, cols, lines, 8); break;
    }
  }
}

/* y[r][0..cols) = x[r] . (panels a and b side by side) + bias for rows r < ROWS (a constant
 * after inlining), cols <= 64: a register block of ROWS rows by two panels' 64 outputs. The
 * hardware prefetcher follows the two sequential panel reads; meanwhile the fetch_lines cache
 * lines from fetch on are fetched into L2, one every k / fetch_lines steps (fetch_lines is at
 * most k, see rows_of_pair). */
static inline __attribute__((always_inline)) void pair_block(
    const float* x, int64_t k, const float* a, const float* b, const float* bias, float* y,
    int64_t n, int64_t cols, const float* fetch, int64_t fetch_lines, const int rows) {
  vec16 acc[PAIR_BLOCK][4];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = load(bias + 16 * j);
  const int64_t spacing = fetch_lines > 0 && k / fetch_lines > 1 ? k / fetch_lines : 1;
  int64_t fetched = 0, fetch_at = 0;
  for (int64_t i = 0; i < k; i++) {
    if (i == fetch_at && fetched < fetch_lines) {
      __builtin_prefetch(fetch + fetched * LINE, 0, 2);
      fetched++;
      fetch_at += spacing;
    }
    const vec16 w0 = load(a + i * PANEL), w1 = load(a + i * PANEL + 16);
    const vec16 w2 = load(b + i * PANEL), w3 = load(b + i * PANEL + 16);
    for (int r = 0; r < rows; r++) {
      const float xi = x[r * k + i];
      acc[r][0] += xi * w0;
      acc[r][1] += xi * w1;
      acc[r][2] += xi * w2;
      acc[r][3] += xi * w3;
    }
  }
  for (int r = 0; r < rows; r++) {
    float full[2 * PANEL];
    for (int j = 0; j < 4; j++) store(full + 16 * j, acc[r][j]);
    memcpy(y + r * n, full, (size_t)cols * sizeof(float));
  }
}

/* Rows [start, end) of y against panels a and b (the 64 outputs from y's column on, cols of
 * them real). The first pass reads the pair from memory (or from L2, where the pair before
 * fetched it); the later ones, reading it from cache, fetch the next_lines cache lines that
 * follow it (the next pair) into L2 in equal shares, each spread over its pass: a burst of
 * fetches at a pass's start measured slower, and so did halving a product's rows between the
 * threads to even out an odd number of pairs. A share is at most k lines: next_lines is at most
 * 4k (two panels of k rows of two lines), and a chunk of more than 24 rows makes four or more
 * later passes. */
static void rows_of_pair(const float* x, int64_t start, int64_t end, int64_t k, const float* a,
                         const float* b, const float* bias, float* y, int64_t n, int64_t cols,
                         int64_t next_lines) {
  const int64_t passes = (end - start + PAIR_BLOCK - 1) / PAIR_BLOCK;
  const float* next = a + 2 * k * PANEL;
  int64_t r = start;
  for (int64_t pass = 0; r < end; r += PAIR_BLOCK, pass++) {
    const float* fetch = NULL;
    int64_t fetch_lines = 0;
    if (pass > 0 && next_lines > 0) {
      const int64_t share_first = (pass - 1) * next_lines / (passes - 1);
      fetch = next + share_first * LINE;
      fetch_lines = pass * next_lines / (passes - 1) - share_first;
    }
    const float* xb = x + r * k;
    float* yb = y + r * n;
    switch (end - r < PAIR_BLOCK ? end - r : PAIR_BLOCK) { /* one specialised copy per size */
      case 1: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 1); break;
      case 2: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 2); break;
      case 3: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 3); break;
      case 4: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 4); break;
      case 5: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 5); break;
      default: pair_block(xb, k, a, b, bias, yb, n, cols, fetch, fetch_lines, 6); break;
    }
  }
}

/* How the threads share a product's tasks. Each starts with an equal run of units (panels,
 * or panel-chunks), takes its tasks from the run's front in order, and then takes what is left
 * of the other runs from their backs: on a machine whose cores other processes share, a
 * thread that the kernel has paused no longer holds up the product (with a second process
 * busy half of one core's time, 512-row products over the model's matrices took 1.2 times as
 * long as with this sharing under a fixed split; docs/performance.md). Nor does a thread that
 * starts late: a team smaller than expected takes the missing threads' runs. Which thread
 * multiplies a task does not change its result. A run's two ends are one word, so each take
 * is one compare-and-swap, and each run has a cache line of its own. */
#define MAX_RUNS 64

typedef struct {
  /* front in the low 32 bits, back in the high (a product's units are fewer than 2^32: its
   * output would be 2^43 floats first) */
  uint64_t ends __attribute__((aligned(64)));
} Run;

typedef struct {
  Run runs[MAX_RUNS];
  int64_t num_runs;
  int64_t num_panels, num_chunks; /* units: panel-chunks, a pair's chunk by chunk */
  int pairs;                      /* tasks of two units (a pair's chunk), else of one */
} Share;

static inline uint64_t run_ends(int64_t front, int64_t back) {
  return (uint64_t)front | (uint64_t)back << 32;
}

static void share_init(Share* s, int64_t num_panels, int64_t num_chunks, int pairs) {
  const int64_t num_units = num_panels * num_chunks, threads = omp_get_max_threads();
  s->num_runs = threads < 1 ? 1 : threads < MAX_RUNS ? threads : MAX_RUNS;
  s->num_panels = num_panels;
  s->num_chunks = num_chunks;
  s->pairs = pairs;
  for (int64_t t = 0; t < s->num_runs; t++)
    s->runs[t].ends = run_ends(num_units * t / s->num_runs, num_units * (t + 1) / s->num_runs);
}

/* The first panel of the pair (or the panel) whose task holds unit u. */
static inline int64_t task_panel(const Share* s, int64_t u) {
  return s->pairs ? u / (2 * s->num_chunks) * 2 : u / s->num_chunks;
}

/* The units of the task that holds unit u: 2 for a pair's chunk, 1 otherwise. */
static inline int64_t task_width(const Share* s, int64_t u) {
  return s->pairs && s->num_panels - task_panel(s, u) >= 2 ? 2 : 1;
}

/* The end of the task that holds unit u. */
static inline int64_t task_end(const Share* s, int64_t u) {
  const int64_t first = task_panel(s, u) * s->num_chunks, width = task_width(s, u);
  return first + ((u - first) / width + 1) * width;
}

/* The next task of the thread's own run, [*unit, *to), and what remains of the run after it
 * ends at *back; 0 where the run is empty. */
static int take_own(Share* s, int64_t thread, int64_t* unit, int64_t* to, int64_t* back) {
  if (thread >= s->num_runs) return 0;
  Run* run = &s->runs[thread];
  uint64_t ends = __atomic_load_n(&run->ends, __ATOMIC_ACQUIRE);
  for (;;) {
    const int64_t front = (int64_t)(ends & 0xffffffffu), end = (int64_t)(ends >> 32);
    if (front >= end) return 0;
    const int64_t task = task_end(s, front), stop = task < end ? task : end;
    if (__atomic_compare_exchange_n(&run->ends, &ends, run_ends(stop, end), 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      *unit = front;
      *to = stop;
      *back = end;
      return 1;
    }
  }
}

/* The last task left in run `victim`, [*unit, *to); 0 where the run is empty. */
static int take_last(Share* s, int64_t victim, int64_t* unit, int64_t* to) {
  Run* run = &s->runs[victim];
  uint64_t ends = __atomic_load_n(&run->ends, __ATOMIC_ACQUIRE);
  for (;;) {
    const int64_t front = (int64_t)(ends & 0xffffffffu), end = (int64_t)(ends >> 32);
    if (front >= end) return 0;
    const int64_t task = task_end(s, end - 1) - task_width(s, end - 1);
    const int64_t start = task > front ? task : front;
    if (__atomic_compare_exchange_n(&run->ends, &ends, run_ends(front, start), 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      *unit = start;
      *to = end;
      return 1;
    }
  }
}

/* Rows [start, end) of y against panel p (see rows_of_panel), fetching ahead through the
 * `ahead` panels from p on. */
static void one_panel(const float* x, int64_t start, int64_t end, int64_t k, const float* panels,
                      int64_t n, const float* bias, float* y, int64_t p, int64_t ahead,
                      int chunked) {
  const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
  float panel_bias[PANEL] = {0};
  if (bias) memcpy(panel_bias, bias + p * PANEL, (size_t)cols * sizeof(float));
  rows_of_panel(x, start, end, k, panels + p * k * PANEL, panel_bias, y + p * PANEL, n, cols,
                ahead * k * LINES_PER_ROW, chunked);
}

/* Units [unit, to) of a product over pairs (see many_rows), within one task: two units are a
 * pair's chunk, one a last odd panel's chunk or half of a pair's. A pair's first chunk fetches
 * the next_panels (0 to 2) panels after the pair into L2. */
static void run_units(const Share* s, const float* x, int64_t m, int64_t k, const float* panels,
                      int64_t n, const float* bias, float* y, int64_t unit, int64_t to,
                      int64_t next_panels) {
  const int64_t p = task_panel(s, unit), width = task_width(s, unit);
  const int64_t chunk = (unit - p * s->num_chunks) / width;
  const int64_t half = (unit - p * s->num_chunks) % width; /* 1: the second panel alone */
  const int64_t start = chunk * CHUNK, end = start + CHUNK < m ? start + CHUNK : m;
  if (to - unit == 1) {
    one_panel(x, start, end, k, panels, n, bias, y, p + half, 1, 0);
    return;
  }
  const int64_t cols = n - p * PANEL < 2 * PANEL ? n - p * PANEL : 2 * PANEL;
  float pair_bias[2 * PANEL] = {0};
  if (bias) memcpy(pair_bias, bias + p * PANEL, (size_t)cols * sizeof(float));
  if (chunk != 0) next_panels = 0; /* the pair's later chunks read it from L2 */
  if (next_panels > 2) next_panels = 2;
  if (next_panels > s->num_panels - p - 2) next_panels = s->num_panels - p - 2;
  if (next_panels < 0) next_panels = 0;
  const float* a = panels + p * k * PANEL;
  rows_of_pair(x, start, end, k, a, a + k * PANEL, pair_bias, y + p * PANEL, n, cols,
               next_panels * k * LINES_PER_ROW);
}

/* y = x W^T + bias for more than PAIR_MIN rows: tasks of (two panels, CHUNK rows), pair by
 * pair (a pair's chunks one after another, so that it stays in L2 between them), a last odd
 * panel on its own, shared as above. The runs are equal in work, not in tasks: a pair that a
 * run's end cuts goes as its two panels, one to each side (shared by number, the 9 pairs of a
 * 576-output product and the 15 of a 960-output one left one thread a pair more than the
 * other: 6-10 % slower for 48 or 64 rows). A pair's first chunk fetches the panels its owner
 * multiplies next. */
static void many_rows(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                      const float* bias, float* y) {
  Share share;
  share_init(&share, (n + PANEL - 1) / PANEL, (m + CHUNK - 1) / CHUNK, 1);
#pragma omp parallel
  {
    const int64_t thread = omp_get_thread_num();
    int64_t unit, to, back;
    while (take_own(&share, thread, &unit, &to, &back)) /* the next pair's units in the run */
      run_units(&share, x, m, k, panels, n, bias, y, unit, to,
                back - (task_panel(&share, unit) + 2) * share.num_chunks);
    for (int64_t i = 1; i <= share.num_runs; i++)
      while (take_last(&share, (thread + i) % share.num_runs, &unit, &to))
        run_units(&share, x, m, k, panels, n, bias, y, unit, to, 0);
  }
}

/* y = x W^T + bias for up to PAIR_MIN rows: every row against one panel at a time, shared as
 * above. The owner of a run fetches ahead through the panels its run still holds. */
static void few_rows(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                     const float* bias, float* y) {
  Share share;
  share_init(&share, (n + PANEL - 1) / PANEL, 1, 0);
#pragma omp parallel
  {
    const int64_t thread = omp_get_thread_num();
    int64_t p, to, back;
    while (take_own(&share, thread, &p, &to, &back))
      one_panel(x, 0, m, k, panels, n, bias, y, p, back - p, 1);
    for (int64_t i = 1; i <= share.num_runs; i++)
      while (take_last(&share, (thread + i) % share.num_runs, &p, &to))
        one_panel(x, 0, m, k, panels, n, bias, y, p, 1, 1);
  }
}

/* y (m, n) = x (m, k) W^T + bias (n, or NULL), W given as panels; all row-major, contiguous.
 * Returns 0 (it needs no memory of its own; the int is the linear layers' signature, which
 * sy_tile_linear can fail). */
int sy_panel_linear(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                    const float* bias, float* y) {
  if (m > PAIR_MIN) {
    many_rows(x, m, k, panels, n, bias, y);
    return 0;
  }
  few_rows(x, m, k, panels, n, bias, y);
  return 0;
}
