"""Tensor parallelism: the worker's process group, how weights split, and the collectives.

This is the only module that knows how many ranks share the model. ``init_tensor_parallel``
joins this process to a torch.distributed group before the model is built (NCCL when the worker
runs on CUDA, gloo on the CPU; ranks rendezvous at ``tcp://master_addr:master_port``, and
gloo's connections bind the interface toward master_addr, so ranks on several hosts meet). The
layers in ``worker.models.linear`` ask it which rows or columns of a checkpoint tensor this rank
holds and reduce or gather their outputs through it; the model files never see a rank. With one
rank (the default) nothing is initialised and every collective returns its input.

Weights split in units (an attention head's ``head_dim`` rows, one row of an MLP or of the
vocabulary). A projection of ``n`` units on ``p`` ranks gives each rank ``n / p`` consecutive
units when ``p`` divides ``n``; when ``n`` divides ``p`` (fewer key-value heads than ranks) each
rank holds one unit, unit ``rank * n // p``, so the ranks that serve one query-head group share
its key-value head.

Besides the device group, ``control`` is a gloo group on the CPU for the small messages the
model runner exchanges around each step (``agree_on_step``, ``share_tokens``). A collective that
fails raises ``GroupBroken``: the ranks are out of step for good, and the worker exits.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""How long the rendezvous and each collective wait for a silent rank before they raise. On gloo
a rank that dies closes its connections, which fails its peers' collectives at once; this bounds
a rank that hangs, and on NCCL (asynchronous collectives) a rank that dies too."""
GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
"""gloo's own variable: the network interface its connections between ranks bind."""


class GroupBroken(RuntimeError):
    """A collective failed (a rank died, or one rank raised mid-step): the ranks are out of step
    and the process must leave the group; the scheduler then fails the group's requests."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group. ``group`` and ``control`` are None
    with one rank (no torch.distributed)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def is_driver(self) -> bool:
        """Whether this rank samples tokens and answers the scheduler (rank 0)."""
        return self.rank == 0


_current = TensorParallel()


def tensor_parallel() -> TensorParallel:
    """The group this process belongs to (one rank until ``init_tensor_parallel``)."""
    return _current


def init_tensor_parallel(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TensorParallel:
    """Join rank ``rank`` of ``world_size`` through the rendezvous at master_addr:master_port
    (rank 0 listens there); returns once every rank has joined. ``ValueError`` for bad
    arguments; torch's ``DistNetworkError`` if the rendezvous fails within ``timeout_s``."""
    global _current
    check_rank(rank, world_size)
    if world_size == 1:
        _current = TensorParallel()
        return _current
    backend = "nccl" if device.type == "cuda" else "gloo"
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    bind_gloo_toward(master_addr, master_port)
    logger.info(
        "rank %d of %d: joining %s group at %s:%d", rank, world_size, backend, host, master_port
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL, so nothing lands on cuda:0 by default
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    _current = TensorParallel(rank, world_size, dist.group.WORLD, control)
    return _current


def bind_gloo_toward(master_addr: str, master_port: int) -> None:
    """Have gloo bind the interface this host reaches ``master_addr`` through, unless the
    operator named one in GLOO_SOCKET_IFNAME. Left alone, gloo binds the address the host name
    resolves to, which /etc/hosts often maps to a loopback address (127.0.1.1 on Debian), or
    falls back to 127.0.0.1: the ranks on other hosts then cannot reach this one. With
    ``master_addr`` on the loopback this picks ``lo``, so one host's ranks stay on it."""
    if os.environ.get(GLOO_INTERFACE_VARIABLE):
        return
    try:
        interface = interface_with_address(local_address_toward(master_addr, master_port))
    except OSError as error:  # an unresolvable master_addr: the rendezvous will say so
        logger.warning("cannot tell the interface toward %s: %s", master_addr, error)
        return
    if interface is not None:
        logger.info("gloo binds %s, the interface toward %s", interface, master_addr)
        os.environ[GLOO_INTERFACE_VARIABLE] = interface


def local_address_toward(host: str, port: int) -> str:
    """This host's address on the route to host:port (a UDP connect sends nothing)."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the interface holding ``address``; None if none does."""
    wanted = ipaddress.ip_address(address.partition("%")[0])
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            ip = entry.family in (socket.AF_INET, socket.AF_INET6)
            if ip and ipaddress.ip_address(entry.address.partition("%")[0]) == wanted:
                return name
    return None


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent); afterwards this process is one rank again."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = TensorParallel()


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


# -- how weights split ---------------------------------------------------------------------------


def shard_units(num_units: int, what: str, replicate: bool = False) -> tuple[int, int]:
    """(first unit, number of units) of ``num_units`` that this rank holds (``units_of_rank``)."""
    return units_of_rank(num_units, _current.rank, _current.world_size, what, replicate)


def units_of_rank(
    num_units: int, rank: int, size: int, what: str, replicate: bool = False
) -> tuple[int, int]:
    """(first unit, number of units) of ``num_units`` that rank ``rank`` of ``size`` holds.

    ``replicate`` allows fewer units than ranks (each rank then holds unit rank * n // p);
    otherwise the ranks must split the units evenly. ``ValueError`` naming ``what`` when the
    units cannot be split this way.
    """
    if num_units % size == 0:
        per_rank = num_units // size
        return rank * per_rank, per_rank
    if replicate and size % num_units == 0:
        return rank * num_units // size, 1
    how = "divide or be divided by" if replicate else "divide"
    raise ValueError(f"tensor-parallel size {size} must {how} the number of {what} ({num_units})")


def padded_shard(num_units: int) -> tuple[int, int]:
    """(first unit, units per rank) for a split that pads ``num_units`` up to a multiple of the
    world size (the vocabulary): the last rank's range may run past ``num_units``."""
    per_rank = -(-num_units // _current.world_size)
    return _current.rank * per_rank, per_rank


# -- collectives on activations ------------------------------------------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place); ``x`` itself with one rank."""
    if _current.world_size > 1:
        dist.all_reduce(x, group=_current.group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (rows, columns) joined along the last dim, in rank order."""
    if _current.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_current.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_current.group)
    return torch.cat(parts, dim=-1)


def vocab_lookup(
    token_ids: torch.Tensor,
    lookup: Callable[[torch.Tensor], torch.Tensor],
    first: int,
    count: int,
) -> torch.Tensor:
    """Embedding rows for ``token_ids`` (num,) from a table split over the vocabulary, where this
    rank's ``lookup`` reads rows ``first`` to ``first + count`` by local index: (num, hidden)."""
    if _current.world_size == 1:
        return lookup(token_ids)
    local_ids = token_ids - first
    elsewhere = (local_ids < 0) | (local_ids >= count)
    rows = lookup(local_ids.masked_fill(elsewhere, 0))  # (num, hidden)
    return all_reduce(rows.masked_fill(elsewhere.unsqueeze(-1), 0))


# -- control messages between steps --------------------------------------------------------------


def agree_on_step(failed: bool, refused: list[bool]) -> tuple[bool, list[bool]]:
    """Before a step's forward pass: whether any rank ``failed`` to prepare it, and for each new
    request whether any rank ``refused`` it (the same length on every rank). ``GroupBroken``
    if the ranks cannot exchange this."""
    if _current.world_size == 1:
        return failed, refused
    values = torch.tensor([failed, *refused], dtype=torch.int64)
    with group_breaks_on_error("agree on a step"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=_current.control)
    anyone_failed, *anyone_refused = (bool(value) for value in values.tolist())
    return anyone_failed, anyone_refused


def share_tokens(
    token_lists: list[list[int]] | None, capacities: list[int]
) -> list[list[int]] | None:
    """After a step: rank 0's sampled tokens, a list per sampled request of at most
    ``capacities[i]`` tokens (None if its sampling failed), on every rank; other ranks'
    ``token_lists`` are ignored. ``GroupBroken`` if the ranks cannot exchange them."""
    if _current.world_size == 1:
        return token_lists
    size = 1 + sum(1 + capacity for capacity in capacities)  # failed, then (count, tokens...)
    message = [0] * size
    if _current.is_driver:
        if token_lists is None:
            message[0] = 1
        else:
            at = 1
            for tokens, capacity in zip(token_lists, capacities, strict=True):
                message[at : at + 1 + len(tokens)] = [len(tokens), *tokens]
                at += 1 + capacity
    values = torch.tensor(message, dtype=torch.int64)
    with group_breaks_on_error("share the sampled tokens"):
        dist.broadcast(values, src=0, group=_current.control)
    failed, *shared = values.tolist()
    if failed:
        return None
    shared_lists, at = [], 0
    for capacity in capacities:
        count = min(max(shared[at], 0), capacity)
        shared_lists.append(shared[at + 1 : at + 1 + count])
        at += 1 + capacity
    return shared_lists


def all_reduce_min(value: int) -> int:
    """The minimum of ``value`` over the ranks."""
    if _current.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    with group_breaks_on_error("agree on a minimum"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_current.control)
    return int(tensor.item())


@contextmanager
def group_breaks_on_error(what: str) -> Iterator[None]:
    """Turn any exception inside into ``GroupBroken`` when there are several ranks: a rank
    that stops partway through a collective sequence can never get back in step."""
    try:
        yield
    except Exception as error:
        if _current.world_size == 1:
            raise
        raise GroupBroken(f"rank {_current.rank} could not {what}: {error}") from error
