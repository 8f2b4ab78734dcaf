"""What structured output costs a worker, spec by spec, with the installed xgrammar: the compile
(on ``worker.grammar_compiler.GrammarCompiler``, the worker's own compiler over the default
model's tokenizer, loaded before the first timed compile) and the per-step mask
(``worker.structured_output.allowed_token_mask`` for a batch of ``--rows`` requests that follow
the same spec, each with its own matcher).

Compile costs are what the grammar limits and the hostile-grammar tests are built on
(``tests/e2e/test_hostile_sampling.py`` needs a small spec that compiles for well over 10 s),
and they change between xgrammar's patch releases: run this before moving its pin in
pyproject.toml, under each version, and compare.

Each spec's matchers walk one output: at every step a token is drawn (seeded) from those the
mask allows, preferring tokens without ``"`` or ``}`` so the walk goes deep into strings, where
the masks of length-bounded rules are dearest; up to ``--steps`` steps.

Run: ``python benchmarks/grammar_costs.py [--threads 2] [--rows 16] [--steps 300]
[--spec NAME ...]``; ``--quick`` skips the specs that compile for more than a few seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version

import torch
from transformers import AutoConfig, AutoTokenizer

from interfaces import StructuredOutput
from worker.grammar_compiler import GrammarCompiler
from worker.model_files import resolve_model
from worker.structured_output import RequestGrammar, allowed_token_mask


def schema(properties: dict) -> StructuredOutput:
    spec = {"type": "object", "properties": properties, "required": list(properties)}
    return StructuredOutput("json_schema", json.dumps(spec))


def max_length_strings(count: int, max_length: int) -> StructuredOutput:
    return schema({f"p{i}": {"type": "string", "maxLength": max_length + i} for i in range(count)})


def optional_letters(count: int) -> StructuredOutput:
    """A string of at most ``count`` letters written as ``count`` optional letters: xgrammar
    compiles it in time quadratic in ``count``."""
    return schema({"p0": {"type": "string", "pattern": "^" + "[a-z]?" * count + "$"}})


PATTERN = "[a-z]{3,40}[0-9]{2,9}"
SPECS = {
    "json_object": (StructuredOutput("json_object", None), False),
    "1 string, maxLength 12": (max_length_strings(1, 12), False),
    "10 strings, maxLength 300": (max_length_strings(10, 300), True),
    "30 strings, maxLength 300": (max_length_strings(30, 300), True),
    "string, length 200-400": (
        schema({"a": {"type": "string", "minLength": 200, "maxLength": 400}}),
        False,
    ),
    "10 patterns": (
        schema({f"q{i}": {"type": "string", "pattern": PATTERN} for i in range(10)}),
        False,
    ),
    "60 optional letters": (optional_letters(60), False),
    "300 optional letters": (optional_letters(300), True),
    "regex, bounded repeats": (
        StructuredOutput("regex", "(a|b|c)[a-z0-9 ]{0,500}x{10,300}"),
        False,
    ),
}


def walk(
    grammars: list[RequestGrammar], vocab_size: int, token_texts: list[str], steps: int
) -> list[float]:
    """The seconds of each step's ``allowed_token_mask`` over ``grammars``, all following the
    same seeded walk."""
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        if grammars[0].is_terminated:
            break
        started = time.perf_counter()
        allowed = allowed_token_mask(grammars, vocab_size, torch.device("cpu"))
        times.append(time.perf_counter() - started)
        ids = allowed[0].nonzero().flatten().tolist()
        inside = [i for i in ids if i < len(token_texts) and not set('"}') & set(token_texts[i])]
        token_id = rng.choice(inside or ids)
        for grammar in grammars:
            grammar.accept(token_id)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="compile threads (xgrammar's)")
    parser.add_argument("--rows", type=int, default=16, help="requests in a step's batch")
    parser.add_argument("--steps", type=int, default=300, help="steps to walk per spec")
    parser.add_argument("--quick", action="store_true", help="skip the slow compiles")
    parser.add_argument(
        "--spec", action="append", choices=SPECS, help="only these specs (repeatable)"
    )
    parser.add_argument("--model-path", help="a model directory (default: the default model)")
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model_path)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    print(f"xgrammar {version('xgrammar')}, {args.threads} compile threads, {args.rows} rows")
    print("| spec | compile | steps | mask per step, median | p90 | max |")
    print("|---|---|---|---|---|---|")
    compiler = GrammarCompiler(model_dir, vocab_size, num_threads=args.threads)
    compiler.compile(StructuredOutput("regex", "warm-up"))  # loads the tokenizer, untimed
    for name, (structured, slow) in SPECS.items():
        if (slow and args.quick) or (args.spec and name not in args.spec):
            continue
        started = time.perf_counter()
        compiled = compiler.compile(structured)
        compile_s = time.perf_counter() - started
        eos = compiler.stop_token_ids
        grammars = [RequestGrammar(compiled, eos) for _ in range(args.rows)]
        times = sorted(walk(grammars, vocab_size, token_texts, args.steps))
        p90 = times[int(len(times) * 0.9)]
        print(
            f"| {name} | {compile_s * 1e3:,.0f} ms | {len(times)} "
            f"| {statistics.median(times) * 1e3:.2f} ms | {p90 * 1e3:.2f} ms "
            f"| {times[-1] * 1e3:.2f} ms |",
            flush=True,
        )
    compiler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
