/* Two limits of this machine that the CPU kernels are measured against (benchmarks/
 * machine_probe.py builds this with the kernels' flags):
 *
 * sy_fma_loop: every thread multiply-adds into 12 independent vectors held in registers, with
 * no memory access: the arithmetic peak no matrix product can pass.
 *
 * sy_read_blocks: the threads sum blocks of a pool in a given order, each thread a contiguous
 * share of the order, with one of the prefetch schemes below: how fast the paged KV cache's
 * layout (blocks lying anywhere in the pool) can be read at all, with no arithmetic beside the
 * read. Decode attention reads the cache in that layout.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

#define LINE 16   /* floats per 64-byte cache line */
#define PAGE_BYTES 4096

/* Returns a sum of the accumulators, so that the loop is not optimised away. Twelve named
 * vectors, not an array: an array of them was kept on the stack, a load and a store each. */
float sy_fma_loop(int64_t iterations) {
  float total = 0.0f;
#pragma omp parallel reduction(+ : total)
  {
    const vec16 scale = (vec16){0} + 0.999999f, step = (vec16){0} + 1e-7f;
    vec16 a0 = (vec16){0} + 0.0f, a1 = a0 + 1.0f, a2 = a0 + 2.0f, a3 = a0 + 3.0f;
    vec16 a4 = a0 + 4.0f, a5 = a0 + 5.0f, a6 = a0 + 6.0f, a7 = a0 + 7.0f;
    vec16 a8 = a0 + 8.0f, a9 = a0 + 9.0f, a10 = a0 + 10.0f, a11 = a0 + 11.0f;
    for (int64_t it = 0; it < iterations; it++) {
      a0 = a0 * scale + step, a1 = a1 * scale + step, a2 = a2 * scale + step;
      a3 = a3 * scale + step, a4 = a4 * scale + step, a5 = a5 * scale + step;
      a6 = a6 * scale + step, a7 = a7 * scale + step, a8 = a8 * scale + step;
      a9 = a9 * scale + step, a10 = a10 * scale + step, a11 = a11 * scale + step;
    }
    const vec16 sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    for (int j = 0; j < 16; j++) total += sum[j];
  }
  return total;
}

/* Schemes: 0, no software prefetch (the hardware prefetchers alone); 1, the next block into L1
 * a line per line read; 2, that and the block after next into L2 the same way; 3, the next
 * block into L1 and the first four lines of each 4 KB page of the block after next into L2,
 * to start the L2 hardware prefetcher there. Returns the sum of every float read (each lane's
 * float sum is exact while it stays below 2^24: a pool of ones up to 4 GiB a thread). */
double sy_read_blocks(const float* pool, const int64_t* order, int64_t num_blocks,
                      int64_t block_floats, int scheme) {
  double total = 0.0;
#pragma omp parallel reduction(+ : total)
  {
    const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t first = num_blocks * thread / threads, end = num_blocks * (thread + 1) / threads;
    vec16 acc[4] = {{0}};
    for (int64_t b = first; b < end; b++) {
      const float* block = pool + order[b] * block_floats;
      const float* next = b + 1 < end ? pool + order[b + 1] * block_floats : NULL;
      const float* after = b + 2 < end ? pool + order[b + 2] * block_floats : NULL;
      for (int64_t f = 0; f < block_floats; f += LINE) {
        if (scheme >= 1 && next) __builtin_prefetch(next + f, 0, 3);
        if (scheme == 2 && after) __builtin_prefetch(after + f, 0, 2);
        if (scheme == 3 && after && (uintptr_t)(after + f) % PAGE_BYTES < 4 * LINE * sizeof(float))
          __builtin_prefetch(after + f, 0, 2); /* the page's first four lines, wherever it lies */
        vec16 v;
        memcpy(&v, block + f, sizeof v);
        acc[f / LINE % 4] += v;
      }
    }
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 16; j++) total += acc[i][j];
  }
  return total;
}
