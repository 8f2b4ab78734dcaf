"""Messages a worker sends to the scheduler (its DEALER → the scheduler's backend ROUTER)."""

from __future__ import annotations

import msgspec

from interfaces.outputs import TextGenerationOutput
from interfaces.requests import RequestID


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    """Sent once after the model is loaded and the KV pool allocated, by every rank of a
    tensor-parallel group: the scheduler serves the group once all ``tensor_parallel_size``
    ranks have registered (with the same model and KV pool)."""

    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    rank: int = 0
    tensor_parallel_size: int = 1


class ModelOutput(msgspec.Struct, tag="output", array_like=True):
    """The tokens a step produced, for the requests that reached a sampling point (sent by
    rank 0 only, as is ``WorkerFailure``).

    ``refused`` names new requests the worker cannot serve (an invalid structured-output spec,
    a logit_bias outside the vocabulary), with the reason for the user. Their scheduled tokens
    were still computed, so blocks they share stay valid; they got no token and the worker has
    already released them. The rest of the step ran normally.
    """

    step_id: int
    outputs: dict[RequestID, TextGenerationOutput]
    refused: dict[RequestID, str] = {}


class WorkerFailure(msgspec.Struct, tag="failure", array_like=True):
    """The worker could not run a step; the scheduler fails the step's requests with ``error``."""

    step_id: int
    error: str


WorkerToSchedulerMessage = WorkerReady | ModelOutput | WorkerFailure
