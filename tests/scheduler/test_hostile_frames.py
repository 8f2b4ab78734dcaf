"""Well-formed frames with hostile values, sent to every internal socket beside innocent work.

Each socket a peer can reach: the scheduler's frontend ROUTER (API servers), its backend ROUTER
(workers) and a decode worker's KV-transfer PULL socket. (A worker's DEALER binds nothing: only
the scheduler it connected to can send it frames; ``test_worker_server.py`` sends it garbage.)
Every hostile frame decodes; its values are what is wrong. Each test shows the frame refused
(answered with an error where the protocol has an answer), an innocent request beside it done
with exactly its tokens, and the process serving on.
"""

from __future__ import annotations

import secrets
import shutil
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from interfaces import (
    ErrorKind,
    ImageMetadata,
    SchedulerStatus,
    SharedMemoryArray,
    TextContext,
)
from interfaces.api_to_scheduler import AbortRequests, LoRAOperationRequest, SubmitRequest
from interfaces.embeddings import EmbeddingsContext
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.lora import LoRAOperation, LoRARequest
from interfaces.sampling import SamplingParams
from interfaces.scheduler_to_api import LoRAOperationResult, SchedulerResults
from interfaces.scheduler_to_worker import KVReceive, KVSend, Shutdown
from interfaces.transport import TransportSecurity, generate_curve_keys
from interfaces.worker_to_scheduler import KVLayout, WorkerReady, WorkerRole
from interfaces.worker_to_worker import KVShardHeader
from scheduler.admission import context_problem
from scheduler.config import SchedulerConfig, WorkerLimits
from scheduler.counters import SchedulerCounters
from scheduler.disaggregation import DisaggregatedPlacement
from scheduler.embeddings import Embeddings
from scheduler.worker_group import ready_problem
from tests.support.curve_keys import role_keys
from tests.support.kv_caches import LAYOUT, empty_cache, filled_cache, poll_reports
from tests.support.scheduler_sockets import (
    TIMEOUT_MS,
    api_client,
    collect,
    ctx,
    decode_worker,
    encode,
    expected,
    receive,
    start_worker,
    stats,
)
from worker import kv_early_shards
from worker.kv_transfer import KVReceiver, KVSender

# -- the scheduler's frontend: what an API server (or anyone on its socket) submits ---------------


def refusal_of(client, request_id):
    """The one result refusing ``request_id``, the first message ``client`` receives."""
    message = receive(client)
    assert isinstance(message, SchedulerResults)
    assert list(message.results) == [request_id]
    return message.results[request_id]


def test_a_token_id_of_2_63_is_refused_and_the_scheduler_serves_on(system):
    """The issue's frame of token ids 2**63 (a block of them, as the hashes take full blocks):
    it used to raise OverflowError in the block hashes and end the scheduler."""
    _, context, frontend, backend = system
    client, intruder = api_client(context, frontend), api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("innocent", [1, 2, 3], max_new_tokens=20))))
    frame = encode(SubmitRequest(TextContext("evil", [2**63] * 4, 10)))
    assert len(frame) < 100  # a full block of 2**63: one prefix-cache hash would overflow
    intruder.send(frame)
    refused = refusal_of(intruder, "evil")
    assert (refused.status, refused.error_kind) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.INVALID_REQUEST,
    )
    assert refused.error == "prompt token ids must be in [0, 2147483648)"
    tokens, finals = collect(client, ["innocent"])
    assert tokens == {"innocent": expected([1, 2, 3], 20)}
    assert finals["innocent"].status is SchedulerStatus.COMPLETE
    client.send(encode(SubmitRequest(ctx("after", [4]))))
    assert collect(client, ["after"])[0] == {"after": expected([4], 5)}
    assert stats(client).num_kv_blocks_used == 0


def image(start: int, end: int, image_hash: str = "h") -> ImageMetadata:
    pixels = SharedMemoryArray("switchyard_00000000_" + "0" * 24, (1,), "float32")
    return ImageMetadata(start, end, pixels, image_hash)


HOSTILE_CONTEXTS = {
    "negative prompt id": (
        TextContext("x", [5, -1], 10),
        "prompt token ids must be in [0, 2147483648)",
    ),
    "eos id beyond int64": (
        TextContext("x", [5], 10, eos_token_ids=[2**64 - 1]),
        "eos_token_ids must be in [-1, 2147483648)",
    ),
    "stop id beyond int64": (
        TextContext("x", [5], 10, sampling_params=SamplingParams(stop_token_ids=[2**63])),
        "stop_token_ids must be in [0, 2147483648)",
    ),
    "logit_bias key beyond the vocabulary": (
        TextContext("x", [5], 10, sampling_params=SamplingParams(logit_bias={2**40: 1.0})),
        "logit_bias keys must be in [0, 2147483648)",
    ),
    "top_k of 2**64 - 1": (
        TextContext("x", [5], 10, sampling_params=SamplingParams(top_k=2**64 - 1)),
        "top_k must be below 2**63, got 18446744073709551615",
    ),
    "a million logprobs": (
        TextContext("x", [5], 10, logprobs=10**6),
        "logprobs must be in [0, 20], got 1000000",
    ),
    "image beyond the prompt": (
        TextContext("x", [5, 6], 10, images=[image(1, 2**40)]),
        "images must cover prompt positions in order, without overlapping",
    ),
    "overlapping images": (
        TextContext("x", [5, 6, 7, 8], 10, images=[image(0, 3), image(2, 4)]),
        "images must cover prompt positions in order, without overlapping",
    ),
    "generated id beyond int64": (
        TextContext("x", [5], 10, generated_token_ids=[6, 2**64 - 1]),
        "generated token ids must be in [0, 2147483648)",
    ),
    "more generated tokens than the request may have": (
        TextContext("x", [5], 10, generated_token_ids=[6] * 100_000),
        "the prompt and the 100000 tokens generated already leave no room to generate within "
        "10 tokens",
    ),
    "a request id of 10,000 characters": (
        TextContext("x" * 10_000, [5], 10),
        "the request id must be 1 to 256 characters",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_CONTEXTS))
def test_hostile_request_values_are_refused_to_their_sender_alone(system, case):
    _, context, frontend, backend = system
    client, intruder = api_client(context, frontend), api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("innocent", [7, 8], max_new_tokens=10))))
    hostile, error = HOSTILE_CONTEXTS[case]
    intruder.send(encode(SubmitRequest(hostile)))
    refused = refusal_of(intruder, hostile.request_id)
    assert (refused.error_kind, refused.error) == (ErrorKind.INVALID_REQUEST, error)
    assert collect(client, ["innocent"])[0] == {"innocent": expected([7, 8], 10)}
    assert intruder.poll(0) == 0  # nothing else went to the intruder


LORA_FRAMES = {
    "a name of 10,000 characters": (
        LoRARequest(LoRAOperation.LOAD, "x" * 10_000, "/adapters/x"),
        "lora_name must be 1 to 128 characters",
    ),
    "a path of 100,000 characters": (
        LoRARequest(LoRAOperation.LOAD, "x", "/" * 100_000),
        "lora_path must be a path of at most 4096 characters",
    ),
    "no path": (LoRARequest(LoRAOperation.LOAD, "x"), "lora_path is required"),
    "LoRA not enabled": (
        LoRARequest(LoRAOperation.LOAD, "x", "/adapters/x"),
        "LoRA is not enabled (start the workers with --enable-lora)",
    ),
    "an unknown adapter": (
        LoRARequest(LoRAOperation.UNLOAD, "nobody"),
        "The LoRA adapter 'nobody' cannot be found.",
    ),
}


@pytest.mark.parametrize("case", list(LORA_FRAMES))
def test_hostile_lora_operations_are_answered_to_their_sender_alone(system, case):
    _, context, frontend, backend = system
    client, intruder = api_client(context, frontend), api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("innocent", [7, 8], max_new_tokens=10))))
    request, error = LORA_FRAMES[case]
    intruder.send(encode(LoRAOperationRequest(2**63 - 1, request)))
    answer = receive(intruder)
    assert isinstance(answer, LoRAOperationResult) and answer.ticket == 2**63 - 1
    assert not answer.response.ok and error in answer.response.message
    named = msgspec.structs.replace(ctx("named", [7, 8]), lora_name=request.lora_name, lora_id=9)
    intruder.send(encode(SubmitRequest(named)))
    refused = refusal_of(intruder, "named")  # no adapter of that name: its lora_id is no help
    assert (refused.error_kind, refused.error) == (
        ErrorKind.NOT_FOUND,
        "the LoRA adapter this request names is not loaded",
    )
    assert collect(client, ["innocent"])[0] == {"innocent": expected([7, 8], 10)}
    assert intruder.poll(0) == 0


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", float("nan")), ("repetition_penalty", float("inf"))]
)
def test_sampling_numbers_that_are_not_numbers_are_refused_by_request_id(system, field, value):
    """A NaN or an infinity refused by ``SamplingParams`` itself (the frame does not decode:
    answered by its request id, so its sender does not wait forever) or, if its range admits
    it, by the scheduler's check; either way an INVALID_REQUEST naming the field."""
    _, context, frontend, backend = system
    client, intruder = api_client(context, frontend), api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("innocent", [3], max_new_tokens=8))))
    fields = {"request_id": "bad", "prompt_token_ids": [1], "max_length": 4}
    intruder.send(msgspec.msgpack.encode(["submit", {**fields, "sampling_params": {field: value}}]))
    refused = refusal_of(intruder, "bad")
    assert refused.error_kind is ErrorKind.INVALID_REQUEST
    assert field in refused.error
    assert collect(client, ["innocent"])[0] == {"innocent": expected([3], 8)}


def test_the_vocabulary_a_worker_reports_bounds_every_token_id():
    vocab = 1000
    good = TextContext("a", [0, 999], 10, eos_token_ids=[-1, 2], logprobs=20)
    assert context_problem(good, vocab) is None
    assert context_problem(TextContext("a", [1000], 10), vocab) == (
        "prompt token ids must be in [0, 1000)"
    )
    stops = SamplingParams(stop_token_ids=[1] * 1001)
    assert context_problem(TextContext("a", [1], 10, sampling_params=stops), vocab) == (
        "1001 stop_token_ids, more than the vocabulary's 1000 tokens"
    )
    assert context_problem(TextContext("a", [1], 10, eos_token_ids=[-2]), vocab) == (
        "eos_token_ids must be in [-1, 1000)"
    )


def test_an_error_while_admitting_one_request_refuses_it_alone(system, monkeypatch):
    server, context, frontend, backend = system
    client = api_client(context, frontend)
    start_worker(context, backend, client)
    add_request = server.placement.add_request

    def add_or_raise(request, client_id):
        if request.request_id == "boom":
            raise RuntimeError("a bug that only this request triggers")
        return add_request(request, client_id)

    monkeypatch.setattr(server.placement, "add_request", add_or_raise)
    client.send(encode(SubmitRequest(ctx("innocent", [1, 1], max_new_tokens=10))))
    client.send(encode(SubmitRequest(ctx("boom", [2]))))
    tokens, finals = collect(client, ["innocent", "boom"])
    assert tokens["innocent"] == expected([1, 1], 10)
    assert (finals["boom"].error_kind, finals["boom"].error) == (
        ErrorKind.INTERNAL,
        "the scheduler could not admit this request",
    )
    client.send(encode(SubmitRequest(ctx("after", [9]))))
    assert collect(client, ["after"])[0] == {"after": expected([9], 5)}


def test_an_api_server_cannot_abort_another_ones_requests(system):
    _, context, frontend, backend = system
    owner, intruder = api_client(context, frontend), api_client(context, frontend)
    worker = start_worker(context, backend, owner)
    worker.step_delay_s = 0.01  # the abort arrives while the request runs
    owner.send(encode(SubmitRequest(ctx("victim", [5, 6], max_new_tokens=30))))
    first = receive(owner).results["victim"]
    assert first.status is SchedulerStatus.ACTIVE
    intruder.send(encode(AbortRequests(["victim", "unknown"])))
    tokens, finals = collect(owner, ["victim"])
    assert first.result.tokens + tokens["victim"] == expected([5, 6], 30)
    assert finals["victim"].status is SchedulerStatus.COMPLETE
    assert intruder.poll(200) == 0  # no result of someone else's request
    owner.send(encode(SubmitRequest(ctx("mine", [1], max_new_tokens=200))))
    assert receive(owner).results["mine"].status is SchedulerStatus.ACTIVE
    owner.send(encode(AbortRequests(["mine"])))  # its own: aborted
    assert collect(owner, ["mine"])[1]["mine"].status is SchedulerStatus.CANCELLED


def test_embedding_aborts_are_bound_to_their_submitter():
    embeddings = Embeddings(SchedulerConfig())
    embeddings.add_group("g")
    assert embeddings.submit(b"owner", [EmbeddingsContext("e", [1, 2])]) == {}
    refused = embeddings.submit(b"owner", [EmbeddingsContext("big", [2**63])])
    assert refused[b"owner"]["big"].error == "token ids must be in [0, 2147483648)"
    embeddings.abort(b"intruder", ["e"])
    assert [item.context.request_id for item in embeddings.queue] == ["e"]
    embeddings.abort(b"owner", ["e"])
    assert embeddings.num_waiting == 0


# -- the scheduler's backend: what a worker (or anyone on its socket) registers -------------------


def register(context, backend, ready: WorkerReady) -> Shutdown | None:
    """Send ``ready`` from a new connection; the Shutdown it gets back within a second."""
    intruder = api_client(context, backend)
    intruder.send(encode(ready))
    answer = decode_worker(intruder.recv()) if intruder.poll(TIMEOUT_MS) else None
    intruder.close(linger=0)
    return answer


HOSTILE_HANDSHAKES = {
    "2**40 KV blocks": (
        {"num_kv_blocks": 2**40},
        "num_kv_blocks 1099511627776 is outside [1, 1048576]",
    ),
    "2**31 ranks": ({"tensor_parallel_size": 2**31}, "tensor_parallel_size 2147483648 is "),
    "rank beyond the group": ({"rank": 5, "tensor_parallel_size": 2}, "rank 5 is outside [0, 1]"),
    "no block size": ({"block_size": 0}, "block_size 0 is outside [1, 1024]"),
    "a context of 2**40": ({"max_model_len": 2**40}, "max_model_len 1099511627776 is outside"),
    "a vocabulary of 2**40": ({"vocab_size": 2**40}, "vocab_size 1099511627776 is outside"),
    "2**40 LoRA slots": ({"max_loras": 2**40}, "max_loras 1099511627776 is outside [0, 256]"),
    "a step budget of 2**40 tokens": (
        {"step_tokens": 2**40},
        "step_tokens 1099511627776 is outside [0, 1048576]",
    ),
    "a group name of 100,000 characters": (
        {"group": "g" * 100_000},
        "group must be at most 256 printable characters",
    ),
    "a control character in the model name": (
        {"model_name": "m\x1b[2J"},
        "model_name must be at most 256 printable characters",
    ),
    "an object dtype": (
        {"kv_layout": KVLayout(2, 4, 8, "object"), "role": WorkerRole.DECODE},
        "kv_layout dtype 'object' is not one of float32, bfloat16, float16",
    ),
    "a transfer address of another scheme": (
        {"transfer_addr": "udp://10.0.0.1:9"},
        "transfer_addr 'udp://10.0.0.1:9' is not a tcp:// or ipc:// address",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_HANDSHAKES))
def test_hostile_handshakes_are_refused_and_the_workers_serve_on(system, case):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    worker = start_worker(context, backend, client)
    worker.step_delay_s = 0.01
    client.send(encode(SubmitRequest(ctx("innocent", [4, 4], max_new_tokens=30))))
    changes, error = HOSTILE_HANDSHAKES[case]
    started = time.monotonic()
    answer = register(context, backend, WorkerReady(**{**READY, **changes}))
    assert isinstance(answer, Shutdown) and error in answer.reason
    assert answer.reason.startswith("refused the handshake of a worker of group ")
    assert stats(client).num_kv_blocks_total == 64  # the real worker's pool alone
    assert time.monotonic() - started < 5  # no pool of 2**40 blocks was built
    assert collect(client, ["innocent"])[0] == {"innocent": expected([4, 4], 30)}
    assert not worker.got_shutdown.is_set()


READY = {"protocol_version": PROTOCOL_VERSION, "model_name": "fake", "num_kv_blocks": 64}
READY |= {"block_size": 4, "max_model_len": 256}
"""The fake worker's handshake (``tests.support.scheduler_sockets.FakeWorkerThread``)."""


@pytest.mark.parametrize("system", [{"worker_return_timeout_s": 0}], indirect=True)
def test_a_second_handshake_cannot_take_a_serving_group(system):
    """It used to retire the real workers and take their traffic. A restarted worker still
    takes the group's place once the old connection has closed."""
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    worker = start_worker(context, backend, client, die_after_steps=40)
    client.send(encode(SubmitRequest(ctx("innocent", [2, 3], max_new_tokens=20))))
    answer = register(context, backend, WorkerReady(**READY))  # the same group, ""
    assert answer == Shutdown(
        "worker rank 0 of group '': that group is serving; a worker may take its place once "
        "the old one has disconnected"
    )
    tokens, finals = collect(client, ["innocent"])
    assert tokens == {"innocent": expected([2, 3], 20)}
    assert finals["innocent"].status is SchedulerStatus.COMPLETE
    assert not worker.got_shutdown.is_set() and stats(client).workers_ready
    client.send(encode(SubmitRequest(ctx("dies", [1], max_new_tokens=100))))
    assert collect(client, ["dies"])[1]["dies"].error == "the worker serving this request died"
    start_worker(context, backend, client)  # the restarted worker registers the group anew
    client.send(encode(SubmitRequest(ctx("after", [6]))))
    assert collect(client, ["after"])[0] == {"after": expected([6], 5)}


# -- a decode worker's KV-transfer socket ---------------------------------------------------------


class TransferEnds:
    """A decode rank's receiver (8 blocks, every head) and a prefill rank's sender, and a raw
    PUSH socket for the intruder, on one context."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.security = TransportSecurity()
        self.binder = self.security.binder(self.context)
        self.receiver = KVReceiver(
            self.context, self.binder, "tcp://127.0.0.1:*", empty_cache(8, 4), LAYOUT, 0, 1
        )
        self.source = filled_cache(8, (0, 4), seed=3)
        self.sender = KVSender(self.context, self.security, self.source, LAYOUT, 0, 1)
        self.intruder = self.context.socket(zmq.PUSH)
        self.intruder.linger = 0
        self.intruder.connect(self.receiver.address)

    def forge(self, transfer_id: int, num_blocks: int, fill: float = 666.0, **changes) -> None:
        header = KVShardHeader(transfer_id, 0, 0, 4, num_blocks, time.time())
        header = msgspec.structs.replace(header, **changes)
        payload = np.full(num_blocks * LAYOUT.block_bytes(4) // 4, fill, dtype=np.float32)
        self.intruder.send_multipart([msgspec.msgpack.encode(header), payload.tobytes()])

    def drain(self, quiet_ms: int = 300) -> list:
        """Receive until nothing arrived for ``quiet_ms`` (every frame sent so far has been
        handled); the reports of transfers completed meanwhile."""
        reports = []
        while self.receiver.socket.poll(quiet_ms):
            reports += self.receiver.receive()
        return reports

    def blocks_hold_source(self, destination: list[int], source: list[int]) -> bool:
        caches = zip(self.receiver._cache.cache.key_caches, self.source.key_caches, strict=True)
        return all(torch.equal(got[destination], want[source]) for got, want in caches)

    def close(self) -> None:
        for endpoint in (self.sender, self.receiver):
            endpoint.close()
        self.intruder.close()
        self.binder.close()
        self.context.term()


@pytest.fixture
def transfer():
    ends = TransferEnds()
    yield ends
    ends.close()


def test_transfer_ids_are_unguessable():
    placement = DisaggregatedPlacement(SchedulerConfig(), SchedulerCounters())
    ids = [placement.new_transfer_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(0 <= i < 2**64 for i in ids)
    assert sum(i >= 2**32 for i in ids) > 990  # 64 random bits, not a counter


def test_forged_shards_never_reach_an_announced_transfers_blocks(transfer):
    """An intruder guesses ids (the small ones a counter would have used) and floods shards of
    the right size; the real transfer's blocks hold exactly what its prefill rank sent."""
    real_id = secrets.randbits(64)
    assert transfer.receiver.expect(KVReceive(real_id, "innocent", [5, 6], 1)) is None
    for guess in range(8):
        transfer.forge(guess, 2)
    transfer.forge(real_id ^ 1, 2)  # a near miss
    transfer.sender.send([KVSend(real_id, "innocent", [1, 2], [transfer.receiver.address])])
    reports = poll_reports(transfer.receiver) + transfer.drain()
    assert [r.transfer_id for r in reports] == [real_id]
    assert reports[0].num_bytes == 2 * LAYOUT.block_bytes(4)
    assert transfer.blocks_hold_source([5, 6], [1, 2])
    assert transfer.receiver.num_early_shards == 9  # kept, bounded, and never written
    transfer.receiver.cancel(list(range(8)))
    assert transfer.receiver.num_early_shards == 1


def test_a_shard_for_an_announced_transfer_with_other_sizes_is_dropped(transfer):
    real_id = secrets.randbits(64)
    transfer.receiver.expect(KVReceive(real_id, "innocent", [5, 6], 1))
    transfer.forge(real_id, 3)  # three blocks, two reserved
    transfer.forge(real_id, 2, head_start=1)  # heads it does not hold in that shard
    transfer.forge(real_id, 2, source_rank=7)  # a prefill rank the group does not have
    transfer.forge(real_id, 2, started_at=float("nan"))
    assert transfer.drain() == []
    assert torch.count_nonzero(transfer.receiver._cache.cache.key_caches[0][5:7]) == 0
    transfer.sender.send([KVSend(real_id, "innocent", [3, 4], [transfer.receiver.address])])
    assert [r.transfer_id for r in poll_reports(transfer.receiver)] == [real_id]
    assert transfer.blocks_hold_source([5, 6], [3, 4])


def test_a_flood_of_early_shards_is_bounded_by_count_and_bytes(transfer, monkeypatch):
    for _ in range(kv_early_shards.MAX_EARLY_SHARDS + 20):
        transfer.forge(secrets.randbits(64), 1)
    transfer.drain()
    assert transfer.receiver.num_early_shards == kv_early_shards.MAX_EARLY_SHARDS
    transfer.receiver.cancel(transfer.receiver._early.transfer_ids)
    monkeypatch.setattr(kv_early_shards, "MAX_EARLY_SHARD_BYTES", 3 * LAYOUT.block_bytes(4))
    for _ in range(5):
        transfer.forge(secrets.randbits(64), 1)
    transfer.forge(secrets.randbits(64), 8)  # a whole pool: more than the room left
    transfer.drain()
    assert transfer.receiver.num_early_shards == 3
    assert transfer.receiver._early.num_bytes == 3 * LAYOUT.block_bytes(4)
    # Shards that could never fit anything are not kept at all.
    transfer.forge(secrets.randbits(64), 9)  # more blocks than the pool
    transfer.forge(secrets.randbits(64), 1, head_stop=5)  # heads beyond the model's
    transfer.drain()
    assert transfer.receiver.num_early_shards == 3
    # An announced transfer still arrives whole.
    real_id = secrets.randbits(64)
    transfer.receiver.expect(KVReceive(real_id, "innocent", [0, 7], 1))
    transfer.sender.send([KVSend(real_id, "innocent", [6, 5], [transfer.receiver.address])])
    assert [r.transfer_id for r in poll_reports(transfer.receiver)] == [real_id]
    assert transfer.blocks_hold_source([0, 7], [6, 5])


def test_a_frame_bigger_than_the_pool_drops_that_connection_only(transfer):
    oversized = bytes(8 * LAYOUT.block_bytes(4) + 1)  # the pool holds 8 blocks
    header = KVShardHeader(1, 0, 0, 4, 8, time.time())
    transfer.intruder.send_multipart([msgspec.msgpack.encode(header), oversized])
    assert transfer.drain() == [] and transfer.receiver.num_early_shards == 0
    real_id = secrets.randbits(64)
    transfer.receiver.expect(KVReceive(real_id, "innocent", [2], 1))
    transfer.sender.send([KVSend(real_id, "innocent", [4], [transfer.receiver.address])])
    assert [r.transfer_id for r in poll_reports(transfer.receiver)] == [real_id]
    assert transfer.blocks_hold_source([2], [4])


def test_curve_transfers_need_no_scheduler_secret_and_refuse_an_api_servers_key(tmp_path):
    """Each host holds only its own key files (``FILES_BY_PROCESS``): the decode rank binds
    without the scheduler's secret key, the prefill rank's transfer arrives, and a sender with
    the API servers' key pair gets nothing through."""
    generate_curve_keys(tmp_path / "all")
    decode_keys = role_keys(tmp_path / "all", tmp_path, "decode worker")
    prefill_keys = role_keys(tmp_path / "all", tmp_path, "worker (hybrid, prefill or embedding)")
    assert not (decode_keys / "scheduler.key_secret").exists()
    intruder_keys = role_keys(tmp_path / "all", tmp_path, "API server")
    shutil.copy(intruder_keys / "api_server.key_secret", intruder_keys / "worker.key_secret")
    shutil.copy(tmp_path / "all" / "kv_transfer.key", intruder_keys)
    context = zmq.Context()
    binder = TransportSecurity(curve_keys_dir=decode_keys).binder(context)
    receiver = KVReceiver(context, binder, "tcp://127.0.0.1:*", empty_cache(8, 4), LAYOUT, 0, 1)
    source = filled_cache(8, (0, 4), seed=5)
    senders = [
        KVSender(context, TransportSecurity(curve_keys_dir=keys), source, LAYOUT, 0, 1)
        for keys in (intruder_keys, prefill_keys)
    ]
    try:
        forged_id, real_id = secrets.randbits(64), secrets.randbits(64)
        receiver.expect(KVReceive(forged_id, "forged", [0], 1))
        receiver.expect(KVReceive(real_id, "innocent", [3, 4], 1))
        senders[0].send([KVSend(forged_id, "forged", [7], [receiver.address])])
        senders[1].send([KVSend(real_id, "innocent", [1, 2], [receiver.address])])
        reports = poll_reports(receiver)
        while receiver.socket.poll(300):
            reports += receiver.receive()
        assert [report.transfer_id for report in reports] == [real_id]
        assert receiver.num_expected == 1  # the forged transfer's shard never came through
        caches = zip(receiver._cache.cache.key_caches, source.key_caches, strict=True)
        assert all(torch.equal(got[[3, 4]], want[[1, 2]]) for got, want in caches)
    finally:
        for endpoint in (*senders, receiver):
            endpoint.close()
        binder.close()
        context.term()


def test_the_kv_block_bound_is_the_schedulers_flag():
    from scheduler.__main__ import parse_args

    args = parse_args(["--frontend-addr", "ipc://a", "--backend-addr", "ipc://b"])
    assert args.max_worker_kv_blocks == WorkerLimits().max_kv_blocks == 1 << 20
    args = parse_args(
        ["--frontend-addr", "ipc://a", "--backend-addr", "ipc://b", "--max-worker-kv-blocks", "32"]
    )
    limits = WorkerLimits(max_kv_blocks=args.max_worker_kv_blocks)
    assert ready_problem(WorkerReady(**{**READY, "num_kv_blocks": 32}), limits) is None
    assert ready_problem(WorkerReady(**READY), limits) == (
        "num_kv_blocks 64 is outside [1, 32] (give the worker a larger --block-size or a "
        "smaller --kv-cache-memory, or the scheduler a larger --max-worker-kv-blocks)"
    )
    # No KV cache at all:
    embedding = WorkerReady(PROTOCOL_VERSION, "e", 0, 1, 512, role=WorkerRole.EMBEDDING)
    assert ready_problem(embedding, limits) is None
    with pytest.raises(ValueError, match="max_kv_blocks must be at least 1"):
        WorkerLimits(max_kv_blocks=0)
