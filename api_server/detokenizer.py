"""Incremental detokenization: token ids in, text deltas out, as vLLM does it.

Decoding each new token alone is wrong twice over: a character may span several byte-level tokens
(decoding half of it gives U+FFFD), and SentencePiece-style decoders drop the leading space of the
first token they see. So each step decodes a small window of recent tokens: ``prefix_offset`` marks
where the window starts (context only), ``read_offset`` where the text already emitted ends. The
new text is ``decode(tokens[prefix_offset:])`` minus ``decode(tokens[prefix_offset:read_offset])``,
held back while it ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    The deltas returned by ``add`` and then ``flush`` concatenate to exactly
    ``decode(all_tokens, skip_special_tokens)``, and no delta ends in a half-finished character.
    One instance per request; not thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text that became final (possibly "")."""
        self.token_ids.extend(token_ids)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever text is still held back (the stream ended); call once, at the end."""
        prefix_text, new_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _window_texts(self) -> tuple[str, str]:
        window = self.token_ids[self._prefix_offset :]
        num_prefix_tokens = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:num_prefix_tokens])
        return prefix_text, self._decode(window)

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
