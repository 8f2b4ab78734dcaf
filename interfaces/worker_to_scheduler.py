"""Messages a worker sends to the scheduler (its DEALER → the scheduler's backend ROUTER)."""

from __future__ import annotations

import enum

import msgspec
import numpy as np

from interfaces.lora import LoRAOperation, LoRAResponse
from interfaces.outputs import TextGenerationOutput
from interfaces.requests import RequestID

MAX_KV_BLOCKS = 1 << 20
"""The most KV blocks a worker reports in ``WorkerReady``: one whose memory budget holds more
(a small model on a large GPU) uses this many, and the scheduler refuses a handshake claiming
more than its ``--max-worker-kv-blocks`` (this by default). 16M tokens of 16-token blocks."""
CPU_STEP_TOKENS = 512
"""A CPU group's step budget (``WorkerReady.step_tokens``): a burst of prompts prefilled in one
multi-second step would hold back every running request's next token (docs/performance.md)."""
CUDA_STEP_TOKENS = 8192
"""A GPU group's (vLLM's default for its API server): with decode steps in CUDA graphs, a small
budget leaves the prompts of a burst waiting many steps for their first token."""
MAX_STEP_TOKENS = 1 << 20
"""The largest step budget a handshake may suggest."""


class WorkerRole(enum.Enum):
    """What a worker group does (lmdeploy's EngineRole; MAX's prefill_only / decode_only).

    A ``hybrid`` group runs requests from prompt to last token. With disaggregation, a
    ``prefill`` group computes prompts and their first token, its KV blocks are sent to a
    ``decode`` group, and that group generates the rest.
    """

    HYBRID = "hybrid"
    PREFILL = "prefill"
    DECODE = "decode"
    EMBEDDING = "embedding"
    """An encoder model that turns inputs into vectors (``EmbeddingsStep``), beside the others."""


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """The shape of a group's KV cache, which a transfer between groups must agree on.

    ``num_kv_heads`` counts the model's key-value heads (every rank of a tensor-parallel group
    holds its share of them); ``dtype`` is torch's name without the prefix ("bfloat16").
    Each block holds ``block_size`` tokens of keys and values of every layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers and heads, keys and values together."""
        element_size = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element_size


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    """The handshake: sent once after the model is loaded and the KV pool allocated, by every
    rank of a worker group. The scheduler serves the group once all ``tensor_parallel_size``
    ranks have registered alike (model, KV pool, role, layout).

    ``group`` names the group its ranks belong to (a group that registers again under the same
    name replaced the old one). A ``decode`` rank receives KV blocks at ``transfer_addr``.

    ``protocol_version`` comes first in every version (``interfaces.handshake``): a scheduler
    refuses a worker of another version before reading anything else.
    """

    protocol_version: int
    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    rank: int = 0
    tensor_parallel_size: int = 1
    role: WorkerRole = WorkerRole.HYBRID
    group: str = ""
    kv_layout: KVLayout | None = None
    transfer_addr: str = ""
    vocab_size: int = 0
    """The model's vocabulary size: the scheduler admits only prompt token ids below it (0:
    not reported, so only ids that fit the wire's integers pass)."""
    max_loras: int = 0
    """LoRA adapters the group can hold at once (0: LoRA is not enabled)."""
    max_lora_rank: int = 0
    """The largest adapter rank it serves."""
    step_tokens: int = 0
    """The per-step token budget the group works best with, which its scheduler takes when
    ``--max-num-batched-tokens`` was not given: ``CPU_STEP_TOKENS`` on a CPU,
    ``CUDA_STEP_TOKENS`` on CUDA (0: not reported, the CPU's)."""


class RequestFailure(msgspec.Struct, array_like=True, frozen=True):
    """Why the worker could not sample one request's token, for that request's user alone.

    ``invalid_request``: the request's own parameters caused it (its grammar), an HTTP 400;
    otherwise the failure is the system's, a 500.
    """

    reason: str
    invalid_request: bool = False


class WorkerOutput(msgspec.Struct, tag="output", array_like=True):
    """The tokens a step produced, for the requests that reached a sampling point (sent by
    rank 0 only, as is ``WorkerFailure``).

    ``refused`` names new requests the worker cannot serve (an invalid structured-output spec,
    a logit_bias outside the vocabulary), with the reason for the user. Their scheduled tokens
    were still computed, so blocks they share stay valid; they got no token and the worker has
    already released them. The rest of the step ran normally.

    ``failed`` names requests whose token could not be sampled (their logits, logits processing
    or grammar raised): their scheduled tokens were computed, they got no token, and the worker
    keeps their state until the scheduler releases them. The others in the step are unaffected.

    ``deferred`` names requests that reached a sampling point before their grammar finished
    compiling: their scheduled tokens were computed (KV written) but they got no token. The
    scheduler recomputes their last token once ``GrammarsReady`` names them.
    """

    step_id: int
    outputs: dict[RequestID, TextGenerationOutput]
    refused: dict[RequestID, str] = {}
    failed: dict[RequestID, RequestFailure] = {}
    deferred: list[RequestID] = []


class GrammarsReady(msgspec.Struct, tag="grammars", array_like=True):
    """Sent by rank 0 between steps, about requests it deferred (``WorkerOutput.deferred``):
    their grammars are ``ready`` to sample with, or ``failed`` to compile (an invalid spec, or
    past the compile time limit), with the reason for the user (an HTTP 400). A request is named
    once, and only after the ``WorkerOutput`` that deferred it."""

    ready: list[RequestID] = []
    failed: dict[RequestID, str] = {}


class WorkerFailure(msgspec.Struct, tag="failure", array_like=True):
    """The worker could not run a step; the scheduler fails the step's requests. ``error`` is
    for the logs: it may name any request of the step, so users get a generic message."""

    step_id: int
    error: str


class KVReceived(msgspec.Struct, tag="kv_received", array_like=True):
    """A decode rank holds its share of transfer ``transfer_id``'s blocks (every rank of the
    decode group sends one; the request may decode once all have).

    ``num_bytes`` were received; ``seconds`` ran from the first sender starting to gather the
    blocks to the last of them written here (wall clocks: across hosts, as exact as their
    synchronization)."""

    transfer_id: int
    rank: int
    num_bytes: int
    seconds: float


class WorkerEmbeddingsOutput(msgspec.Struct, tag="embedded", array_like=True):
    """An embedding group's answer to ``EmbeddingsStep``: one float32 vector per context, or,
    in ``refused``, why a context could not be embedded (too long for the model)."""

    step_id: int
    embeddings: dict[RequestID, np.ndarray]
    refused: dict[RequestID, str] = {}


class LoRAUpdated(msgspec.Struct, tag="lora_updated", array_like=True):
    """A group's answer to ``LoRAUpdate`` (from rank 0): ``response.status`` is SUCCESS when
    every rank holds the adapter (a load) or none does any more (an unload)."""

    operation: LoRAOperation
    lora_id: int
    response: LoRAResponse


WorkerToSchedulerMessage = (
    WorkerReady
    | WorkerOutput
    | WorkerFailure
    | KVReceived
    | WorkerEmbeddingsOutput
    | GrammarsReady
    | LoRAUpdated
)
