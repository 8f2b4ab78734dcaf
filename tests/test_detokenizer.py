"""Incremental detokenization and stop-string matching (api_server.detokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher

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
