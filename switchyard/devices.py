"""Which GPUs each worker group of ``switchyard serve`` runs on.

On CUDA every worker group gets devices of its own: group i (in ``ServeConfig.worker_groups``
order) takes the i-th ``tensor_parallel_size`` of the launcher's visible devices, told to its
ranks through ``CUDA_VISIBLE_DEVICES``, so that rank r of a group runs on the r-th of its own
(``worker.config.WorkerConfig.torch_device``). The embedding worker takes the next device left
over, or shares the last group's last device when none is. Too few devices for the groups is
refused before any process starts: two groups on one GPU would each size its KV cache from the
same free memory.

The visible devices are the launcher's own ``CUDA_VISIBLE_DEVICES`` when set (as many of them
as CUDA sees), else ``0..device_count - 1``. The launcher never imports torch, so a child
process counts the devices (``cuda_device_count``), and only when the workers may run on CUDA:
``--device cuda``, or ``auto`` on a host with a GPU driver. ``--device cpu`` and ``cuda:N``
assign nothing (``ServeConfig`` refuses ``cuda:N`` for several groups).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("switchyard")

VISIBLE_DEVICES_VARIABLE = "CUDA_VISIBLE_DEVICES"
MAX_DEVICES = 1024
"""The most devices a device count is believed up to (a count above it is a broken probe)."""
PROBE_TIMEOUT_S = 120.0
"""How long the child counting the devices may take (it imports torch and initialises CUDA)."""
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""One of these exists where torch can see a GPU (NVIDIA's driver, ROCm's, WSL's); on a host
with none of them ``--device auto`` is the CPU without asking torch."""
_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def parse_visible_devices(text: str) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value lists (indices, ``GPU-``/``MIG-`` UUIDs), in
    order, up to the first empty entry or ``-1``, where CUDA stops reading too."""
    devices = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def assign_devices(
    groups: Sequence[str], ranks_per_group: int, embedding: str | None, devices: Sequence[str]
) -> dict[str, str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each worker group, by name: text generation ``groups``
    of ``ranks_per_group`` ranks each take consecutive slices of ``devices``; the ``embedding``
    group (None: none) the device after them, or the last group's last one when none is left.
    ``ValueError`` when ``devices`` cannot give every rank a device of its own."""
    needed = len(groups) * ranks_per_group
    if needed > len(devices) or not devices:
        shown = ",".join(devices) or "none"
        raise ValueError(
            f"{len(groups)} worker group(s) of {ranks_per_group} rank(s) need {needed} GPU(s), "
            f"one per rank; {len(devices)} visible ({shown}). Lower --data-parallel-size, "
            "--prefill-workers/--decode-workers or --tensor-parallel-size, or serve on the CPU "
            "(--device cpu)"
        )
    assigned = {
        group: ",".join(devices[index * ranks_per_group : (index + 1) * ranks_per_group])
        for index, group in enumerate(groups)
    }
    if embedding is not None:
        assigned[embedding] = devices[min(needed, len(devices) - 1)]
    return assigned


def visible_cuda_devices(device: str) -> list[str] | None:
    """The devices worker groups are placed on for ``--device`` ``device``; None when the
    workers run on the CPU or on the one GPU ``cuda:N`` names (nothing to assign).
    ``ValueError`` for ``cuda`` where no CUDA device is available."""
    if device == "cpu" or device.startswith("cuda:"):
        return None
    given = os.environ.get(VISIBLE_DEVICES_VARIABLE)
    listed = None if given is None else parse_visible_devices(given)
    if device == "auto" and (listed == [] or not _has_gpu_driver()):
        return None
    count = cuda_device_count()
    if count == 0:
        if device == "cuda":
            raise ValueError("--device cuda: no CUDA device is available")
        return None
    return listed[:count] if listed is not None else [str(index) for index in range(count)]


def _has_gpu_driver() -> bool:
    return any(Path(path).exists() for path in GPU_DRIVER_PATHS)


def cuda_device_count() -> int:
    """The CUDA devices torch sees in a child process with the launcher's environment (0: no
    CUDA, or the child failed: its error is logged)."""
    try:
        completed = subprocess.run(
            [sys.executable, "-c", _PROBE],
            stdout=subprocess.PIPE,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        logger.warning("counting CUDA devices took over %g s; taking none", PROBE_TIMEOUT_S)
        return 0
    lines = completed.stdout.strip().splitlines()
    text = lines[-1] if lines else ""
    if completed.returncode != 0 or not text.isdigit() or int(text) > MAX_DEVICES:
        logger.warning(
            "counting CUDA devices failed (exit %d, %.100r); taking none",
            *(completed.returncode, text),
        )
        return 0
    return int(text)
