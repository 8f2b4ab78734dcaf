"""The CPU float32 kernels of ``cpu_ops.c``: paged attention in place, fused small ops.

- ``paged_attention``: each query token attends to its request's cached keys through the block
  table, reading the paged cache where it lies (no gathered or padded copy), with an online
  softmax over chunks of 16 keys: a decode reads each chunk once for all its heads, decodes
  whose tables begin with the same blocks (a prefix-cache hit) read those once for all of
  them (``shared_prefix_groups`` tells which), a prefill tile computes its rows as the lanes
  of a vector, and a lone decode over a long context is split over the threads (``cpu_ops.c``
  tells how).
- ``rope_write_kv``: rotary embedding of queries and keys straight from the stacked q/k/v
  product, with the keys and values stored into their cache slots in the same pass.
- ``add_rms_norm``: the residual add and the RMSNorm after it, in one pass.
- ``silu_mul``: SwiGLU's ``silu(gate) * up``.
- ``greedy_tokens``: each row's greedy token, in one pass over the logits (the sampler's).
- ``sample_tokens``: each row's token by the sampler's exponential race (its counter-based
  noise made on the fly), or its greedy token, in one pass over the logits.
- ``token_logprobs``: each row's log probability of a token and its likeliest tokens with
  theirs, without the log-softmax's copy of the logits.
- ``decoder_layers``: every decoder layer of a step in one call, the kernels above and the
  matrix product in the order the layer modules call them (``worker.models.fused_layers``).

Each replaces several torch ops (and their temporaries) per layer. ``applies(tensor)`` says
whether a tensor's device and dtype are theirs and the library is built (``worker.models.native``);
elsewhere (CUDA, bfloat16, no compiler) the callers keep their torch code. Results differ from
that code only by float32 rounding. The wrappers check shapes and dtypes; the C code trusts
them, and the slots and block tables, which the model runner checked against the cache when
the scheduler sent them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.models import native

SOURCE = Path(__file__).with_name("cpu_ops.c")
LANES = 16  # must match cpu_ops.c
MAX_HEAD_DIM = 256  # must match cpu_ops.c
MAX_GROUP = 16  # query heads per key-value head at most (the lanes of a vector)
MAX_TOP = 64  # must match cpu_ops.c

_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "sy_paged_attention": (
        ctypes.c_int,
        [_POINTER] * 4 + [_INT] + [_POINTER] * 2 + [_INT] * 5 + [_FLOAT, _INT, _POINTER],
    ),
    "sy_shared_prefix_groups": (
        ctypes.c_int64,
        [_POINTER] + [_INT] + [_POINTER] * 2 + [_INT] * 5 + [_POINTER] * 2,
    ),
    "sy_rope_write_kv": (None, [_POINTER] + [_INT] * 4 + [_POINTER] * 6),
    "sy_add_rms_norm": (None, [_POINTER] * 3 + [_INT] * 2 + [_FLOAT, _POINTER]),
    "sy_silu_mul": (None, [_POINTER, _INT, _INT, _POINTER]),
    "sy_greedy_tokens": (None, [_POINTER, _INT, _INT, _POINTER]),
    "sy_sample_tokens": (ctypes.c_int, [_POINTER, _INT, _INT] + [_POINTER] * 7),
    "sy_token_logprobs": (None, [_POINTER, _INT, _INT, _POINTER, _INT] + [_POINTER] * 4),
    "sy_decoder_layers": (
        ctypes.c_int,
        [_POINTER] * 2
        + [_INT] * 4
        + [_FLOAT]
        + [_INT] * 3
        + [_POINTER] * 4
        + [_INT]
        + [_POINTER] * 2
        + [_INT] * 2
        + [_FLOAT, _INT]
        + [_POINTER, _INT]
        + [_POINTER] * 2,
    ),
}


class LayerWeights(ctypes.Structure):
    """``cpu_ops.c``'s LayerWeights: one decoder layer's norms, packed linear panels and
    biases (None for none), and its KV cache, as addresses."""

    _fields_ = [
        (name, _POINTER)
        for name in (
            *("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias"),
            *("gate_up", "gate_up_bias", "down", "down_bias", "key_cache", "value_cache"),
        )
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built here."""
    return build(SOURCE)


def build(source: Path) -> ctypes.CDLL | None:
    """The library built from ``source`` (this checkout's cpu_ops.c, or another version of it
    for a benchmark to compare), its functions typed; None where it cannot be built."""
    lib = native.load(source.resolve())
    if lib is None:
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def applies(tensor: torch.Tensor) -> bool:
    """Whether these kernels serve ``tensor``'s device and dtype here: CPU float32, built."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and library() is not None


def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``paged_attention`` takes these head shapes."""
    return (
        head_dim % LANES == 0
        and 0 < head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``query`` (num_tokens, num_heads, head_dim) over the paged cache.

    ``key_cache``/``value_cache`` (num_blocks, block_size, num_kv_heads, head_dim) already hold
    the step's keys and values. Request r's queries are rows ``query_starts[r]`` to
    ``query_starts[r + 1]`` (num_requests + 1 values, the last num_tokens) at positions from
    ``context_starts[r]``; its blocks are ``block_tables[r]`` (num_requests, max_blocks).
    All int64. Returns (num_tokens, num_heads, head_dim).
    """
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check_float32(query, key_cache, value_cache)
    if block_size < 1:
        raise ValueError("the caches have blocks of no tokens")
    if value_cache.shape != key_cache.shape or key_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(key_cache.shape)} do not fit queries {query.shape}")
    step = _step(block_tables, query_starts, context_starts, (num_heads, num_kv_heads, head_dim))
    output = torch.empty_like(query)
    status = library().sy_paged_attention(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        *step,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
        output.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged attention could not allocate its task list")
    return output


def shared_prefix_groups(
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_starts: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> tuple[list[int], list[int]]:
    """How ``paged_attention`` groups a step's decodes that share cached blocks (the step as it
    takes it): (each request's group, -1 for none; the keys its group reads once for all)."""
    num_requests = block_tables.shape[0]
    step = _step(block_tables, query_starts, context_starts, (num_heads, num_kv_heads, LANES))
    if block_size < 1:
        raise ValueError(f"block_size must be positive, not {block_size}")
    ends = context_starts + (query_starts[1:] - query_starts[:-1])
    if num_requests and int(ends.max()) > block_tables.shape[1] * block_size:
        raise ValueError("a request's tokens reach past its block table")
    group_of = torch.empty(num_requests, dtype=torch.int64)
    shared_keys = torch.empty(num_requests, dtype=torch.int64)
    status = library().sy_shared_prefix_groups(
        *step,
        num_heads,
        num_kv_heads,
        block_size,
        torch.get_num_threads(),
        group_of.data_ptr(),
        shared_keys.data_ptr(),
    )
    if status < 0:
        raise MemoryError("paged attention could not allocate its task list")
    return group_of.tolist(), shared_keys.tolist()


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Rotate the queries and keys of ``qkv`` (num_tokens, (num_heads + 2 num_kv_heads)
    head_dim) by ``cos``/``sin`` (num_tokens, 1, head_dim), store the keys and values at cache
    ``slots`` (num_tokens,), and return the queries (num_tokens, num_heads, head_dim)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    num_tokens = qkv.shape[0]
    _check_float32(qkv, cos, sin, key_cache, value_cache)
    _check_int64(slots)
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"q/k/v of width {qkv.shape[1]} do not fit the cache's heads")
    if cos.shape != (num_tokens, 1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit {num_tokens} tokens")
    if slots.shape != (num_tokens,) or value_cache.shape != key_cache.shape:
        raise ValueError(f"{num_tokens} tokens need as many slots, and matching caches")
    query = qkv.new_empty(num_tokens, num_heads, head_dim)
    library().sy_rope_write_kv(
        qkv.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        query.data_ptr(),
    )
    return query


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place (unless ``x`` is None), then return
    ``residual / rms(residual) * weight``; ``x``/``residual`` (num_tokens, hidden)."""
    num_tokens, hidden = residual.shape
    _check_float32(residual, weight, *(() if x is None else (x,)))
    if weight.shape != (hidden,) or (x is not None and x.shape != residual.shape):
        raise ValueError(f"cannot normalise {tuple(residual.shape)} with {tuple(weight.shape)}")
    out = torch.empty_like(residual)
    library().sy_add_rms_norm(
        None if x is None else x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        num_tokens,
        hidden,
        eps,
        out.data_ptr(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` (num_tokens, 2 inner) = [gate | up]: (num_tokens,
    inner)."""
    _check_float32(gate_up)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate and up halves of an odd width {width}")
    out = gate_up.new_empty(num_tokens, width // 2)
    library().sy_silu_mul(gate_up.data_ptr(), num_tokens, width // 2, out.data_ptr())
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token for ``logits`` (num_rows, vocab_size): int64 (num_rows,), the
    first index of the row's largest logit, NaN counted as -inf and +inf as the largest float32
    (``worker.sampler.finite_logits``), and -1 for a row whose logits are all -inf or NaN. The
    same tokens as ``finite_logits(logits).argmax(-1)`` in one pass (at 64 rows of 49,152 logits
    about a tenth of those torch ops' time)."""
    _check_float32(logits)
    if logits.dim() != 2 or not 0 < logits.shape[1] < 2**31:
        raise ValueError(f"greedy tokens of logits shaped {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64)
    library().sy_greedy_tokens(logits.data_ptr(), num_rows, vocab_size, tokens.data_ptr())
    return tokens


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    keys: torch.Tensor,
    sampled: torch.Tensor,
) -> torch.Tensor:
    """Each row's token for ``logits`` (num_rows, vocab_size): int64 (num_rows,). A row where
    ``sampled`` (bool) is true takes the token ``worker.sampler.torch_tokens`` draws with torch
    ops (x = finite_logits(finite_logits(logits) / temperature), its top-k (vocab_size or more:
    off), top-p (1 or more: off) and min-p (0: off) applied, ``argmax(softmax(x) /
    exponential_noise(keys))``) but for scores within float32 rounding of one another, a
    filter's mass or weight within rounding of its threshold, and where the torch sort breaks
    ties in x (here the lower index ranks first, -0 equal to +0); the other rows their
    ``greedy_tokens`` token. -1 for a row whose logits are all -inf or NaN; a sampled row
    whose x all came out -inf (finite logits divided by a tiny temperature) takes its greedy
    token. The filters rank the row through a histogram of its values instead of sorting it,
    and the noise is made as it is used: at 64 rows of 49,152 logits about a ninth of the torch
    ops' time, and a fifteenth with top-p or top-k (docs/performance.md)."""
    _check_float32(logits, temperatures, top_ps, min_ps)
    _check_int64(keys, top_ks)
    if keys.device.type != "cpu" or top_ks.device.type != "cpu" or sampled.device.type != "cpu":
        raise TypeError("the CPU kernels take CPU tensors")
    if logits.dim() != 2 or not 0 < logits.shape[1] < 2**31:
        raise ValueError(f"sampling from logits shaped {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if any(t.shape != (num_rows,) for t in (temperatures, top_ks, top_ps, min_ps, keys)):
        raise ValueError(f"{num_rows} rows need as many temperatures, filters and noise keys")
    if sampled.dtype != torch.bool or sampled.shape != (num_rows,) or not sampled.is_contiguous():
        raise TypeError("sampled must be a contiguous bool tensor, one entry a row")
    # The kernel divides by the temperature (a negative one would rank the rows' padding lanes,
    # past the vocabulary, first) and compares against the filters (NaN passes no comparison).
    temperatures_of_sampled = temperatures[sampled]
    if not bool(((temperatures_of_sampled > 0) & temperatures_of_sampled.isfinite()).all()):
        raise ValueError("a sampled row's temperature must be positive and finite")
    if bool(top_ps.isnan().any() or min_ps.isnan().any()):
        raise ValueError("top_p and min_p must be numbers")
    tokens = torch.empty(num_rows, dtype=torch.int64)
    status = library().sy_sample_tokens(
        logits.data_ptr(), num_rows, vocab_size, temperatures.data_ptr(), top_ks.data_ptr(),
        top_ps.data_ptr(), min_ps.data_ptr(), keys.data_ptr(), sampled.data_ptr(),
        tokens.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("sampling could not allocate its per-row state")
    return tokens


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``logits`` (num_rows, vocab_size) and ``token_ids`` (num_rows,) int64: each row's
    log probability of its token (num_rows,), its ``num_top`` likeliest tokens' log
    probabilities and ids (num_rows, num_top; most likely first, the lower id first among
    equals), and which rows hold NaN or an infinity (bool, num_rows): those rows' results are
    left unset, for torch's ops to give. Otherwise ``log_softmax(logits)``'s values gathered
    and ranked by ``topk``, within float32 rounding, in two passes over each row and no copy
    (at 512 rows of 49,152 logits about a tenth of those ops' time, docs/performance.md)."""
    _check_float32(logits)
    _check_int64(token_ids)
    if logits.dim() != 2 or not 0 < logits.shape[1] < 2**31:
        raise ValueError(f"log probabilities of logits shaped {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if token_ids.shape != (num_rows,) or token_ids.device.type != "cpu":
        raise ValueError(f"{num_rows} rows of logits need as many token ids, on the CPU")
    if not 0 <= num_top <= min(MAX_TOP, vocab_size):
        raise ValueError(f"{num_top} top log probabilities of rows of {vocab_size} logits")
    if num_rows and not bool(((token_ids >= 0) & (token_ids < vocab_size)).all()):
        raise ValueError(f"a token id outside the vocabulary of {vocab_size}")
    chosen = torch.empty(num_rows)
    top_values = torch.empty(num_rows, num_top)
    top_ids = torch.empty(num_rows, num_top, dtype=torch.int64)
    nonfinite = torch.zeros(num_rows, dtype=torch.bool)
    library().sy_token_logprobs(
        logits.data_ptr(), num_rows, vocab_size, token_ids.data_ptr(), num_top,
        chosen.data_ptr(), top_values.data_ptr(), top_ids.data_ptr(), nonfinite.data_ptr(),
    )  # fmt: skip
    return chosen, top_values, top_ids, nonfinite


def decoder_layers(
    linear: int,
    layers: ctypes.Array,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_starts: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of ``layers`` (``LayerWeights``, whose addresses the caller keeps valid)
    over the embeddings ``x`` (num_tokens, hidden), which become the residual stream in place:
    returns (the last layer's output, the residual stream before it). ``linear`` is the
    address of panel_gemm's ``sy_panel_linear``; ``shape`` is (inner, num_heads,
    num_kv_heads, head_dim, block_size); the rest is as ``rope_write_kv`` and
    ``paged_attention`` take it. With ``keep`` (int64 row indices, strictly increasing), the
    last layer goes past its attention for those rows only, and both results hold just them,
    in that order: (len(keep), hidden) each."""
    inner, num_heads, num_kv_heads, head_dim, block_size = shape
    num_tokens, hidden = x.shape
    _check_float32(x, cos, sin)
    _check_int64(slots)
    if cos.shape != (num_tokens, 1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit {num_tokens} tokens")
    if slots.shape != (num_tokens,):
        raise ValueError(f"{num_tokens} tokens need as many slots")
    step = _step(block_tables, query_starts, context_starts, (num_heads, num_kv_heads, head_dim))
    num_rows = num_tokens
    if keep is not None:  # the kernel moves rows by these: check them here
        _check_int64(keep)
        num_rows = keep.numel()
        if keep.device.type != "cpu":
            raise ValueError(f"kept rows must be on the CPU, not {keep.device}")
        if keep.dim() != 1 or not _strictly_increasing_below(keep, num_tokens):
            raise ValueError(f"kept rows must be increasing indices below {num_tokens}")
    out = torch.empty_like(x)
    status = library().sy_decoder_layers(
        linear,
        ctypes.addressof(layers),
        len(layers),
        num_tokens,
        hidden,
        inner,
        eps,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        *step,
        block_size,
        scale,
        torch.get_num_threads(),
        None if keep is None else keep.data_ptr(),
        num_rows,
        x.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError("the layer stack could not allocate its buffers or its products' inputs")
    return out[:num_rows], x[:num_rows]


def _strictly_increasing_below(indices: torch.Tensor, bound: int) -> bool:
    if indices.numel() == 0:
        return True
    return bool(indices[0] >= 0 and indices[-1] < bound and (indices[1:] > indices[:-1]).all())


def _step(
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_starts: torch.Tensor,
    heads: tuple[int, int, int],
) -> tuple[int, int, int, int, int]:
    """A step as the kernels take it: (block tables, max_blocks, query starts, context starts,
    num_requests), once checked that the tables and starts are int64 and agree and that the
    kernel takes ``heads`` (num_heads, num_kv_heads, head_dim)."""
    _check_int64(block_tables, query_starts, context_starts)
    if block_tables.dim() != 2:
        raise ValueError(f"block tables must be 2-D, not {tuple(block_tables.shape)}")
    num_requests, max_blocks = block_tables.shape
    if query_starts.shape != (num_requests + 1,) or context_starts.shape != (num_requests,):
        raise ValueError(f"{num_requests} block tables need as many starts")
    if not supports_attention(*heads):
        num_heads, num_kv_heads, head_dim = heads
        raise ValueError(f"no paged kernel for {num_heads}/{num_kv_heads} heads of {head_dim}")
    pointers = (block_tables.data_ptr(), query_starts.data_ptr(), context_starts.data_ptr())
    return pointers[0], max_blocks, pointers[1], pointers[2], num_requests


def _check_float32(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise TypeError(f"the CPU kernels take float32 CPU tensors, not {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError("the CPU kernels take contiguous tensors")


def _check_int64(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.int64 or not tensor.is_contiguous():
            raise TypeError(f"indices must be contiguous int64, not {tensor.dtype}")
