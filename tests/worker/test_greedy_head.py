"""Greedy tokens from the LM head's bfloat16 estimates (``tile_gemm.GreedyHead``).

The head must give exactly the token that the float32 logits' argmax gives (``panel_gemm`` for
the logits, ``cpu_ops.greedy_tokens`` for the argmax): on random rows, on the real model's
states, through exact ties and ties one unit in the last place apart, never a padding row of the
vocabulary, and no token at all for a row whose values are not finite. In a step, only rows
whose sampling needs nothing but that argmax take it, beside rows that need their logits, and
every request gets the tokens and log probabilities it gets without the head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interfaces import StructuredOutput
from tests.support.step_driver import DrivenRequest, StepDriver, context, small_runner
from worker.model_runner import ModelRunner
from worker.models import cpu_ops, panel_gemm, tile_gemm

pytestmark = pytest.mark.skipif(
    not tile_gemm.greedy_available() or cpu_ops.library() is None,
    reason="no bfloat16 dot products (AMX-BF16 or AVX512-BF16) or no C compiler here",
)


def _float32_tokens(x: torch.Tensor, panels: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The argmax of the float32 logits, as the worker takes it without the head."""
    logits = panel_gemm.linear(x, panels, None, n)[:, :vocab].contiguous()
    return cpu_ops.greedy_tokens(logits)


@pytest.mark.parametrize(("n", "vocab", "k"), [(49152, 49152, 576), (1000, 997, 64), (40, 33, 40)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
def test_the_head_gives_the_float32_logits_argmax(n, vocab, k, m):
    generator = torch.Generator().manual_seed(m)
    weight = torch.randn(n, k, generator=generator) * 0.05
    panels = panel_gemm.pack(weight)
    head = tile_gemm.GreedyHead.build(panels, n, vocab)
    x = torch.randn(m, k, generator=generator) * 3
    assert head.tokens(x).tolist() == _float32_tokens(x, panels, n, vocab).tolist()


@pytest.mark.parametrize(("m", "k"), [(1, 576), (8, 576), (12, 72), (40, 72)])
def test_exact_and_one_ulp_ties_keep_the_float32_token(m, k):
    """Through each of the float32 kernel's paths (1, 2-8, 9-32 and more rows), and a k that
    fills neither a 64-feature chunk nor a 32-feature step."""
    generator = torch.Generator().manual_seed(m)
    n = 4096
    weight = torch.randn(n, k, generator=generator) * 0.05
    x = torch.randn(m, k, generator=generator)
    for row, top in enumerate((x @ weight.T).argmax(-1).tolist()):
        # in other panels of 32 (wrapping around the vocabulary's ends for a few rows)
        below, above = (top - 39 - row) % n, (top + 45 + row) % n
        weight[below] = weight[top]  # an exact tie: the lower index wins
        weight[above] = weight[top]  # and one a unit in the last place away from it
        weight[above, 3] = torch.nextafter(weight[top, 3], torch.tensor(1.0))
    panels = panel_gemm.pack(weight)
    want = _float32_tokens(x, panels, n, n)
    assert tile_gemm.GreedyHead.build(panels, n, n).tokens(x).tolist() == want.tolist()


def test_a_token_whose_estimate_ranks_below_another_still_wins_when_its_logit_is_larger():
    """Rounding to bfloat16 (steps of 2^-7 at 1.5) lifts token 37's estimate above token 5's
    while token 5's float32 logit is the larger: only the bounds keep token 5's panel (outputs
    0-31; token 37 is in the next one) among those computed exactly."""
    k, n, step = 64, 64, 2.0**-7
    weight = torch.full((n, k), 0.01)
    weight[5] = 1.5
    weight[37] = 1.5
    weight[37, 0] += 0.51 * step  # rounds up a step: the estimate gains one step
    weight[37, 1:3] -= 0.49 * step  # round back to 1.5: the logit loses 0.98 of one
    x = torch.ones(1, k)  # exact in bfloat16
    panels = panel_gemm.pack(weight)
    assert _float32_tokens(x, panels, n, n).tolist() == [5]
    rounded = x @ weight.to(torch.bfloat16).float().T
    assert rounded[0, 37] > rounded[0, 5]
    assert tile_gemm.GreedyHead.build(panels, n, n).tokens(x).tolist() == [5]


def test_padding_rows_of_the_vocabulary_are_never_picked():
    n, vocab, k = 96, 70, 64
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    weight[vocab:] = 10.0  # padding rows whose logits would be the largest
    x = torch.ones(4, k)
    panels = panel_gemm.pack(weight)
    tokens = tile_gemm.GreedyHead.build(panels, n, vocab).tokens(x)
    assert tokens.tolist() == _float32_tokens(x, panels, n, vocab).tolist()
    assert max(tokens.tolist()) < vocab


def test_a_row_that_is_not_finite_asks_for_its_logits_and_no_other_does():
    n, k = 512, 64
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    panels = panel_gemm.pack(weight)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    x[1, 7], x[3, 0] = float("nan"), float("inf")
    tokens = tile_gemm.GreedyHead.build(panels, n, n).tokens(x).tolist()
    want = _float32_tokens(x, panels, n, n).tolist()
    assert tokens[1] == tokens[3] == tile_gemm.NEEDS_LOGITS
    assert [tokens[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]


def test_tiny_huge_and_subnormal_values_keep_the_float32_token_or_ask_for_logits():
    """Values the tile unit flushes to zero (below 2^-126) and sums that come near overflow."""
    generator = torch.Generator().manual_seed(5)
    n, k = 1024, 64
    weight = torch.randn(n, k, generator=generator) * 0.05
    weight[:, :8] *= 1e-38  # subnormal weights
    panels = panel_gemm.pack(weight)
    head = tile_gemm.GreedyHead.build(panels, n, n)
    x = torch.randn(4, k, generator=generator)
    x[1] *= 1e-36  # products below the smallest normal float32
    x[2] *= 1e30  # large, but every sum stays far from overflow
    x[3] *= 3e37  # sums that might overflow: its logits are asked for
    tokens = head.tokens(x).tolist()
    want = _float32_tokens(x, panels, n, n).tolist()
    assert tokens[:3] == want[:3]
    assert tokens[3] == tile_gemm.NEEDS_LOGITS


def test_the_head_refuses_what_does_not_fit():
    panels = panel_gemm.pack(torch.zeros(64, 32))
    with pytest.raises(ValueError, match="are not an 100-row head"):
        tile_gemm.GreedyHead.build(panels, 100, 64)
    with pytest.raises(ValueError, match="a vocabulary of 65"):
        tile_gemm.GreedyHead.build(panels, 64, 65)
    head = tile_gemm.GreedyHead.build(panels, 64, 64)
    with pytest.raises(ValueError, match="the weight expects 32"):
        head.tokens(torch.zeros(2, 31))
    with pytest.raises(TypeError, match="float32"):
        head.tokens(torch.zeros(2, 32, dtype=torch.float64))


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir: Path) -> ModelRunner:
    return small_runner(tiny_llama_dir)


def _requests() -> list[DrivenRequest]:
    prompt = [1, 412, 1337, 95, 6012, 44, 23011, 7, 310]
    fields = {
        "plain": {"temperature": 0.0},
        "top-k 1": {"top_k": 1, "temperature": 0.7},
        "logprobs": {"temperature": 0.0, "logprobs": 2},
        "biased": {"temperature": 0.0, "logit_bias": {5: 30.0}},
        "penalised": {"temperature": 0.0, "repetition_penalty": 1.5},
        "min tokens": {"temperature": 0.0, "min_new_tokens": 6, "stop_token_ids": [17]},
        "sampled": {"top_k": 0, "temperature": 0.8, "seed": 11},
        "regex": {"temperature": 0.0, "structured_output": StructuredOutput("regex", "[0-9]{8}")},
    }
    return [
        DrivenRequest(context(name, prompt[: 4 + i], 8, **kwargs), prefill_chunks=[2])
        for i, (name, kwargs) in enumerate(fields.items())
    ]


def test_a_step_takes_greedy_tokens_from_the_head_only_where_the_argmax_is_all_it_needs(
    tiny_runner, monkeypatch
):
    model = tiny_runner.model.text_model
    assert model.greedy_head is not None  # CPU float32, panels, no bias, one rank, a tile unit
    screened: list[tuple[str, int]] = []  # (request, outputs so far) of each screened row
    argmax_only = tiny_runner._argmax_only

    def spy(sampled: list) -> list[bool]:
        flags = argmax_only(sampled)
        screened.extend(
            (state.request_id, state.num_output_tokens)
            for state, flag in zip(sampled, flags, strict=True)
            if flag
        )
        return flags

    monkeypatch.setattr(tiny_runner, "_argmax_only", spy)
    with_head = StepDriver(tiny_runner).run(_requests())
    # "plain" and "top-k 1" at every token, "min tokens" once it has its 6
    assert sorted(screened) == sorted(
        [(name, outputs) for name in ("plain", "top-k 1") for outputs in range(8)]
        + [("min tokens", 6), ("min tokens", 7)]
    )
    monkeypatch.setattr(model, "greedy_head", None)
    without = StepDriver(tiny_runner).run(_requests())
    for name, request in with_head.items():
        assert request.output_token_ids == without[name].output_token_ids, name
        assert [o.log_probabilities for o in request.outputs] == [
            o.log_probabilities for o in without[name].outputs
        ], name
