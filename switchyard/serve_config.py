"""``ServeConfig``: everything ``switchyard serve`` (and the offline pipeline) asks of the
launcher, checked when it is made (``ValueError`` with a message for the user).

It composes the roles' settings rather than repeating them (``interfaces.settings``): the
API server's ``HttpBind``, the scheduler's ``SchedulerConfig``, of the worker's and the API
server's settings those a user gives ``serve`` (``SERVE_WORKER_SETTINGS``,
``SERVE_API_SERVER_SETTINGS``) and the log's; ``switchyard.cli`` resolves the models of the
``ModelSettings`` and ``EmbeddingModelSettings`` given. The launcher fills in the rest
(addresses, ranks, models) and starts each role with ``to_argv`` of its settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from api_server.config import ApiServerSettings, EmbeddingModelSettings, HttpBind
from api_server.generation_config import AUTO, load_generation_defaults
from interfaces.logs import LogSettings
from interfaces.settings import component, setting, to_argv
from interfaces.shared_settings import ModelSettings
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.config import SchedulerConfig
from scheduler.worker_group import MAX_GROUPS
from worker.settings import WorkerSettings

SERVE_WORKER_SETTINGS = (
    *("tensor_parallel_size", "kv_cache_memory", "dtype", "block_size", "attention_backend"),
    *("device", "max_cudagraph_capture_size", "float32_matmul_precision"),
    *("grammar_limits", "logits_processors", "lora"),
)
"""The ``WorkerSettings`` fields ``serve`` takes flags for."""
SERVE_API_SERVER_SETTINGS = (
    *("api_key", "allowed_origins", "shutdown_timeout_s", "limits", "request_limits"),
    *("max_stream_backlog", "scheduler_return_timeout_s", "media", "generation_config"),
    *("reasoning_parser", "responses_store", "allow_runtime_lora_updating"),
)
"""The ``ApiServerSettings`` fields ``serve`` takes flags for."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``switchyard serve`` needs: its own settings and the roles' it passes on."""

    model_dir: Path | None
    """The text generation model; None serves only ``embedding_model_dir``."""
    served_model_name: str | None
    max_model_len: int | None = None
    """The context length its workers and API servers enforce; None: the model's."""
    bind: HttpBind = component(HttpBind)
    """Where ``serve`` listens, handing the socket to every API server."""
    api_servers: int = setting(1, "--api-servers", "API server processes")
    prefill_workers: int = setting(
        0,
        "--prefill-workers",
        "disaggregate: this many prefill worker groups (with --decode-workers)",
    )
    """Prefill groups (each of ``tensor_parallel_size`` ranks); 0 with ``decode_workers`` 0
    serves ``data_parallel_size`` hybrid groups."""
    decode_workers: int = setting(
        0,
        "--decode-workers",
        "disaggregate: this many decode worker groups (with --prefill-workers)",
    )
    data_parallel_size: int = setting(
        1,
        "--data-parallel-size",
        "hybrid worker groups, each of --tensor-parallel-size ranks, behind the one scheduler "
        "(on CUDA each on GPUs of its own; on the CPU they share the cores)",
        metavar="N",
    )
    """Hybrid groups to start: one is named ``hybrid``, several ``hybrid-0`` ... Not with
    ``prefill_workers``, which give the groups of disaggregated serving."""
    restart_limit: int = setting(
        5,
        "--restart-limit",
        "restarts of worker groups and the scheduler allowed a minute (one whose process dies "
        "or hangs is started again); one more stops serve with exit 1; 0 stops it at the first "
        "death",
        metavar="N",
    )
    """Restarts of worker groups and of the scheduler in any 60 s
    (``switchyard.worker_restarts``)."""
    embedding_model_dir: Path | None = None
    """Also serve /v1/embeddings with this encoder, on a worker of its own."""
    embedding_model_name: str | None = None
    scheduler: SchedulerConfig = component(SchedulerConfig)
    worker: WorkerSettings = component(WorkerSettings, only=SERVE_WORKER_SETTINGS)
    """What every text generation worker is given; the launcher fills in the rest."""
    api_server: ApiServerSettings = component(ApiServerSettings, only=SERVE_API_SERVER_SETTINGS)
    """What every API server is given; the launcher fills in the rest. Its ``api_key`` goes to
    the API servers in their environment (SWITCHYARD_API_KEY), never in argv."""
    log: LogSettings = component(LogSettings)
    """How ``serve`` and every child log, told through the children's environment."""

    @property
    def text_worker(self) -> WorkerSettings:
        """``worker``, with LoRA enabled when ``--lora-modules`` names adapters to load."""
        lora = self.worker.lora
        if self.scheduler.lora_modules and not lora.enable_lora:
            return replace(self.worker, lora=replace(lora, enable_lora=True))
        return self.worker

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks in each text generation worker group."""
        return self.worker.tensor_parallel_size

    @property
    def restart_limit_in_effect(self) -> int:
        """``restart_limit``, but 0 with ``--migration-limit 0``: fail-fast as before,
        a worker's death stops the unit."""
        return self.restart_limit if self.scheduler.migration_limit > 0 else 0

    @property
    def api_key(self) -> str | None:
        return self.api_server.api_key

    @property
    def model(self) -> ModelSettings:
        """The text generation model as its workers and API servers are given it (no path:
        none)."""
        path = None if self.model_dir is None else str(self.model_dir)
        return ModelSettings(path, self.served_model_name, self.max_model_len)

    @property
    def embedding(self) -> EmbeddingModelSettings:
        """The embedding model as the API servers are given it (no path: none)."""
        path = None if self.embedding_model_dir is None else str(self.embedding_model_dir)
        return EmbeddingModelSettings(path, self.embedding_model_name)

    @property
    def worker_groups(self) -> list[tuple[str, WorkerRole]]:
        """(group name, role) of every text generation worker group to start."""
        if self.model_dir is None:
            return []
        if self.prefill_workers:
            return [(f"prefill-{i}", WorkerRole.PREFILL) for i in range(self.prefill_workers)] + [
                (f"decode-{i}", WorkerRole.DECODE) for i in range(self.decode_workers)
            ]
        if self.data_parallel_size == 1:
            return [("hybrid", WorkerRole.HYBRID)]
        return [(f"hybrid-{i}", WorkerRole.HYBRID) for i in range(self.data_parallel_size)]

    @property
    def num_worker_processes(self) -> int:
        """Worker processes on this machine, which share its cores: every rank of every
        generation group, and the embedding worker."""
        generation = self.tensor_parallel_size * len(self.worker_groups)
        return generation + (self.embedding_model_dir is not None)

    @property
    def model_names(self) -> str:
        """What it serves, for people: the served model names."""
        names = (self.served_model_name, self.embedding_model_name)
        return " and ".join(name for name in names if name)

    def _generation_only_flags(self) -> list[str]:
        """The flags given that only a text generation model uses: the worker's but
        ``--device`` (the embedding worker's too), the context length, disaggregation, prefix
        caching, generation-config defaults and reasoning parsing."""
        worker = replace(self.worker, device=WorkerSettings.device)
        given = [arg for arg in to_argv(worker) if arg.startswith("--")]
        if self.max_model_len is not None:
            given.append("--max-model-len")
        if self.prefill_workers:
            given.append("--prefill-workers/--decode-workers")
        if self.data_parallel_size != 1:
            given.append("--data-parallel-size")
        if not self.scheduler.enable_prefix_caching:
            given.append("--no-prefix-caching")
        if self.scheduler.lora_modules:
            given.append("--lora-modules")
        if self.api_server.generation_config != AUTO:
            given.append("--generation-config")
        if self.api_server.reasoning_parser is not None:
            given.append("--reasoning-parser")
        return given

    def __post_init__(self) -> None:
        if self.model_dir is None and self.embedding_model_dir is None:
            raise ValueError("--model none serves nothing without --embedding-model")
        if (self.model_dir is None) != (self.served_model_name is None):
            raise ValueError("served_model_name goes with model_dir")
        if self.model_dir is None and (given := self._generation_only_flags()):
            raise ValueError(
                f"{', '.join(given)} configure the text generation model; --model none serves none"
            )
        if self.api_servers < 1:
            raise ValueError(f"--api-servers must be at least 1, got {self.api_servers}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.restart_limit < 0:
            raise ValueError(f"--restart-limit must be at least 0, got {self.restart_limit}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("--prefill-workers and --decode-workers cannot be negative")
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise ValueError(
                "disaggregated serving needs both --prefill-workers and --decode-workers "
                f"(got {self.prefill_workers} and {self.decode_workers})"
            )
        self._check_worker_groups()
        if self.model_dir is not None:  # a bad file stops serve here, not each API server
            load_generation_defaults(self.model_dir, self.api_server.generation_config)
        num_adapters, max_loras = len(self.scheduler.lora_modules), self.worker.lora.max_loras
        if num_adapters > max_loras:
            raise ValueError(
                f"--lora-modules names {num_adapters} adapters, more than --max-loras ({max_loras})"
            )
        if not 0 <= self.bind.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.bind.port}")
        if not self.api_server.shutdown_timeout_s >= 0:
            raise ValueError(
                f"--shutdown-timeout must be 0 or more, got {self.api_server.shutdown_timeout_s}"
            )

    def _check_worker_groups(self) -> None:
        """How many worker groups, of what kind, on which devices: ``ValueError`` for what
        cannot be served."""
        if self.data_parallel_size < 1:
            raise ValueError(
                f"--data-parallel-size must be at least 1, got {self.data_parallel_size}"
            )
        if self.data_parallel_size > 1 and self.prefill_workers:
            raise ValueError(
                "--data-parallel-size starts hybrid worker groups; disaggregated serving gets "
                "its groups from --prefill-workers and --decode-workers: give one or the other"
            )
        num_groups = int(self.embedding_model_dir is not None)
        if self.model_dir is not None:
            num_groups += self.prefill_workers + self.decode_workers or self.data_parallel_size
        if num_groups > MAX_GROUPS:
            raise ValueError(
                f"{num_groups} worker groups asked for; the scheduler serves at most {MAX_GROUPS}"
            )
        device = self.worker.device
        if device.startswith("cuda:") and len(self.worker_groups) > 1:
            raise ValueError(
                f"--device {device} puts all {len(self.worker_groups)} worker groups on one GPU; "
                "give --device cuda (or auto): each group then gets GPUs of its own"
            )


def check_lora_adapters(
    model_dir: Path, adapters: list[tuple[str, str]], max_lora_rank: int
) -> None:
    """Read each (name, path) adapter as the workers will (``worker.lora_checkpoint``), so one
    the model cannot serve stops ``serve`` (or the offline pipeline) before anything starts,
    with the reason: ``ValueError``. Imports torch: ``serve`` runs it in its prepare-model
    child, and only when there are adapters: a start without them never waits for torch."""
    if not adapters:
        return
    from worker.lora_checkpoint import AdapterProblem, LoRAModelShape, read_adapter
    from worker.models.config import ModelConfig

    shape = LoRAModelShape.of(ModelConfig.from_dir(model_dir))
    for name, path in adapters:
        try:
            read_adapter(path, shape, max_lora_rank)
        except AdapterProblem as problem:
            raise ValueError(f"LoRA adapter {name!r}: {problem}") from None
