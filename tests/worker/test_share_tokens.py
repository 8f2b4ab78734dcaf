"""``parallel.share_tokens`` between two gloo ranks: rank 0's token lists, of any length up to
each request's capacity (speculative decoding accepts a varying number), reach rank 1 as sent."""

from __future__ import annotations

import multiprocessing
import socket

import torch

from worker import parallel

CAPACITIES = [1, 5, 3, 1]
SENT = [[7], [1, 2, 3], [], [9]]  # a request with drafts kept three; one got no token


def _rank(rank: int, port: int, results) -> None:
    parallel.init_tensor_parallel(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=60)
    shared = parallel.share_tokens(SENT if rank == 0 else None, CAPACITIES)
    failed = parallel.share_tokens(None, CAPACITIES)  # rank 0's sampling failed
    results.put((rank, shared, failed))


def test_variable_token_lists_reach_every_rank():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        reports = [results.get(timeout=120) for _ in ranks]
        received = {rank: (shared, failed) for rank, shared, failed in reports}
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert received == {0: (SENT, None), 1: (SENT, None)}
