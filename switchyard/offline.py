"""The offline Python API, in lmdeploy's shape: ``pipeline()`` returns a ``Pipeline``.

    from switchyard import pipeline, GenerationConfig

    with pipeline() as pipe:                       # the default model; or pipeline("DIR")
        print(pipe(["Hello", "What is the capital of France?"]))  # chat template applied
        print(pipe("The capital of France is", do_preprocess=False))  # text as it is
        for response in pipe.stream_infer("Tell me a story"):
            print(response.text, end="")

A ``Pipeline`` starts the scheduler and worker processes (``switchyard.launcher``, no HTTP
server) or connects to a running scheduler's frontend (``scheduler_addr``), and talks to it as an
API server does: the same tokenizer, chat template, continuous batching, detokenization and stop
strings. Its asyncio client runs in a thread of its own, so the API is synchronous. ``close()``
(or leaving the ``with`` block) stops every process it started.

Where lmdeploy differs from the OpenAI server, the pipeline follows lmdeploy: a text prompt is
one user turn of the chat template unless ``do_preprocess=False``, a ``ChatTemplateConfig``
renders prompts, ``max_new_tokens`` is cut to the room the context leaves (with lmdeploy's
warning) instead of refusing the request, a prompt that leaves no room at all gets an empty
response with finish reason "length", and a response's ``token_ids`` stop before the token that
stopped generation. ``(text, image)`` tuples give a vision-language model images
(``switchyard.offline_images``); a prompt whose image cannot be used fails alone, with finish
reason "error" and the reason as its text, as lmdeploy reports a failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from pathlib import Path
from queue import Queue

import msgspec

from api_server.config import EngineClientConfig, resolve_max_model_len
from api_server.engine_client import EngineClient
from api_server.image_segments import ImageSegments
from api_server.text_stream import GenerationStream, TextOptions
from api_server.tokenizer import HuggingFaceTokenizer
from interfaces.logs import LogSettings
from interfaces.scheduler_to_api import SchedulerStats
from interfaces.shared_settings import LogitsProcessorSettings, LoRASettings
from scheduler.config import SchedulerConfig
from switchyard.launcher import Launcher
from switchyard.offline_images import image_prompt
from switchyard.offline_prompts import ImageError, Prompt, PromptBuilder
from switchyard.offline_types import (
    ChatTemplateConfig,
    EngineConfig,
    GenerationConfig,
    Response,
    Session,
)
from switchyard.serve_config import ServeConfig, check_lora_adapters
from worker.settings import WorkerSettings, parse_memory

logger = logging.getLogger("switchyard.offline")

READY_TIMEOUT_S = 600.0


class Pipeline:
    """A synchronous client of the Switchyard engine for offline batch and chat use."""

    def __init__(
        self,
        model_path: str | None = None,
        backend_config: EngineConfig | None = None,
        chat_template_config: ChatTemplateConfig | None = None,
        log_level: str = "WARNING",
        *,
        scheduler_addr: str | None = None,
    ) -> None:
        """Start the engine for ``model_path`` (a Hugging Face directory or .gguf file; None:
        the default model), or connect to the scheduler at ``scheduler_addr`` serving it.
        ``chat_template_config`` (see ``ChatTemplateConfig``) renders every prompt; without it
        prompts go through the model's chat template."""
        from worker.model_files import model_name_for, resolve_model

        config = backend_config or EngineConfig()
        model_dir = resolve_model(model_path)
        self.model_name = model_name_for(model_path)
        self.tokenizer = HuggingFaceTokenizer(
            model_dir, resolve_max_model_len(model_dir, config.session_len)
        )
        self.prompts = PromptBuilder(self.tokenizer, chat_template_config)
        self.scheduler_addr = scheduler_addr
        """The scheduler's frontend, where more clients of this engine may connect."""
        self._launcher: Launcher | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._session_ids = itertools.count()
        self._closed = False
        try:
            if scheduler_addr is None:
                serve_config = _serve_config(model_dir, self.model_name, config, log_level)
                adapters = serve_config.scheduler.lora_adapters
                check_lora_adapters(model_dir, adapters, config.max_lora_rank)
                self._launcher = Launcher(serve_config)
                self.scheduler_addr = self._launcher.start_engine()
            # Nothing restarts this pipeline's scheduler: its requests fail when it dies.
            engine = EngineClientConfig(self.scheduler_addr, scheduler_return_timeout_s=0.0)
            self._engine = EngineClient(engine)
            self._run(self._engine.start())
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    # -- the lmdeploy API ----------------------------------------------------------------------

    def __call__(
        self,
        prompts: Prompt | list[Prompt],
        gen_config: GenerationConfig | list[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        use_tqdm: bool = False,
    ) -> Response | list[Response]:
        return self.infer(prompts, gen_config, do_preprocess, adapter_name, use_tqdm)

    def infer(
        self,
        prompts: Prompt | list[Prompt],
        gen_config: GenerationConfig | list[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        use_tqdm: bool = False,
    ) -> Response | list[Response]:
        """Every prompt's final ``Response``, in input order (one for a single prompt). All of
        them run at once, batched by the engine; ``use_tqdm`` shows a progress bar.

        ``do_preprocess`` (lmdeploy's): text is one user turn rendered with the chat template,
        generation prompt included; False sends text as it is (with the tokenizer's BOS) and
        message lists as their contents run together. ``adapter_name`` names the LoRA adapter
        (of ``EngineConfig.adapters``) every prompt runs with (``ValueError`` for one not
        loaded); None: the base model."""
        lora_name = self._adapter(adapter_name)
        single, batch = _as_batch(prompts)
        configs = _configs(gen_config, len(batch))
        progress = _progress_bar(len(batch)) if use_tqdm else None
        finals: list[Response | None] = [None] * len(batch)
        for response in self._stream(batch, configs, do_preprocess, lora_name=lora_name):
            if response.finish_reason is not None:
                finals[response.index] = response
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return finals[0] if single else finals

    def stream_infer(
        self,
        prompts: Prompt | list[Prompt],
        gen_config: GenerationConfig | list[GenerationConfig] | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
    ) -> Iterator[Response]:
        """Incremental ``Response``s as tokens arrive, each with its prompt's ``index``: the
        text and tokens new since that prompt's previous one (prompts as ``infer`` takes
        them)."""
        lora_name = self._adapter(adapter_name)
        _, batch = _as_batch(prompts)
        configs = _configs(gen_config, len(batch))
        yield from self._stream(batch, configs, do_preprocess, True, lora_name)

    def chat(
        self,
        prompt: str,
        session: Session | None = None,
        gen_config: GenerationConfig | None = None,
        adapter_name: str | None = None,
    ) -> Session:
        """One turn of a multi-turn chat; returns the session, with this turn's ``response``.
        As in lmdeploy, every turn goes through the chat template."""
        session = session or Session(next(self._session_ids))
        turn = {"role": "user", "content": prompt}
        response = self.infer([[*session.messages, turn]], gen_config, adapter_name=adapter_name)[0]
        session.messages += [turn, {"role": "assistant", "content": response.text}]
        session.response = response
        return session

    def _adapter(self, adapter_name: str | None) -> str | None:
        """``adapter_name`` if the engine has that LoRA adapter loaded (asked again when this
        client has not seen it); ``ValueError`` naming those it has otherwise."""
        if adapter_name is None:
            return None
        if adapter_name not in self._engine.lora_names:
            self.stats()  # the engine client takes the adapters from the reply
        if adapter_name not in self._engine.lora_names:
            loaded = sorted(self._engine.lora_names)
            raise ValueError(
                f"adapter_name {adapter_name!r} is not a loaded LoRA adapter (loaded: {loaded}; "
                "EngineConfig.adapters loads them)"
            )
        return adapter_name

    def stats(self) -> SchedulerStats:
        """The scheduler's counters and gauges (running requests, prefix-cache hits, ...)."""
        return self._run(self._engine.stats())

    def close(self) -> None:
        """Disconnect, and stop every process this pipeline started (idempotent). Requests
        still running end; the pipeline takes no more."""
        self._closed = True
        try:
            engine = getattr(self, "_engine", None)
            if engine is not None and self._loop.is_running():
                self._run(engine.close(), timeout=30)  # fails what is in flight
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        finally:
            if self._launcher is not None:
                self._launcher.shutdown()
                self._launcher = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.close()

    # -- running requests ----------------------------------------------------------------------

    def _run(self, coroutine, timeout: float | None = None):
        return self._submit(coroutine).result(timeout)

    def _submit(self, coroutine) -> Future:
        if self._closed and not self._loop.is_running():
            coroutine.close()
            raise RuntimeError("the pipeline is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _wait_until_ready(self) -> None:
        """Until a worker serves and the adapters this pipeline loads are loaded."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        adapters: set[str] = set()
        if self._launcher is not None:
            adapters = {name for name, _ in self._launcher.config.scheduler.lora_adapters}
        while time.monotonic() < deadline:
            launcher = self._launcher
            if launcher is not None and (dead := launcher.dead_child()) is not None:
                raise RuntimeError(f"the engine's {dead} process exited while starting")
            try:
                stats = self.stats()
                if stats.workers_ready and adapters <= {a.name for a in stats.lora_adapters}:
                    return
            except Exception:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the engine was not ready within {READY_TIMEOUT_S:.0f} s")

    def _stream(
        self,
        prompts: list[Prompt],
        configs: list[GenerationConfig],
        do_preprocess: bool,
        incremental: bool = False,
        lora_name: str | None = None,
    ) -> Iterator[Response]:
        """Responses of every prompt as they come: cumulative, or only what is new; generated
        with LoRA adapter ``lora_name`` (None: the base model)."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        if any(isinstance(prompt, tuple) for prompt in prompts):
            if self.tokenizer.vision is None:
                why = self.tokenizer.why_no_images
                raise ValueError(f"the model {self.model_name!r} takes no images: {why}")
            for prompt in prompts:
                if isinstance(prompt, tuple):
                    image_prompt(prompt)  # a malformed one fails the call before any runs
        updates: Queue[Response | BaseException | None] = Queue()
        futures: list[Future] = []
        try:
            for index, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
                request = (index, prompt, config, do_preprocess, incremental, lora_name)
                coroutine = self._generate(self._responses(*request), updates)
                futures.append(self._submit(coroutine))
            remaining = len(futures)
            while remaining:
                update = updates.get()
                if update is None:
                    remaining -= 1
                elif isinstance(update, BaseException):
                    raise update
                else:
                    yield update
        finally:
            for future in futures:
                future.cancel()  # a consumer that stops early aborts what still runs

    @staticmethod
    async def _generate(responses: AsyncIterator[Response], updates: Queue) -> None:
        """Hand each of ``responses`` (one prompt's) to the caller's thread through
        ``updates``, then None; an exception goes the same way."""
        try:
            async for response in responses:
                updates.put(response)
        except BaseException as error:  # handed to the caller's thread
            updates.put(error)
        finally:
            updates.put(None)

    async def _responses(
        self,
        index: int,
        prompt: Prompt,
        config: GenerationConfig,
        do_preprocess: bool,
        incremental: bool,
        lora_name: str | None,
    ) -> AsyncIterator[Response]:
        config = self.prompts.with_stop_words(config)
        try:
            request, num_prompt_tokens = await self.tokenizer.run_in_thread(
                self.prompts.request, prompt, config, do_preprocess
            )
        except ImageError as error:  # this prompt fails, as lmdeploy fails one: the others run
            logger.warning("prompt %d failed: %s", index, error)
            yield Response(str(error), 0, 0, "error", index=index)
            return
        if num_prompt_tokens >= self.tokenizer.max_model_len:
            # lmdeploy answers a prompt that leaves no room with an empty "length" response.
            logger.info("run out of tokens: the prompt has %d tokens", num_prompt_tokens)
            yield Response("", 0, num_prompt_tokens, "length", index=index)
            return
        if lora_name is not None:
            request = msgspec.structs.replace(request, lora_name=lora_name)
        with ImageSegments() as images:  # unlinks the image segments unless the engine got them
            context = await self.tokenizer.new_context(request, images)
            stream = GenerationStream(
                self._engine, context, self.tokenizer.backend, _text_options(config), images=images
            )
            async for response in self._results(index, stream, config, incremental):
                yield response

    async def _results(
        self, index: int, stream: GenerationStream, config: GenerationConfig, incremental: bool
    ) -> AsyncIterator[Response]:
        """The responses of one submitted request, as it generates."""
        context = stream.context
        stop_ids = {*context.eos_token_ids, *(config.stop_token_ids or ())}
        total = Response("", 0, context.num_prompt_tokens, index=index)
        total.logprobs = [] if config.logprobs is not None else None
        async for delta in stream.deltas():
            token_ids = self.prompts.reported_tokens(delta, total.token_ids, config, stop_ids)
            logprobs = [_logprob_entry(entry) for entry in delta.logprobs or ()][: len(token_ids)]
            total.text += delta.text
            total.token_ids += token_ids
            total.generate_token_len = len(total.token_ids)
            total.finish_reason = delta.finish_reason
            if total.logprobs is not None:
                total.logprobs += logprobs
            if incremental:
                yield Response(
                    delta.text, total.generate_token_len, total.input_token_len,
                    delta.finish_reason, token_ids,
                    logprobs if total.logprobs is not None else None, index,
                )  # fmt: skip
        if not incremental:
            yield total


def pipeline(
    model_path: str | None = None,
    backend_config: EngineConfig | None = None,
    chat_template_config: ChatTemplateConfig | None = None,
    log_level: str = "WARNING",
    *,
    scheduler_addr: str | None = None,
) -> Pipeline:
    """lmdeploy's ``pipeline()``: a ``Pipeline`` for ``model_path`` (see ``Pipeline``)."""
    return Pipeline(
        model_path, backend_config, chat_template_config, log_level, scheduler_addr=scheduler_addr
    )


def _serve_config(model_dir: Path, name: str, config: EngineConfig, log_level: str) -> ServeConfig:
    memory = config.cache_max_entry_count
    worker = WorkerSettings(
        tensor_parallel_size=config.tp,
        kv_cache_memory=None if memory is None else parse_memory(str(memory)),
        block_size=config.block_size,
        device=config.device_type or WorkerSettings.device,
        dtype=config.dtype,
        logits_processors=LogitsProcessorSettings(tuple(config.logits_processors or ())),
        lora=_lora_settings(config),
    )
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_prefill_token_num,
        enable_prefix_caching=config.enable_prefix_caching,
        lora_modules=tuple(f"{name}={path}" for name, path in (config.adapters or {}).items()),
    )
    return ServeConfig(
        model_dir=model_dir,
        served_model_name=name,
        max_model_len=config.session_len,
        scheduler=scheduler,
        worker=worker,
        log=LogSettings(level=log_level),
    )


def _as_batch(prompts: Prompt | list[Prompt]) -> tuple[bool, list[Prompt]]:
    """(whether ``prompts`` is one prompt, the prompts as a list)."""
    if isinstance(prompts, (str, tuple)):  # text, or (text, images)
        return True, [prompts]
    if prompts and isinstance(prompts[0], dict):
        return True, [prompts]  # one conversation
    return False, list(prompts)


def _lora_settings(config: EngineConfig) -> LoRASettings:
    """Slots for every adapter of ``config.adapters`` (at least ``--max-loras``' default)."""
    if not config.adapters:
        return LoRASettings()
    max_loras = max(LoRASettings.max_loras, len(config.adapters))
    return LoRASettings(True, max_loras, config.max_lora_rank)


def _text_options(config: GenerationConfig) -> TextOptions:
    return TextOptions(
        stop=tuple(config.stop_words or ()),
        skip_special_tokens=config.skip_special_tokens,
        include_stop_str_in_output=config.include_stop_str_in_output,
    )


def _configs(
    gen_config: GenerationConfig | list[GenerationConfig] | None, count: int
) -> list[GenerationConfig]:
    if isinstance(gen_config, list):
        if len(gen_config) != count:
            raise ValueError(f"{len(gen_config)} generation configs for {count} prompts")
        return gen_config
    return [gen_config or GenerationConfig()] * count


def _logprob_entry(entry) -> dict[int, float]:
    """lmdeploy's per-token log probabilities: the chosen token's and the top ones'."""
    top = dict(entry.top or {})
    top[entry.token_id] = entry.logprob
    return top


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt")
