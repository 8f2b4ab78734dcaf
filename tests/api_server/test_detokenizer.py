"""Incremental detokenization and stop-string matching (api_server.detokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from api_server.detokenizer import (
    MAX_PENDING_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
)

MULTILINGUAL_TEXT = (
    "Hello, world! Grüße aus München. 日本語のテキストです。 Привет, мир! "
    "Emoji: 🎉👍🏽 👨‍👩‍👧 and 🇫🇷 — ça marche? مرحبا بالعالم. 한국어도 됩니다."
)


@pytest.fixture(scope="module")
def smollm_tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], step: int) -> list[str]:
    deltas = [detokenizer.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_deltas_concatenate_to_the_full_decode(smollm_tokenizer: Tokenizer, step: int) -> None:
    token_ids = smollm_tokenizer.encode(MULTILINGUAL_TEXT, add_special_tokens=False).ids
    deltas = stream(IncrementalDetokenizer(smollm_tokenizer), token_ids, step)
    assert "".join(deltas) == smollm_tokenizer.decode(token_ids) == MULTILINGUAL_TEXT
    assert [delta for delta in deltas if "\ufffd" in delta] == []


def test_the_text_really_splits_characters_across_tokens(smollm_tokenizer: Tokenizer) -> None:
    token_ids = smollm_tokenizer.encode(MULTILINGUAL_TEXT, add_special_tokens=False).ids
    broken = [t for t in token_ids if "\ufffd" in smollm_tokenizer.decode([t])]
    assert len(broken) >= 4  # so the test above exercises the hold-back


def test_an_incomplete_character_is_held_back_until_it_completes(
    smollm_tokenizer: Tokenizer,
) -> None:
    token_ids = smollm_tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(token_ids) > 1
    detokenizer = IncrementalDetokenizer(smollm_tokenizer)
    assert [detokenizer.add([t]) for t in token_ids] == [""] * (len(token_ids) - 1) + ["🎉"]
    assert detokenizer.flush() == ""


def test_flush_returns_a_truncated_character_at_the_end(smollm_tokenizer: Tokenizer) -> None:
    token_ids = smollm_tokenizer.encode("ok 🎉", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(smollm_tokenizer)
    deltas = [detokenizer.add([t]) for t in token_ids[:-1]]
    assert "".join(deltas) + detokenizer.flush() == smollm_tokenizer.decode(token_ids[:-1])


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_special_tokens(smollm_tokenizer: Tokenizer, skip: bool, expected: str) -> None:
    token_ids = [*smollm_tokenizer.encode("Hi there", add_special_tokens=False).ids, 2]
    deltas = stream(
        IncrementalDetokenizer(smollm_tokenizer, skip_special_tokens=skip), token_ids, 1
    )
    assert "".join(deltas) == expected


def test_sentencepiece_leading_spaces_survive_token_by_token_decoding() -> None:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    token_ids = [1, 2, 3, 4]
    assert tokenizer.decode([2]) == "world"  # decoding one token alone loses its space
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids, 1)
    assert deltas == ["Hello", " world", "!", " again", ""]
    assert "".join(deltas) == tokenizer.decode(token_ids) == "Hello world! again"


class CountingTokenizer:
    """A tokenizer that counts the tokens it was asked to decode: the detokenizer's work."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decoded_tokens = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_decoded_tokens += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def continuation_byte_tokens(tokenizer: Tokenizer) -> list[int]:
    """Byte-level tokens holding one UTF-8 continuation byte (0xA1-0xBF but 0xAD, which GPT-2's
    byte alphabet spells as themselves): any run of them is invalid UTF-8, one U+FFFD a byte."""
    return [tokenizer.token_to_id(chr(byte)) for byte in range(0xA1, 0xC0) if byte != 0xAD]


def detokenizing_work(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[str, int]:
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    text = "".join(detokenizer.add([token_id]) for token_id in token_ids) + detokenizer.flush()
    return text, counting.num_decoded_tokens


def test_lone_bytes_detokenize_in_linear_work(smollm_tokenizer: Tokenizer) -> None:
    lone_bytes = continuation_byte_tokens(smollm_tokenizer)
    assert [smollm_tokenizer.decode([t]) for t in lone_bytes] == ["\ufffd"] * 30
    work = {}
    for num_tokens in (8000, 16000):
        token_ids = [lone_bytes[i % len(lone_bytes)] for i in range(num_tokens)]
        text, work[num_tokens] = detokenizing_work(smollm_tokenizer, token_ids)
        assert text == smollm_tokenizer.decode(token_ids) == "\ufffd" * num_tokens
    # Holding every byte back decoded 32 million tokens for 8,000; now a few dozen per token.
    assert work[8000] <= 8000 * 3 * MAX_PENDING_TOKENS
    assert work[16000] <= 2.1 * work[8000]


def test_many_tokens_at_once_ending_mid_character_stay_exact(smollm_tokenizer: Tokenizer) -> None:
    token_ids = smollm_tokenizer.encode("word " * 20 + "🎉", add_special_tokens=False).ids
    assert len(token_ids) > MAX_PENDING_TOKENS + 1
    assert "\ufffd" in smollm_tokenizer.decode(token_ids[:-1])
    detokenizer = IncrementalDetokenizer(smollm_tokenizer)
    deltas = [detokenizer.add(token_ids[:-1]), detokenizer.add(token_ids[-1:]), detokenizer.flush()]
    assert deltas == ["word " * 19 + "word", " 🎉", ""]  # the space is in the emoji's first token


def test_a_long_run_of_skipped_special_tokens_keeps_the_next_space() -> None:
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["<pad>"])
    pad = tokenizer.token_to_id("<pad>")
    token_ids = [1, *[pad] * (4 * MAX_PENDING_TOKENS), 2]
    counting = CountingTokenizer(tokenizer)
    deltas = stream(IncrementalDetokenizer(counting), token_ids, 1)  # type: ignore[arg-type]
    assert "".join(deltas) == tokenizer.decode(token_ids) == "Hello world"
    assert deltas[-2:] == [" world", ""]
    assert counting.num_decoded_tokens <= len(token_ids) * 3 * MAX_PENDING_TOKENS


def test_stop_string_spanning_deltas_is_cut_and_never_sent() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("abc S") == ("ab", False)
    assert matcher.add("T") == ("c", False)
    assert matcher.add("OP and more") == (" ", True)


def test_stop_string_hold_back_is_released_when_no_stop_follows() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.add("x </e") == ("", False)
    assert matcher.add("nx more") == ("x </enx", False)
    assert matcher.flush() == " more"


def test_the_earliest_stop_string_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.add("hello world") == ("hel", True)


def test_no_stop_strings_sends_everything_at_once() -> None:
    matcher = StopStringMatcher([])
    assert matcher.add("abc") == ("abc", False)
    assert matcher.flush() == ""
