"""The offline API's value types, in lmdeploy's vocabulary: ``GenerationConfig``,
``EngineConfig``, ``ChatTemplateConfig``, ``Response`` and ``Session`` (``switchyard.offline``
runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from interfaces import SamplingParams
from interfaces.requests import StructuredOutput
from interfaces.sampling import LogitsProcessorCall
from interfaces.shared_settings import LoRASettings
from scheduler.config import SchedulerConfig


@dataclass
class GenerationConfig:
    """lmdeploy's generation parameters. ``do_sample=False`` (the default) is greedy whatever
    the temperature; ``top_k`` 0 means no top-k cut. ``logits_processors`` takes names, not
    callables as lmdeploy does (code never goes to the workers): each a processor that
    ``EngineConfig.logits_processors`` loads, or ``{"name": ..., "args": {...}}``."""

    n: int = 1
    max_new_tokens: int | None = 512
    """None: up to the context length."""
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    logits_processors: list[str | dict[str, Any]] | None = None

    def sampling_params(self) -> SamplingParams:
        """These parameters for the engine; ``ValueError`` names the one that is invalid."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (one response per prompt), got {self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        sampled = self.do_sample and self.temperature > 0
        return SamplingParams(
            top_k=(self.top_k if self.top_k > 0 else -1) if sampled else 1,
            top_p=self.top_p,
            min_p=self.min_p,
            temperature=self.temperature if sampled else 1.0,
            repetition_penalty=self.repetition_penalty,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens or 0,
            ignore_eos=self.ignore_eos,
            stop=self.stop_words or None,
            stop_token_ids=self.stop_token_ids or None,
            seed=self.random_seed,
            logits_processors=_logits_processor_calls(self.logits_processors),
        )

    def structured_output(self) -> StructuredOutput | None:
        """``response_format`` as the engine's constraint: ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` or
        ``{"type": "regex_schema", "regex_schema": "..."}``."""
        response_format = self.response_format
        if response_format is None or response_format.get("type") == "text":
            return None
        kind = response_format.get("type")
        if kind == "json_object":
            return StructuredOutput("json_object")
        if kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                return StructuredOutput("json_object")
            return _json_schema(schema)
        if kind == "regex_schema" and isinstance(response_format.get("regex_schema"), str):
            return StructuredOutput("regex", response_format["regex_schema"])
        raise ValueError(f"unsupported response_format: {response_format!r}")


def _logits_processor_calls(
    uses: list[str | dict[str, Any]] | None,
) -> list[LogitsProcessorCall] | None:
    """``GenerationConfig.logits_processors`` for the wire; ``ValueError`` for a bad entry."""
    calls = []
    for use in uses or ():
        if isinstance(use, str):
            calls.append(LogitsProcessorCall(use))
        elif (
            isinstance(use, dict)
            and isinstance(use.get("name"), str)
            and set(use)
            <= {
                "name",
                "args",
            }
        ):
            calls.append(LogitsProcessorCall(use["name"], use.get("args")))
        else:
            raise ValueError(
                "logits_processors entries are processor names or {'name': ..., 'args': {...}}, "
                f"got {use!r}"[:300]
            )
    return calls or None


def _json_schema(schema: Any) -> StructuredOutput:
    from api_server.errors import OpenAIError
    from api_server.structured_output import json_schema_output

    try:
        return json_schema_output(schema, "response_format")
    except OpenAIError as error:
        raise ValueError(error.message) from None


@dataclass
class EngineConfig:
    """The engine's settings, named as lmdeploy's ``PytorchEngineConfig`` where it has them.

    ``session_len`` is the context length (prompt plus output; default: the model's);
    ``max_batch_size`` the most requests per step; ``max_prefill_token_num`` the token budget
    per step (None: 512 on a CPU, 8192 on CUDA); ``cache_max_entry_count`` the KV cache size,
    as a fraction of free memory or as bytes with a unit ("2GiB"); ``tp`` the tensor-parallel
    size. ``logits_processors`` are user logits processors' import paths (``pkg.module:Name``,
    as ``--logits-processors``) the workers load; a ``GenerationConfig`` applies those it
    names. ``adapters`` (lmdeploy's) are LoRA adapters, name → PEFT directory, loaded at
    start; a call's ``adapter_name`` picks one. ``max_lora_rank`` bounds their rank
    (``--max-lora-rank``).
    """

    tp: int = 1
    session_len: int | None = None
    max_batch_size: int = SchedulerConfig.max_num_seqs
    cache_max_entry_count: float | str | None = None
    block_size: int = 16
    max_prefill_token_num: int | None = SchedulerConfig.max_num_batched_tokens
    enable_prefix_caching: bool = True
    device_type: str | None = None
    dtype: str | None = None
    logits_processors: list[str] | None = None
    adapters: dict[str, str] | None = None
    max_lora_rank: int = LoRASettings.max_lora_rank


TEMPLATE_PIECES = (
    "system", "meta_instruction", "eosys", "user", "eoh", "assistant", "eoa", "tool", "eotool",
    "separator",
)  # fmt: skip


@dataclass
class ChatTemplateConfig:
    """lmdeploy's chat template settings: which template turns prompts into the model's text.

    The pieces (``system`` ... ``separator``) make lmdeploy's ``BaseChatTemplate``: a
    conversation reads ``{system}{meta_instruction}{eosys}{user}...{eoh}{assistant}...{eoa}
    {separator}`` and ends with ``{assistant}`` for the answer; a text prompt is one user turn,
    unless ``capability`` is "completion". ``stop_words`` stop every request that names no stop
    words or stop token ids of its own (lmdeploy's default stop words).

    Which template renders: the pieces when any is given or ``model_name`` is "base"; the chat
    template of ``model_path`` (default: the pipeline's model) for "hf", which must have one. Any
    other name is one of lmdeploy's built-in templates, which are not here: the model's own
    template stands in for it, and a model without one gets the (empty) pieces, as lmdeploy
    renders a name it does not know.
    """

    model_name: str | None
    model_path: str | None = None
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    tool: str | None = None
    eotool: str | None = None
    separator: str | None = None
    capability: Literal["completion", "infilling", "chat", "python"] | None = None
    stop_words: list[str] | None = None

    @property
    def has_pieces(self) -> bool:
        return any(getattr(self, name) is not None for name in TEMPLATE_PIECES)

    def uses_model_template(self, model_has_template: bool) -> bool:
        """Whether prompts go through the model's own chat template rather than the pieces."""
        if self.model_name == "hf":
            return True
        return model_has_template and not self.has_pieces and self.model_name != "base"

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The text of a conversation in the pieces (None is ""), as lmdeploy's
        ``BaseChatTemplate.messages2prompt`` writes it: a conversation that ends with an
        assistant turn ends with that answer, for the model to go on with it."""
        piece = {name: getattr(self, name) or "" for name in TEMPLATE_PIECES}
        opening = {role: piece[role] for role in ("system", "user", "assistant", "tool")}
        closing = {"system": piece["eosys"], "user": piece["eoh"], "tool": piece["eotool"]}
        closing["assistant"] = piece["eoa"] + piece["separator"]
        text = ""
        if messages and messages[0]["role"] != "system":
            text += piece["system"] + piece["meta_instruction"] + piece["eosys"]
        for message in messages:
            role = message["role"]
            if role not in opening:
                raise ValueError(f"the chat template has no {role!r} role (roles: {[*opening]})")
            text += opening[role] + _content_text(message.get("content")) + closing[role]
        if messages and messages[-1]["role"] == "assistant" and closing["assistant"]:
            return text[: -len(closing["assistant"])]
        return text + piece["assistant"]


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text: typed parts' texts joined by newlines (as lmdeploy merges them)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")


@dataclass
class Response:
    """One prompt's generation (so far, when streamed): lmdeploy's ``Response``.

    ``token_ids`` are the generated tokens, and ``generate_token_len`` their number (a streamed
    piece has its own tokens and the count so far). As in lmdeploy, the token that stopped
    generation is not one of them: a stop token (EOS, ``stop_token_ids``), or the token that
    completed a stop word, and nothing after it; the text ends before the stop word.
    ``include_stop_str_in_output`` keeps that token (and the stop word). ``logprobs`` has one
    ``{token_id: logprob}`` per token in ``token_ids`` (the chosen token and the top ones) when
    ``GenerationConfig.logprobs`` asked. ``finish_reason`` is "stop", "length" or "abort" once
    done, else None; ``index`` the prompt's position. A prompt that could not run (an image
    that cannot be used) gets finish reason "error" with the reason as its ``text``, as
    lmdeploy reports a failed request.
    """

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0


@dataclass
class Session:
    """A multi-turn chat: the messages so far. Each turn's prompt starts with the last turn's
    prompt and answer, so the engine's prefix cache serves them again."""

    session_id: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    response: Response | None = None
