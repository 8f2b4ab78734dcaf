"""Build and load Switchyard's C kernels (``panel_gemm.c``, ``cpu_ops.c``, ``tile_gemm.c``) on
first use.

Each source is compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``; ``-O3
-march=native -ffp-contract=fast -fopenmp``) into ``<cache dir>/kernels/``, keyed by a hash of
the source, the compiler, these flags and this CPU's model and flags, so a later start loads it
in milliseconds. ``-ffp-contract=fast`` (GCC's default in its GNU mode, spelled out for any
compiler) makes each ``a += x * w`` of the kernels one fused multiply-add, which the greedy
head's exact logits (``tile_gemm.c``, fused multiply-adds in the same order) repeat to the
bit. Without a compiler, or if the build fails, ``load`` logs why once and returns None, and the
callers fall back to torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401 (loaded first, so the kernels' libgomp.so.1 resolves to torch's copy)

from interfaces import envs

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120


def load(source: Path) -> ctypes.CDLL | None:
    """The library built from ``source``, or None (logged) where it cannot be built here.

    Callers cache the result (``functools.cache``): each source is built and logged once."""
    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels of %s unavailable (%s); using torch's", source.name, error)
        return None


def _build(source: Path) -> Path:
    """Compile ``source`` unless this CPU's build is cached; return the shared library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode() + _cpu_identity())
    path = envs.cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=path.parent) as build_dir:
        built = Path(build_dir) / path.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, path)
    logger.info("built the CPU kernels of %s at %s", source.name, path)
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
