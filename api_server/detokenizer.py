"""Incremental detokenization: token ids in, text deltas out, as vLLM does it, in linear time.

Decoding each new token alone is wrong twice over: a character may span several byte-level tokens
(decoding half of it gives U+FFFD), and SentencePiece-style decoders drop the leading space of the
first token they see. So each step decodes a small window: the *context* tokens (whose text was
already sent, kept only so the decoder sees what came before) and the *pending* tokens (whose text
was not). The new text is ``decode(context + pending)`` minus ``decode(context)``, held back while
it ends in U+FFFD (an incomplete character) or adds nothing.

Held back without limit, a model that emits lone bytes (forced with ``logit_bias``) would make
every step decode every token so far: 8,000 such tokens cost 32 million decoded tokens. So once
more than ``MAX_PENDING_TOKENS`` tokens are pending the detokenizer forces progress: it sends the
text up to the last token boundary where the text is complete (an incomplete character spans at
most ``MAX_INCOMPLETE_CHARACTER_TOKENS`` tokens), or, when the tail is invalid bytes, their U+FFFD
characters; pending tokens that decode to nothing (skipped special tokens) are dropped. Each step
then decodes at most a few dozen tokens. (tokenizers' ``DecodeStream`` holds back the same way and
is just as quadratic.)
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"
MAX_PENDING_TOKENS = 16
"""Pending tokens beyond this many force progress. Normal text never gets there one step at a
time: an incomplete character spans at most ``MAX_INCOMPLETE_CHARACTER_TOKENS`` tokens."""
MAX_INCOMPLETE_CHARACTER_TOKENS = 3
"""A UTF-8 character is at most 4 bytes and each byte-level or byte-fallback token carries at
least one, so the unfinished character at the end of the text spans at most 3 tokens."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    The deltas returned by ``add`` and then ``flush`` concatenate to exactly
    ``decode(all_tokens, skip_special_tokens)``, and no delta ends in a half-finished character,
    whenever the text is valid UTF-8 and no more than ``MAX_PENDING_TOKENS`` tokens in a row
    decode to nothing. Otherwise (invalid bytes, long runs of skipped special tokens) the deltas
    are still sent, in time linear in the number of tokens. One instance per request; not
    thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._context: list[int] = []
        self._context_text = ""
        self._pending: list[int] = []

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text that became final (possibly "")."""
        self._pending.extend(token_ids)
        text = self._decode(self._context + self._pending)
        if self._is_final(text):
            return self._send(len(self._pending), text)
        if len(self._pending) <= MAX_PENDING_TOKENS:
            return ""
        return self._force_progress(text)

    def flush(self) -> str:
        """Return whatever text is still held back (the stream ended); call once, at the end."""
        text = self._decode(self._context + self._pending)
        delta = text[len(self._context_text) :]
        self._context, self._context_text, self._pending = [], "", []
        return delta

    def _is_final(self, text: str) -> bool:
        """Whether ``text`` (context and some pending tokens) adds complete characters."""
        return len(text) > len(self._context_text) and not text.endswith(REPLACEMENT_CHARACTER)

    def _send(self, num_tokens: int, text: str) -> str:
        """Send the text of the first ``num_tokens`` pending tokens (``text`` is their decode
        with the context); they become the context of what follows."""
        delta = text[len(self._context_text) :]
        self._context = self._pending[:num_tokens]
        self._pending = self._pending[num_tokens:]
        self._context_text = self._decode(self._context)
        return delta

    def _force_progress(self, text: str) -> str:
        """Too many tokens are pending: send what can be sent and shorten the window."""
        if text == self._context_text:
            self._pending.clear()  # they decode to nothing here, and would to nothing later
            return ""
        num_pending = len(self._pending)
        for num_tokens in range(
            num_pending - 1, num_pending - 1 - MAX_INCOMPLETE_CHARACTER_TOKENS, -1
        ):
            shorter_text = self._decode(self._context + self._pending[:num_tokens])
            if self._is_final(shorter_text):
                return self._send(num_tokens, shorter_text)
        # No complete character in reach: the tail before the last few tokens is invalid bytes.
        num_tokens = num_pending - MAX_INCOMPLETE_CHARACTER_TOKENS
        return self._send(num_tokens, self._decode(self._context + self._pending[:num_tokens]))

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    While streaming it holds back the last ``len(longest stop) - 1`` characters, which could be the
    start of a stop string, so text that a stop string later cuts off is never sent. The match is
    the stop string that starts first (the shortest of those starting at the same place).
    """

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self._stop = [text for text in stop if text]
        self._include_stop = include_stop
        self._num_held_back = max((len(text) for text in self._stop), default=1) - 1
        self._pending = ""

    def add(self, text: str) -> tuple[str, bool]:
        """Append ``text``; return (text safe to send, whether a stop string was found).

        When a stop string is found, the returned text ends just before it (just after it with
        ``include_stop``) and the caller stops.
        """
        self._pending += text
        found = [(self._pending.find(stop), len(stop)) for stop in self._stop]
        start, length = min(((i, n) for i, n in found if i >= 0), default=(-1, 0))
        if start >= 0:
            cut = start + length if self._include_stop else start
            safe, self._pending = self._pending[:cut], ""
            return safe, True
        split = max(len(self._pending) - self._num_held_back, 0)
        safe, self._pending = self._pending[:split], self._pending[split:]
        return safe, False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop string."""
        text, self._pending = self._pending, ""
        return text
