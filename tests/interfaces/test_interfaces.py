"""Every wire message round-trips through msgpack unchanged; bad frames never decode."""

from __future__ import annotations

import gc
import pickle
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from interfaces import (
    ErrorKind,
    GenerationStatus,
    ImageMetadata,
    LogProbabilities,
    SamplingParams,
    SchedulerResult,
    SchedulerStatus,
    SharedMemoryArray,
    StructuredOutput,
    TextContext,
    TextGenerationOutput,
    TextGenerationRequest,
    TextGenerationRequestFunction,
    TextGenerationRequestMessage,
    TextGenerationRequestTool,
    TokenGenerator,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.api_to_scheduler import (
    AbortRequests,
    ApiToSchedulerMessage,
    StatsRequest,
    SubmitEmbeddings,
    SubmitRequest,
)
from interfaces.embeddings import EmbeddingsContext, EmbeddingsOutput
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.lora import LoRAAdapterInfo
from interfaces.requests import PreparedImage
from interfaces.sampling import LogitsProcessorCall
from interfaces.scheduler_to_api import (
    ITERATION_TOKENS_BUCKETS,
    KV_TRANSFER_SECONDS_BUCKETS,
    MIGRATION_PAUSE_SECONDS_BUCKETS,
    MIGRATION_REASONS,
    SCHEDULER_RESTARTED,
    WORKER_DIED,
    WORKER_STALLED,
    GroupAway,
    GroupStats,
    SchedulerEmbeddingsResults,
    SchedulerResults,
    SchedulerStats,
    SchedulerToApiMessage,
)
from interfaces.scheduler_to_worker import (
    CachedRequestData,
    EmbeddingsStep,
    KVReceive,
    KVSend,
    KVTransfers,
    NewRequestData,
    ScheduledStep,
    SchedulerToWorkerMessage,
    Shutdown,
)
from interfaces.worker_to_scheduler import (
    GrammarsReady,
    KVLayout,
    KVReceived,
    RequestFailure,
    WorkerEmbeddingsOutput,
    WorkerFailure,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
    WorkerToSchedulerMessage,
)
from tests.support.fake_worker import FakeTokenGenerator

encode = msgpack_numpy_encoder()

SEGMENT = "switchyard_00000000_" + "0" * 24
"""A well-formed segment name (no such segment exists)."""
SAMPLING = SamplingParams(
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    temperature=0.7,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    repetition_penalty=1.1,
    max_new_tokens=64,
    min_new_tokens=2,
    ignore_eos=True,
    stop=["\n\n", "END"],
    stop_token_ids=[7, 8],
    detokenize=False,
    seed=1234,
    logit_bias={42: 5.0, 7: -100.0},
    logits_processors=[
        LogitsProcessorCall("ban"),
        LogitsProcessorCall("force", {"token": 3, "why": ["a", 1.5]}),
    ],
)
CONTEXT = TextContext(
    "req-1",
    [1, 2, 3],
    67,
    eos_token_ids=[2],
    sampling_params=SAMPLING,
    cache_salt="tenant",
    logprobs=5,
    prompt_logprobs=0,
    structured_output=StructuredOutput("json_schema", '{"type": "object"}'),
    images=[ImageMetadata(1, 3, SharedMemoryArray(SEGMENT, (3, 4, 4), "float32"), "f00d")],
)
OUTPUT = TextGenerationOutput(
    "req-1",
    [42],
    GenerationStatus.END_OF_SEQUENCE,
    [LogProbabilities([-0.25], [{42: -0.25, 7: -1.5}])],
    LogProbabilities([-3.0, -0.5], [{2: -3.0}, {3: -0.5}]),
)

MESSAGES = [
    (ApiToSchedulerMessage, SubmitRequest(CONTEXT)),
    (ApiToSchedulerMessage, AbortRequests(["a", "b"])),
    (ApiToSchedulerMessage, StatsRequest()),
    (SchedulerToApiMessage, SchedulerResults({"req-1": SchedulerResult.active(OUTPUT)})),
    (SchedulerToApiMessage, SchedulerResults({"x": SchedulerResult.complete(OUTPUT)})),
    (SchedulerToApiMessage, SchedulerResults({"y": SchedulerResult.cancelled("worker died")})),
    (SchedulerToApiMessage, SchedulerStats(3, 1, 100, 40, workers_ready=True)),
    (
        SchedulerToWorkerMessage,
        ScheduledStep(
            step_id=9,
            new_requests=[NewRequestData(CONTEXT, [4, 5], 0, output_token_ids=[11])],
            cached_requests=[CachedRequestData("old", [6], 17)],
            num_scheduled_tokens={"req-1": 4, "old": 1},
            finished_request_ids=["gone"],
        ),
    ),
    (SchedulerToWorkerMessage, Shutdown()),
    (
        WorkerToSchedulerMessage,
        WorkerReady(PROTOCOL_VERSION, "SmolLM2-135M-Instruct", 1000, 16, 8192),
    ),
    (
        WorkerToSchedulerMessage,
        WorkerReady(PROTOCOL_VERSION, "SmolLM2-135M-Instruct", 1000, 16, 8192, 2, 3),
    ),
    (WorkerToSchedulerMessage, WorkerOutput(9, {"req-1": OUTPUT})),
    (WorkerToSchedulerMessage, WorkerOutput(9, {}, refused={"x": "invalid regex"})),
    (
        WorkerToSchedulerMessage,
        WorkerOutput(
            9,
            {"req-1": OUTPUT},
            failed={"y": RequestFailure("the grammar failed: boom", invalid_request=True)},
            deferred=["z"],
        ),
    ),
    (WorkerToSchedulerMessage, GrammarsReady(["a"], {"b": "took longer than the limit"})),
    (WorkerToSchedulerMessage, WorkerFailure(9, "CUDA out of memory")),
    (ApiToSchedulerMessage, SubmitEmbeddings([EmbeddingsContext("e-1", [101, 7, 102])])),
    (SchedulerToWorkerMessage, EmbeddingsStep(4, [EmbeddingsContext("e-1", [101, 102])])),
    (SchedulerToWorkerMessage, Shutdown("block_size 8 differs from the served groups' 16")),
    (
        SchedulerToWorkerMessage,
        KVTransfers(receive=[KVReceive(3, "req-1", [7, 8], 2)], cancel=[1, 2]),
    ),
    (
        SchedulerToWorkerMessage,
        ScheduledStep(2, num_scheduled_tokens={"a": 1}, kv_sends=[KVSend(3, "a", [1], ["x"])]),
    ),
    (
        WorkerToSchedulerMessage,
        WorkerReady(
            PROTOCOL_VERSION,
            "m",
            64,
            16,
            512,
            1,
            2,
            WorkerRole.DECODE,
            "decode-0",
            KVLayout(30, 3, 64, "bfloat16"),
            "tcp://10.0.0.5:7000",
        ),
    ),
    (WorkerToSchedulerMessage, KVReceived(3, 1, 4096, 0.25)),
]


@pytest.mark.parametrize(("union", "message"), MESSAGES, ids=lambda m: type(m).__name__)
def test_wire_messages_round_trip(union, message):
    decoded = msgpack_numpy_decoder(union)(encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def default_of(field: msgspec.structs.FieldInfo) -> object:
    """A struct field's default value (``msgspec.NODEFAULT`` for a required field)."""
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


def test_group_away_round_trips():
    away = GroupAway("hybrid-1", WORKER_STALLED, 2.5)
    assert msgpack_numpy_decoder(GroupAway)(encode(away)) == away


def test_scheduler_stats_round_trip_with_every_field_set():
    stats = SchedulerStats(
        num_requests_running=3,
        num_requests_waiting=1,
        num_kv_blocks_total=100,
        num_kv_blocks_used=40,
        workers_ready=True,
        num_preemptions_total=2,
        prefix_cache_queries_total=500,
        prefix_cache_hits_total=128,
        iteration_tokens_counts=list(range(len(ITERATION_TOKENS_BUCKETS) + 1)),
        iteration_tokens_sum=4096,
        num_requests_running_by_role={"prefill": 1, "decode": 2},
        num_requests_waiting_by_role={"prefill": 1, "decode": 0},
        kv_transfer_bytes_total=1 << 20,
        kv_transfer_seconds_counts=[1] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1),
        kv_transfer_seconds_sum=0.75,
        embedding_workers_ready=True,
        request_migrations_total={WORKER_DIED: 4, WORKER_STALLED: 1, SCHEDULER_RESTARTED: 7},
        worker_restarts_total=2,
        migration_pause_seconds_counts=[2] * (len(MIGRATION_PAUSE_SECONDS_BUCKETS) + 1),
        migration_pause_seconds_sum=3.5,
        groups_away=[GroupAway("b", WORKER_DIED, 0.5), GroupAway("a", WORKER_STALLED, 12.0)],
        groups=[GroupStats("prefill-0", "prefill", 1, 1, 50, 20, 300, 100)],
        spec_decode_num_drafts_total=9,
        spec_decode_num_draft_tokens_total=30,
        spec_decode_num_accepted_tokens_total=17,
        spec_decode_num_accepted_tokens_per_pos_total=[9, 5, 3, 0],
        lora_adapters=[LoRAAdapterInfo("sql", "/adapters/sql"), LoRAAdapterInfo("chat", "/c")],
        max_loras=4,
        running_lora_adapters=["sql"],
        waiting_lora_adapters=["chat", "sql"],
    )
    fields = msgspec.structs.fields(SchedulerStats)
    assert [f.name for f in fields if getattr(stats, f.name) == default_of(f)] == []
    assert set(stats.request_migrations_total) == set(MIGRATION_REASONS)
    decoded = msgpack_numpy_decoder(SchedulerToApiMessage)(encode(stats))
    assert decoded == stats
    assert type(decoded) is SchedulerStats


def test_embeddings_travel_as_float32_arrays():
    vector = np.linspace(-1, 1, 384, dtype=np.float32)
    output = msgpack_numpy_decoder(WorkerToSchedulerMessage)(
        encode(WorkerEmbeddingsOutput(4, {"e-1": vector}, refused={"e-2": "too long"}))
    )
    assert isinstance(output, WorkerEmbeddingsOutput) and output.refused == {"e-2": "too long"}
    assert output.embeddings["e-1"].dtype == np.float32
    assert np.array_equal(output.embeddings["e-1"], vector)
    results = msgpack_numpy_decoder(SchedulerToApiMessage)(
        encode(
            SchedulerEmbeddingsResults({"e-1": SchedulerResult.complete(EmbeddingsOutput(vector))})
        )
    )
    assert isinstance(results, SchedulerEmbeddingsResults)
    assert np.array_equal(results.results["e-1"].result.embeddings, vector)


def test_text_generation_request_round_trips_with_every_field():
    pixels = np.arange(18, dtype=np.float32).reshape(2, 3, 3)
    request = TextGenerationRequest(
        request_id="r",
        index=1,
        messages=[
            TextGenerationRequestMessage("system", "be brief"),
            TextGenerationRequestMessage("user", [{"type": "text", "text": "hi"}]),
        ],
        images=[PreparedImage(pixels, "f00d")],
        tools=[
            TextGenerationRequestTool(
                TextGenerationRequestFunction("get_weather", "Weather", {"type": "object"})
            )
        ],
        logprobs=3,
        echo=True,
        sampling_params=SAMPLING,
        structured_output=StructuredOutput("json_schema", '{"type": "object"}'),
        cache_salt="tenant",
    )
    decoded = msgpack_numpy_decoder(TextGenerationRequest)(encode(request))
    assert np.array_equal(decoded.images[0].pixels, pixels)
    without_pixels = msgspec.structs.replace(decoded, images=[])
    assert without_pixels == msgspec.structs.replace(request, images=[])
    completion = TextGenerationRequest("r", 0, prompt=[1, 2, 3])
    assert msgpack_numpy_decoder(TextGenerationRequest)(encode(completion)).prompt == [1, 2, 3]


def test_numpy_arrays_travel_through_msgpack_numpy():
    class Frame(msgspec.Struct):
        pixels: np.ndarray

    pixels = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    decoded = msgpack_numpy_decoder(Frame)(encode(Frame(pixels)))
    assert decoded.pixels.dtype == np.float32
    np.testing.assert_array_equal(decoded.pixels, pixels)


class Pixels(msgspec.Struct):
    pixels: np.ndarray


def array_map(**fields) -> dict:
    """A msgpack-numpy array map as msgpack-numpy writes it, with ``fields`` replaced."""
    array = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [2], b"data": bytes(8)}
    return {"pixels": {**array, **{name.encode(): value for name, value in fields.items()}}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": b"O", "type": "|O", "data": pickle.dumps([1, 2])}, "dtype object"),
        ({"type": "|V8"}, "dtype |V8"),
        ({"type": "<U4"}, "dtype <U4"),
        ({"type": "no such dtype"}, "not a dtype"),
        ({"shape": [1 << 40]}, "needs 4398046511104"),
        ({"shape": [-2]}, "non-negative"),
        ({"data": "not bytes"}, "bytes data"),
        ({"nd": False}, "expected a msgpack-numpy array"),
    ],
)
def test_only_plain_numeric_arrays_decode(fields, message):
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
        msgpack_numpy_decoder(Pixels)(encode(array_map(**fields)))


@pytest.mark.parametrize(
    ("name", "shape", "dtype", "message"),
    [
        (SEGMENT, (2,), "|O", "dtype object"),
        (SEGMENT, (-1, 3), "<f4", "negative size"),
        (SEGMENT, (1,), "x", "not a dtype"),
        ("torch_123", (1,), "<f4", "not a Switchyard shared-memory segment: 'torch_123'"),
        ("switchyard_00000000_../../etc", (1,), "<f4", "not a Switchyard shared-memory segment"),
    ],
)
def test_shared_memory_references_to_odd_arrays_do_not_decode(name, shape, dtype, message):
    frame = msgspec.msgpack.encode([name, list(shape), dtype])
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
        msgpack_numpy_decoder(SharedMemoryArray)(frame)


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x00\x01garbage", pickle.dumps(SubmitRequest(CONTEXT)), encode({"tag": "submit"})],
)
def test_bad_frames_raise_instead_of_decoding(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        msgpack_numpy_decoder(ApiToSchedulerMessage)(frame)


def test_a_frame_nested_too_deeply_is_a_decode_error():
    """Free-form fields (tool parameters, a logits processor's args) decode as ``Any``: a frame
    nesting them past the decoder's recursion is a bad frame, not a RecursionError."""
    frame = b"\x81\xa1a" + b"\x91" * 200_000 + b"\xc0"  # {"a": [[[...[None]...]]]}
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        msgpack_numpy_decoder(dict[str, Any])(frame)


def test_decoding_validates_sampling_params():
    # Flip the sign bit of temperature=0.7 (float64 0x3FE6666666666666) inside a valid frame.
    good = encode(SubmitRequest(CONTEXT))
    bad = good.replace(b"\xcb?\xe6ffffff", b"\xcb\xbf\xe6ffffff")
    assert bad != good
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgpack_numpy_decoder(ApiToSchedulerMessage)(bad)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "must not exceed"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop": [""]}, "stop strings"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {5: 101.0}}, "logit_bias values"),
        ({"logits_processors": [LogitsProcessorCall("x")] * 2}, "more than once"),
        ({"logits_processors": [LogitsProcessorCall(str(i)) for i in range(9)]}, "at most 8"),
        ({"logits_processors": [LogitsProcessorCall("")]}, "1 to 128 characters"),
        ({"logits_processors": [LogitsProcessorCall("x", {"a": "b" * 5000})]}, "exceed 4096"),
    ],
)
def test_sampling_params_reject_bad_values_clearly(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_sampling_params_defaults_are_max_s_and_greedy():
    params = SamplingParams()
    assert (params.top_k, params.top_p, params.temperature, params.max_new_tokens) == (
        1,
        1.0,
        1.0,
        None,
    )
    assert params.is_greedy
    assert SamplingParams(top_k=-1, temperature=0.0).is_greedy
    assert not SamplingParams(top_k=-1, temperature=0.8).is_greedy
    assert SamplingParams(top_k=-1, temperature=1e-300).is_greedy  # 0.0 in float32
    assert not SamplingParams(top_k=-1, temperature=1e-5).is_greedy


def test_scheduler_result_constructors():
    assert SchedulerResult.active(OUTPUT).status is SchedulerStatus.ACTIVE
    assert not SchedulerResult.active(OUTPUT).stop_stream
    assert SchedulerResult.complete(OUTPUT).stop_stream
    cancelled = SchedulerResult.cancelled()
    assert (cancelled.status, cancelled.result, cancelled.stop_stream) == (
        SchedulerStatus.CANCELLED,
        None,
        True,
    )
    assert (cancelled.error, cancelled.error_kind) == (None, None)  # a client's abort
    failed = SchedulerResult.cancelled("worker error: boom")
    assert (failed.error, failed.error_kind) == ("worker error: boom", ErrorKind.INTERNAL)
    rejected = SchedulerResult.rejected_request("too long")
    assert rejected.error_kind is ErrorKind.INVALID_REQUEST
    assert OUTPUT.is_done and GenerationStatus.MAXIMUM_LENGTH.is_done
    assert not GenerationStatus.ACTIVE.is_done


def test_text_context_limits():
    assert CONTEXT.num_prompt_tokens == 3
    assert CONTEXT.max_new_tokens == 64


def test_shared_memory_array_round_trip_and_unlink():
    pixels = np.random.default_rng(0).integers(0, 255, (3, 8, 8), dtype=np.uint8)
    reference = SharedMemoryArray.create(pixels)
    decoded = msgpack_numpy_decoder(SharedMemoryArray)(encode(reference))
    np.testing.assert_array_equal(decoded.read(), pixels)
    assert Path(f"/dev/shm/{reference.name}").exists()
    decoded.unlink()
    decoded.unlink()
    assert not Path(f"/dev/shm/{reference.name}").exists()


def test_fake_worker_satisfies_the_token_generator_protocol():
    assert isinstance(FakeTokenGenerator(block_size=4), TokenGenerator)


def test_per_step_wire_types_are_not_tracked_by_the_garbage_collector():
    """One of each is made per request per step; untracked, they never slow a collection."""
    output = TextGenerationOutput("r", [5], GenerationStatus.ACTIVE)
    untracked = [
        CachedRequestData("r", [1, 2], 16),
        output,
        SchedulerResult.active(output),
    ]
    assert [gc.is_tracked(item) for item in untracked] == [False, False, False]
