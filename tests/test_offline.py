"""The offline Python API (``switchyard.pipeline``): the same engine as the server, in-process.

One pipeline over the tiny model serves the module; a ``switchyard serve`` of the same model is
the reference for its greedy outputs.
"""

from __future__ import annotations

import httpx
import pytest

from switchyard import EngineConfig, GenerationConfig, Response, pipeline
from tests.serve_process import ServeProcess, alive

NUM_NEW_TOKENS = 8
GREEDY = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
PROMPTS = [f"Prompt number {i}: the {'quick ' * (i % 5)}brown fox" for i in range(50)]


@pytest.fixture(scope="module")
def pipe(tiny_llama_dir):
    engine = EngineConfig(cache_max_entry_count="64MiB", max_prefill_token_num=64)
    with pipeline(str(tiny_llama_dir), backend_config=engine) as started:
        yield started


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    serve = ServeProcess("--model", str(tiny_llama_dir), "--kv-cache-memory", "64MiB")
    yield serve
    serve.kill()


def test_infer_returns_the_servers_greedy_outputs_in_input_order(pipe, server):
    responses = pipe.infer(PROMPTS, GREEDY, use_tqdm=True)
    body = {"model": "tiny-llama0", "prompt": PROMPTS, "max_tokens": NUM_NEW_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    expected = sorted(reply.json()["choices"], key=lambda choice: choice["index"])
    assert [r.text for r in responses] == [choice["text"] for choice in expected]
    assert [r.index for r in responses] == list(range(len(PROMPTS)))
    for response in responses:
        assert (response.finish_reason, response.generate_token_len) == ("length", 8)
        assert len(response.token_ids) == NUM_NEW_TOKENS
        assert pipe.tokenizer.backend.decode(response.token_ids) == response.text
    assert pipe(PROMPTS[0], GREEDY) == responses[0]  # a single prompt: a single Response


def test_stream_infer_pieces_add_up_to_infer(pipe):
    prompts = PROMPTS[:4]
    finals = pipe.infer(prompts, GREEDY)
    text, token_ids = [""] * 4, [[] for _ in prompts]
    reasons: list[str | None] = [None] * 4
    for piece in pipe.stream_infer(prompts, GREEDY):
        assert reasons[piece.index] is None  # nothing after the last piece
        text[piece.index] += piece.text
        token_ids[piece.index] += piece.token_ids
        reasons[piece.index] = piece.finish_reason
    assert text == [r.text for r in finals]
    assert token_ids == [r.token_ids for r in finals]
    assert reasons == ["length"] * 4


def test_a_three_turn_chat_reuses_the_cached_prefix(pipe):
    config = GenerationConfig(max_new_tokens=12)
    session = None
    hits = []
    for turn in ("Hello there, how are you today?", "Tell me about foxes.", "And dogs?"):
        before = pipe.stats().prefix_cache_hits_total
        session = pipe.chat(turn, session, config)
        hits.append(pipe.stats().prefix_cache_hits_total - before)
        assert session.response.finish_reason in ("stop", "length")
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3
    # Turns 2 and 3 start with the previous turn's prompt: its full blocks come from the cache.
    assert hits[1] >= 16 and hits[2] > hits[1]


def test_logprobs_stop_words_and_messages(pipe):
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=2)
    response = pipe([{"role": "user", "content": "Say something."}], config)
    assert isinstance(response, Response) and len(response.logprobs) == len(response.token_ids)
    for token, entry in zip(response.token_ids, response.logprobs, strict=True):
        assert token in entry and 1 <= len(entry) <= 3 and all(v <= 0 for v in entry.values())
    stop_word = response.text[3:6]
    stopped = pipe(
        [{"role": "user", "content": "Say something."}],
        GenerationConfig(max_new_tokens=6, ignore_eos=True, stop_words=[stop_word]),
    )
    assert stopped.finish_reason == "stop" and stopped.text == response.text[: len(stopped.text)]
    assert stop_word not in stopped.text


def test_generation_config_maps_onto_sampling_params_and_refuses_bad_values():
    greedy = GenerationConfig().sampling_params()
    assert (greedy.top_k, greedy.temperature, greedy.max_new_tokens) == (1, 1.0, 512)
    sampled = GenerationConfig(do_sample=True, top_k=0, top_p=0.9, temperature=0.7,
                               random_seed=3, stop_token_ids=[5]).sampling_params()  # fmt: skip
    assert (sampled.top_k, sampled.top_p, sampled.temperature) == (-1, 0.9, 0.7)
    assert (sampled.seed, sampled.stop_token_ids) == (3, [5])
    with pytest.raises(ValueError, match="n must be 1"):
        GenerationConfig(n=2).sampling_params()
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(do_sample=True, top_p=1.5).sampling_params()
    regex = GenerationConfig(response_format={"type": "regex_schema", "regex_schema": "a+"})
    assert regex.structured_output().kind == "regex"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert GenerationConfig(response_format=schema).structured_output().kind == "json_schema"
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        bad = {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}
        GenerationConfig(response_format=bad).structured_output()
    with pytest.raises(ValueError, match="unsupported response_format"):
        GenerationConfig(response_format={"type": "xml"}).structured_output()


def test_a_prompt_too_long_is_a_clear_error(pipe):
    with pytest.raises(ValueError, match="maximum context length"):
        pipe("word " * 5000, GREEDY)


def test_close_stops_every_process_it_started(tiny_llama_dir):
    engine = EngineConfig(cache_max_entry_count="32MiB")
    pipe = pipeline(str(tiny_llama_dir), backend_config=engine)
    children = [process.pid for process in pipe._launcher.children.values()]
    assert len(children) == 2 and all(alive(pid) for pid in children)  # scheduler, worker
    assert pipe("Hi", GenerationConfig(max_new_tokens=2)).generate_token_len == 2
    pipe.close()
    assert not any(alive(pid) for pid in children)
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        pipe("Hi")
