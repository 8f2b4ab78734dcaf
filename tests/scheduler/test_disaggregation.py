"""Prefill/decode disaggregation: its placement of requests and the KV transfer itself.

The placement runs against model-free workers (``FakeTokenGenerator``: the next token is a
function of every token so far, so a request computed on two groups must produce what one group
produces). The transfer runs real ZeroMQ sockets between real KV caches, with tensor-parallel
sizes that differ on the two sides.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from interfaces import ErrorKind, SchedulerStatus, TextContext
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_worker import KVReceive, KVSend, KVTransfers, ScheduledStep
from interfaces.transport import TransportSecurity
from interfaces.worker_to_scheduler import (
    KVLayout,
    KVReceived,
    WorkerReady,
    WorkerRole,
)
from scheduler.split_request import Phase
from tests.support.kv_caches import BLOCK_SIZE, LAYOUT, empty_cache, filled_cache, poll_reports
from tests.support.placement_cluster import DISAGGREGATED, HYBRID, PlacementCluster
from worker.kv_transfer import KVReceiver, KVSender, Shard, head_range, transfer_plan

# -- the placement --------------------------------------------------------------------------------


PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(5 + 6 * i)] for i in range(5)}


def test_disaggregated_requests_produce_the_hybrid_tokens_and_transfer_the_prompt_blocks():
    hybrid, split = PlacementCluster(HYBRID), PlacementCluster(DISAGGREGATED)
    for cluster in (hybrid, split):
        for request_id, prompt in PROMPTS.items():
            cluster.submit(request_id, prompt)
    expected = hybrid.run()
    assert split.run() == expected and len(expected) == len(PROMPTS)

    sends = [m for name, m in split.sent if isinstance(m, ScheduledStep) for m in m.kv_sends]
    assert sorted(send.request_id for send in sends) == sorted(PROMPTS)  # once each
    for send in sends:  # exactly the prompt's blocks, to the decode group's ranks
        assert len(send.block_ids) == -(-len(PROMPTS[send.request_id]) // BLOCK_SIZE)
        assert send.destinations == ["inproc://d"]
    announced = [m for name, m in split.sent if isinstance(m, KVTransfers)]
    assert all(name == "d" for name, m in split.sent if isinstance(m, KVTransfers))
    assert sorted(r.request_id for m in announced for r in m.receive) == sorted(PROMPTS)
    # Each announcement precedes the step that sends the blocks.
    order = [(n, m) for n, m in split.sent]
    for send in sends:
        announce = next(i for i, (_, m) in enumerate(order) if isinstance(m, KVTransfers)
                        and any(r.transfer_id == send.transfer_id for r in m.receive))  # fmt: skip
        step = next(i for i, (_, m) in enumerate(order) if isinstance(m, ScheduledStep)
                    and send in m.kv_sends)  # fmt: skip
        assert announce < step

    stats = split.placement.stats()
    assert stats.kv_transfer_bytes_total == sum(100 * len(send.block_ids) for send in sends)
    assert sum(stats.kv_transfer_seconds_counts) == len(PROMPTS)
    assert split.used_blocks() == {"p": 0, "d": 0}


def hybrid_tokens(prompts: dict[str, list[int]], max_new_tokens: int = 6) -> dict:
    cluster = PlacementCluster(HYBRID)
    for request_id, prompt in prompts.items():
        cluster.submit(request_id, prompt, max_new_tokens)
    return cluster.run()


def test_decoding_waits_for_both_the_first_token_and_every_decode_rank():
    cluster = PlacementCluster(DISAGGREGATED)
    cluster.placement.groups["d"].size = 2  # two decode ranks must report
    cluster.deliver_transfers = False
    prompt = list(range(1, 10))
    cluster.submit("a", prompt)
    first = {}
    while not first:
        first = cluster.step()
    placement = cluster.placement.requests["a"]
    assert placement.phase is Phase.TRANSFER and first["a"].status is SchedulerStatus.ACTIVE
    decode = cluster.placement.groups["d"].scheduler
    assert cluster.step() == {}  # nothing runs while the blocks travel
    cluster.placement.on_kv_received("d", KVReceived(placement.transfer_id, 0, 10, 0.1))
    assert "a" in decode.reserved and not decode.running
    cluster.placement.on_kv_received("d", KVReceived(placement.transfer_id, 1, 10, 0.3))
    assert decode.running[0].request_id == "a" and placement.phase is Phase.DECODE
    stats = cluster.placement.stats()
    assert (stats.kv_transfer_bytes_total, stats.kv_transfer_seconds_sum) == (20, 0.3)
    assert cluster.run()["a"] == hybrid_tokens({"a": prompt})["a"]


def test_an_abort_mid_transfer_frees_both_sides_and_cancels_the_transfer():
    cluster = PlacementCluster(DISAGGREGATED)
    cluster.deliver_transfers = False
    cluster.submit("a", list(range(1, 20)))
    while "a" not in cluster.step():
        pass
    transfer_id = cluster.placement.requests["a"].transfer_id
    assert cluster.used_blocks()["d"] == 5  # 19 prompt tokens and the first output: 20 / 4

    results = cluster.placement.abort_requests(["a"])
    assert results[b"client"]["a"].status is SchedulerStatus.CANCELLED
    assert cluster.used_blocks() == {"p": 0, "d": 0}
    name, message = cluster.placement.schedule([])[0]
    assert (name, message) == ("d", KVTransfers(cancel=[transfer_id]))
    # A report that arrives afterwards is ignored.
    cluster.placement.on_kv_received("d", KVReceived(transfer_id, 0, 10, 0.1))
    cluster.placement.check_integrity()
    assert cluster.placement.requests == {}


def test_a_transfer_that_does_not_finish_in_time_fails_its_request_clearly():
    cluster = PlacementCluster(DISAGGREGATED, kv_transfer_timeout_s=5.0)
    cluster.deliver_transfers = False
    cluster.submit("a", list(range(1, 9)))
    while "a" not in cluster.step():
        pass
    placement = cluster.placement
    assert placement.check_timeouts(time.monotonic() + 1) == {}
    results = placement.check_timeouts(time.monotonic() + 6)
    result = results[b"client"]["a"]
    assert (result.status, result.error_kind) == (SchedulerStatus.CANCELLED, ErrorKind.UNAVAILABLE)
    assert result.error == (
        "the KV cache transfer from prefill group 'p' to decode group 'd' did not finish within 5 s"
    )
    assert cluster.used_blocks() == {"p": 0, "d": 0}


def test_a_request_that_ends_at_its_first_token_frees_its_decode_reservation():
    cluster = PlacementCluster(DISAGGREGATED)
    prompt = list(range(1, 9))
    cluster.submit("a", prompt, max_new_tokens=1)
    cluster.deliver_transfers = False
    tokens = cluster.run()
    assert tokens == hybrid_tokens({"a": prompt}, max_new_tokens=1)
    assert cluster.used_blocks() == {"p": 0, "d": 0}
    # Its first token is its last: no blocks are sent, none announced.
    assert not any(
        isinstance(m, KVTransfers) or getattr(m, "kv_sends", []) for _, m in cluster.sent
    )


def test_a_request_that_ends_at_its_first_token_by_eos_cancels_its_transfer():
    cluster = PlacementCluster(DISAGGREGATED)
    prompt = list(range(1, 9))
    first = hybrid_tokens({"a": prompt})["a"][0]
    context = TextContext("a", prompt, len(prompt) + 6, eos_token_ids=[first])
    assert cluster.placement.add_request(context, b"client") is None
    cluster.deliver_transfers = False
    assert cluster.run() == {"a": [first]}
    assert cluster.used_blocks() == {"p": 0, "d": 0}
    cancels = [m.cancel for _, m in cluster.sent if isinstance(m, KVTransfers) and m.cancel]
    sends = [send.transfer_id for _, m in cluster.sent for send in getattr(m, "kv_sends", [])]
    assert len(sends) == 1 and cancels == [sends]  # the transfer under way is called off


def test_requests_wait_for_decode_blocks_and_survive_preemption_on_the_decode_group():
    # 10 blocks of 4 tokens: the first two reserve 4 each, the third waits for 3; and the
    # first two, growing to 6 blocks each, cannot both stay on the decode group.
    prompts = {"a": list(range(1, 15)), "b": list(range(20, 34)), "c": list(range(40, 50))}
    cluster = PlacementCluster(DISAGGREGATED, num_blocks=10, max_num_batched_tokens=64)
    for request_id, prompt in prompts.items():
        cluster.submit(request_id, prompt, max_new_tokens=8)
    cluster.step()
    assert [p.request_id for p in cluster.placement.queue] == ["c"]  # no decode blocks yet
    assert cluster.run() == hybrid_tokens(prompts, max_new_tokens=8)


def test_with_a_migration_limit_of_0_the_death_of_a_group_fails_its_requests_on_both_sides():
    cluster = PlacementCluster(DISAGGREGATED, migration_limit=0)
    cluster.deliver_transfers = False
    cluster.submit("a", list(range(1, 9)))
    cluster.submit("b", list(range(1, 40)))
    cluster.step()
    results = cluster.placement.remove_group("d", "the worker serving this request died")
    assert {r: (x.status, x.error_kind) for r, x in results[b"client"].items()} == {
        "a": (SchedulerStatus.CANCELLED, ErrorKind.UNAVAILABLE),
        "b": (SchedulerStatus.CANCELLED, ErrorKind.UNAVAILABLE),
    }
    assert cluster.used_blocks() == {"p": 0} and cluster.placement.requests == {}
    refused = cluster.placement.add_request(TextContext("c", [1, 2], 10), b"client")
    assert refused.error_kind is ErrorKind.UNAVAILABLE  # no decode group is left


def test_with_a_migration_limit_of_0_a_dead_prefill_group_fails_only_those_not_decoding():
    cluster = PlacementCluster(DISAGGREGATED, max_num_batched_tokens=64, migration_limit=0)
    cluster.submit("decoding", list(range(1, 9)), max_new_tokens=20)
    cluster.step()
    cluster.step()
    placements = cluster.placement.requests
    assert placements["decoding"].phase is Phase.DECODE
    cluster.submit("prefilling", list(range(1, 40)))
    cluster.placement.schedule([])  # dispatched to the prefill group, not yet run
    results = cluster.placement.remove_group("p", "the worker serving this request died")
    assert list(results[b"client"]) == ["prefilling"]
    assert list(placements) == ["decoding"]
    refused = cluster.placement.add_request(TextContext("new", [1, 2], 10), b"client")
    assert refused.error_kind is ErrorKind.UNAVAILABLE  # no prefill group left...
    tokens = cluster.run()  # ...but the request already decoding runs to its end
    assert len(tokens["decoding"]) == 20


def test_stats_count_each_role_while_a_role_is_missing():
    cluster = PlacementCluster({"d": WorkerRole.DECODE})
    stats = cluster.placement.stats()
    assert not stats.workers_ready
    assert stats.num_requests_running_by_role == {"prefill": 0, "decode": 0}
    assert stats.num_requests_waiting_by_role == {"prefill": 0, "decode": 0}


def test_groups_that_cannot_work_together_are_refused_with_the_reason():
    cluster = PlacementCluster(DISAGGREGATED)
    workers, placement = cluster.workers, cluster.placement

    def register(name: str, role: WorkerRole, **changes) -> str | None:
        fields = {"protocol_version": PROTOCOL_VERSION, "model_name": "m", "num_kv_blocks": 64}
        fields |= {"block_size": BLOCK_SIZE}
        fields |= {"max_model_len": 256, "kv_layout": LAYOUT, "transfer_addr": "inproc://x"}
        ready = WorkerReady(**{**fields, **changes}, role=role, group=name)
        workers.register(name.encode(), ready)
        return placement.add_group(workers.groups[name])

    assert register("h", WorkerRole.HYBRID) == (
        "group 'h' (hybrid) cannot serve: hybrid groups and prefill/decode groups cannot serve "
        "together; 'd' (decode), 'p' (prefill) already serve"
    )
    assert register("d2", WorkerRole.DECODE, block_size=8) == (
        "group 'd2' (decode) cannot serve: block_size 8 differs from the served groups' 4"
    )
    other = KVLayout(2, 4, 8, "bfloat16")
    assert "KV blocks could not be transferred between them" in register(
        "p2", WorkerRole.PREFILL, kv_layout=other
    )
    assert register("d3", WorkerRole.DECODE, transfer_addr="") == (
        "group 'd3' (decode) cannot serve: a rank did not report the address it receives KV "
        "transfers at"
    )
    assert register("p3", WorkerRole.PREFILL) is None  # a second prefill group is welcome
    assert sorted(placement.groups) == ["d", "p", "p3"]


def test_requests_spread_over_the_prefill_groups_and_the_decode_groups():
    roles = {"p0": WorkerRole.PREFILL, "p1": WorkerRole.PREFILL,
             "d0": WorkerRole.DECODE, "d1": WorkerRole.DECODE}  # fmt: skip
    cluster = PlacementCluster(roles)
    for request_id, prompt in PROMPTS.items():
        cluster.submit(request_id, prompt)
    assert cluster.run() == hybrid_tokens(PROMPTS)
    senders = {name for name, m in cluster.sent if getattr(m, "kv_sends", [])}
    receivers = {name for name, m in cluster.sent if isinstance(m, KVTransfers)}
    assert (senders, receivers) == ({"p0", "p1"}, {"d0", "d1"})
    stats = cluster.placement.stats()
    assert stats.num_requests_running_by_role == {"prefill": 0, "decode": 0}


# -- the transfer ---------------------------------------------------------------------------------


def test_transfer_plan_sends_each_decode_rank_its_heads_from_the_lowest_holder():
    assert transfer_plan(4, 1, 1) == [Shard(0, 0, 0, 4)]
    assert transfer_plan(4, 2, 1) == [Shard(0, 0, 0, 2), Shard(1, 0, 2, 4)]
    assert transfer_plan(4, 1, 2) == [Shard(0, 0, 0, 2), Shard(0, 1, 2, 4)]
    assert transfer_plan(4, 2, 4) == [
        Shard(0, 0, 0, 1), Shard(0, 1, 1, 2), Shard(1, 2, 2, 3), Shard(1, 3, 3, 4)
    ]  # fmt: skip
    # Two heads over four prefill ranks: ranks 0 and 1 both hold head 0; rank 0 sends it.
    assert head_range(2, 1, 4) == (0, 1)
    assert transfer_plan(2, 4, 1) == [Shard(0, 0, 0, 1), Shard(2, 0, 1, 2)]
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        transfer_plan(4, 3, 1)


@pytest.mark.parametrize(("source_size", "destination_size"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_blocks_arrive_intact_across_tensor_parallel_sizes(source_size, destination_size):
    context = zmq.Context()
    security = TransportSecurity()
    binder = security.binder(context)
    heads = LAYOUT.num_kv_heads
    receivers, senders = [], []
    try:
        for rank in range(destination_size):
            first, last = head_range(heads, rank, destination_size)
            cache = empty_cache(16, last - first)
            address = f"inproc://kv-{rank}"
            receivers.append(
                KVReceiver(context, binder, address, cache, LAYOUT, rank, destination_size)
            )
        for rank in range(source_size):
            cache = filled_cache(16, head_range(heads, rank, source_size), 7)
            senders.append(KVSender(context, security, cache, LAYOUT, rank, source_size))
        source_blocks, destination_blocks = [3, 9, 4], [11, 0, 6]
        addresses = [receiver.address for receiver in receivers]
        send = KVSend(5, "a", source_blocks, addresses)
        sent = sum(sender.send([send]) for sender in senders)
        assert sent == 3 * LAYOUT.block_bytes(BLOCK_SIZE)  # the prompt's blocks x block bytes

        reports = []
        for receiver in receivers:
            assert receiver.expect(KVReceive(5, "a", destination_blocks, source_size)) is None
            reports += poll_reports(receiver)
        assert sum(report.num_bytes for report in reports) == sent
        assert sorted(report.rank for report in reports) == list(range(destination_size))

        full = filled_cache(16, (0, heads), 7)
        for rank, receiver in enumerate(receivers):
            first, last = head_range(heads, rank, destination_size)
            for layer in range(LAYOUT.num_layers):
                got = receiver._cache.cache.key_caches[layer][destination_blocks]
                want = full.key_caches[layer][source_blocks][:, :, first:last]
                assert torch.equal(got, want)
                got = receiver._cache.cache.value_caches[layer][destination_blocks]
                assert torch.equal(got, full.value_caches[layer][source_blocks][:, :, first:last])
    finally:
        for endpoint in [*senders, *receivers]:
            endpoint.close()
        binder.close()
        context.term()


def test_early_shards_wait_for_their_announcement_and_cancelled_ones_are_dropped():
    context = zmq.Context()
    security = TransportSecurity()
    binder = security.binder(context)
    receiver = KVReceiver(context, binder, "inproc://kv", empty_cache(8, 4), LAYOUT, 0, 1)
    sender = KVSender(context, security, filled_cache(8, (0, 4), 3), LAYOUT, 0, 1)
    try:
        sender.send([KVSend(1, "early", [0, 1], [receiver.address])])
        sender.send([KVSend(2, "cancelled", [2], [receiver.address])])
        deadline = time.monotonic() + 5
        while receiver.receive() == [] and time.monotonic() < deadline:
            if len(receiver._early) == 2:
                break
            receiver.socket.poll(100)
        receiver.cancel([2])
        report = receiver.expect(KVReceive(1, "early", [5, 6], 1))
        assert report is not None and report.num_bytes == 2 * LAYOUT.block_bytes(BLOCK_SIZE)
        assert receiver.expect(KVReceive(2, "cancelled", [7], 1)) is None
        assert torch.count_nonzero(receiver._cache.cache.key_caches[0][7]) == 0
        # A shard that does not match what was announced is dropped, not written.
        receiver.expect(KVReceive(3, "wrong", [4, 5, 6], 1))
        sender.send([KVSend(3, "wrong", [0, 1], [receiver.address])])
        time.sleep(0.2)
        assert receiver.receive() == [] and receiver.num_expected == 2
    finally:
        sender.close()
        receiver.close()
        binder.close()
        context.term()


def test_the_handshake_round_trips_with_its_layout_and_role():
    ready = WorkerReady(
        PROTOCOL_VERSION, "m", 8, 16, 64, 1, 2, WorkerRole.DECODE, "d", LAYOUT, "tcp://h:1"
    )
    encoded = msgspec.msgpack.encode(ready)
    assert msgspec.msgpack.decode(encoded, type=WorkerReady) == ready
    assert LAYOUT.block_bytes(16) == 2 * 2 * 16 * 4 * 8 * 4
