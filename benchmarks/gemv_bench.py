"""How fast a one-row linear layer can stream SmolLM2-135M's weights on this machine.

Measures, over the default model's 121 matrices (30 layers x qkv, o, gate_up, down, plus the
LM head: 538 MB of fp32), one pass of ``x W^T`` with

- ``F.linear`` (the default BLAS path), for 1 row;
- oneDNN's packed kernel (what ``worker/models/linear.py`` uses on the CPU), for 1 and 4 rows;
- a plain C kernel over a column-panel layout (``[N / 32][K][32]``: one sequential read per
  thread), compiled here with ``cc -O3 -march=native -fopenmp`` (skipped without a compiler);

and ``sum()`` of a 1 GiB tensor, the read bandwidth ``benchmarks/roofline.py`` reports. This is
the evidence behind the concurrency-1 TPOT gap in docs/performance.md.

Run: ``python benchmarks/gemv_bench.py [--threads 2]``.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from workload import num_cores

NUM_LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LM_HEAD_SHAPE = (49152, 576)
PANEL = 32

PANEL_KERNEL = r"""
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
static inline v16 load(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, v16 v) { memcpy(p, &v, sizeof v); }

/* w (N, K) row-major -> panels (N / 32, K, 32); N must be a multiple of 32. */
void pack(const float* w, float* panels, int64_t n, int64_t k) {
  for (int64_t p = 0; p < n / 32; p++)
    for (int64_t i = 0; i < k; i++)
      for (int j = 0; j < 32; j++) panels[(p * k + i) * 32 + j] = w[(p * 32 + j) * k + i];
}

/* y (N) = panels x (K): each panel is one sequential read. */
void gemv(const float* x, const float* panels, float* y, int64_t n, int64_t k) {
  #pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < n / 32; p++) {
    const float* w = panels + p * k * 32;
    v16 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
    int64_t i = 0;
    for (; i + 1 < k; i += 2) {
      a0 += x[i] * load(w + i * 32); a1 += x[i] * load(w + i * 32 + 16);
      b0 += x[i + 1] * load(w + (i + 1) * 32); b1 += x[i + 1] * load(w + (i + 1) * 32 + 16);
    }
    for (; i < k; i++) { a0 += x[i] * load(w + i * 32); a1 += x[i] * load(w + i * 32 + 16); }
    store(y + p * 32, a0 + b0); store(y + p * 32 + 16, a1 + b1);
  }
}
"""


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2] * 1e3


def compile_panel_kernel(workdir: Path) -> ctypes.CDLL | None:
    """The C kernel as a shared library, or None without a C compiler. torch is imported
    first, so the library's OpenMP runtime is the one torch already loaded (same soname)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = workdir / "panel.c", workdir / "panel.so"
    source.write_text(PANEL_KERNEL)
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([compiler, *flags, "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=num_cores())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(shape) for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(LM_HEAD_SHAPE))
    megabytes = sum(w.numel() for w in weights) * 4 / 1e6
    inputs = {rows: {k: torch.randn(rows, k) for k in (576, 1536)} for rows in (1, 4)}
    results: dict[str, float] = {}

    one_row = inputs[1]
    results["F.linear, 1 row"] = median_ms(
        lambda: [F.linear(one_row[w.shape[1]], w) for w in weights]
    )
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        for rows, xs in inputs.items():
            results[f"oneDNN packed, {rows} row(s)"] = median_ms(
                lambda xs=xs: [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(weights, packed, strict=True)
                ]
            )
        del packed

    with tempfile.TemporaryDirectory() as workdir:
        lib = compile_panel_kernel(Path(workdir))
        if lib is not None:
            panels = []
            for w in weights:
                panel = torch.empty_like(w)
                lib.pack(w.data_ptr(), panel.data_ptr(), *w.shape)
                panels.append(panel)
            outputs = [torch.empty(w.shape[0]) for w in weights]

            def run_panels() -> None:
                for w, panel, y in zip(weights, panels, outputs, strict=True):
                    x = one_row[w.shape[1]]
                    lib.gemv(x.data_ptr(), panel.data_ptr(), y.data_ptr(), *w.shape)

            results["C column-panel kernel, 1 row"] = median_ms(run_panels)
            expected = F.linear(one_row[576], weights[0])[0]
            torch.testing.assert_close(outputs[0], expected, rtol=1e-4, atol=1e-3)

    print(f"{len(weights)} matrices, {megabytes:.0f} MB of fp32, {args.threads} threads")
    for name, ms in results.items():
        print(f"{name:34s} {ms:6.1f} ms  {megabytes / ms:5.1f} GB/s")
    big = torch.ones(1 << 28)  # 1 GiB
    sum_ms = median_ms(big.sum, repeats=10)
    print(f"{'sum() of 1 GiB':34s} {sum_ms:6.1f} ms  {big.numel() * 4 / 1e6 / sum_ms:5.1f} GB/s")


if __name__ == "__main__":
    main()
