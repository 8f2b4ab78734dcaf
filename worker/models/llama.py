"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat batch and a paged KV cache.

Module names follow Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``...) so weights
load by name. One forward pass takes every request's scheduled tokens concatenated; attention
finds each token's request and cache blocks in ``AttentionMetadata``. The layers come from
``worker.models.linear``, which splits them over tensor-parallel ranks; this file reads as if
on one device (head counts come from the layers). A vision-language model
(``worker.models.llava``) may feed it input embeddings instead of token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from worker import flex_attention, parallel
from worker.attention import AttentionKind, AttentionMetadata, paged_attention, write_kv
from worker.kv_cache import KVCache
from worker.models import cpu_ops, tile_gemm
from worker.models.config import ModelConfig
from worker.models.fused_layers import FusedLayers
from worker.models.linear import Linear, Split, VocabEmbedding, prepack_linears
from worker.models.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32; with a residual, the add that precedes it too."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); ``residual`` (like ``x``) may be updated in
        place, so the caller passes one it owns. Without a residual: (norm(x), x)."""
        if cpu_ops.applies(x):
            if residual is None:
                return cpu_ops.add_rms_norm(None, x, self.weight, self.eps), x
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype), x


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the paged cache."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = head_dim = config.head_dim
        heads = Split(config.num_attention_heads, head_dim, "attention heads")
        kv_heads = Split(config.num_key_value_heads, head_dim, "key-value heads", replicate=True)
        self.qkv_proj = Linear.column(
            config.hidden_size, [heads, kv_heads, kv_heads], bias=config.qkv_bias
        )
        self.o_proj = Linear.row(heads, config.hidden_size, bias=config.o_proj_bias)
        self.qkv_sizes = self.qkv_proj.output_sizes  # this worker's heads (all, on one device)
        self.num_heads = self.qkv_sizes[0] // head_dim
        self.num_kv_heads = self.qkv_sizes[1] // head_dim

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over ``x`` (num_tokens, hidden), every row's keys and values written to the
        cache: (num_tokens, hidden), or with ``keep`` (row indices) the rows it names only."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        key_cache, value_cache = kv_cache.layer(self.layer_index)
        if metadata.in_place_cpu:  # one kernel rotates, and writes the cache
            q = cpu_ops.rope_write_kv(
                qkv, *cos_sin, metadata.slot_mapping, key_cache, value_cache, num_heads
            )  # (num_tokens, num_heads, head_dim)
        else:
            qk = qkv[:, : -self.qkv_sizes[2]].view(-1, num_heads + num_kv_heads, head_dim)
            # (num_tokens, num_heads + num_kv_heads, head_dim): queries and keys rotate together
            q, k = RotaryEmbedding.rotate(qk, *cos_sin).split([num_heads, num_kv_heads], dim=1)
            v = qkv[:, -self.qkv_sizes[2] :].view(-1, num_kv_heads, head_dim)
            # (num_tokens, num_kv_heads, head_dim)
            write_kv(key_cache, value_cache, k, v, metadata.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, metadata, scale=head_dim**-0.5)
        out = out.flatten(1)  # (num_tokens, num_heads * head_dim)
        return self.o_proj(out if keep is None else out[keep])


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one product."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = Split(config.intermediate_size, 1, "intermediate features")
        self.gate_up_proj = Linear.column(hidden, [inner, inner], bias=config.mlp_bias)
        self.down_proj = Linear.row(inner, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * intermediate_size)
        if cpu_ops.applies(gate_up):
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # (num_tokens, intermediate_size) each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the block's output and is added inside the next norm
    (``RMSNorm`` with a residual), one pass instead of two."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it): their sum is the block's
        result in the textbook form. The first block gets the embeddings and no residual.

        With ``keep`` (row indices), every row's keys and values still go to the cache, but
        the rest of the block runs for the kept rows only, and both results hold just them:
        the last block of a step needs no more than the rows whose logits it takes."""
        hidden, residual = self.input_layernorm(x, residual)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, metadata, keep)
        if keep is not None:
            residual = residual[keep]  # a copy: the norm below may add into it
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # None once a tied LM head's packed weight serves the lookups (``finish_loading``).
        self.embed_tokens: VocabEmbedding | None = VocabEmbedding(
            config.vocab_size, config.hidden_size
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat token batch. Build it with ``load_llama``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head = Linear.vocab(config.hidden_size, config.vocab_size)
        self.attention_kind = AttentionKind.GATHERED
        """How attention reads the paged cache (``worker.attention``); set by
        ``finish_loading``."""
        self.fused_layers: FusedLayers | None = None
        """Every layer in one C call where each piece has a CPU kernel; set by
        ``finish_loading``."""
        self.greedy_head: tile_gemm.GreedyHead | None = None
        """Greedy tokens without the float32 logits, where the tile unit serves them
        (``greedy_tokens``); set by ``finish_loading``."""

    @classmethod
    def empty(
        cls, config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> LlamaForCausalLM:
        """The model on ``device`` with weights allocated but not set (a tied LM head shares the
        embedding's); fill them with ``checkpoint_loaders``, then call ``finish_loading``."""
        with torch.device("meta"):
            model = cls(config)
        # Module.to_empty's empty_like of a meta tensor imports sympy (0.3 s of every start).
        model = model._apply(
            lambda meta: torch.empty(
                meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype, device=device
            )
        )
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def checkpoint_loaders(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """For each checkpoint tensor name this model needs, what copies it into place."""
        loaders = checkpoint_loaders(self)
        if self.config.tie_word_embeddings:
            loaders.pop("lm_head.weight")
        return loaders

    def finish_loading(self) -> LlamaForCausalLM:
        """After the weights are in: on the CPU, linear layers switch to packed weights
        (``worker.models.linear``), and a tied LM head's panels replace the embedding matrix;
        attention reads the cache in place where a kernel for this device exists."""
        prepack_linears(self)
        if self.config.tie_word_embeddings and self.lm_head.packing == "panels":
            self.model.embed_tokens = None  # lookups read the LM head's panels: one copy, not two
        attention = self.model.layers[0].self_attn
        device = self.model.norm.weight.device
        if cpu_ops.applies(self.model.norm.weight) and cpu_ops.supports_attention(
            attention.num_heads, attention.num_kv_heads, attention.head_dim
        ):
            self.attention_kind = AttentionKind.IN_PLACE_CPU
        elif flex_attention.is_available(device):
            self.attention_kind = AttentionKind.FLEX
        self.fused_layers = FusedLayers.build(self)
        head = self.lm_head
        if (
            head.packing == "panels"
            and head.bias is None
            and parallel.tensor_parallel().world_size == 1
            and tile_gemm.greedy_available()
        ):
            self.greedy_head = tile_gemm.GreedyHead.build(
                head.packed_weight, head.out_features, self.config.vocab_size
            )
        return self.eval()

    @property
    def text_model(self) -> LlamaForCausalLM:
        """The model whose ``hidden_states``, ``logits`` and ``greedy_tokens`` a step runs."""
        return self

    @property
    def num_kv_heads(self) -> int:
        """Key-value heads per layer in this worker's KV cache."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def num_heads(self) -> int:
        """Query heads per layer on this worker."""
        return self.model.layers[0].self_attn.num_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (num_tokens,): (num_tokens, hidden_size)."""
        embed_tokens = self.model.embed_tokens or self.lm_head.rows
        return embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        input_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``input_ids`` (num_tokens,) at ``positions`` (num_tokens,); cache their keys/values.

        ``input_embeddings`` (num_tokens, hidden_size), when given, is used instead of
        ``embed(input_ids)`` (a vision-language model puts image features in some rows).
        Returns float32 logits (len(logits_indices), vocab_size) for the flat-batch rows in
        ``logits_indices`` only: the tokens that are followed by a sampled token.
        """
        return self.logits(
            self.hidden_states(
                input_ids, positions, kv_cache, metadata, logits_indices, input_embeddings
            )
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        input_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` up to the LM head: the final norm's output for the rows in
        ``logits_indices``, (len(logits_indices), hidden_size), which ``logits`` or
        ``greedy_tokens`` take."""
        # x becomes the residual stream, which the norms add into in place: it must be ours,
        # and contiguous for the CPU kernels
        if input_embeddings is None:
            x = self.embed(input_ids).contiguous()
        else:
            x = input_embeddings.clone(memory_format=torch.contiguous_format)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        keep, logits_indices = self._kept_rows(logits_indices, x.shape[0])
        if self.fused_layers is not None and self.fused_layers.serves(metadata):
            x, residual = self.fused_layers(x, cos_sin, kv_cache, metadata, keep)
        else:
            residual = None
            last = len(self.model.layers) - 1
            for index, layer in enumerate(self.model.layers):
                rows = keep if index == last else None
                x, residual = layer(x, residual, cos_sin, kv_cache, metadata, rows)
        # (num_sampled, hidden_size): x[i] + residual[i] are fresh rows, safe to add into
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])
        return x

    def _kept_rows(
        self, logits_indices: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rows the last layer must finish (sorted, once each), and ``logits_indices`` as
        indices into them; (None, ``logits_indices``) where every row is needed anyway, or
        where LoRA adapters run this step (their products index the whole batch's rows).

        A step with as many logits as tokens (every decode step, and so every CUDA graph
        capture, where ``torch.unique``'s wait for the device is not allowed) returns before
        looking at the indices."""
        lora = self.model.layers[-1].self_attn.o_proj.lora
        if logits_indices.numel() >= num_tokens or (lora is not None and lora.batch.groups):
            return None, logits_indices
        return torch.unique(logits_indices, sorted=True, return_inverse=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (num_rows, vocab_size) of ``hidden_states`` rows."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each ``hidden_states`` row's greedy token, the first index of its largest float32
        logit, without computing those logits (``tile_gemm.GreedyHead``); int64 (num_rows,),
        ``tile_gemm.NEEDS_LOGITS`` for a row whose values are not all finite. Only where
        ``greedy_head`` is set."""
        assert self.greedy_head is not None, "no greedy head here: take the logits"
        return self.greedy_head.tokens(hidden)


STACKED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Stacked layers and the checkpoint projections they hold, in row order."""

SHARDED_LAYERS = (Linear, VocabEmbedding)
"""Layers that cut their part of a checkpoint tensor themselves (``load_shard``)."""


def load_llama(
    config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """Build the model ``config`` describes and load ``model_dir``'s safetensors weights.

    Raises ``ValueError`` for missing files or missing weights.
    """
    model = LlamaForCausalLM.empty(config, device, dtype)
    load_checkpoint(Path(model_dir), model.checkpoint_loaders())
    return model.finish_loading()


def load_checkpoint(
    model_dir: Path,
    loaders: dict[str, Callable[[torch.Tensor], None]],
    rename: Callable[[str], str] | None = None,
) -> None:
    """Copy each tensor of ``model_dir``'s safetensors files that ``loaders`` names (after
    ``rename``) into place; tensors it does not name are skipped unread. ``ValueError`` if
    there are no files or some of ``loaders`` found no tensor."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors files")
    loaders = dict(loaders)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a dict)
                load = loaders.pop(rename(name) if rename else name, None)
                if load is not None:
                    load(weights.get_tensor(name))
    if loaders:
        raise ValueError(f"weights missing from {model_dir}: {sorted(loaders)[:5]}")


def checkpoint_loaders(module: nn.Module) -> dict[str, Callable[[torch.Tensor], None]]:
    """For each checkpoint tensor name ``module``'s parameters load from, what copies it into
    place: sharded layers cut their slice, any other parameter is copied whole."""
    loaders: dict[str, Callable[[torch.Tensor], None]] = {}
    for prefix, layer in module.named_modules():
        if not isinstance(layer, SHARDED_LAYERS):
            continue
        parent, _, local_name = prefix.rpartition(".")
        names = STACKED_PROJECTIONS.get(local_name, (local_name,))
        for shard, checkpoint_name in enumerate(names):
            base = f"{parent}.{checkpoint_name}" if parent else checkpoint_name
            for kind in (
                ("weight", "bias") if getattr(layer, "bias", None) is not None else ("weight",)
            ):
                loaders[f"{base}.{kind}"] = partial(layer.load_shard, shard, kind)
    for name, parameter in module.named_parameters():
        if not isinstance(module.get_submodule(name.rpartition(".")[0]), SHARDED_LAYERS):
            loaders[name] = partial(_copy_weight, parameter, name=name)
    return loaders


@torch.no_grad()
def _copy_weight(parameter: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if parameter.shape != tensor.shape:
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {parameter.shape}"
        )
    parameter.copy_(tensor)
