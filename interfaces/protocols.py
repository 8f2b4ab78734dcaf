"""The two roles every model integration fills, as in MAX's interfaces."""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from interfaces.outputs import TextGenerationOutput
from interfaces.requests import RequestID, TextContext, TextGenerationRequest

InputsT = TypeVar("InputsT", contravariant=True)


@runtime_checkable
class PipelineTokenizer(Protocol):
    """Turns requests into token contexts and tokens back into text (API server side)."""

    @property
    def eos(self) -> int:
        """The end-of-sequence token id."""
        ...

    @property
    def expects_content_wrapping(self) -> bool:
        """True if text parts are ``{"type": "text", "content": ...}`` rather than ``"text"``."""
        ...

    async def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``prompt``; ``ValueError`` if it exceeds the context length."""
        ...

    async def decode(self, encoded: list[int], **kwargs) -> str:
        """Text for ``encoded`` token ids."""
        ...

    async def new_context(self, request: TextGenerationRequest) -> TextContext:
        """Apply the chat template if needed, tokenize, and bound the output length; the
        context carries everything else the request asks for."""
        ...


@runtime_checkable
class TokenGenerator(Protocol[InputsT]):
    """Runs one batched step of the model (worker side)."""

    def next_token(self, inputs: InputsT) -> dict[RequestID, TextGenerationOutput]:
        """Run the step; return the tokens produced, by request id."""
        ...

    def release(self, request_id: RequestID) -> None:
        """Forget everything held for ``request_id``."""
        ...
