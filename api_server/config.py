"""Configuration of one API server process, and the model facts it reads from the model directory.

The model directory is Hugging Face format: config.json (``max_position_embeddings``), optional
generation_config.json (``eos_token_id``), tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

    def __post_init__(self) -> None:
        if isinstance(self.max_stream_backlog, bool) or self.max_stream_backlog < 1:
            raise ValueError(
                f"max_stream_backlog must be a positive integer, got {self.max_stream_backlog!r}"
            )


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on one HTTP request, enforced by ``api_server.limits`` before any route runs.

    A body above ``max_request_body_bytes`` is a 413; more header fields than
    ``max_header_count``, or more than ``max_header_bytes`` of names plus values, a 431.
    The body default leaves room for images sent as base64 data URLs.
    """

    max_request_body_bytes: int = 32 * 1024 * 1024
    max_header_count: int = 100
    max_header_bytes: int = 64 * 1024

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
    rest of the context; None: 16 contexts.
    """

    max_prompt_bytes: int | None = None
    max_structured_output_bytes: int = 128 * 1024
    max_choices: int = 128
    max_request_output_tokens: int | None = None

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


@dataclass(frozen=True)
class MediaConfig:
    """Where images in chat messages may come from, and bounds on them (api_server.images).

    Data URLs are always accepted. ``file://`` URLs only inside ``allowed_local_media_path``
    (None: none); http(s) URLs only from the hosts in ``allowed_media_domains`` (empty: none),
    fetched within ``fetch_timeout_s`` in all, following at most ``max_redirects`` redirects on
    the same host. A request may have at most ``max_images_per_prompt`` images, and an image
    at most ``max_image_bytes`` encoded and ``max_image_pixels`` decoded.
    """

    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_images_per_prompt: int = 8
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


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The ``HttpLimits`` flags (a request above them is a 413 or 431), with its defaults."""
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=HttpLimits.max_request_body_bytes,
        help="larger request bodies get 413 (default: %(default)s, 32 MiB)",
    )
    parser.add_argument(
        "--max-header-count",
        type=int,
        default=HttpLimits.max_header_count,
        help="requests with more header fields get 431 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=HttpLimits.max_header_bytes,
        help="requests whose header names and values take more bytes get 431 "
        "(default: %(default)s)",
    )
    add_request_limit_flags(parser)


def add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The ``RequestLimits`` flags and ``--max-stream-backlog`` (a request above them is a 400,
    a stream over its backlog is aborted), with their defaults."""
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        help="requests whose prompt text (messages and tools) takes more UTF-8 bytes get 400, "
        "before tokenizing (default: 16 per token of the context, at least 1 MiB)",
    )
    parser.add_argument(
        "--max-structured-output-bytes",
        type=int,
        default=RequestLimits.max_structured_output_bytes,
        help="a larger JSON schema, grammar, regex or choice list gets 400 "
        "(default: %(default)s, 128 KiB)",
    )
    parser.add_argument(
        "--max-choices-per-request",
        type=int,
        default=RequestLimits.max_choices,
        help="requests asking for more choices (prompts x n) get 400 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-output-tokens",
        type=int,
        help="requests whose choices may generate more tokens in all (a choice without "
        "max_tokens counts the rest of the context) get 400 (default: 16 x the context length)",
    )
    parser.add_argument(
        "--max-stream-backlog",
        type=int,
        default=EngineClientConfig.max_stream_backlog,
        help="results a request may have waiting for a client that does not read them; beyond "
        "it the request is aborted and its stream ends with an error (default: %(default)s)",
    )


def limit_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``add_limit_flags`` flags as parsed in ``args``, to hand on to an API server."""
    return (
        *("--max-request-body-bytes", str(args.max_request_body_bytes)),
        *("--max-header-count", str(args.max_header_count)),
        *("--max-header-bytes", str(args.max_header_bytes)),
        *_optional_flag("--max-prompt-bytes", args.max_prompt_bytes),
        *("--max-structured-output-bytes", str(args.max_structured_output_bytes)),
        *("--max-choices-per-request", str(args.max_choices_per_request)),
        *_optional_flag("--max-request-output-tokens", args.max_request_output_tokens),
        *("--max-stream-backlog", str(args.max_stream_backlog)),
    )


def _optional_flag(name: str, value: int | None) -> tuple[str, ...]:
    return () if value is None else (name, str(value))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The ``add_request_limit_flags`` flags as a ``RequestLimits``; ``ValueError`` for a value
    below 1."""
    return RequestLimits(
        max_prompt_bytes=args.max_prompt_bytes,
        max_structured_output_bytes=args.max_structured_output_bytes,
        max_choices=args.max_choices_per_request,
        max_request_output_tokens=args.max_request_output_tokens,
    )


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    """The ``MediaConfig`` flags: where chat images may come from besides data URLs."""
    parser.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="accept file:// image URLs of files inside DIR (default: no local files)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="fetch http(s) image URLs from these hosts, comma-separated or repeated "
        "(default: no remote images)",
    )
    parser.add_argument(
        "--max-images-per-prompt",
        type=int,
        default=MediaConfig.max_images_per_prompt,
        help="more images in one request get 400 (default: %(default)s)",
    )


def media_config(args: argparse.Namespace) -> MediaConfig:
    """The ``add_media_flags`` flags as a ``MediaConfig``; ``ValueError`` for a path that is not
    a directory."""
    return MediaConfig(
        allowed_local_media_path=media_path(args.allowed_local_media_path),
        allowed_media_domains=media_domains(args.allowed_media_domains),
        max_images_per_prompt=args.max_images_per_prompt,
    )


def media_path(value: str | None) -> Path | None:
    """``--allowed-local-media-path`` as an absolute path, symlinks resolved (None: unset)."""
    return None if value is None else Path(value).expanduser().resolve()


def media_domains(values: list[str]) -> tuple[str, ...]:
    """``--allowed-media-domains`` values as lower-case host names."""
    return tuple(domain.lower() for domain in split_commas(values))


def split_commas(values: list[str]) -> tuple[str, ...]:
    """``["a,b", "c"]`` → ``("a", "b", "c")``: comma-separated, repeated, or both."""
    items = (item.strip() for value in values for item in value.split(","))
    return tuple(dict.fromkeys(item for item in items if item))
