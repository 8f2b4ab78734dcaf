"""The API server's tokenizer: chat templates, the no-template fallback, context limits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from api_server.chat_template import ChatTemplateError
from api_server.tokenizer import HuggingFaceTokenizer
from interfaces import SamplingParams, TextGenerationRequest
from tests.support.tokenizer_dirs import chat_request, make_model_dir

SMOLLM_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(default_model_dir, max_model_len=64)


def test_smollm2_chat_template(tokenizer: HuggingFaceTokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_default_system_prompt(tokenizer: HuggingFaceTokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert (
        prompt == SMOLLM_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_new_context_encodes_the_template_without_extra_special_tokens(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    context = asyncio.run(tokenizer.new_context(chat_request([{"role": "user", "content": "Hi"}])))
    expected = tokenizer.encode_now(
        SMOLLM_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert context.prompt_token_ids == expected
    assert context.prompt_token_ids[0] == 1  # <|im_start|>, once, from the template
    assert context.prompt_token_ids.count(1) == 3
    assert context.max_length == 64  # max_new_tokens None: the whole context
    assert context.eos_token_ids == [2]
    assert context.request_id == "r1"


def test_new_context_draws_a_seed_only_for_a_request_without_one(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    params = SamplingParams(top_k=0, temperature=0.8, max_new_tokens=4)
    unseeded = TextGenerationRequest("r", 0, prompt="Hello", sampling_params=params)
    drawn = [asyncio.run(tokenizer.new_context(unseeded)).sampling_params for _ in range(2)]
    seeds = [sent.seed for sent in drawn]
    assert seeds[0] != seeds[1]  # 63 fresh bits each: two requests sample differently
    assert all(isinstance(seed, int) and 0 <= seed < 2**63 for seed in seeds)
    assert drawn == [msgspec.structs.replace(params, seed=seed) for seed in seeds]
    for seed in (-(2**63), 0, 7):
        seeded = TextGenerationRequest(
            "r", 0, prompt="Hello", sampling_params=SamplingParams(seed=seed)
        )
        assert asyncio.run(tokenizer.new_context(seeded)).sampling_params == SamplingParams(
            seed=seed
        )


def test_max_length_is_prompt_plus_max_new_tokens_within_the_context(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    short = asyncio.run(tokenizer.new_context(chat_request(messages, max_new_tokens=5)))
    assert short.max_length == short.num_prompt_tokens + 5
    unbounded = asyncio.run(tokenizer.new_context(chat_request(messages)))
    assert unbounded.max_length == 64
    exact_fit = 64 - short.num_prompt_tokens
    fits = asyncio.run(tokenizer.new_context(chat_request(messages, max_new_tokens=exact_fit)))
    assert fits.max_length == 64


def test_prompt_plus_max_tokens_beyond_the_context_is_a_value_error(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError) as error:
        asyncio.run(tokenizer.new_context(chat_request(messages, max_new_tokens=1000)))
    assert str(error.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 1031 tokens "
        "(31 in the prompt, 1000 for the completion). Please reduce the length of the prompt "
        "or of the completion."
    )


def test_content_parts_are_joined_and_developer_is_system(tokenizer: HuggingFaceTokenizer) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    context = asyncio.run(tokenizer.new_context(chat_request(messages)))
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
    assert asyncio.run(tokenizer.decode(context.prompt_token_ids)) == (
        expected + "<|im_start|>assistant\n"
    )


def test_prompt_too_long_is_a_value_error(tokenizer: HuggingFaceTokenizer) -> None:
    request = TextGenerationRequest(request_id="r", index=0, prompt="word " * 100)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, but the prompt has"):
        asyncio.run(tokenizer.new_context(request))
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        asyncio.run(tokenizer.encode("word " * 100))


def test_a_prompt_that_fills_the_context_leaves_no_room(tokenizer: HuggingFaceTokenizer) -> None:
    request = TextGenerationRequest(request_id="r", index=0, prompt=[5] * 64)
    with pytest.raises(ValueError, match="leaving no room"):
        asyncio.run(tokenizer.new_context(request))
    ok = TextGenerationRequest(request_id="r", index=0, prompt=[5] * 63)
    assert asyncio.run(tokenizer.new_context(ok)).max_length == 64


@pytest.mark.parametrize(
    ("prompt", "message"), [("", "prompt is empty"), ([], "prompt is empty"), ([49152], "outside")]
)
def test_bad_prompts(tokenizer: HuggingFaceTokenizer, prompt, message: str) -> None:
    request = TextGenerationRequest(request_id="r", index=0, prompt=prompt)
    with pytest.raises(ValueError, match=message):
        asyncio.run(tokenizer.new_context(request))


def test_completion_prompt_text_is_encoded_with_special_tokens(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    request = TextGenerationRequest(request_id="r", index=0, prompt="Hello world")
    context = asyncio.run(tokenizer.new_context(request))
    assert context.prompt_token_ids == [19556, 905]  # SmolLM2 adds no BOS to plain text


def test_fallback_format_without_a_chat_template(default_model_dir: Path, tmp_path: Path) -> None:
    config = {"eos_token": "<|im_end|>"}
    model_dir = make_model_dir(default_model_dir, tmp_path / "plain", config)
    tokenizer = HuggingFaceTokenizer(model_dir, max_model_len=128)
    assert not tokenizer.has_chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "ASSISTANT's RULE: Be brief.\nUSER: Hi\nASSISTANT: Hello.\nUSER: Bye\nASSISTANT:"
    )


def test_template_file_tojson_strftime_and_special_token_variables(
    default_model_dir: Path, tmp_path: Path
) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ strftime_now('%Y') | length }}{% endif %}"
    )
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    model_dir = make_model_dir(
        default_model_dir, tmp_path / "custom", config, chat_template__jinja=template
    )
    tokenizer = HuggingFaceTokenizer(model_dir, max_model_len=128)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "é"}])
    assert prompt == '<|im_start|>{"role": "user", "content": "é"}\n4'


def test_named_templates_pick_tool_use_when_tools_are_given(
    default_model_dir: Path, tmp_path: Path
) -> None:
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        ],
    }
    model_dir = make_model_dir(default_model_dir, tmp_path / "named", config)
    tokenizer = HuggingFaceTokenizer(model_dir, max_model_len=128)
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == "plain"
    assert tokenizer.apply_chat_template(messages, tools=[{"type": "function"}]) == "tools: 1"


def test_raise_exception_in_a_template_is_a_value_error(
    default_model_dir: Path, tmp_path: Path
) -> None:
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": "{{ raise_exception('roles must alternate') }}",
    }
    model_dir = make_model_dir(default_model_dir, tmp_path / "strict", config)
    tokenizer = HuggingFaceTokenizer(model_dir, max_model_len=128)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_eos_token_ids_merge_generation_config_and_tokenizer(
    default_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = make_model_dir(
        default_model_dir,
        tmp_path / "eos",
        {"eos_token": "<|im_end|>"},
        generation_config__json=json.dumps({"eos_token_id": [0, 2]}),
    )
    tokenizer = HuggingFaceTokenizer(model_dir, max_model_len=128)
    assert tokenizer.eos_token_ids == [2, 0]
    assert tokenizer.eos == 2
