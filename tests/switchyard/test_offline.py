"""The offline Python API (``switchyard.pipeline``): the same engine as the server, in-process.

One pipeline over the tiny model serves the module; a ``switchyard serve`` of the same model is
the reference for its greedy outputs. Pipelines with a chat template connect to the first one's
scheduler, so they start no processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import httpx
import pytest
from PIL import Image

from api_server.text_stream import TextDelta
from interfaces.sampling import LogitsProcessorCall
from switchyard import ChatTemplateConfig, EngineConfig, GenerationConfig, Response, pipeline
from switchyard.offline import _serve_config
from switchyard.offline_prompts import _num_tokens_before_stop_word
from tests.support.engine import greedy_tokens
from tests.support.serve_process import ServeProcess, alive

NUM_NEW_TOKENS = 8
GREEDY = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
PROMPTS = [f"Prompt number {i}: the {'quick ' * (i % 5)}brown fox" for i in range(50)]


@pytest.fixture(scope="module")
def pipe(tiny_llama_dir, tiny_lora_adapters):
    engine = EngineConfig(
        cache_max_entry_count="64MiB",
        max_prefill_token_num=64,
        adapters={"alpha": str(tiny_lora_adapters["alpha"])},
        max_lora_rank=8,
    )
    with pipeline(str(tiny_llama_dir), backend_config=engine) as started:
        yield started


@pytest.fixture(scope="module")
def no_template_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model's config and tokenizer without a chat template (no weights: pipelines
    over it connect to the module's scheduler)."""
    model_dir = tmp_path_factory.mktemp("no-template")
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        if (tiny_llama_dir / name).is_file():
            shutil.copy(tiny_llama_dir / name, model_dir / name)
    tokenizer_config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model_dir


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    serve = ServeProcess("--model", str(tiny_llama_dir), "--kv-cache-memory", "64MiB")
    yield serve
    serve.kill()


def test_infer_returns_the_servers_greedy_outputs_in_input_order(pipe, server):
    responses = pipe.infer(PROMPTS, GREEDY, do_preprocess=False, use_tqdm=True)
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
    # A single prompt: a single Response.
    assert pipe(PROMPTS[0], GREEDY, do_preprocess=False) == responses[0]


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


def test_logits_processors_go_by_name_to_the_engine_and_the_workers(tmp_path):
    config = GenerationConfig(logits_processors=["ban", {"name": "force", "args": {"token": 3}}])
    assert config.sampling_params().logits_processors == [
        LogitsProcessorCall("ban"),
        LogitsProcessorCall("force", {"token": 3}),
    ]
    with pytest.raises(ValueError, match="logits_processors entries are processor names"):
        GenerationConfig(logits_processors=[{"name": "x", "code": "print()"}]).sampling_params()
    with pytest.raises(ValueError, match="names a processor more than once"):
        GenerationConfig(logits_processors=["ban", "ban"]).sampling_params()
    engine = EngineConfig(logits_processors=["pkg.bans:ban"])
    serve = _serve_config(tmp_path, "name", engine, "INFO")
    assert serve.worker.logits_processors.paths == ("pkg.bans:ban",)


def test_a_prompt_longer_than_the_context_gets_an_empty_length_response(pipe):
    prompt = "word " * 5000
    num_tokens = len(pipe.tokenizer.encode_now(prompt))
    assert num_tokens > 512
    expected = Response("", 0, num_tokens, "length")  # as in lmdeploy
    assert pipe(prompt, GREEDY, do_preprocess=False) == expected


def test_close_stops_every_process_it_started(tiny_llama_dir):
    engine = EngineConfig(cache_max_entry_count="32MiB")
    pipe = pipeline(str(tiny_llama_dir), backend_config=engine)
    children = [process.pid for process in pipe._launcher.children.values()]
    assert len(children) == 2 and all(alive(pid) for pid in children)  # scheduler, worker
    assert pipe("Hi", GenerationConfig(max_new_tokens=2, ignore_eos=True)).generate_token_len == 2
    pipe.close()
    assert not any(alive(pid) for pid in children)
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        pipe("Hi")


PIECES = ChatTemplateConfig(
    model_name="my-template", system="<<S>>", meta_instruction="Be brief.", eosys="<</S>>\n",
    user="[U]", eoh="[/U]\n", assistant="[A]", eoa="[/A]", separator="\n", tool="[T]",
    eotool="[/T]\n",
)  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Sys."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "tool", "content": "42"},
    {"role": "user", "content": [{"type": "text", "text": "More"}, {"type": "text", "text": "?"}]},
]


def test_chat_template_pieces_render_as_lmdeploys_base_template():
    assert PIECES.render([{"role": "user", "content": "Hello"}]) == (
        "<<S>>Be brief.<</S>>\n[U]Hello[/U]\n[A]"
    )
    assert PIECES.render(CONVERSATION) == (
        "<<S>>Sys.<</S>>\n[U]Hi[/U]\n[A]Hello![/A]\n[T]42[/T]\n[U]More\n?[/U]\n[A]"
    )
    # A conversation that ends with an answer is continued: no end of answer, no new turn.
    assert PIECES.render(CONVERSATION[:3]) == "<<S>>Sys.<</S>>\n[U]Hi[/U]\n[A]Hello!"
    assert ChatTemplateConfig("x", user="U:").render([{"role": "user", "content": "a"}]) == "U:a"
    with pytest.raises(ValueError, match="no 'developer' role"):
        PIECES.render([{"role": "developer", "content": "a"}])
    names = ("hf", "qwen", "base")
    uses_model_template = [ChatTemplateConfig(name).uses_model_template(True) for name in names]
    assert uses_model_template == [True, True, False]
    assert not PIECES.uses_model_template(True)  # pieces given
    assert not ChatTemplateConfig("qwen").uses_model_template(False)  # the model has none


def test_chat_template_pieces_render_text_and_messages_for_the_engine(pipe, tiny_llama_dir):
    expected = {
        "Hello there": "<<S>>Be brief.<</S>>\n[U]Hello there[/U]\n[A]",
        "conversation": "<<S>>Sys.<</S>>\n[U]Hi[/U]\n[A]Hello![/A]\n[T]42[/T]\n[U]More\n?[/U]\n[A]",
    }
    with pipeline(
        str(tiny_llama_dir), chat_template_config=PIECES, scheduler_addr=pipe.scheduler_addr
    ) as templated:
        responses = templated(["Hello there", CONVERSATION], GREEDY)
        completion = dataclasses.replace(PIECES, capability="completion")
        with pipeline(
            str(tiny_llama_dir), chat_template_config=completion, scheduler_addr=pipe.scheduler_addr
        ) as raw_text:
            assert raw_text("Hello there", GREEDY) == pipe(
                "Hello there", GREEDY, do_preprocess=False
            )
    references = pipe(list(expected.values()), GREEDY, do_preprocess=False)
    assert responses == references  # text, token ids, lengths: the rendered text, encoded as text
    for response, text in zip(responses, expected.values(), strict=True):
        assert response.input_token_len == len(pipe.tokenizer.encode_now(text))


def test_chat_template_stop_words_apply_when_the_request_has_none(pipe, tiny_llama_dir):
    prompt = "<<S>>Be brief.<</S>>\n[U]Tell me[/U]\n[A]"
    free = pipe(prompt, GREEDY, do_preprocess=False)
    word = free.text[4:7]
    assert len(word) == 3 and free.text.index(word) == 4
    config = dataclasses.replace(PIECES, stop_words=[word, "<|im_start|>"])
    with pipeline(
        str(tiny_llama_dir), chat_template_config=config, scheduler_addr=pipe.scheduler_addr
    ) as templated:
        stopped = templated("Tell me", GREEDY)
        own_stop = templated("Tell me", dataclasses.replace(GREEDY, stop_words=["\x00none"]))
        effective = templated.prompts.with_stop_words(GREEDY)
    assert (stopped.finish_reason, stopped.text) == ("stop", free.text[:4])
    assert own_stop == free  # lmdeploy: the template's stop words only stand in for none
    # A special token's text is skipped from the output, so it stops on its token id instead.
    assert (effective.stop_words, effective.stop_token_ids) == ([word], [1])


def test_chat_template_without_pieces_is_the_models_own(pipe, tiny_llama_dir, no_template_dir):
    as_chat = pipe([{"role": "user", "content": "Hi there"}], GREEDY)
    as_text = pipe("Hi there", GREEDY, do_preprocess=False)
    assert pipe("Hi there", GREEDY) == as_chat  # do_preprocess: one user turn
    cases = [
        (tiny_llama_dir, ChatTemplateConfig("hf"), as_chat),
        (tiny_llama_dir, ChatTemplateConfig("qwen2"), as_chat),  # an lmdeploy template's name
        (no_template_dir, ChatTemplateConfig("hf", model_path=str(tiny_llama_dir)), as_chat),
        (no_template_dir, ChatTemplateConfig("qwen2"), as_text),  # no template
        (tiny_llama_dir, ChatTemplateConfig("base"), as_text),  # empty pieces
    ]
    for model_dir, config, expected in cases:
        with pipeline(
            str(model_dir), chat_template_config=config, scheduler_addr=pipe.scheduler_addr
        ) as templated:
            assert templated("Hi there", GREEDY) == expected, config
    with pytest.raises(ValueError, match=r"model_name 'hf' .* which has none"):
        pipeline(str(no_template_dir), chat_template_config=ChatTemplateConfig("hf"))


def test_max_new_tokens_is_cut_to_the_room_the_context_leaves(pipe, caplog):
    prompt = "word" + " word" * 504  # 505 tokens of the 512 the tiny model has
    assert len(pipe.tokenizer.encode_now(prompt)) == 505
    with caplog.at_level(logging.WARNING, logger="switchyard.offline"):
        response = pipe(prompt, GenerationConfig(max_new_tokens=100, ignore_eos=True), False)
    assert (response.finish_reason, response.input_token_len) == ("length", 505)
    assert response.generate_token_len == len(response.token_ids) == 7
    assert "total sequence length (505 + 100) exceeds `session_len` (512), `max_new_tokens` " \
        "is truncated to 7" in caplog.text  # fmt: skip
    full, fits = "word" + " word" * 511, "word"  # 512 tokens: no room for any output
    responses = pipe([full, fits], GenerationConfig(max_new_tokens=1, ignore_eos=True), False)
    assert responses[0] == Response("", 0, 512, "length", index=0)  # as lmdeploy answers it
    assert (responses[1].finish_reason, responses[1].generate_token_len) == ("length", 1)
    at_least = GenerationConfig(max_new_tokens=100, min_new_tokens=50)  # both cut to the room
    assert pipe(prompt, at_least, do_preprocess=False).generate_token_len == 7


def test_a_stop_word_that_is_a_special_token_stops_on_its_id(pipe):
    config = pipe.prompts.with_stop_words(GenerationConfig(stop_words=["<|im_end|>", "x"]))
    assert (config.stop_words, config.stop_token_ids) == (["x"], [2])


def _stream(pipe, prompt, config, do_preprocess=True) -> Response:
    """The pieces of ``stream_infer`` added up (each counting the tokens so far)."""
    total = Response("", 0, 0)
    for piece in pipe.stream_infer(prompt, config, do_preprocess):
        total.text += piece.text
        total.token_ids += piece.token_ids
        assert piece.generate_token_len == len(total.token_ids)
        total.finish_reason = piece.finish_reason
    return total


def test_a_stop_reports_the_tokens_before_the_one_that_stopped(pipe):
    free = pipe(PROMPTS[7], GenerationConfig(max_new_tokens=8), do_preprocess=False)
    ids, decode = free.token_ids, pipe.tokenizer.backend.decode
    assert free.finish_reason == "length" and len(ids) == 8
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    before, text = decode(ids[:k]), decode(ids[: k + 1])
    word = text[len(before) :]  # token k's text: the stop word first appears there
    assert word and text.index(word) == len(before)
    for stop in ({"stop_token_ids": [ids[k]]}, {"stop_words": [word]}):
        for keep in (False, True):
            config = GenerationConfig(max_new_tokens=8, include_stop_str_in_output=keep, **stop)
            response = pipe(PROMPTS[7], config, do_preprocess=False)
            token_ids = ids[: k + keep]
            assert (response.finish_reason, response.token_ids, response.text) == (
                "stop", token_ids, text if keep else before,
            ), (stop, keep)  # fmt: skip
            assert response.generate_token_len == len(token_ids)
            streamed = _stream(pipe, PROMPTS[7], config, do_preprocess=False)
            assert (streamed.text, streamed.token_ids, streamed.finish_reason) == (
                response.text, response.token_ids, "stop",
            )  # fmt: skip
    # One result with tokens past the stop word (as a multi-token step gives): they are dropped.
    assert _num_tokens_before_stop_word(pipe.tokenizer.backend, ids[:2], ids[2:], [word], True) \
        == k - 2  # fmt: skip
    delta = TextDelta("", "stop", token_ids=ids[2:])
    for keep in (False, True):
        config = GenerationConfig(stop_words=[word], include_stop_str_in_output=keep)
        assert pipe.prompts.reported_tokens(delta, ids[:2], config, {2}) == ids[2 : k + keep]


QUESTIONS = ["What is the capital of France?", "Name a fruit."]


def _record_sent_prompts(pipe) -> list[list[int]]:
    """The token ids of every prompt ``pipe`` sends from now on, in the order they are built."""
    sent: list[list[int]] = []
    build = pipe.prompts.request

    def request(*args):
        built, num_prompt_tokens = build(*args)
        sent.append(list(built.prompt))
        return built, num_prompt_tokens

    pipe.prompts.request = request
    return sent


def test_text_prompts_are_one_user_turn_of_the_chat_template(pipe, default_model_dir):
    """lmdeploy's ``do_preprocess=True``, on the default model's tokenizer and chat template
    (the module's engine, whose tiny model shares them, answers)."""
    with pipeline(str(default_model_dir), scheduler_addr=pipe.scheduler_addr) as default:
        tokenizer = default.tokenizer
        sent = _record_sent_prompts(default)
        responses = default.infer(QUESTIONS, GREEDY)
        rendered = []
        for question in QUESTIONS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
            assert text.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
            rendered.append(tokenizer.encode_now(text, add_special_tokens=False))
        assert sorted(sent) == sorted(rendered)
        for response, token_ids in zip(responses, rendered, strict=True):
            assert response.input_token_len == len(token_ids)
            assert response.generate_token_len == NUM_NEW_TOKENS and response.text
        del sent[:]
        # __call__ and stream_infer render the same; do_preprocess=False sends the text as it is.
        assert default(QUESTIONS[0], GREEDY) == responses[0]
        streamed = _stream(default, QUESTIONS[1], GREEDY)
        assert (streamed.text, streamed.token_ids) == (responses[1].text, responses[1].token_ids)
        raw = default(QUESTIONS[0], GREEDY, do_preprocess=False)
        raw_streamed = _stream(default, QUESTIONS[1], GREEDY, do_preprocess=False)
        assert raw.input_token_len == len(tokenizer.encode_now(QUESTIONS[0]))
        assert raw_streamed.token_ids == default(QUESTIONS[1], GREEDY, False).token_ids
    as_text = [tokenizer.encode_now(question) for question in QUESTIONS]
    assert sent == [*rendered, as_text[0], as_text[1], as_text[1]]
    # Message lists without do_preprocess: their contents run together (lmdeploy's base template).
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " there"}]
    request, _ = pipe.prompts.request(messages, GREEDY, False)
    assert request.prompt == pipe.tokenizer.encode_now("Hi there")


def test_adapter_name_runs_engine_config_s_adapter_as_peft_does(pipe, tiny_llama_dir,
                                                                 tiny_lora_adapters):  # fmt: skip
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    prompt = AutoTokenizer.from_pretrained(tiny_llama_dir)("The quick brown fox").input_ids
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    model.generation_config.eos_token_id = None
    base = greedy_tokens(model, prompt, NUM_NEW_TOKENS)
    model = PeftModel.from_pretrained(model, tiny_lora_adapters["alpha"])
    alpha = greedy_tokens(model, prompt, NUM_NEW_TOKENS)
    assert alpha != base
    text = "The quick brown fox"
    [with_alpha, without] = [
        pipe.infer([text], GREEDY, do_preprocess=False, adapter_name=name)[0]
        for name in ("alpha", None)
    ]
    assert (with_alpha.token_ids, without.token_ids) == (alpha, base)
    streamed = pipe.stream_infer(text, GREEDY, do_preprocess=False, adapter_name="alpha")
    assert [t for piece in streamed for t in piece.token_ids] == alpha
    chat = pipe.chat("Hi", gen_config=GREEDY, adapter_name="alpha").response.token_ids
    turn = [{"role": "user", "content": "Hi"}]
    assert chat == pipe.infer([turn], GREEDY, adapter_name="alpha")[0].token_ids


def test_an_adapter_name_not_loaded_is_refused(pipe):
    calls = [
        lambda: pipe("Hi", adapter_name="my-lora"),
        lambda: pipe.infer(["Hi"], GREEDY, adapter_name="my-lora"),
        lambda: list(pipe.stream_infer("Hi", adapter_name="my-lora")),
        lambda: pipe.chat("Hi", adapter_name="my-lora"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"adapter_name 'my-lora' is not a loaded LoRA adapt"):
            call()


def test_images_need_a_vision_model(pipe):
    image = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="takes no images: it is not a vision-language model"):
        pipe(("Describe this image.", image))
