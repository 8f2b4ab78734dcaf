"""ModelRunner: turns one ScheduledStep into one batched forward pass and sampled tokens.

The runner decides nothing about scheduling. It caches each request's tokens and block ids,
computes exactly the tokens the scheduler named, and samples a token for every request whose
computed tokens thereby reach the end of its known tokens (prompt plus outputs so far), along with
the log probabilities and grammar masks the request asked for.

One request never fails its batch (``worker.request_sampler``): an error in its logits
processing, sampling or grammar fails that request alone (``take_failures``), and a request whose
grammar is still compiling when it must sample is deferred (``take_deferred``): it gets no token
this step, and ``grammar_news`` says when its grammar is ready (or failed), for the scheduler to
recompute its last token.

Tensor-parallel, every rank runs the same step on its share of the model (``worker.parallel``).
Before the forward pass the ranks agree on which new requests are refused and whether the step
failed, so their batches stay identical; after it, rank 0 alone samples (and alone compiles
grammars) and sends the tokens to the others, which need them as the next step's inputs
(none for a request that got none; with speculative decoding, the drafts it accepted and the
token after them, ``worker.request_sampler``). A collective that fails leaves the ranks out of
step, which no step can repair: it raises ``GroupBroken`` and the worker exits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import numpy as np
import torch

from interfaces import RequestID, TextGenerationOutput
from interfaces.scheduler_to_worker import (
    MAX_DRAFT_TOKENS,
    LoRAUpdate,
    NewRequestData,
    ScheduledStep,
)
from interfaces.worker_to_scheduler import (
    CPU_STEP_TOKENS,
    CUDA_STEP_TOKENS,
    GrammarsReady,
    KVLayout,
    LoRAUpdated,
    RequestFailure,
)
from worker import flex_attention, parallel
from worker.attention import AttentionKind, build_batch_layout, choose_attention_kind
from worker.config import WorkerConfig, default_num_threads
from worker.cuda_graphs import DecodeGraphs, build_decode_graphs
from worker.grammar_compiler import GrammarCompiler
from worker.images import RequestImage, input_embeddings, read_images
from worker.kv_cache import (
    KVCache,
    bytes_per_block,
    check_fits_in_memory,
    kv_cache_budget,
    num_blocks_for_budget,
)
from worker.kv_transfer import kv_layout
from worker.logprobs import check_logprob_counts
from worker.lora import LoRAAdapters, update_without_lora
from worker.models.config import ModelConfig
from worker.models.loader import load_model
from worker.parallel import tensor_parallel
from worker.prompt_logprobs import plan_prompt_logprob_rows, record_prompt_logprobs
from worker.request_sampler import RequestSampler
from worker.request_state import RequestState
from worker.sampler import Sampler, check_supported
from worker.structured_output import MaskFiller
from worker.user_processors import check_processor_names, load_user_processors

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache and per-request state of one worker (TokenGenerator).

    Called by the worker server's loop, one step at a time, from a single thread.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.user_processors = load_user_processors(config.logits_processors)
        """Every rank loads them (a bad path stops each alone); rank 0 applies them."""
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.tensor_parallel = tensor_parallel()
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or default_num_threads())
        torch.set_float32_matmul_precision(config.float32_matmul_precision)  # packing reads it
        self.model = load_model(config.model_dir, self.device, self.dtype)
        self.model_config: ModelConfig = self.model.config
        self.lora: LoRAAdapters | None = None
        """The LoRA adapters' slots (``worker.lora``); None without ``--enable-lora``."""
        if config.lora.enable_lora:
            if self.model_config.vision is not None:
                raise ValueError(
                    "LoRA adapters are served for text models only: drop --enable-lora"
                )
            self.lora = LoRAAdapters(self.model, config.lora, self.device, self.dtype)
        self._max_model_len = _max_model_len(config, self.model_config)
        self.kv_cache = self._allocate_kv_cache()
        self.attention_kind = choose_attention_kind(
            self.model.attention_kind, self.block_size, config.attention_backend
        )
        graphs_wanted = (
            self.attention_kind is AttentionKind.FLEX
            and config.max_cudagraph_capture_size > 0
            and self.tensor_parallel.world_size == 1
            and self.model_config.vision is None
        )
        self._spare_blocks = 1 if graphs_wanted else 0
        """Blocks at the cache's end kept from the scheduler: CUDA graphs' padding rows
        write there (``worker.cuda_graphs``)."""
        _check_kv_capacity(self.num_kv_blocks * self.block_size, self._max_model_len)
        if self.attention_kind is AttentionKind.FLEX:
            flex_attention.warm_up(*self.kv_cache.layer(0), self.model.num_heads)
        self.decode_graphs: DecodeGraphs | None = None
        """Decode steps replayed as CUDA graphs; None: every step runs eagerly."""
        if graphs_wanted:
            self.decode_graphs = build_decode_graphs(
                self.model,
                self.kv_cache,
                self.num_kv_blocks,
                self._max_model_len,
                config.max_cudagraph_capture_size,
            )
        self.sampler = Sampler(self.device, config.seed)
        self.grammars: GrammarCompiler | None = None
        """Rank 0's: only it samples, so only it follows grammars."""
        if self.tensor_parallel.is_driver:
            self.grammars = GrammarCompiler(
                config.model_dir,
                self.model_config.vocab_size,
                default_num_threads(),
                config.grammar_limits,
            )
        self.requests: dict[RequestID, RequestState] = {}
        self._refusals: dict[RequestID, str] = {}
        limits = config.grammar_limits
        self.request_sampler = RequestSampler(
            self.sampler,
            self.model_config.vocab_size,
            self.device,
            self.user_processors,
            MaskFiller(
                limits.mask_timeout_s,
                limits.mask_timeout_error(),
                per_token_s=limits.mask_time_per_token_s,
                budget_failure=limits.mask_budget_error(),
            ),
        )
        logger.info(
            "loaded %s on %s (%s), rank %d of %d: %d KV blocks of %d tokens, max_model_len %d, "
            "attention %s",
            config.model_dir,
            self.device,
            self.dtype,
            self.tensor_parallel.rank,
            self.tensor_parallel.world_size,
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
            self.attention_kind.value,
        )

    @property
    def step_tokens(self) -> int:
        """The step budget this worker suggests to the scheduler (``WorkerReady.step_tokens``)."""
        return CUDA_STEP_TOKENS if self.device.type == "cuda" else CPU_STEP_TOKENS

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the scheduler may use: the cache's, less any spare."""
        return self.kv_cache.num_blocks - self._spare_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt plus output) one request may hold."""
        return self._max_model_len

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size, reported to the scheduler (``WorkerReady``)."""
        return self.model_config.vocab_size

    @property
    def lora_limits(self) -> tuple[int, int]:
        """(adapters held at once, their largest rank), reported to the scheduler
        (``WorkerReady``); (0, 0) without ``--enable-lora``."""
        return (self.lora.max_loras, self.lora.max_rank) if self.lora is not None else (0, 0)

    def update_lora(self, update: LoRAUpdate) -> LoRAUpdated:
        """Load or unload an adapter between steps (every rank; rank 0 sends the answer).
        Never raises but ``GroupBroken``: a bad adapter is a status in the answer."""
        if self.lora is None:
            return update_without_lora(update)
        return self.lora.update(update)

    @property
    def kv_layout(self) -> KVLayout:
        """The KV cache's shape, for the handshake and KV transfers."""
        return kv_layout(self.kv_cache, self.model_config.num_key_value_heads)

    def _allocate_kv_cache(self) -> KVCache:
        """This rank's pool: its key-value heads, and as many blocks as every rank can hold,
        so that a block id means the same slots on each."""
        model, num_kv_heads = self.model_config, self.model.num_kv_heads
        shape = (model.num_hidden_layers, self.config.block_size, num_kv_heads)
        block_bytes = bytes_per_block(*shape, model.head_dim, self.dtype)
        budget = kv_cache_budget(self.config.kv_cache_memory, self.device)
        num_blocks = parallel.all_reduce_min(num_blocks_for_budget(budget, block_bytes))
        check_fits_in_memory(num_blocks * block_bytes, self.device)
        return KVCache(
            model.num_hidden_layers,
            num_blocks,
            self.config.block_size,
            num_kv_heads,
            model.head_dim,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def next_token(self, scheduler_output: ScheduledStep) -> dict[RequestID, TextGenerationOutput]:
        """Run one step; return one new token for each request that reached a sampling point.

        A new request the worker cannot serve (a bad grammar, logit_bias outside the vocabulary)
        is refused alone: see ``take_refusals``. If the step raises (``ValueError`` for an
        inconsistent step), every request it named is released, so no half-applied state
        outlives it. Ranks other than 0 return no outputs.
        """
        try:
            failure = None
            try:
                self._update_states(scheduler_output)
            except Exception as error:  # every rank must still take part in the agreement
                failure = error
            self._agree_on_refusals(scheduler_output, failure)
            outputs = self._execute(scheduler_output.num_scheduled_tokens)
        except Exception:
            for request_id in _named_request_ids(scheduler_output):
                self.release(request_id)
            self.request_sampler.discard_step()  # the whole step fails instead
            raise
        for request_id in scheduler_output.num_scheduled_tokens:
            refusal = self.requests[request_id].refusal
            if refusal is not None:
                self._refusals[request_id] = refusal
                self.release(request_id)
        return outputs

    def take_refusals(self) -> dict[RequestID, str]:
        """Requests refused since the last call, with the reason; the caller reports them."""
        refusals, self._refusals = self._refusals, {}
        return refusals

    def take_failures(self) -> dict[RequestID, RequestFailure]:
        """Requests whose token could not be sampled since the last call (``WorkerOutput``'s
        ``failed``); their state stays until the scheduler releases them."""
        return self.request_sampler.take_failures()

    def take_deferred(self) -> list[RequestID]:
        """Requests that waited for their grammar instead of sampling since the last call."""
        return self.request_sampler.take_deferred()

    def grammar_news(self, now: float | None = None) -> GrammarsReady | None:
        """Which deferred requests' grammars compiled, or failed (invalid, or past the time
        limit), since the last call; None when there is nothing new. Rank 0 calls it between
        steps (``GrammarCompiler.wakeup_fd`` tells when a compile finished)."""
        if self.grammars is not None:
            self.grammars.drain_wakeups()
        return self.request_sampler.grammar_news(self.requests, now)

    @property
    def grammar_wakeup_fd(self) -> int | None:
        """A file descriptor readable when a grammar finished compiling (rank 0's)."""
        return self.grammars.wakeup_fd if self.grammars is not None else None

    def release(self, request_id: RequestID) -> None:
        """Forget ``request_id``; unknown ids are ignored. Its blocks belong to the scheduler."""
        self.requests.pop(request_id, None)
        self.request_sampler.forget(request_id)

    def release_all(self) -> None:
        """Forget every request and what was due to be reported about them: the scheduler that
        sent them went away. The KV cache's contents stay, unread: a new scheduler's blocks
        are all free, and it schedules every token it needs computed."""
        for request_id in list(self.requests):
            self.release(request_id)
        self._refusals = {}
        self.request_sampler.discard_step()
        if self.lora is not None:  # its ids were that scheduler's: a new one loads its own
            self.lora.unload_all()

    def _update_states(self, scheduler_output: ScheduledStep) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.release(request_id)
        for new in scheduler_output.new_requests:
            state = self._new_state(new)
            self._check_block_ids(state.request_id, state.block_ids)
            self.requests[state.request_id] = state
        for cached in scheduler_output.cached_requests:
            state = self._state(cached.request_id)
            self._check_block_ids(cached.request_id, cached.new_block_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for request_id, drafts in scheduler_output.spec_token_ids.items():
            state = self._state(request_id)
            self._check_drafts(state, drafts, scheduler_output.num_scheduled_tokens)
            state.drafts = list(drafts)

    def _new_state(self, new: NewRequestData) -> RequestState:
        """State for a request the scheduler sends in full; one the worker cannot serve gets a
        ``refusal`` (and no grammar or logprobs) instead of failing the step. Its images are read
        first and kept on a refusal: the step still computes its blocks, which the scheduler
        registered in the prefix cache, and another request may share them within the step."""
        context = new.context
        images = []
        try:
            images = read_images(context, self.model_config.vision, new.num_computed_tokens)
            check_supported(context.sampling_params, self.model_config.vocab_size)
            check_processor_names(context.sampling_params, self.user_processors)
            check_logprob_counts(context)
            self._check_lora_id(new.context.lora_id)
            grammar = None
            if context.structured_output is not None and self.grammars is not None:
                grammar = self.grammars.start(context)
        except ValueError as error:
            return self._refused_state(new, str(error), images)
        vocab_size = self.model_config.vocab_size
        return RequestState.from_new_request(new, self.device, vocab_size, grammar, images)

    def _refused_state(
        self, new: NewRequestData, reason: str, images: list[RequestImage]
    ) -> RequestState:
        plain = NewRequestData(
            msgspec.structs.replace(new.context, logprobs=None, prompt_logprobs=None),
            new.block_ids,
            new.num_computed_tokens,
            new.output_token_ids,
        )
        vocab_size = self.model_config.vocab_size
        state = RequestState.from_new_request(plain, self.device, vocab_size, images=images)
        state.refusal = reason
        return state

    def _agree_on_refusals(self, step: ScheduledStep, failure: Exception | None) -> None:
        """Raise ``failure``, or a failure on another rank; then refuse on every rank each new
        request that some rank refused (rank 0 alone compiles grammars; any rank may fail to
        read an image whose segment was unlinked meanwhile)."""
        refused = [
            failure is None and self.requests[new.context.request_id].refusal is not None
            for new in step.new_requests
        ]
        anyone_failed, anyone_refused = parallel.agree_on_step(failure is not None, refused)
        if failure is not None:
            raise failure
        if anyone_failed:
            raise RuntimeError("another tensor-parallel rank failed this step")
        for new, mine, anyone in zip(step.new_requests, refused, anyone_refused, strict=True):
            if anyone and not mine:
                request_id = new.context.request_id
                driver = self.tensor_parallel.is_driver
                reason = "refused by another rank" if driver else "refused by rank 0"
                images = self.requests[request_id].images
                self.requests[request_id] = self._refused_state(new, reason, images)

    def _execute(
        self, num_scheduled: dict[RequestID, int]
    ) -> dict[RequestID, TextGenerationOutput]:
        states = [self._state(request_id) for request_id in num_scheduled]
        counts = list(num_scheduled.values())
        if not states:
            return {}
        for state, count in zip(states, counts, strict=True):
            self._check_schedulable(state, count)
        lora_slots = self._lora_slots(states)
        sampling = [
            i
            for i, (s, n) in enumerate(zip(states, counts, strict=True))
            if _reaches_end(s, n) and s.refusal is None
        ]
        # Each sampling request's last token, and with drafts the drafts before it too.
        last = (np.cumsum(counts) - 1).tolist()
        rows = [
            last[i] - len(states[i].drafts) + k
            for i in sampling
            for k in range(1 + len(states[i].drafts))
        ]
        prompt_rows = plan_prompt_logprob_rows(states, counts)
        input_ids = self._input_ids(states, counts)
        argmax_only = self._argmax_only([states[i] for i in sampling])
        with (
            parallel.group_breaks_on_error("run a forward pass"),
            self._lora_rows(lora_slots, counts),
        ):
            logits, known = self._logits(
                states, counts, input_ids, rows, prompt_rows.flat_indices, argmax_only
            )
            # known: a token per row of rows or None; logits: the None rows, then the prompt rows
        num_open = known.count(None)
        for state, count in zip(states, counts, strict=True):
            state.num_computed_tokens += count
        sampled = [states[i] for i in sampling]
        capacities = [1 + len(state.drafts) for state in sampled]
        try:
            if not self.tensor_parallel.is_driver:
                return self._follow(sampled, capacities)
            try:
                record_prompt_logprobs(logits[num_open:], prompt_rows)
                outputs = self.request_sampler.sample(logits[:num_open], sampled, known)
            except Exception:
                parallel.share_tokens(None, capacities)
                raise
            produced = [outputs.get(state.request_id) for state in sampled]
            parallel.share_tokens([o.tokens if o else [] for o in produced], capacities)
            for state, output in zip(sampled, produced, strict=True):
                _rewind_rejected(state, output.tokens if output else [])
            return outputs
        finally:
            for state in states:
                state.drafts = []  # this step's only

    def _argmax_only(self, sampled: list[RequestState]) -> list[bool]:
        """Per sampling row of the step (each state's, then its drafts'), whether the model's
        greedy head may pick its token (``RequestState.picks_argmax``); all False where the
        model has none."""
        if self.model.text_model.greedy_head is None or not self.tensor_parallel.is_driver:
            return [False] * sum(1 + len(state.drafts) for state in sampled)
        return [
            (state.at_draft(index) if index else state).picks_argmax()
            for state in sampled
            for index in range(1 + len(state.drafts))
        ]

    def _logits(
        self,
        states: list[RequestState],
        counts: list[int],
        input_ids: list[int],
        rows: list[int],
        prompt_rows: list[int],
        argmax_only: list[bool],
    ) -> tuple[torch.Tensor, list[int | None]]:
        """The forward pass over the step's ``input_ids``: for each of flat-batch ``rows`` a
        token where ``argmax_only`` says it and the model's greedy head picked one, else None;
        and float32 logits of the None rows, then of ``prompt_rows``. A step of single-token
        decodes replays a CUDA graph (``worker.cuda_graphs``) where one serves it; any other
        runs eagerly."""
        num_computed = [state.num_computed_tokens for state in states]
        block_ids = [state.block_ids for state in states]
        embeddings = input_embeddings(
            self.model, input_ids, [state.images for state in states], num_computed, counts
        )
        graphs = self.decode_graphs
        if (
            graphs is not None
            and graphs.serves(counts)
            and embeddings is None
            and not prompt_rows
            and (self.lora is None or not self.lora.batch.groups)
        ):
            logits = graphs.run(num_computed, block_ids, input_ids)  # a row per request
            if len(rows) < len(states):
                logits = logits[torch.tensor(rows, device=self.device)]
            return logits, [None] * len(rows)
        layout = build_batch_layout(
            num_computed,
            counts,
            block_ids,
            self.block_size,
            self.device,
            kind=self.attention_kind,
            num_cache_blocks=self.kv_cache.num_blocks,
        )
        model = self.model.text_model  # forward = logits(hidden_states(...)), split here
        hidden = model.hidden_states(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            layout.positions,
            self.kv_cache,
            layout.metadata,
            torch.tensor(rows + prompt_rows, dtype=torch.int64).to(self.device),
            embeddings,
        )
        known: list[int | None] = [None] * len(rows)
        screened = [row for row, only in enumerate(argmax_only) if only]
        try:
            tokens = model.greedy_tokens(hidden[screened]).tolist() if screened else []
        except MemoryError:  # the head's buffers: these rows take their logits instead
            logger.warning("no memory for the greedy head: %d rows take logits", len(screened))
            screened, tokens = [], []
        for row, token in zip(screened, tokens, strict=True):
            if token >= 0:  # else tile_gemm.NEEDS_LOGITS
                known[row] = token
        open_rows = [row for row in range(len(hidden)) if row >= len(rows) or known[row] is None]
        if len(open_rows) < len(hidden):
            hidden = hidden[open_rows]
        return model.logits(hidden), known

    def _follow(
        self, sampled: list[RequestState], capacities: list[int]
    ) -> dict[RequestID, TextGenerationOutput]:
        """Ranks other than 0: take rank 0's tokens for the states it sampled; no outputs."""
        token_lists = parallel.share_tokens(None, capacities)
        if token_lists is None:
            raise RuntimeError("rank 0 failed to sample this step")
        for state, tokens in zip(sampled, token_lists, strict=True):
            for token in tokens:
                state.append_output(token)
            _rewind_rejected(state, tokens)
        return {}

    def _check_lora_id(self, lora_id: int) -> None:
        if lora_id != 0 and (self.lora is None or self.lora.slot_of(lora_id) is None):
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded on this worker")

    def _lora_slots(self, states: list[RequestState]) -> list[int | None]:
        """Each request's adapter slot (None: the base model). A request whose adapter was
        unloaded while it ran is refused alone (every rank holds the same adapters, so every
        rank refuses it); its tokens run on the base model, unsampled."""
        slots: list[int | None] = []
        for state in states:
            slot = None if self.lora is None else self.lora.slot_of(state.lora_id)
            if slot is None and state.lora_id != 0 and state.refusal is None:
                state.refusal = f"LoRA adapter id {state.lora_id} is not loaded on this worker"
            slots.append(slot)
        return slots

    @contextmanager
    def _lora_rows(self, slots: list[int | None], counts: list[int]) -> Iterator[None]:
        """Within: the model's adapter layers know which rows run with which adapter."""
        if self.lora is None or not any(slot is not None for slot in slots):
            yield
            return
        self.lora.batch.plan(slots, counts)
        try:
            yield
        finally:
            self.lora.batch.clear()

    def _input_ids(self, states: list[RequestState], counts: list[int]) -> list[int]:
        input_ids = []
        for state, count in zip(states, counts, strict=True):
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start : start + count])
            if state.drafts:  # a decode: its last token, then its drafts
                input_ids.extend(state.drafts)
        return input_ids

    def _state(self, request_id: RequestID) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise ValueError(f"request {request_id!r} is not known to this worker")
        return state

    def _check_block_ids(self, request_id: RequestID, block_ids: list[int]) -> None:
        if any(not 0 <= block_id < self.num_kv_blocks for block_id in block_ids):
            raise ValueError(
                f"request {request_id!r} names block ids outside [0, {self.num_kv_blocks})"
            )

    def _check_drafts(
        self, state: RequestState, drafts: list[int], num_scheduled: dict[RequestID, int]
    ) -> None:
        """``ValueError`` unless ``drafts`` may follow ``state``'s tokens in this step: a
        decode (its one known token left to compute) scheduled for that token and the drafts,
        without a grammar or prompt log probabilities to follow, drafts in the vocabulary."""
        problem = None
        if not 1 <= len(drafts) <= MAX_DRAFT_TOKENS:
            problem = f"{len(drafts)} draft tokens (1 to {MAX_DRAFT_TOKENS} allowed)"
        elif num_scheduled.get(state.request_id) != 1 + len(drafts):
            problem = f"{len(drafts)} drafts, but {num_scheduled.get(state.request_id)} tokens"
        elif state.num_computed_tokens + 1 != state.num_tokens:
            problem = "drafts for a request that is not decoding"
        elif state.grammar is not None or state.pending_grammar is not None:
            problem = "drafts for a request that follows a grammar"
        elif state.prompt_logprobs is not None:
            problem = "drafts before the first token of a request with prompt log probabilities"
        elif not all(0 <= token < self.model_config.vocab_size for token in drafts):
            problem = "draft tokens outside the vocabulary"
        if problem is not None:
            raise ValueError(f"request {state.request_id!r}: {problem}")

    def _check_schedulable(self, state: RequestState, count: int) -> None:
        end = state.num_computed_tokens + count
        problem = None
        if count < 1:
            problem = f"{count} tokens scheduled"
        elif end > state.num_tokens + len(state.drafts):
            problem = f"tokens up to {end} scheduled but only {state.num_tokens} are known"
        elif end > self.max_model_len:
            problem = f"tokens up to {end} exceed max_model_len {self.max_model_len}"
        elif len(state.block_ids) * self.block_size < end:
            problem = f"{len(state.block_ids)} blocks cannot hold {end} tokens"
        if problem is not None:
            raise ValueError(f"request {state.request_id!r}: {problem}")


def _reaches_end(state: RequestState, count: int) -> bool:
    return state.num_computed_tokens + count == state.num_tokens + len(state.drafts)


def _rewind_rejected(state: RequestState, tokens: list[int]) -> None:
    """After verifying ``state``'s drafts (``tokens``: the accepted ones and the token sampled
    after them, appended already): only the accepted drafts' keys and values count as
    computed; the rejected ones' slots are written again later."""
    if state.drafts:  # no tokens: the request failed; its last known token was computed
        state.num_computed_tokens = state.num_tokens - (1 if tokens else 0)


def _named_request_ids(scheduler_output: ScheduledStep) -> set[RequestID]:
    named = {new.context.request_id for new in scheduler_output.new_requests}
    named.update(cached.request_id for cached in scheduler_output.cached_requests)
    named.update(scheduler_output.num_scheduled_tokens)
    return named


def _check_kv_capacity(num_cache_tokens: int, max_model_len: int) -> None:
    """Refuse to start when one request of the full context length could not fit in the pool."""
    if num_cache_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_cache_tokens} tokens, fewer than max_model_len "
            f"{max_model_len}; raise --kv-cache-memory or lower --max-model-len"
        )


def _max_model_len(config: WorkerConfig, model: ModelConfig) -> int:
    """The configured limit, else the model's; capped to a sliding window so attention is exact."""
    limit = config.max_model_len or model.max_position_embeddings
    if limit > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len {limit} exceeds the model's {model.max_position_embeddings} positions"
        )
    if model.sliding_window is not None and model.sliding_window < limit:
        logger.warning("capping max_model_len to the sliding window of %d", model.sliding_window)
        limit = model.sliding_window
    return limit
