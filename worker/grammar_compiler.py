"""Grammar compilation off the step: ``GrammarCompiler`` turns a request's ``StructuredOutput``
into a ``PendingGrammar``, compiled on background threads (xgrammar's compiler releases the GIL, so
steps go on meanwhile), each distinct (kind, spec) once; once compiled it yields the request's
``RequestGrammar`` (``worker.structured_output``).

A spec is parsed at once (fast; an invalid one is refused with xgrammar's reason) and checked
against ``GrammarLimits``; the compile against the vocabulary is what takes seconds. A compile
cannot be interrupted. A request waits at most ``GrammarLimits.compile_timeout_s`` for its grammar,
counted from when it asked, queueing for a compile thread included; past that it fails (a 400).
A compile already running runs on to the end (its result is cached; the spec limits bound how long
that is), and a queued one whose requests have all stopped waiting is never started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from interfaces import StructuredOutput, TextContext
from worker.grammar_limits import GrammarLimits
from worker.structured_output import RequestGrammar

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
"""Grammars compiled at once; a third waits in a queue (its requests' time limits running)."""
COMPILE_NICENESS = 10
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class CompileJob:
    """One spec's compile on a compile thread, shared by the requests that ask for it.

    ``deadline`` (``time.monotonic()``) is when the last request waiting for it gives up: a job
    still queued then is dropped instead of compiled.
    """

    def __init__(self, kind: str, deadline: float) -> None:
        self.kind = kind
        self.future: Future = Future()
        self.deadline = deadline

    @classmethod
    def done(cls, kind: str, compiled: xgrammar.CompiledGrammar) -> CompileJob:
        job = cls(kind, 0.0)
        job.future.set_result(compiled)
        return job


class PendingGrammar:
    """One request's grammar while it compiles (``GrammarCompiler.start``); ``poll`` tells."""

    def __init__(
        self,
        kind: str,
        job: CompileJob,
        eos_token_ids: Sequence[int],
        compiler: GrammarCompiler,
    ) -> None:
        self.kind = kind
        self.job = job
        self.eos_token_ids = list(eos_token_ids)
        self.compiler = compiler
        self.waiting_since = time.monotonic()

    def poll(self, now: float | None = None) -> RequestGrammar | str | None:
        """The request's matcher once compiled; the reason for its user (a 400) if the spec
        could not be compiled or its compile ran past the time limit; None while it compiles."""
        limits, future = self.compiler.limits, self.job.future
        if not future.done():
            now = time.monotonic() if now is None else now
            if now - self.waiting_since > limits.compile_timeout_s:
                return limits.timeout_error(self.kind)
            return None
        error = future.exception()
        if error is not None:
            return str(error) or type(error).__name__
        stop_token_ids = self.eos_token_ids or self.compiler.stop_token_ids
        return RequestGrammar(future.result(), stop_token_ids)


class GrammarCompiler:
    """Compiles structured-output specs for one model's tokenizer; owned by the ModelRunner,
    called from its thread (the compiles run on ``COMPILE_THREADS`` threads of its own).

    The tokenizer (transformers' AutoTokenizer from ``model_dir``) is loaded by the first
    compile, so a model directory without one works until a request asks for structured output.
    Each finished compile writes a byte to ``wakeup_fd`` (a pipe), so a loop that polls it
    notices at once; ``drain_wakeups`` empties it.
    """

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        num_threads: int = 1,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self.limits = limits or GrammarLimits()
        self.stop_token_ids: list[int] = []
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[CompileJob, xgrammar.Grammar] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._compiling: dict[tuple[str, str | None], CompileJob] = {}
        self._cache: OrderedDict[tuple[str, str | None], xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self.wakeup_fd, self._wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_fd, False)

    def start(self, context: TextContext) -> PendingGrammar:
        """Start compiling ``context.structured_output`` (which must be set), unless it is
        cached or compiling already. ``ValueError`` naming the request for an invalid spec
        (parsed here, at once) or one too big to try (naming the limit)."""
        structured = context.structured_output
        self._collect()
        key = (structured.kind, structured.spec)
        job = self._compiling.get(key)
        deadline = time.monotonic() + self.limits.compile_timeout_s
        if key in self._cache:
            self._cache.move_to_end(key)
            job = CompileJob.done(structured.kind, self._cache[key])
        elif job is not None:
            job.deadline = max(job.deadline, deadline)
        else:
            try:
                self.limits.check(structured)
                grammar = parse(structured)
            except ValueError as error:
                raise ValueError(f"request {context.request_id!r}: {error}") from None
            job = CompileJob(structured.kind, deadline)
            job.future.add_done_callback(self._wake)
            self._start_threads()
            self._jobs.put((job, grammar))
            self._compiling[key] = job
        return PendingGrammar(structured.kind, job, context.eos_token_ids, self)

    def grammar_for(self, context: TextContext) -> RequestGrammar:
        """A fresh matcher for ``context.structured_output``, waiting for its compile (tests
        and tools; the worker polls ``start``'s ``PendingGrammar`` instead). ``ValueError``
        naming the request when the spec is invalid or too big."""
        pending = self.start(context)
        pending.job.future.exception()  # waits
        grammar = pending.poll()
        if isinstance(grammar, str):
            raise ValueError(f"request {context.request_id!r}: {grammar}")
        return grammar

    def compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar for ``structured``, waiting for it (tests and tools).
        ``ValueError`` with xgrammar's reason for an invalid schema, regex or grammar."""
        pending = self.start(TextContext("compile", [0], 1, structured_output=structured))
        return pending.job.future.result()

    def drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup_fd, 4096):
                pass

    def close(self) -> None:
        """Stop the compile threads once their compiles end (daemon threads: a process that
        exits does not wait for them) and close the pipe."""
        for _ in self._threads:
            self._jobs.put(None)
        os.close(self.wakeup_fd)
        os.close(self._wakeup_write)

    def _start_threads(self) -> None:
        """The compile threads, on first use; daemons, so that a compile that runs for minutes
        never holds up the worker's exit (a ThreadPoolExecutor's threads are joined at exit)."""
        while len(self._threads) < COMPILE_THREADS:
            thread = threading.Thread(
                target=self._serve_compiles, name=f"grammar-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _serve_compiles(self) -> None:
        _lower_priority()
        while (item := self._jobs.get()) is not None:
            job, grammar = item
            if time.monotonic() > job.deadline:  # every request waiting for it gave up
                job.future.set_exception(ValueError(self.limits.timeout_error(job.kind)))
                continue
            try:
                compiled = self._run(grammar)
            except Exception as error:
                job.future.set_exception(error)
            else:
                job.future.set_result(compiled)

    def _wake(self, _future: Future) -> None:
        with contextlib.suppress(OSError):  # full (the loop will look anyway) or closed
            os.write(self._wakeup_write, b"\0")

    def _run(self, grammar: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        """On a compile thread: load the compiler (``ValueError`` if the model has no
        tokenizer), then compile."""
        self._xgrammar_compiler()
        return self._compile(grammar)

    def _compile(self, grammar: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        return self._xgrammar_compiler().compile_grammar(grammar)

    def _collect(self) -> None:
        """Move finished compiles into the cache, least recently used out past its bytes."""
        for key, job in list(self._compiling.items()):
            if not job.future.done():
                continue
            del self._compiling[key]
            if job.future.exception() is None:
                self._remember(key, job.future.result())

    def _remember(self, key: tuple[str, str | None], compiled: xgrammar.CompiledGrammar) -> None:
        num_bytes = compiled.memory_size_bytes
        if num_bytes > self.limits.cache_bytes:
            return
        self._cache[key] = compiled
        self._cache_bytes += num_bytes
        while self._cache_bytes > self.limits.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.memory_size_bytes

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._load_compiler()
            return self._compiler

    def _load_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as error:
            # The path and the loader's text go to the log; the 400 a client sees names neither.
            logger.error("cannot load the tokenizer in %s for grammars: %s", self.model_dir, error)
            raise ValueError(
                "structured output is not available: the model has no tokenizer"
            ) from None
        self.stop_token_ids = _stop_token_ids(tokenizer, self.model_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgrammar.GrammarCompiler(info, max_threads=self.num_threads, cache_enabled=False)


def _lower_priority() -> None:
    """Run this compile thread (and the threads xgrammar starts from it, which inherit it) at
    a lower CPU priority than the steps: on a busy CPU a compile then takes idle time instead
    of slowing every request's forward pass (torch's threads spin-wait on a shared core)."""
    with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def parse(structured: StructuredOutput) -> xgrammar.Grammar:
    """Parse one spec into xgrammar's grammar (fast: 72 ms for a 1.1 MB choice list; the
    compile against the vocabulary is what takes seconds). JSON comes out compact (no free
    whitespace), as ``json.dumps`` writes it, so a small model cannot wander off into endless
    blank lines. ``ValueError`` with xgrammar's reason for an invalid schema, regex or grammar."""
    import xgrammar

    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        spec = '{"type": "object"}'
    elif spec is None:
        raise ValueError(f"{kind} needs a spec")
    try:
        if kind in ("json_object", "json_schema"):
            json.loads(spec)
            return xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec)
        return xgrammar.Grammar.from_ebnf(spec)
    except (json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"invalid {kind} for structured output: {error}") from None
    except RuntimeError as error:
        reason = _XGRAMMAR_LOCATION.sub("", str(error).strip())
        raise ValueError(f"invalid {kind} for structured output: {reason}") from None


def _stop_token_ids(tokenizer, model_dir: Path) -> list[int]:
    """The tokenizer's eos id and generation_config.json's ``eos_token_id`` (int or list)."""
    token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = model_dir / "generation_config.json"
    configured = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    token_ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(t for t in token_ids if isinstance(t, int)))
