"""Every decoder layer of a CPU float32 step in one C call (``cpu_ops.decoder_layers``).

Between the nine kernels of a layer the module path runs Python: module calls, the wrappers'
checks, a tensor allocation per result. At batch 1 that was about a quarter of a decode step
(profiled with perf: the main thread outside the kernels while the other thread waited in
OpenMP), 30 layers of 9 calls. ``FusedLayers`` hands the whole stack to C instead: the same
kernels in the same order, so the logits are the same to the bit.

It serves a model where every piece has a CPU kernel: float32 on the CPU with attention in place
(``AttentionKind.IN_PLACE_CPU``), every linear layer packed in panels (``panel_gemm``) or every
one in tile form (``tile_gemm``, at "high" float32 matmul precision), one
rank (tensor parallelism sums partial products between the kernels), and steps where no row runs
with a LoRA adapter (whose products join the linear layers' outputs). Elsewhere, and whenever
``serves`` says no, the layer modules run as before.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch
from torch import nn

from worker import parallel
from worker.attention import AttentionKind, AttentionMetadata
from worker.kv_cache import KVCache
from worker.models import cpu_ops, panel_gemm, tile_gemm


class FusedLayers:
    """The C layer stack of one model: its layers' weight addresses, kept with the model."""

    def __init__(self, model: nn.Module) -> None:
        """Use ``build``, which checks that the model (a ``LlamaForCausalLM``) fits."""
        layers = model.model.layers
        first = layers[0]
        attention, mlp = first.self_attn, first.mlp
        self._qkv = attention.qkv_proj  # its LoRA batch is every layer's
        if attention.qkv_proj.packing == "tiles":
            product = tile_gemm.library().sy_tile_linear
        else:
            product = panel_gemm.library().sy_panel_linear
        self._linear = ctypes.cast(product, ctypes.c_void_p).value
        self._weights = (cpu_ops.LayerWeights * len(layers))()
        for fields, layer in zip(self._weights, layers, strict=True):
            fields.input_norm = layer.input_layernorm.weight.data_ptr()
            fields.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in _linears(layer).items():
                setattr(fields, name, linear.packed_weight.data_ptr())
                bias = linear.bias
                setattr(fields, f"{name}_bias", None if bias is None else bias.data_ptr())
        self._shape = (
            mlp.gate_up_proj.out_features // 2,
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
        )
        self._cache: Callable[[], KVCache | None] = lambda: None
        """The KV cache the weights' fields point at (a weak reference), or None yet."""
        self._eps = first.input_layernorm.eps
        self._scale = attention.head_dim**-0.5

    @classmethod
    def build(cls, model: nn.Module) -> FusedLayers | None:
        """The layer stack of ``model`` (a ``LlamaForCausalLM``, loaded), or None where a piece
        of it has no CPU kernel."""
        layers = model.model.layers
        if (
            model.attention_kind is not AttentionKind.IN_PLACE_CPU
            or parallel.tensor_parallel().world_size != 1
            or panel_gemm.library() is None
            or not cpu_ops.applies(model.model.norm.weight)
        ):
            return None
        first = layers[0]
        hidden = first.input_layernorm.weight.numel()
        attention = first.self_attn
        heads_width = attention.num_heads * attention.head_dim
        qkv_width = heads_width + 2 * attention.num_kv_heads * attention.head_dim
        inner = first.mlp.gate_up_proj.out_features // 2
        inputs_outputs = {  # what each linear layer must take and give
            "qkv": (hidden, qkv_width),
            "o": (heads_width, hidden),
            "gate_up": (hidden, 2 * inner),
            "down": (inner, hidden),
        }
        packing = attention.qkv_proj.packing  # every linear layer's, or the stack cannot run
        for layer in layers:
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(norm.eps != first.input_layernorm.eps for norm in norms):
                return None
            if any(not _fits(norm.weight, (hidden,)) for norm in norms):
                return None
            for name, linear in _linears(layer).items():
                k, n = inputs_outputs[name]
                if linear.packing != packing or not _packed_fits(linear, packing, k, n):
                    return None
                if linear.out_features != n or not _fits(linear.bias, (n,), optional=True):
                    return None
        return cls(model)

    def _point_at(self, kv_cache: KVCache) -> None:
        """Put ``kv_cache``'s layers in the weights' fields, once per cache (its tensors are
        set when it is built; a step with another cache points at that one)."""
        self._cache = lambda: None  # until every layer points at it
        _, _, num_kv_heads, head_dim = self._shape
        layer_shape = (kv_cache.num_blocks, kv_cache.block_size, num_kv_heads, head_dim)
        for index, fields in enumerate(self._weights):
            key_cache, value_cache = kv_cache.layer(index)
            if not (_fits(key_cache, layer_shape) and _fits(value_cache, layer_shape)):
                raise ValueError(f"layer {index}'s KV cache does not fit {layer_shape}")
            fields.key_cache = key_cache.data_ptr()
            fields.value_cache = value_cache.data_ptr()
        self._cache = weakref.ref(kv_cache)  # weak: a replaced cache's memory is freed

    def serves(self, metadata: AttentionMetadata) -> bool:
        """Whether this step runs here: attention in place, and no row with a LoRA adapter."""
        if not metadata.in_place_cpu:
            return False
        lora = self._qkv.lora
        return lora is None or not lora.batch.groups

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over ``x`` (num_tokens, hidden; the embeddings, ours, contiguous, and the
        residual stream afterwards): (the last layer's output, the residual stream before it),
        as the module loop returns them; with ``keep`` (increasing row indices), for those
        rows only (``DecoderLayer.forward``)."""
        if self._cache() is not kv_cache:
            self._point_at(kv_cache)
        return cpu_ops.decoder_layers(
            self._linear,
            self._weights,
            x,
            *cos_sin,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.query_starts,
            metadata.context_starts,
            (*self._shape, kv_cache.block_size),
            self._eps,
            self._scale,
            keep,
        )


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's linear layers by their ``LayerWeights`` field names."""
    return {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }


def _packed_fits(linear: nn.Module, packing: str | None, k: int, n: int) -> bool:
    """Whether ``linear`` holds a (n, k) weight packed for one of the stack's products."""
    if packing == "panels":
        shape = (-(-n // panel_gemm.PANEL), k, panel_gemm.PANEL)
        return _fits(linear.packed_weight, shape)
    if packing == "tiles":
        return _fits(linear.packed_weight, tile_gemm.tile_shape(n, k), dtype=torch.int16)
    return False


def _fits(
    tensor: torch.Tensor | None,
    shape: tuple[int, ...],
    optional: bool = False,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether ``tensor`` is a contiguous ``dtype`` CPU tensor of ``shape`` (or None, if
    ``optional``)."""
    if tensor is None:
        return optional
    return (
        tuple(tensor.shape) == shape
        and tensor.dtype == dtype
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
    )
