"""Every choice of one response, generated together: ``n`` per prompt, one or more prompts.

Each choice is its own request to the scheduler (id ``<response id>-<index>`` when there are
several). All are submitted at once, so choices of one prompt share its KV blocks through the
prefix cache, and its images' shared-memory segments and their owner (``ImageSegments``). Their
deltas are merged in arrival order, each tagged with its choice index; completions' ``echo``
puts the prompt (and its log probabilities) before a choice's first text. A prompt's log
probabilities are computed once, by its first choice, and echoed by all of them
(``EchoedLogprobs``).

The merge holds at most one delta per choice: a choice whose deltas are not taken waits, so
results for a client that stopped reading pile up in the engine client, which bounds them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec

from api_server.logprobs import TokenLogprob
from api_server.responses import FinishReason, Usage
from api_server.text_stream import GenerationStream, RequestFailed, TextDelta
from interfaces import TextContext

INT64_MIN, INT64_RANGE = -(2**63), 2**64


class EchoedLogprobs:
    """The log probabilities of one prompt's tokens, for every choice that echoes it.

    Only the prompt's first choice asks the engine for them (it ``give``s them with its first
    delta); the others ask for none, so each is an ordinary prefill that the prefix cache can
    serve, and wait for the first's (``get``). If the first choice ends without them (it
    failed or was aborted), ``get`` raises ``RequestFailed``: no choice waits for ever.
    """

    def __init__(self) -> None:
        self._entries: asyncio.Future[list[TokenLogprob]] = (
            asyncio.get_running_loop().create_future()
        )

    def give(self, entries: list[TokenLogprob]) -> None:
        if not self._entries.done():
            self._entries.set_result(entries)

    def withhold(self) -> None:
        """The first choice ended without them (a no-op once given)."""
        if not self._entries.done():
            self._entries.set_exception(
                RequestFailed("the prompt's first choice ended before its log probabilities")
            )
            self._entries.exception()  # retrieved: no warning when no choice was left to wait

    async def get(self) -> list[TokenLogprob]:
        return await asyncio.shield(self._entries)


@dataclass
class Choice:
    """One choice: its index in the response, its stream, and the prompt text to echo first
    (None: no echo). ``echoed_logprobs``: the prompt's log probabilities shared by its choices
    (None: this choice's own stream brings them, or none are asked for); ``gives_logprobs``:
    this choice is the one whose stream computes them."""

    index: int
    stream: GenerationStream
    echo_text: str | None = None
    echoed_logprobs: EchoedLogprobs | None = None
    gives_logprobs: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return self.stream.context.logprobs is not None


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice; ``logprobs`` is None when the request did not ask for them."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class ChoiceOutput:
    """A whole choice, for a non-streaming response."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason


def choice_context(context: TextContext, response_id: str, index: int, sample: int) -> TextContext:
    """``context`` for choice ``index`` (the ``sample``-th of its prompt): its own request id
    and, when the request has a seed, seed + ``sample``, so seeded choices differ (vLLM's rule;
    ``new_context`` gives every request a seed, so all choices differ).
    It names the same image segments as ``context`` (and shares their owner).
    """
    params = context.sampling_params
    if params.seed is not None and sample:
        seed = (params.seed + sample - INT64_MIN) % INT64_RANGE + INT64_MIN
        params = msgspec.structs.replace(params, seed=seed)
    return msgspec.structs.replace(
        context, request_id=f"{response_id}-{index}", sampling_params=params
    )


class Generation:
    """The choices of one response, run together. ``num_prompt_tokens`` counts each prompt
    once, however many choices it has; ``usage()`` adds every choice's output tokens."""

    def __init__(self, choices: list[Choice], num_prompt_tokens: int) -> None:
        self.choices = choices
        self.num_prompt_tokens = num_prompt_tokens

    def usage(self) -> Usage:
        completion_tokens = sum(choice.stream.num_output_tokens for choice in self.choices)
        return Usage.of(self.num_prompt_tokens, completion_tokens)

    async def deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        """Deltas of every choice as they arrive; each choice's last has its finish reason.

        Raises the first error any choice raises (``RequestFailed``, ``SchedulerUnavailable``);
        closing the generator early aborts every choice still running. However it ends, it
        closes every choice's image segments once no choice can send them any more (they are
        unlinked unless one was sent: ``ImageSegments``).
        """
        queue: asyncio.Queue[ChoiceDelta | Exception | None] = asyncio.Queue(len(self.choices))
        tasks = [asyncio.create_task(self._pump(choice, queue)) for choice in self.choices]
        try:
            num_running = len(tasks)
            while num_running:
                item = await queue.get()
                if item is None:
                    num_running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                for choice in self.choices:
                    choice.stream.images.close()

    async def collect(self) -> list[ChoiceOutput]:
        """Every choice whole, in index order."""
        texts: dict[int, list[str]] = {choice.index: [] for choice in self.choices}
        logprobs = {c.index: [] if c.wants_logprobs else None for c in self.choices}
        finish_reasons: dict[int, FinishReason] = dict.fromkeys(texts, "abort")
        async for delta in self.deltas():
            texts[delta.index].append(delta.text)
            entries = logprobs[delta.index]
            if entries is not None:
                entries.extend(delta.logprobs or [])
            finish_reasons[delta.index] = delta.finish_reason or finish_reasons[delta.index]
        return [
            ChoiceOutput(index, "".join(texts[index]), logprobs[index], finish_reasons[index])
            for index in sorted(texts)
        ]

    @staticmethod
    async def _pump(choice: Choice, queue: asyncio.Queue) -> None:
        """Move one choice's deltas to ``queue``, waiting while it is full; an error goes there
        too; None ends it. Cancelled (the consumer is gone), it puts nothing more."""
        shared = choice.echoed_logprobs
        try:
            is_first = True
            async with contextlib.aclosing(choice.stream.deltas()) as deltas:
                async for delta in deltas:
                    prompt_logprobs = delta.prompt_logprobs
                    if is_first and shared is not None:
                        if choice.gives_logprobs and prompt_logprobs is not None:
                            shared.give(prompt_logprobs)
                        elif not choice.gives_logprobs:
                            prompt_logprobs = await shared.get()
                    await queue.put(_choice_delta(choice, delta, prompt_logprobs, is_first))
                    is_first = False
        except Exception as error:
            await queue.put(error)
        else:
            await queue.put(None)
        finally:
            if shared is not None and choice.gives_logprobs:
                shared.withhold()


def _choice_delta(
    choice: Choice,
    delta: TextDelta,
    prompt_logprobs: list[TokenLogprob] | None,
    is_first: bool,
) -> ChoiceDelta:
    text = delta.text
    logprobs = (delta.logprobs or []) if choice.wants_logprobs else None
    if is_first and choice.echo_text is not None:
        text = choice.echo_text + text
        if logprobs is not None:
            logprobs = (prompt_logprobs or []) + logprobs
    return ChoiceDelta(choice.index, text, logprobs, delta.finish_reason)
