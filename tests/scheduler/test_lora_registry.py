"""The scheduler's LoRA adapters (scheduler.lora): loads across groups, refusals, unloads that
wait for their requests, groups that join or leave mid-load; and the prefix cache kept apart by
adapter (scheduler.block_hash)."""

from __future__ import annotations

import msgspec

from interfaces.lora import LoRAOperation, LoRARequest, LoRAResponse, LoRAStatus
from interfaces.scheduler_to_worker import LoRAUpdate
from interfaces.worker_to_scheduler import LoRAUpdated
from scheduler.block_hash import extend_block_hashes, hash_block, lora_root
from scheduler.lora import LoRAAdapters
from tests.support.fake_worker import FakeTokenGenerator
from tests.support.scheduler_steps import CLIENT as SCHEDULER_CLIENT
from tests.support.scheduler_steps import context, make_scheduler, run_step, run_to_completion

CLIENT = (b"api-0", 7)
OK = LoRAResponse(LoRAStatus.SUCCESS, "ok")


def load(name: str, path: str = "/adapters/x") -> LoRARequest:
    return LoRARequest(LoRAOperation.LOAD, name, path)


def unload(name: str) -> LoRARequest:
    return LoRARequest(LoRAOperation.UNLOAD, name)


def answered(update: LoRAUpdate, response: LoRAResponse = OK) -> LoRAUpdated:
    return LoRAUpdated(update.operation, update.lora_id, response)


def serving(*groups: str, max_loras: int = 2) -> LoRAAdapters:
    adapters = LoRAAdapters()
    for group in groups:
        assert adapters.group_joined(group, max_loras) == ([], [])
    return adapters


def test_a_load_is_usable_once_every_group_holds_it():
    adapters = serving("g0", "g1")
    replies, sends = adapters.request(CLIENT, load("alpha"))
    assert replies == []
    [(groups, update)] = sends
    assert groups == ["g0", "g1"] and update.operation is LoRAOperation.LOAD
    assert update.lora_name == "alpha" and update.lora_path == "/adapters/x"
    assert adapters.on_updated("g0", answered(update)) == ([], [])
    assert adapters.resolve("alpha") is None  # g1 has not answered
    replies, sends = adapters.on_updated("g1", answered(update))
    assert sends == []
    [(client, response)] = replies
    assert client == CLIENT and response.status is LoRAStatus.SUCCESS
    assert adapters.resolve("alpha") == update.lora_id > 0
    assert [info.name for info in adapters.infos()] == ["alpha"]


def test_a_load_one_group_refuses_is_undone_on_the_others():
    adapters = serving("g0", "g1")
    _, [(_, update)] = adapters.request(CLIENT, load("alpha"))
    adapters.on_updated("g0", answered(update))
    refusal = LoRAResponse(LoRAStatus.LOAD_INVALID_ADAPTER, "rank 64 is above --max-lora-rank")
    replies, sends = adapters.on_updated("g1", answered(update, refusal))
    assert replies == [(CLIENT, refusal)]
    [(groups, undo)] = sends
    assert groups == ["g0"] and undo.operation is LoRAOperation.UNLOAD
    assert undo.lora_id == update.lora_id
    assert adapters.resolve("alpha") is None and adapters.num_slots_taken == 0


def test_refusals_before_anything_is_sent():
    assert LoRAAdapters().request(CLIENT, load("alpha"))[0][0][1].status is (
        LoRAStatus.UNSPECIFIED_ERROR  # no group serves yet: a 503
    )
    disabled = serving("g0", max_loras=0)
    [(_, response)], sends = disabled.request(CLIENT, load("alpha"))
    assert sends == [] and "--enable-lora" in response.message
    adapters = serving("g0", max_loras=1)
    assert adapters.request(CLIENT, load("alpha"))[0] == []
    [(_, response)], _ = adapters.request(CLIENT, load("alpha"))  # while loading
    assert response.status is LoRAStatus.LOAD_NAME_EXISTS
    [(_, response)], _ = adapters.request(CLIENT, load("beta"))
    assert response.status is LoRAStatus.LOAD_ERROR and "--max-loras (1)" in response.message
    [(_, response)], _ = adapters.request(CLIENT, load("bad name"))
    assert response.status is LoRAStatus.LOAD_ERROR and "lora_name" in response.message
    [(_, response)], _ = adapters.request(CLIENT, LoRARequest(LoRAOperation.LOAD, "gamma"))
    assert "lora_path is required" in response.message
    [(_, response)], _ = adapters.request(CLIENT, unload("nobody"))
    assert response.status is LoRAStatus.UNLOAD_NAME_NONEXISTENT


def loaded(adapters: LoRAAdapters, name: str) -> int:
    _, [(groups, update)] = adapters.request(CLIENT, load(name))
    for group in groups:
        adapters.on_updated(group, answered(update))
    assert adapters.resolve(name) == update.lora_id
    return update.lora_id


def test_an_unload_takes_the_name_at_once_and_the_weights_when_unused():
    adapters = serving("g0")
    lora_id = loaded(adapters, "alpha")
    replies, sends = adapters.request(CLIENT, unload("alpha"))
    assert replies[0][1].status is LoRAStatus.SUCCESS and sends == []
    assert adapters.resolve("alpha") is None and adapters.num_slots_taken == 1
    assert adapters.release_drained({lora_id}) == []  # a request still uses it
    [(groups, update)] = adapters.release_drained(set())
    assert groups == ["g0"] and update == LoRAUpdate(LoRAOperation.UNLOAD, lora_id, "alpha")
    assert adapters.num_slots_taken == 0
    # Loaded again: a new id, so nothing cached under the old one is shared.
    assert loaded(adapters, "alpha") != lora_id


def test_a_group_that_serves_later_gets_every_adapter_first():
    adapters = serving("g0")
    lora_id = loaded(adapters, "alpha")
    replies, sends = adapters.group_joined("g1", 2)
    assert replies == []
    assert sends == [(["g1"], LoRAUpdate(LoRAOperation.LOAD, lora_id, "alpha", "/adapters/x"))]
    refusal = LoRAResponse(LoRAStatus.LOAD_ERROR, "all slots taken")
    assert adapters.on_updated("g1", answered(sends[0][1], refusal)) == ([], [])
    assert adapters.resolve("alpha") == lora_id  # still served where it loaded (logged)


def test_a_late_answer_from_a_joined_group_never_brings_back_an_unloaded_adapter():
    adapters = serving("g1", max_loras=2)
    lora_id = loaded(adapters, "x")
    [(_, resent)] = adapters.group_joined("g2", 2)[1]
    adapters.request(CLIENT, unload("x"))
    [(groups, _)] = adapters.release_drained(set())
    assert groups == ["g1", "g2"]
    assert adapters.on_updated("g2", answered(resent)) == ([], [])  # the load sent at join
    assert adapters.resolve("x") is None and adapters.num_slots_taken == 0
    assert loaded(adapters, "x") != lora_id  # a fresh load of the name, not "already loaded"
    assert loaded(adapters, "y") and adapters.num_slots_taken == 2  # both slots, none lost


def test_a_load_in_flight_reaches_a_group_that_joins_and_survives_one_that_leaves():
    adapters = serving("g0", "g1")
    _, [(_, update)] = adapters.request(CLIENT, load("alpha"))
    _, sends = adapters.group_joined("g2", 2)
    assert sends == [(["g2"], update)]
    adapters.on_updated("g0", answered(update))
    adapters.on_updated("g2", answered(update))
    replies, _ = adapters.group_left("g1")  # died before answering
    assert replies[0][1].status is LoRAStatus.SUCCESS
    assert adapters.resolve("alpha") == update.lora_id


def test_a_load_whose_groups_all_leave_fails():
    adapters = serving("g0")
    assert adapters.request(CLIENT, load("alpha"))[0] == []
    [(_, response)], sends = adapters.group_left("g0")
    assert response.status is LoRAStatus.UNSPECIFIED_ERROR and sends == []
    assert adapters.resolve("alpha") is None and adapters.max_loras == 0


def test_lora_modules_load_when_the_first_group_serves():
    adapters = LoRAAdapters([("alpha", "/a"), ("beta", "/b")])
    replies, sends = adapters.group_joined("g0", 4)
    assert replies == [] and [update.lora_name for _, update in sends] == ["alpha", "beta"]
    for _, update in sends:
        assert adapters.on_updated("g0", answered(update)) == ([], [])  # nobody to answer
    assert adapters.resolve("alpha") and adapters.resolve("beta")
    assert adapters.group_joined("g1", 4)[1] == [
        (["g1"], LoRAUpdate(LoRAOperation.LOAD, update.lora_id, update.lora_name, update.lora_path))
        for _, update in sends
    ]


def test_unexpected_answers_are_dropped():
    adapters = serving("g0")
    stray = LoRAUpdated(LoRAOperation.LOAD, 99, OK)
    assert adapters.on_updated("g0", stray) == ([], [])
    failure = LoRAResponse(LoRAStatus.UNLOAD_ERROR, "x")
    failed_unload = LoRAUpdated(LoRAOperation.UNLOAD, 99, failure)
    assert adapters.on_updated("g0", failed_unload) == ([], [])


def test_blocks_are_kept_apart_by_adapter():
    tokens = list(range(8))
    base, alpha, beta, salted = [], [], [], []
    extend_block_hashes(base, tokens, 4, None)
    extend_block_hashes(alpha, tokens, 4, None, lora_id=1)
    extend_block_hashes(beta, tokens, 4, None, lora_id=2)
    extend_block_hashes(salted, tokens, 4, "x", lora_id=1)
    assert len({base[0], alpha[0], beta[0], salted[0]}) == 4
    assert alpha[0] == hash_block(lora_root(1), tokens[:4])
    assert alpha[1] == hash_block(alpha[0], tokens[4:])  # the chain goes on as usual
    assert lora_root(1) != lora_root(2) and len(lora_root(1)) == 32


def test_the_scheduler_tells_the_worker_each_request_s_adapter_and_shares_no_blocks_across():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    prompt = list(range(10, 33))  # 5 full blocks
    base = context("base", prompt, max_new_tokens=2)
    scheduler.add_request(base, CLIENT)
    run_to_completion(scheduler, worker)
    for request_id, lora_id in (("alpha", 1), ("alpha-again", 1), ("beta", 2)):
        with_adapter = msgspec.structs.replace(
            context(request_id, prompt, max_new_tokens=2), lora_name=request_id, lora_id=lora_id
        )
        scheduler.add_request(with_adapter, SCHEDULER_CLIENT)
        step, _ = run_step(scheduler, worker)
        [new] = step.new_requests
        assert new.context.lora_id == lora_id
        cached = 20 if request_id == "alpha-again" else 0  # only alpha's own blocks are shared
        assert new.num_computed_tokens == cached
        run_to_completion(scheduler, worker)
