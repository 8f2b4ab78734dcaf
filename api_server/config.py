"""Configuration of one API server process, and the model facts it reads from the model directory.

The model directory is Hugging Face format: config.json (``max_position_embeddings``), optional
generation_config.json (``eos_token_id``), tokenizer.json and tokenizer_config.json. The flags of
``python -m api_server`` are declared on the fields of ``ApiServerSettings`` and the limits it
holds (``interfaces.settings``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api_server.generation_config import (
    AUTO,
    NO_DEFAULTS,
    SamplingParamsGenerationConfigDefaults,
    generation_config_source,
)
from api_server.reasoning import REASONING_PARSER_NAMES, reasoning_parser_name
from api_server.response_store import ResponseStoreConfig
from interfaces import envs
from interfaces.settings import component, setting, split_commas
from interfaces.shared_settings import LogitsProcessorSettings, ModelSettings, SchedulerAddress
from interfaces.transport import TransportSecurity

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""On SIGTERM, how long requests in flight may run before they are aborted (api_server.shutdown)."""
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class EngineClientConfig:
    """How the API server talks to the scheduler.

    ``submit_timeout_s`` bounds how long a new request waits for the scheduler's socket to accept
    it; ``stats_timeout_s`` bounds a StatsRequest round trip (health checks, metrics);
    a request in flight fails once the scheduler has said nothing for ``scheduler_timeout_s``
    (it is pinged every ``heartbeat_interval_s`` while requests are in flight).
    """

    scheduler_addr: str
    security: TransportSecurity = field(default_factory=TransportSecurity)
    """CURVE keys for the connection (``interfaces.transport``)."""
    submit_timeout_s: float = 5.0
    stats_timeout_s: float = 1.0
    scheduler_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    max_stream_backlog: int = 1024
    """Results one request may have waiting for a client that does not read them; beyond it
    the request is aborted and its stream ends with an error (``EngineClient``)."""
    scheduler_return_timeout_s: float = 60.0
    """How long text requests in flight, and new ones, wait for a scheduler whose connection
    dropped to come back with a worker (then they are submitted again); 0 fails them at once."""

    def __post_init__(self) -> None:
        if isinstance(self.max_stream_backlog, bool) or self.max_stream_backlog < 1:
            raise ValueError(
                f"max_stream_backlog must be a positive integer, got {self.max_stream_backlog!r}"
            )
        if not self.scheduler_return_timeout_s >= 0:
            raise ValueError(
                "scheduler_return_timeout_s must be at least 0, "
                f"got {self.scheduler_return_timeout_s!r}"
            )


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on one HTTP request, enforced by ``api_server.limits`` before any route runs.

    A body above ``max_request_body_bytes`` is a 413; more header fields than
    ``max_header_count``, or more than ``max_header_bytes`` of names plus values, a 431.
    The body default leaves room for images sent as base64 data URLs.
    """

    max_request_body_bytes: int = setting(
        32 * 1024 * 1024,
        "--max-request-body-bytes",
        "larger request bodies get 413",
        default_text="%(default)s, 32 MiB",
    )
    max_header_count: int = setting(
        100, "--max-header-count", "requests with more header fields get 431"
    )
    max_header_bytes: int = setting(
        64 * 1024,
        "--max-header-bytes",
        "requests whose header names and values take more bytes get 431",
    )

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_header_count", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one generation request may ask for, checked before anything costly runs
    (``api_server.request_limits``); each refusal is a 400 naming its flag.

    ``max_prompt_bytes``: the UTF-8 text of a request's prompts (messages, tool definitions),
    checked before tokenizing; None: 16 bytes per token of the context, at least 1 MiB.
    ``max_structured_output_bytes``: one JSON schema, grammar, regex or choice list (a tool's
    parameters schema too). ``max_choices``: prompts x ``n``. ``max_request_output_tokens``:
    the tokens all choices may generate together, a choice without ``max_tokens`` counting the
    rest of the context and each choice after a prompt's first that echoes it with logprobs
    its tokens; None: 16 contexts.
    """

    max_prompt_bytes: int | None = setting(
        None,
        "--max-prompt-bytes",
        "requests whose prompt text (messages and tools) takes more UTF-8 bytes get 400, before "
        "tokenizing",
        default_text="16 per token of the context, at least 1 MiB",
    )
    max_structured_output_bytes: int = setting(
        128 * 1024,
        "--max-structured-output-bytes",
        "a larger JSON schema, grammar, regex or choice list gets 400",
        default_text="%(default)s, 128 KiB",
    )
    max_choices: int = setting(
        128,
        "--max-choices-per-request",
        "requests asking for more choices (prompts x n) get 400",
    )
    max_request_output_tokens: int | None = setting(
        None,
        "--max-request-output-tokens",
        "requests whose choices may generate more tokens in all (a choice without max_tokens "
        "counts the rest of the context, each choice after a prompt's first that echoes it "
        "with logprobs its tokens) get 400",
        default_text="16 x the context length",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_prompt_bytes",
            "max_structured_output_bytes",
            "max_choices",
            "max_request_output_tokens",
        ):
            value = getattr(self, name)
            if value is None and name in ("max_prompt_bytes", "max_request_output_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def prompt_bytes(self, max_model_len: int) -> int:
        """``max_prompt_bytes``, or its default for a context of ``max_model_len`` tokens."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return max(1024 * 1024, 16 * max_model_len)

    def request_output_tokens(self, max_model_len: int) -> int:
        """``max_request_output_tokens``, or its default for a context of ``max_model_len``."""
        if self.max_request_output_tokens is not None:
            return self.max_request_output_tokens
        return 16 * max_model_len


def media_path(value: str | None) -> Path | None:
    """``--allowed-local-media-path`` as an absolute path, symlinks resolved (None: unset)."""
    return None if value is None else Path(value).expanduser().resolve()


def media_domains(values: list[str]) -> tuple[str, ...]:
    """``--allowed-media-domains`` values as lower-case host names."""
    return tuple(domain.lower() for domain in split_commas(values))


@dataclass(frozen=True)
class MediaConfig:
    """Where images in chat messages may come from, and bounds on them (api_server.images).

    Data URLs are always accepted. ``file://`` URLs only inside ``allowed_local_media_path``
    (None: none); http(s) URLs only from the hosts in ``allowed_media_domains`` (empty: none),
    fetched within ``fetch_timeout_s`` in all, following at most ``max_redirects`` redirects on
    the same host. A request may have at most ``max_images_per_prompt`` images, and an image
    at most ``max_image_bytes`` encoded and ``max_image_pixels`` decoded.
    """

    allowed_local_media_path: Path | None = setting(
        None,
        "--allowed-local-media-path",
        "accept file:// image URLs of files inside DIR",
        parse=str,
        to_field=media_path,
        metavar="DIR",
        default_text="no local files",
    )
    allowed_media_domains: tuple[str, ...] = setting(
        (),
        "--allowed-media-domains",
        "fetch http(s) image URLs from these hosts, comma-separated or repeated",
        to_field=media_domains,
        metavar="HOST[,HOST...]",
        default_text="no remote images",
    )
    max_images_per_prompt: int = setting(
        8, "--max-images-per-prompt", "more images in one request get 400"
    )
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_images_per_prompt < 0:
            raise ValueError(
                f"--max-images-per-prompt must be 0 or more, got {self.max_images_per_prompt}"
            )
        path = self.allowed_local_media_path
        if path is not None and not path.is_dir():
            raise ValueError(f"--allowed-local-media-path {path} is not a directory")
        for domain in self.allowed_media_domains:
            if not domain or domain != domain.strip().lower() or "/" in domain:
                raise ValueError(
                    f"--allowed-media-domains takes lower-case host names, got {domain!r}"
                )


@dataclass(frozen=True)
class ApiServerConfig:
    """Everything one API server process needs besides its listening socket.

    It serves a text generation model (``model_dir``, for the chat, completion and tokenizer
    routes), an embedding model (``embedding_model_dir``, for /v1/embeddings), or both.
    ``python -m api_server`` makes it from ``ApiServerSettings`` (its flags) once the model
    directories are resolved; tests build it directly.
    """

    model_dir: Path | None
    """The text generation model's directory; None when only embeddings are served."""
    served_model_name: str | None
    """Its name for clients (set exactly when ``model_dir`` is)."""
    max_model_len: int | None
    """Prompt plus output tokens at most (see ``resolve_max_model_len``); set with ``model_dir``."""
    engine: EngineClientConfig
    api_key: str | None = field(default=None, repr=False)
    """Clients must send ``Authorization: Bearer <api_key>``; None: no authentication."""
    allowed_origins: tuple[str, ...] = ()
    """Origins allowed by CORS ("*" for any); empty: CORS off."""
    limits: HttpLimits = field(default_factory=HttpLimits)
    """Request body and header limits (api_server.limits)."""
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    """Bounds on what one generation request may ask for (api_server.request_limits)."""
    embedding_model_dir: Path | None = None
    """The embedding model served at /v1/embeddings (by an embedding worker), if any."""
    embedding_model_name: str | None = None
    media: MediaConfig = field(default_factory=MediaConfig)
    """Where chat images may come from (api_server.images)."""
    generation_defaults: SamplingParamsGenerationConfigDefaults = NO_DEFAULTS
    """Sampling defaults of requests that leave fields out (``--generation-config``)."""
    max_new_tokens_limit: int | None = None
    """The most tokens any request may generate: the ``max_new_tokens`` of a generation config
    given as ``--generation-config DIR``, a server-wide limit as in vLLM; None: none."""
    reasoning_parser: str | None = None
    """Splits chat output into ``reasoning_content`` and ``content`` (``api_server.reasoning``;
    ``--reasoning-parser``); None: no reasoning parsing."""
    logits_processor_names: tuple[str, ...] = ()
    """The user logits processors requests may name (``--logits-processors``): the workers
    load them by the same flag."""
    responses_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    """Where the Responses API keeps stored responses (api_server.response_store)."""
    allow_runtime_lora_updating: bool = False
    """Whether clients may load and unload LoRA adapters (api_server.lora_routes)."""

    @property
    def embedding_name(self) -> str | None:
        """The embedding model's name for clients (its directory's by default), if one is
        served."""
        if self.embedding_model_dir is None:
            return None
        return self.embedding_model_name or self.embedding_model_dir.name

    def __post_init__(self) -> None:
        if self.model_dir is None and self.embedding_model_dir is None:
            raise ValueError("serve a model: give --model, --embedding-model or both")
        if (self.model_dir is None) != (self.served_model_name is None) or (
            self.model_dir is None
        ) != (self.max_model_len is None):
            raise ValueError("served_model_name and max_model_len go with model_dir")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or an empty dict when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        data = json.load(file)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def model_context_length(model_dir: Path) -> int | None:
    """The model's context length from config.json (its ``text_config`` for a vision-language
    model), or None when it names none."""
    config = read_json(model_dir / "config.json")
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_LENGTH_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def resolve_max_model_len(model_dir: Path, requested: int | None) -> int:
    """The context length to enforce: ``requested`` if given, else the model's own.

    Raises ``ValueError`` when ``requested`` is below 2 or above the model's context length, or
    when neither is known.
    """
    model_len = model_context_length(model_dir)
    if requested is None:
        if model_len is None:
            raise ValueError(
                f"{model_dir / 'config.json'} names no context length; pass --max-model-len"
            )
        return model_len
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {requested}")
    if model_len is not None and requested > model_len:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length {model_len}"
        )
    return requested


def generation_eos_token_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` from generation_config.json (an int or a list), else from config.json."""
    for name in ("generation_config.json", "config.json"):
        value = read_json(model_dir / name).get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list):
            return [token for token in value if isinstance(token, int)]
    return []


def non_negative_seconds(text: str) -> float:
    """argparse type: a number of seconds, 0 or more."""
    seconds = float(text)
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return seconds


@dataclass(frozen=True)
class HttpBind:
    """Where the OpenAI API listens: ``python -m api_server`` binds it (unless given a socket,
    ``--fd``), and ``switchyard serve`` binds it once for all its API servers."""

    host: str = setting("127.0.0.1", "--host", "address to listen on")
    port: int = setting(8000, "--port", "port to listen on (0: any free)")


@dataclass(frozen=True)
class EmbeddingModelSettings:
    """The embedding model served at /v1/embeddings, as given (none by default)."""

    path: str | None = setting(
        None,
        "--embedding-model",
        "also serve /v1/embeddings with this encoder model directory, which an embedding worker "
        "runs (switchyard serve also takes 'default': the packaged all-MiniLM-L6-v2)",
        default_text="none",
    )
    served_model_name: str | None = setting(
        None,
        "--embedding-model-name",
        "the embedding model's name for clients",
        default_text="its directory's name",
    )


@dataclass(frozen=True)
class ApiServerSettings:
    """``python -m api_server``'s settings but the transport's and the log's;
    ``api_server.__main__`` resolves them into an ``ApiServerConfig``. ``switchyard serve``
    takes the flags of the client-facing ones and fills the rest (``switchyard.serve_config``).
    """

    model: ModelSettings = component(ModelSettings)
    scheduler: SchedulerAddress = component(SchedulerAddress)
    bind: HttpBind = component(HttpBind)
    fd: int | None = setting(
        None,
        "--fd",
        "serve on this inherited listening socket",
        default_text="listen on --host and --port",
    )
    embedding: EmbeddingModelSettings = component(EmbeddingModelSettings)
    api_key: str | None = setting(
        None,
        "--api-key",
        "require 'Authorization: Bearer KEY' on every route but /health and /metrics",
        env_default=envs.api_key,
        default_text=f"${envs.API_KEY_VARIABLE}, which keeps the key out of `ps`",
        secret=True,
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "--allowed-origins",
        "CORS origins, comma-separated or repeated ('*': any)",
        default_text="CORS off",
    )
    shutdown_timeout_s: float = setting(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "--shutdown-timeout",
        "on SIGTERM, seconds to let requests in flight finish before aborting them",
        parse=non_negative_seconds,
        default_text="%(default)s; 0 aborts at once",
    )
    limits: HttpLimits = component(HttpLimits)
    request_limits: RequestLimits = component(RequestLimits)
    max_stream_backlog: int = setting(
        EngineClientConfig.max_stream_backlog,
        "--max-stream-backlog",
        "results a request may have waiting for a client that does not read them; beyond it "
        "the request is aborted and its stream ends with an error",
    )
    scheduler_return_timeout_s: float = setting(
        EngineClientConfig.scheduler_return_timeout_s,
        "--scheduler-return-timeout",
        "how long streams in flight, and new text requests, wait for a scheduler that went away "
        "to come back (they are then submitted and continue); 0 fails them at once",
        metavar="SECONDS",
    )
    media: MediaConfig = component(MediaConfig)
    generation_config: str = setting(
        AUTO,
        "--generation-config",
        "sampling defaults of requests that leave fields out: 'auto' takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), 'vllm' ignores it, a directory takes its generation_config.json",
        parse=generation_config_source,
        metavar="auto|vllm|DIR",
    )
    reasoning_parser: str | None = setting(
        None,
        "--reasoning-parser",
        "split chat output into message.reasoning_content and content at <think>...</think>: "
        f"{' or '.join(REASONING_PARSER_NAMES)} (vLLM's names)",
        parse=reasoning_parser_name,
        metavar="NAME",
        default_text="none",
    )
    logits_processors: LogitsProcessorSettings = component(
        LogitsProcessorSettings, group="logits processors"
    )
    """Only their names: requests may name these; the workers load them."""
    responses_store: ResponseStoreConfig = component(ResponseStoreConfig, group="responses API")
    allow_runtime_lora_updating: bool = setting(
        False,
        "--allow-runtime-lora-updating",
        "let clients load and unload LoRA adapters (POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter, vLLM's routes), from paths the workers read",
        switch=True,
        default_text="off",
    )
