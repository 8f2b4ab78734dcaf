"""Tensor parallelism on the CPU with gloo: how weights split, greedy parity of TP=2/3/4 with
TP=1 and transformers, the scheduler's worker groups, two "hosts" on loopback, and a rank death.
"""

from __future__ import annotations

import os
import re
import signal
import time
from functools import cache
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interfaces.handshake import PROTOCOL_VERSION
from interfaces.worker_to_scheduler import WorkerReady
from scheduler.worker_group import WorkerGroups
from tests.support.clients import free_port, in_background, wait_until
from tests.support.engine import greedy_tokens
from tests.support.serve_process import (
    DEFAULT_MODEL_NAME,
    ServeProcess,
    alive,
    chat_messages,
    long_chat,
    role_processes,
    wait_until_ready,
)
from tests.support.tensor_parallel_ranks import (
    NUM_NEW_TOKENS,
    ScriptedRequest,
    greedy,
    run_group,
    scripted_steps,
    tiny_requests,
)
from worker import parallel
from worker.config import WorkerConfig
from worker.models.linear import Linear, Split, VocabEmbedding


@pytest.fixture
def rank_of(monkeypatch):
    """Pretend to be ``rank`` of ``world_size`` (no process group) while building layers."""

    def pretend(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel, "_current", parallel.TensorParallel(rank, world_size))

    return pretend


# -- how weights split ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_units", "world_size", "replicate", "expected"),
    [
        (9, 3, False, [(0, 3), (3, 3), (6, 3)]),  # SmolLM2's heads on 3 ranks
        (3, 3, True, [(0, 1), (1, 1), (2, 1)]),  # its key-value heads
        (2, 4, True, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # 2 key-value heads shared by 4 ranks
        (4, 2, True, [(0, 2), (2, 2)]),
    ],
)
def test_units_split_evenly_or_are_shared(rank_of, num_units, world_size, replicate, expected):
    shards = []
    for rank in range(world_size):
        rank_of(rank, world_size)
        shards.append(parallel.shard_units(num_units, "heads", replicate))
    assert shards == expected


@pytest.mark.parametrize(
    ("num_units", "world_size", "replicate", "message"),
    [
        (9, 2, False, "tensor-parallel size 2 must divide the number of attention heads (9)"),
        (3, 2, True, "must divide or be divided by the number of attention heads (3)"),
        (2, 4, False, "tensor-parallel size 4 must divide the number of attention heads (2)"),
    ],
)
def test_units_that_cannot_split_are_refused(rank_of, num_units, world_size, replicate, message):
    rank_of(0, world_size)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel.shard_units(num_units, "attention heads", replicate)


def test_parallel_layers_cut_their_slice_of_the_checkpoint(rank_of):
    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    bias = torch.arange(10, dtype=torch.float32)
    rank_of(1, 2)
    heads = Split(2, 2, "heads")  # rows 0-1 on rank 0, 2-3 on rank 1
    kv_heads = Split(1, 3, "key-value heads", replicate=True)  # rows 0-2, on both ranks
    column = Linear.column(6, [heads, kv_heads], bias=True)
    column.load_shard(0, "weight", full[:4])
    column.load_shard(1, "weight", full[4:7])
    column.load_shard(0, "bias", bias[:4])
    assert column.output_sizes == [2, 3]
    assert torch.equal(column.weight, torch.cat([full[2:4], full[4:7]]))
    assert torch.equal(column.bias[:2], bias[2:4])

    row = Linear.row(Split(2, 3, "heads"), 5, bias=True)  # input columns 3-5 on rank 1
    row.load_shard(0, "weight", full[:5])
    row.load_shard(0, "bias", bias[:5])
    assert torch.equal(row.weight, full[:5, 3:6])
    assert torch.equal(row.bias, bias[:5])  # whole: rank 0 alone adds it
    assert row.reduces_output

    lm_head = Linear.vocab(6, 7)  # 7 tokens padded to 8: rows 4-6 and a zero row on rank 1
    lm_head.load_shard(0, "weight", full[:7])
    assert torch.equal(lm_head.weight, torch.cat([full[4:7], torch.zeros(1, 6)]))
    embedding = VocabEmbedding(7, 6)
    embedding.load_shard(0, "model.embed_tokens.weight", full[:7])
    assert torch.equal(embedding.weight, lm_head.weight)
    with pytest.raises(ValueError, match=r"weight has shape \(4, 6\), expected \(7, 6\)"):
        lm_head.load_shard(0, "weight", full[:4])


# -- greedy parity, every rank in its own process -------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy tokens, end-of-sequence stopping off (one model per directory)."""

    @cache
    def model_for(model_dir: Path):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        return model

    def generate(model_dir: Path, prompt: list[int]) -> list[int]:
        return greedy_tokens(model_for(model_dir), prompt, NUM_NEW_TOKENS)

    return generate


def test_tp2_and_tp4_match_tp1_and_transformers_on_the_tiny_model(tiny_llama_dir, reference):
    steps = scripted_steps(tiny_requests(), NUM_NEW_TOKENS)
    expected = {
        new.context.request_id: reference(tiny_llama_dir, new.context.prompt_token_ids)
        for new in steps[0].new_requests
        if new.context.request_id != "bad"
    }
    by_world_size = {size: run_group(tiny_llama_dir, size, steps) for size in (1, 2, 4)}
    for size, reports in by_world_size.items():
        driver = reports[0]
        tokens = {rid: [o.tokens[0] for o in outputs] for rid, outputs in driver["outputs"].items()}
        assert tokens == expected, size
        assert list(driver["refusals"]) == ["bad"]
        assert driver["refusals"]["bad"].startswith("request 'bad': ")
        for follower in reports[1:]:
            assert follower["tokens"] == expected  # what rank 0 sent them
            assert follower["outputs"] == {}
            assert follower["refusals"] == {"bad": "refused by rank 0"}  # agreed before the step
        assert all(report["requests_left"] == [] for report in reports)
        # 2 key-value heads: 1 per rank on 2 ranks, shared by pairs of ranks on 4
        assert [report["num_kv_heads"] for report in reports] == [2 // min(size, 2)] * size
        assert len({report["num_kv_blocks"] for report in reports}) == 1

    def logprobs(reports):
        outputs = reports[0]["outputs"]
        sampled = [o.log_probabilities[0].token_log_probabilities[0] for o in outputs["short"]]
        prompt = outputs["chunked"][0].prompt_log_probabilities.token_log_probabilities
        return sampled, prompt

    sampled_1, prompt_1 = logprobs(by_world_size[1])
    assert len(prompt_1) == 39
    for size in (2, 4):
        sampled, prompt = logprobs(by_world_size[size])
        assert sampled == pytest.approx(sampled_1, abs=1e-4)
        assert prompt == pytest.approx(prompt_1, abs=1e-4)


def test_tp3_matches_transformers_on_the_default_model(default_model_dir, reference):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    questions = ("What is the capital of France?", "Name two planets.")
    requests = []
    for i, question in enumerate(questions):
        prompt = tokenizer.apply_chat_template(
            chat_messages(question), add_generation_prompt=True, return_dict=False
        )
        requests.append(ScriptedRequest(greedy(f"q{i}", prompt), [len(prompt)]))
    steps = scripted_steps(requests, NUM_NEW_TOKENS)
    reports = run_group(default_model_dir, 3, steps)
    expected = {
        r.context.request_id: reference(default_model_dir, r.context.prompt_token_ids)
        for r in requests
    }
    tokens = {rid: [o.tokens[0] for o in outputs] for rid, outputs in reports[0]["outputs"].items()}
    assert tokens == expected
    assert [report["num_kv_heads"] for report in reports] == [1, 1, 1]  # 3 key-value heads


# -- the scheduler's worker groups ----------------------------------------------------------------


def ready(rank: int, size: int = 2, **changes) -> WorkerReady:
    fields = {"protocol_version": PROTOCOL_VERSION, "model_name": "m", "num_kv_blocks": 64}
    fields |= {"block_size": 16, "max_model_len": 512}
    return WorkerReady(**{**fields, **changes}, rank=rank, tensor_parallel_size=size)


def test_a_group_serves_once_every_rank_registered_and_ends_with_any_rank():
    groups = WorkerGroups()
    first = groups.register(b"r1", ready(1))
    assert (first.retired, first.was_serving, first.now_serving) == ([], False, False)
    assert groups.serving() == []
    second = groups.register(b"r0", ready(0))
    assert second.now_serving and groups.serving()[0].driver == b"r0"
    assert groups.serving()[0].members == [b"r1", b"r0"]

    left = groups.leave(b"r1")
    assert (left.retired, left.was_serving) == ([b"r0"], True)
    assert groups.groups == {} and groups.leave(b"r0") is None


def test_a_rank_is_taken_again_only_once_its_connection_has_closed():
    groups = WorkerGroups()
    groups.register(b"r0", ready(0))
    groups.register(b"r1", ready(1))
    hijack = groups.register(b"new-r0", ready(0))
    assert (hijack.retired, hijack.was_serving, hijack.now_serving) == ([b"new-r0"], False, False)
    assert hijack.error == (
        "worker rank 0 of group '': that group is serving; a worker may take its place once "
        "the old one has disconnected"
    )
    assert groups.serving()[0].identities == {0: b"r0", 1: b"r1"}  # unharmed
    left = groups.leave(b"r0")  # the real rank 0 died: its group is over
    assert (left.retired, left.was_serving) == ([b"r1"], True)
    restarted = groups.register(b"new-r0", ready(0))
    assert restarted.error is None and groups.groups[""].identities == {0: b"new-r0"}
    taken = groups.register(b"newer-r0", ready(0))  # the rank is held while the group forms
    assert taken.retired == [b"newer-r0"] and "another connection holds that rank" in taken.error
    again = groups.register(b"new-r0", ready(1))  # one connection, one place
    assert again.retired == [] and "already registered with group ''" in again.error
    assert groups.groups[""].identities == {0: b"new-r0"}


def test_groups_with_other_names_form_and_serve_side_by_side():
    groups = WorkerGroups()
    groups.register(b"a0", ready(0, group="a"))
    groups.register(b"b1", ready(1, group="b"))
    assert groups.register(b"a1", ready(1, group="a")).now_serving
    assert groups.register(b"b0", ready(0, group="b")).now_serving
    assert [group.name for group in groups.serving()] == ["a", "b"]
    left = groups.leave(b"a0")
    assert (left.group, left.retired, left.was_serving) == ("a", [b"a1"], True)
    assert groups.group_of(b"b1").name == "b" and groups.group_of(b"a1") is None


def test_a_rank_that_does_not_match_its_forming_group_is_refused_and_says_why():
    groups = WorkerGroups()
    groups.register(b"r0", ready(0, max_model_len=512))
    mismatch = groups.register(b"r1", ready(1, max_model_len=1024))
    assert mismatch.retired == [b"r1"] and not mismatch.now_serving
    assert mismatch.error == (
        "worker rank 1 of group '' does not match rank(s) [0]: max_model_len 1024 != 512"
    )
    assert groups.groups[""].identities == {0: b"r0"}
    assert groups.register(b"good-r1", ready(1, max_model_len=512)).now_serving
    other_size = WorkerGroups()
    other_size.register(b"r0", ready(0, size=2))
    error = other_size.register(b"r2", ready(2, size=3)).error
    assert "tensor_parallel_size 3 != 2" in error


# -- processes: two hosts on loopback, and a rank that dies ---------------------------------------


def test_two_hosts_on_loopback_serve_through_an_explicit_rendezvous(
    tiny_llama_dir, reference, tmp_path
):
    """Each rank is started alone, as on its own host: TCP to the scheduler, and the ranks meet
    at --master-addr:--master-port."""
    frontend = f"tcp://127.0.0.1:{free_port()}"
    backend = f"tcp://127.0.0.1:{free_port()}"
    http_port, master_port = free_port(), free_port()
    model = str(tiny_llama_dir)
    rank_flags = [
        *("--model", model, "--scheduler-addr", backend, "--device", "cpu"),
        *("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--num-threads", "1"),
        *("--tensor-parallel-size", "2", "--master-addr", "127.0.0.1"),
        *("--master-port", str(master_port)),
    ]
    commands = {
        "scheduler": ["scheduler", "--frontend-addr", frontend, "--backend-addr", backend],
        "rank-1": ["worker", *rank_flags, "--rank", "1"],  # the "other host" comes up first
        "rank-0": ["worker", *rank_flags, "--rank", "0"],
        "api_server": [
            "api_server",
            *("--model", model, "--scheduler-addr", frontend, "--port", str(http_port)),
            *("--served-model-name", "tiny", "--max-model-len", "512"),
        ],
    }
    with role_processes(commands, tmp_path) as (processes, logs):
        url = f"http://127.0.0.1:{http_port}"
        wait_until_ready(url, processes, 120, logs)
        prompt = [1, 450, 7000, 12, 901, 33, 2048]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NUM_NEW_TOKENS, "temperature": 0}
        body |= {"ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        expected = reference(tiny_llama_dir, prompt)
        assert tokens == [tokenizer.decode([token]) for token in expected]
        scheduler_log = logs["scheduler"].read_text()
        waiting = r"worker rank [01] of 2 of group '\S+' \(hybrid\) registered; waiting"
        assert re.search(waiting, scheduler_log)
        assert "(hybrid): tiny-llama0 on 2 rank(s)" in scheduler_log


def test_killing_one_rank_fails_the_group_within_seconds(default_model_dir, tmp_path):
    serve = ServeProcess(  # fail-fast: no move, no worker restart
        *("--tensor-parallel-size", "3", "--migration-limit", "0"), log_path=tmp_path / "serve.log"
    )
    try:
        children = [pid for pid, _ in serve.children()]
        assert len(serve.pids_of("switchyard-worker tp")) == 3
        question = {"model": DEFAULT_MODEL_NAME, "max_tokens": 16, "temperature": 0}
        question["messages"] = chat_messages("What is the capital of France?")
        answer = httpx.post(f"{serve.base_url}/v1/chat/completions", json=question, timeout=60)
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]

        stream, stream_thread = in_background(serve.base_url, long_chat())
        assert stream.first_event.wait(30) and stream.events
        (rank_1,) = serve.pids_of("switchyard-worker tp1")
        killed_at = time.monotonic()
        os.kill(rank_1, signal.SIGKILL)

        stream_thread.join(5)
        assert stream.ended_at - killed_at < 5
        assert stream.events[-1]["error"]["code"] == "service_unavailable"
        assert serve.process.wait(timeout=30) == 1
        assert wait_until(lambda: not any(alive(child) for child in children), 5)
    finally:
        serve.kill()


def test_one_named_gpu_for_several_ranks_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="device 'cuda:1' names one GPU for 2 ranks"):
        WorkerConfig(tiny_llama_dir, device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        WorkerConfig(tiny_llama_dir, rank=2, tensor_parallel_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="device 'cuda': no CUDA device is available"):
        _ = WorkerConfig(tiny_llama_dir, device="cuda", tensor_parallel_size=2).torch_device
