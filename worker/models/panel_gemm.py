"""The CPU float32 matrix product of ``panel_gemm.c``: build, load, pack, multiply.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc`` or
``gcc``; ``-O3 -march=native -fopenmp``) into ``<cache dir>/kernels/``, keyed by a hash of the
source, the compiler and this CPU's model and flags, so a later start loads it in
milliseconds. Without a compiler, or if the build fails, ``library()`` logs why once and
returns None, and linear layers fall back to oneDNN's packed kernel or ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from interfaces import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_gemm.c")
PANEL = 32  # output features per panel; must match panel_gemm.c
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k) as column panels (ceil(n / 32), k, 32), zero past row n.

    One allocation and one copy: no padded temporary the heap would keep after loading."""
    n, k = weight.shape
    full, rest = divmod(n, PANEL)
    panels = torch.empty(full + (rest > 0), k, PANEL, dtype=weight.dtype)
    panels[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if rest:
        panels[full, :, rest:].zero_()
        panels[full, :, :rest].copy_(weight[full * PANEL :].t())
    return panels


def rows(panels: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` (num,) of the weight packed into ``panels``: (num, k)."""
    return panels[indices // PANEL, :, indices % PANEL]


def linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x`` (m, k) W^T + ``bias`` for W packed by ``pack``: (m, out_features), float32."""
    lib = library()
    assert lib is not None, "linear() needs the built library; check library() first"
    if x.dtype != torch.float32:
        raise TypeError(f"the panel kernel multiplies float32, not {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    if panels.shape[1] != k:
        raise ValueError(f"input has {k} features, the weight expects {panels.shape[1]}")
    # The kernel trusts these sizes: check them here rather than read out of bounds there.
    if not (panels.shape[0] - 1) * PANEL < out_features <= panels.shape[0] * PANEL:
        raise ValueError(f"{out_features} outputs do not fit {panels.shape[0]} panels")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features):
        raise ValueError(f"bias must be {out_features} float32 values")
    y = torch.empty(m, out_features, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    lib.sy_panel_linear(x.data_ptr(), m, k, panels.data_ptr(), out_features, bias_ptr, y.data_ptr())
    return y


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built here."""
    try:
        # torch is imported (above), so the library's libgomp.so.1 resolves to torch's copy.
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("CPU matrix kernel unavailable (%s); using torch's kernels", error)
        return None
    lib.sy_panel_linear.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # m
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # panels
        ctypes.c_int64,  # n
        ctypes.c_void_p,  # bias or NULL
        ctypes.c_void_p,  # y
    ]
    lib.sy_panel_linear.restype = None
    return lib


def _build() -> Path:
    """Compile the source unless this CPU's build is cached; return the shared library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode() + _cpu_identity())
    path = envs.cache_dir() / "kernels" / f"panel_gemm-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=path.parent) as build_dir:
        built = Path(build_dir) / path.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, path)
    logger.info("built the CPU matrix kernel at %s", path)
    return path


def _cpu_identity() -> bytes:
    """This CPU's model and feature flags (``-march=native`` depends on them)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine.encode()
    fields = ("model name", "flags", "Features", "CPU part")
    lines = {line for line in cpuinfo.splitlines() if line.split(":")[0].strip() in fields}
    return "\n".join(sorted(lines)).encode()
