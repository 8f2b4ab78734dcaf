"""What every benchmark runs on: the model directory, its vocabulary, and random prompts (of
token ids, or of English words for chat).

Shared by serve_bench.py, hf_baseline.py and roofline.py, so that the server and the transformers
baseline see the same prompts for the same seed. Imports neither torch nor httpx.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

FIRST_ORDINARY_TOKEN_ID = 100
"""Prompt token ids start here: SmolLM2's special tokens (and most tokenizers') sit below it."""

DEFAULT_VOCAB_SIZE = 49152
"""SmolLM2's vocabulary; used only when no model directory is known."""


class BenchmarkError(Exception):
    """A problem the user can fix (bad flag, server unreachable); printed without a traceback."""


class Terminated(BaseException):
    """SIGTERM, raised where the benchmark is so that, as for Ctrl-C, every ``with`` on the way
    out stops the servers and clients it started (Python's default for SIGTERM exits at once
    and leaves them running)."""


def _terminated(signum: int, frame: object) -> None:
    # Once: a second SIGTERM must not cut short the stopping of what the first one unwinds.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def num_cores() -> int:
    """CPU cores this process may run on (what ``nproc`` prints)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def resolve_model_dir(model_path: str | None) -> Path:
    """The Hugging Face directory ``switchyard serve --model MODEL_PATH`` would load.

    ``None`` means Switchyard's default model. Runs ``switchyard prepare-model`` in a child (it
    converts a GGUF file once and caches it), so this process never imports torch.
    """
    argv = [sys.executable, "-m", "switchyard", "prepare-model"]
    if model_path is not None:
        argv += ["--model", model_path]
    completed = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        detail = completed.stderr.strip().splitlines()[-1:] or ["no output"]
        raise BenchmarkError(f"cannot prepare model {model_path or '(default)'}: {detail[0]}")
    return Path(lines[-1])


def read_model_config(model_dir: Path) -> dict:
    """The model's config.json as a dict."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise BenchmarkError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` lists of exactly ``input_len`` token ids in [100, vocab_size).

    Sent as token ids, so no tokenizer round trip can change their length. The same arguments
    always give the same prompts.
    """
    if vocab_size <= FIRST_ORDINARY_TOKEN_ID:
        raise BenchmarkError(f"vocabulary size {vocab_size} leaves no ordinary token ids")
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(input_len)]
        for _ in range(num_prompts)
    ]


_ENGLISH_WORDS_TEXT = """
    time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book
    eye job word business issue side kind head house service friend father power hour game line
    end member law car city community name president team minute idea kid body information back
    parent face others level office door health person art war history party result change
    morning reason research girl guy moment air teacher force education foot boy age policy
    music market sense nation plan college interest death experience effect class control care
    field development role effort rate heart drug show leader light voice wife police mind price
    report decision son view relationship town road arm difference value building action model
    season society tax director position player record paper space ground form event official
    matter center couple site project activity star table need court oil situation cost industry
    figure street image phone data picture practice piece land product doctor wall patient worker
    news test movie north love support technology step baby computer type attention film tree
    source organization hair window evidence population truth fire song summer garden river
    small large good new old great high little long young important different early public
    strong real best free simple open clear full late hard sure human local whole major certain
    say make go know take see come think look want give use find tell ask seem feel try leave
    call keep let begin help talk turn start hear play run move live believe bring happen
    write provide sit stand lose pay meet include continue set learn lead understand watch
    follow stop create speak read allow add spend grow offer remember consider appear buy
    wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell
"""
ENGLISH_WORDS = tuple(_ENGLISH_WORDS_TEXT.split())
"""Common English words for prompts of text (most are one token with a leading space)."""


def random_words(
    rng: random.Random, num_tokens: int, count_tokens: Callable[[str], int] | None = None
) -> str:
    """Random ``ENGLISH_WORDS`` joined by spaces, about ``num_tokens`` tokens long: as many as
    ``count_tokens`` (a tokenizer's count of a text) says fit in ``num_tokens``, or
    ``num_tokens`` words without it. Always at least one word; draws ``2 * num_tokens`` words
    from ``rng`` either way, so later draws do not depend on the tokenizer."""
    words = rng.choices(ENGLISH_WORDS, k=2 * max(num_tokens, 1))
    if count_tokens is None:
        return " ".join(words[: max(num_tokens, 1)])
    fits, too_many = 1, len(words) + 1  # the longest prefix that fits lies in [fits, too_many)
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        if count_tokens(" ".join(words[:middle])) <= num_tokens:
            fits = middle
        else:
            too_many = middle
    return " ".join(words[:fits])


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` (``-`` for stdout), indented."""
    text = json.dumps(payload, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def run_benchmark(
    name: str,
    argv: list[str] | None,
    build_parser: Callable[[], object],
    check_args: Callable[[object, object], None],
    run: Callable[[object], dict],
    report: Callable[[dict], tuple[str, bool]],
) -> int:
    """The benchmarks' shared ``main``: parse and check arguments, run, print the report, write
    ``--output-json``. ``report`` returns the text and whether the run succeeded. Exit codes: 0,
    1 (an error, or a run that did not succeed), 130 (interrupted), 143 (terminated)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = run(args)
    except BenchmarkError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # child processes are stopped on the way out
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:  # the same
        print(f"{name}: terminated", file=sys.stderr)
        return 143
    finally:  # (None: a handler not set from Python, which cannot be put back; the default)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    text, succeeded = report(result)
    print(text)
    if args.output_json:
        write_json(args.output_json, result)
    return 0 if succeeded else 1


def docstring_parser(doc: str, num_description_paragraphs: int) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraphs, the rest as its epilog, as written."""
    paragraphs = doc.split("\n\n")
    return argparse.ArgumentParser(
        description="\n\n".join(paragraphs[:num_description_paragraphs]),
        epilog="\n\n".join(paragraphs[num_description_paragraphs:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def check_output_json(parser: argparse.ArgumentParser, output_json: str | None) -> None:
    """Reject an ``--output-json`` path whose folder does not exist (before the run, not
    after it)."""
    if output_json not in (None, "-") and not Path(output_json).parent.is_dir():
        parser.error(f"--output-json: no folder {Path(output_json).parent}")


def split_serve_args(parser: argparse.ArgumentParser, serve_args: str) -> list[str]:
    """``--serve-args`` as an argv list, split as a shell would."""
    try:
        return shlex.split(serve_args)
    except ValueError as error:
        parser.error(f"--serve-args: {error}")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--temperature`` and ``--top-p``, sent with every request."""
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default: %(default)s, greedy)",
    )
    parser.add_argument(
        "--top-p", type=float, help="every request's top_p (default: none sent, so 1)"
    )


def check_sampling_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The range OpenAI's API accepts for each (``add_sampling_arguments``)."""
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= 2):
        parser.error("--temperature must be 0 to 2")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error("--top-p must be above 0 and at most 1")
