"""KV block transfer from a prefill group to a decode group, over ZeroMQ.

After the step that computes the end of a prompt, each rank of the prefill group gathers the
request's blocks from its cache (the key-value heads it holds, every layer) and pushes them, as
one message of two frames (a msgpack ``KVShardHeader`` and the raw bytes), to each decode rank
that needs those heads. A decode rank binds a PULL socket at its ``transfer_addr`` and writes
what arrives straight into the blocks the scheduler reserved, between steps.

Which rank sends which heads to which is ``transfer_plan``: the groups may differ in
tensor-parallel size, so a decode rank may take its heads from several prefill ranks (and a head
that several prefill ranks replicate is sent once). A decode rank reports ``KVReceived`` when
every shard it expects is written.

Data is written only into the blocks of a transfer the scheduler announced (``KVReceive``) and
has not cancelled, and only a shard whose sender, heads, block count and byte count are the ones
that transfer expects: after an abort the scheduler cancels and reuses the blocks, and anything
that still arrives for that transfer is dropped. Transfer ids are 64-bit random numbers drawn by
the scheduler, so another process that can reach the socket cannot name a transfer in flight.
Data may arrive before its announcement (the two travel different sockets); it waits, within
bounds, in ``worker.kv_early_shards``, if it could belong to a transfer to this rank at all. A
frame larger than this rank's whole pool (no shard can be) drops its connection before it is
buffered (``ZMQ_MAXMSGSIZE``); with CURVE only the workers' key may connect (``KV_TRANSFER``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from interfaces.scheduler_to_worker import KVReceive, KVSend
from interfaces.transport import KV_TRANSFER, Binder, TransportSecurity
from interfaces.worker_to_scheduler import KVLayout, KVReceived
from interfaces.worker_to_worker import KVShardHeader
from worker.kv_cache import KVCache
from worker.kv_early_shards import EarlyShards
from worker.parallel import units_of_rank

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 1024
"""The frame size limit of a pool too small for a header to fit (a tiny test cache)."""


@dataclass(frozen=True)
class Shard:
    """Prefill rank ``source`` sends global key-value heads [head_start, head_stop) to decode
    rank ``destination``."""

    source: int
    destination: int
    head_start: int
    head_stop: int


def head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The global key-value heads [start, stop) that rank ``rank`` of ``size`` holds."""
    first, count = units_of_rank(num_kv_heads, rank, size, "key-value heads", replicate=True)
    return first, first + count


def transfer_plan(num_kv_heads: int, source_size: int, destination_size: int) -> list[Shard]:
    """Every shard of one transfer: for each decode rank, its heads in runs, each run from the
    lowest prefill rank holding it. ``ValueError`` if either size cannot split the heads."""
    sources = [head_range(num_kv_heads, rank, source_size) for rank in range(source_size)]
    plan = []
    for destination in range(destination_size):
        head, stop = head_range(num_kv_heads, destination, destination_size)
        while head < stop:
            source = next(rank for rank, (a, b) in enumerate(sources) if a <= head < b)
            end = min(stop, sources[source][1])
            plan.append(Shard(source, destination, head, end))
            head = end
    return plan


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_layout(cache: KVCache, num_kv_heads: int) -> KVLayout:
    """The layout of ``cache``, whose ranks together hold ``num_kv_heads`` key-value heads."""
    key_cache = cache.key_caches[0]
    return KVLayout(
        len(cache.key_caches), num_kv_heads, key_cache.shape[3], _dtype_name(key_cache.dtype)
    )


class _RankCache:
    """One rank's view of its cache: which global heads it holds, read and written in shards."""

    def __init__(self, cache: KVCache, layout: KVLayout, rank: int, size: int) -> None:
        self.cache = cache
        self.layout = layout
        self.rank, self.size = rank, size
        self.first_head, self.last_head = head_range(layout.num_kv_heads, rank, size)

    def _local(self, shard: Shard) -> slice:
        return slice(shard.head_start - self.first_head, shard.head_stop - self.first_head)

    def _shape(self, num_blocks: int, shard: Shard) -> tuple[int, ...]:
        """A shard's layout: (layers, keys and values, blocks, block_size, heads, head_dim)."""
        num_heads = shard.head_stop - shard.head_start
        return (self.layout.num_layers, 2, num_blocks, self.cache.block_size, num_heads,
                self.layout.head_dim)  # fmt: skip

    def gather(self, block_ids: list[int], shard: Shard) -> torch.Tensor:
        """The shard's heads of ``block_ids``, every layer, as bytes in host memory (pinned
        on CUDA). One layer at a time, so the device needs room for one layer's copy only."""
        key_cache = self.cache.key_caches[0]
        on_cuda = key_cache.device.type == "cuda"
        shape = self._shape(len(block_ids), shard)
        data = torch.empty(shape, dtype=key_cache.dtype, pin_memory=on_cuda)
        index = torch.tensor(block_ids, dtype=torch.int64, device=key_cache.device)
        heads = self._local(shard)
        layers = zip(self.cache.key_caches, self.cache.value_caches, strict=True)
        for layer, (keys, values) in enumerate(layers):
            data[layer, 0].copy_(keys[:, :, heads].index_select(0, index), non_blocking=on_cuda)
            data[layer, 1].copy_(values[:, :, heads].index_select(0, index), non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.current_stream(key_cache.device).synchronize()
        return data.view(torch.uint8).reshape(-1)

    def scatter(self, block_ids: list[int], shard: Shard, payload: memoryview) -> None:
        """Write a shard's bytes (as ``gather`` made them) into ``block_ids``, a layer at a
        time."""
        key_cache = self.cache.key_caches[0]
        shape = self._shape(len(block_ids), shard)
        data = torch.frombuffer(payload, dtype=torch.uint8).view(key_cache.dtype).reshape(shape)
        index = torch.tensor(block_ids, dtype=torch.int64, device=key_cache.device)
        heads = self._local(shard)
        layers = zip(self.cache.key_caches, self.cache.value_caches, strict=True)
        for layer, (keys, values) in enumerate(layers):
            keys[index, :, heads] = data[layer, 0].to(key_cache.device)
            values[index, :, heads] = data[layer, 1].to(key_cache.device)

    def shard_bytes(self, num_blocks: int, shard: Shard) -> int:
        per_head = self.layout.block_bytes(self.cache.block_size) // self.layout.num_kv_heads
        return num_blocks * per_head * (shard.head_stop - shard.head_start)


class KVSender:
    """A prefill rank's side: pushes shards to decode ranks, one PUSH socket per address."""

    def __init__(
        self,
        context: zmq.Context,
        security: TransportSecurity,
        cache: KVCache,
        layout: KVLayout,
        rank: int,
        size: int,
    ) -> None:
        self._context = context
        self._security = security
        self._cache = _RankCache(cache, layout, rank, size)
        self._sockets: dict[str, zmq.Socket] = {}
        self._encode = msgspec.msgpack.Encoder()

    def send(self, sends: list[KVSend]) -> int:
        """Queue this rank's shards of ``sends``; returns the bytes queued. ZeroMQ delivers them
        in the background (the gathered copies are handed over without another copy), so the
        blocks may be reused at once."""
        cache, num_bytes = self._cache, 0
        for send in sends:
            started_at = time.time()
            plan = transfer_plan(cache.layout.num_kv_heads, cache.size, len(send.destinations))
            for shard in plan:
                if shard.source != cache.rank:
                    continue
                payload = cache.gather(send.block_ids, shard)
                header = KVShardHeader(
                    send.transfer_id,
                    cache.rank,
                    shard.head_start,
                    shard.head_stop,
                    len(send.block_ids),
                    started_at,
                )
                socket = self._socket(send.destinations[shard.destination])
                socket.send_multipart([self._encode.encode(header), payload.numpy()], copy=False)
                num_bytes += payload.numel()
        return num_bytes

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.LINGER, 0)
            self._security.connect(socket, address, KV_TRANSFER)
            self._sockets[address] = socket
        return socket

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=0)
        self._sockets.clear()


@dataclass
class _Expected:
    receive: KVReceive
    shards: dict[int, Shard]
    """Still to come, by source rank."""
    num_bytes: int = 0
    started_at: float = math.inf
    """When the earliest of its shards' senders began (``KVShardHeader.started_at``)."""


class KVReceiver:
    """A decode rank's side: a PULL socket bound at ``address``, and the transfers announced
    to it. ``address`` may end in ``:*`` (a free port); ``address`` then tells the bound one."""

    def __init__(
        self,
        context: zmq.Context,
        binder: Binder,
        address: str,
        cache: KVCache,
        layout: KVLayout,
        rank: int,
        size: int,
    ) -> None:
        self._cache = _RankCache(cache, layout, rank, size)
        every_head = Shard(0, rank, self._cache.first_head, self._cache.last_head)
        self._max_shard_bytes = self._cache.shard_bytes(cache.num_blocks, every_head)
        """No transfer holds more than the whole pool of this rank's heads."""
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max(self._max_shard_bytes, MAX_HEADER_BYTES))
        binder.bind(self.socket, address, KV_TRANSFER)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._expected: dict[int, _Expected] = {}
        self._early = EarlyShards()
        self._decode = msgspec.msgpack.Decoder(KVShardHeader)

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    @property
    def num_early_shards(self) -> int:
        return self._early.num_shards

    def expect(self, receive: KVReceive) -> KVReceived | None:
        """Announce a transfer; returns its report if every shard had already arrived."""
        cache = self._cache
        plan = transfer_plan(cache.layout.num_kv_heads, receive.source_size, cache.size)
        shards = {s.source: s for s in plan if s.destination == cache.rank}
        self._expected[receive.transfer_id] = _Expected(receive, shards)
        self._early.forget_stale()
        report = None
        for early in self._early.take(receive.transfer_id):
            report = self._write(early.header, early.payload) or report
        return report

    def cancel(self, transfer_ids: list[int]) -> None:
        """Give up transfers: their blocks are no longer theirs."""
        for transfer_id in transfer_ids:
            self._expected.pop(transfer_id, None)
            self._early.end(transfer_id)

    def cancel_all(self) -> None:
        """Give up every transfer announced (the scheduler that announced them went away;
        shards of others that arrive early are forgotten once stale, as always)."""
        self.cancel(list(self._expected))

    def receive(self) -> list[KVReceived]:
        """Write every shard waiting on the socket; the reports of transfers now complete."""
        reports = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return reports
            report = self._on_frames(frames)
            if report is not None:
                reports.append(report)

    def _on_frames(self, frames: list[zmq.Frame]) -> KVReceived | None:
        if len(frames) != 2:
            logger.warning("dropped a KV shard of %d frames; expected 2", len(frames))
            return None
        try:
            header = self._decode.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("dropped a KV shard with a bad header: %s", error)
            return None
        if header.transfer_id in self._expected:
            return self._write(header, frames[1])
        if self._early.has_ended(header.transfer_id):
            return None  # cancelled (or finished) already
        self._keep_early(header, frames[1])
        return None

    def _keep_early(self, header: KVShardHeader, payload: zmq.Frame) -> None:
        """Keep a shard of a transfer not announced yet, if it could belong to one and there
        is room (``worker.kv_early_shards``)."""
        problem = self._header_problem(header, len(payload))
        if problem is None:
            problem = self._early.keep(header, payload)
        if problem is not None:
            logger.warning("dropped a shard of unannounced KV transfer %d: %s",
                           header.transfer_id, problem)  # fmt: skip

    def _header_problem(self, header: KVShardHeader, num_bytes: int) -> str | None:
        """Why a shard cannot belong to any transfer to this rank, or None."""
        cache = self._cache
        if not cache.first_head <= header.head_start < header.head_stop <= cache.last_head:
            return f"heads [{header.head_start}, {header.head_stop}) are not this rank's"
        if not 0 < header.num_blocks <= cache.cache.num_blocks:
            return f"{header.num_blocks} blocks do not fit the pool"
        shard = Shard(header.source_rank, cache.rank, header.head_start, header.head_stop)
        if num_bytes != cache.shard_bytes(header.num_blocks, shard):
            return f"{num_bytes} bytes do not make {header.num_blocks} blocks of those heads"
        if not math.isfinite(header.started_at):
            return f"its start time {header.started_at} is not a time"
        return None

    def _write(self, header: KVShardHeader, payload: zmq.Frame) -> KVReceived | None:
        expected = self._expected.get(header.transfer_id)
        if expected is None:
            return None  # cancelled meanwhile
        shard = expected.shards.get(header.source_rank)
        block_ids = expected.receive.block_ids
        problem = None
        if shard is None:
            problem = f"no shard was expected from prefill rank {header.source_rank}"
        elif (header.head_start, header.head_stop) != (shard.head_start, shard.head_stop):
            problem = (
                f"heads [{header.head_start}, {header.head_stop}) arrived, "
                f"[{shard.head_start}, {shard.head_stop}) were expected"
            )
        elif header.num_blocks != len(block_ids):
            problem = f"{header.num_blocks} blocks arrived, {len(block_ids)} were reserved"
        elif len(payload) != self._cache.shard_bytes(len(block_ids), shard):
            problem = f"{len(payload)} bytes arrived for {len(block_ids)} blocks"
        elif not math.isfinite(header.started_at):
            problem = f"its start time {header.started_at} is not a time"
        if problem is not None:
            logger.error("dropped a shard of KV transfer %d: %s", header.transfer_id, problem)
            return None
        try:
            self._cache.scatter(block_ids, shard, payload.buffer)
        except (RuntimeError, ValueError) as error:  # the scheduler's timeout fails the request
            logger.error("could not write KV transfer %d: %s", header.transfer_id, error)
            return None
        del expected.shards[header.source_rank]
        expected.num_bytes += len(payload)
        expected.started_at = min(expected.started_at, header.started_at)
        if expected.shards:
            return None
        del self._expected[header.transfer_id]
        self._early.end(header.transfer_id)
        seconds = max(time.time() - expected.started_at, 0.0)
        return KVReceived(header.transfer_id, self._cache.rank, expected.num_bytes, seconds)

    def close(self) -> None:
        self.socket.close(linger=0)
