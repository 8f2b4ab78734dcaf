"""The embedding model (worker.embeddings) against sentence-transformers, its reference, and
embedding inputs batched by the scheduler onto an embedding worker process."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import zmq
from tokenizers import Tokenizer

from interfaces import ErrorKind, SchedulerStatus, msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.api_to_scheduler import SubmitEmbeddings
from interfaces.embeddings import EmbeddingsContext, Pooling, default_embedding_model_dir
from interfaces.scheduler_to_api import SchedulerEmbeddingsResults, SchedulerToApiMessage
from interfaces.worker_to_scheduler import WorkerEmbeddingsOutput
from scheduler.config import SchedulerConfig
from scheduler.embeddings import Embeddings
from scheduler.server import SchedulerServer
from tests.support.serve_process import ServeProcess
from worker.embeddings import EmbeddingsGenerator

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex")  # fmt: skip


@pytest.fixture(scope="module")
def model_dir():
    return default_embedding_model_dir()


@pytest.fixture(scope="module")
def generator(model_dir):
    return EmbeddingsGenerator(model_dir)


def texts(count: int) -> list[str]:
    """Inputs of many lengths, up to a couple of hundred tokens."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 37) % 180))
            for i in range(count)]  # fmt: skip


def test_a_batch_of_100_matches_sentence_transformers(model_dir, generator):
    from sentence_transformers import SentenceTransformer

    inputs = texts(100)
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(inputs)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads and truncates every input to 128 tokens
    tokenizer.no_truncation()
    batch = {f"e{i}": tokenizer.encode(text).ids for i, text in enumerate(inputs)}
    embeddings = generator.encode(batch)
    assert list(embeddings) == list(batch)
    got = np.stack(list(embeddings.values()))
    assert got.shape == (100, 384) and got.dtype == np.float32
    cosine = (got * reference).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized, as configured


def test_the_pooling_comes_from_the_models_sentence_transformers_files(model_dir, generator):
    assert generator.pooling == Pooling(mode="mean", normalize=True, max_seq_length=256)
    assert generator.dimensions == 384


def test_inputs_that_are_empty_or_too_long_are_refused(generator):
    with pytest.raises(ValueError, match="has 257 tokens; the embedding model takes 1 to 256"):
        generator.encode({"long": [101] + [1000] * 255 + [102]})
    with pytest.raises(ValueError, match="has 0 tokens"):
        generator.encode({"empty": []})
    assert generator.encode({}) == {}


# -- served: a scheduler and an embedding worker process ------------------------------------------


@pytest.fixture
def scheduler_with_embedder(tmp_path, model_dir):
    """A SchedulerServer thread, an embedding worker process, and an API-side DEALER."""
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    server = SchedulerServer(SchedulerConfig(max_num_batched_tokens=512), frontend, backend)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(frontend)
    refused = submit(client, [EmbeddingsContext("early", [101, 102])])
    assert refused["early"].error == "no embedding model is being served"
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--role", "embedding", "--model", str(model_dir),
         "--scheduler-addr", backend, "--device", "cpu", "--served-model-name", "minilm"]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not server.embeddings.groups:
            assert time.monotonic() < deadline and worker.poll() is None, "no embedding worker"
            time.sleep(0.1)
        yield server, client
    finally:
        server.stop()
        thread.join(timeout=10)
        assert worker.wait(timeout=30) == 0  # told to shut down
        context.destroy(linger=0)


def submit(client, contexts: list[EmbeddingsContext], timeout_s: float = 60) -> dict:
    """Send the inputs; every input's result, by id."""
    client.send(msgpack_numpy_encoder()(SubmitEmbeddings(contexts)))
    decode = msgpack_numpy_decoder(SchedulerToApiMessage)
    results: dict = {}
    while len(results) < len(contexts):
        assert client.poll(timeout_s * 1000), "no reply from the scheduler"
        message = decode(client.recv())
        assert isinstance(message, SchedulerEmbeddingsResults)
        results.update(message.results)
    return results


def test_the_scheduler_batches_inputs_onto_the_embedding_worker(
    scheduler_with_embedder, model_dir, generator
):
    _, client = scheduler_with_embedder
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    inputs = {f"e{i}": tokenizer.encode(text).ids for i, text in enumerate(texts(40))}
    contexts = [EmbeddingsContext(rid, ids) for rid, ids in inputs.items()]
    too_long = EmbeddingsContext("too-long", [101] + [1000] * 300 + [102])
    results = submit(client, [*contexts, too_long])
    expected = generator.encode(inputs)
    for request_id in inputs:
        result = results[request_id]
        assert result.status is SchedulerStatus.COMPLETE
        vector = result.result.embeddings
        assert vector.dtype == np.float32 and np.allclose(vector, expected[request_id], atol=1e-5)
    refusal = results["too-long"]
    assert (refusal.status, refusal.error_kind) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.INVALID_REQUEST,
    )
    assert refusal.error == "the input has 302 tokens; the embedding model takes 1 to 256"


def test_the_queue_batches_under_the_token_budget_and_forgets_aborted_inputs():
    embeddings = Embeddings(SchedulerConfig(max_num_batched_tokens=10))
    embeddings.add_group("g")
    inputs = [EmbeddingsContext(f"e{i}", [1] * n) for i, n in enumerate((4, 5, 20, 3))]
    assert embeddings.submit(b"api", inputs) == {}
    ((_, step),) = embeddings.schedule(["g"])
    assert [c.request_id for c in step.contexts] == ["e0", "e1"]  # 4 + 5 fit in 10
    assert embeddings.schedule(["g"]) == []  # one step in flight per group
    embeddings.abort(b"api", ["e1"])
    vectors = {c.request_id: np.ones(2, dtype=np.float32) for c in step.contexts}
    results = embeddings.on_output("g", WorkerEmbeddingsOutput(step.step_id, vectors))
    assert list(results[b"api"]) == ["e0"]  # e1 was aborted while it ran
    ((_, step),) = embeddings.schedule(["g"])
    assert [c.request_id for c in step.contexts] == ["e2"]  # alone over budget: still runs
    failed = embeddings.remove_group("g", "the worker serving this request died")
    assert {rid: r.error_kind for rid, r in failed[b"api"].items()} == {
        "e2": ErrorKind.UNAVAILABLE,
        "e3": ErrorKind.UNAVAILABLE,  # queued, and no embedding group is left
    }
    assert embeddings.num_waiting == 0
    refused = embeddings.submit(b"api", [EmbeddingsContext("late", [1])])
    assert refused[b"api"]["late"].error == "no embedding model is being served"


def test_a_dead_groups_inputs_run_again_on_another_group_once():
    embeddings = Embeddings(SchedulerConfig(max_num_batched_tokens=2))
    for name in ("a", "b", "c"):
        embeddings.add_group(name)
    inputs = [EmbeddingsContext(f"e{i}", [1]) for i in range(5)]
    assert embeddings.submit(b"api", inputs) == {}
    ((_, step_a),) = embeddings.schedule(["a"])
    assert [c.request_id for c in step_a.contexts] == ["e0", "e1"]
    embeddings.abort(b"api", ["e1"])  # aborted while running: not run again
    assert embeddings.remove_group("a", "group a died") == {}
    assert [item.context.request_id for item in embeddings.queue] == ["e0", "e2", "e3", "e4"]
    ((_, step_b),) = embeddings.schedule(["b"])
    assert [c.request_id for c in step_b.contexts] == ["e0", "e2"]
    ((_, step_c),) = embeddings.schedule(["c"])
    assert [c.request_id for c in step_c.contexts] == ["e3", "e4"]
    failed = embeddings.remove_group("b", "group b died")  # e0 ran on two dead groups
    assert {rid: r.error for rid, r in failed[b"api"].items()} == {"e0": "group b died"}
    assert [item.context.request_id for item in embeddings.queue] == ["e2"]
    vectors = {c.request_id: np.ones(2, dtype=np.float32) for c in step_c.contexts}
    done = embeddings.on_output("c", WorkerEmbeddingsOutput(step_c.step_id, vectors))
    assert sorted(done[b"api"]) == ["e3", "e4"]
    ((_, step),) = embeddings.schedule(["c"])
    assert [c.request_id for c in step.contexts] == ["e2"]


def test_an_id_aborted_while_running_and_submitted_again_runs_once():
    embeddings = Embeddings(SchedulerConfig())
    embeddings.add_group("a")
    embeddings.add_group("b")
    assert embeddings.submit(b"api", [EmbeddingsContext("e", [1])]) == {}
    embeddings.schedule(["a"])
    embeddings.abort(b"api", ["e"])
    assert embeddings.submit(b"api", [EmbeddingsContext("e", [2, 3])]) == {}  # the id again
    assert embeddings.remove_group("a", "group a died") == {}  # the aborted one is not retried
    assert [item.context.token_ids for item in embeddings.queue] == [[2, 3]]
    failed = embeddings.remove_group("b", "group b died")  # the last group: the queue fails
    assert list(failed[b"api"]) == ["e"] and embeddings.num_waiting == 0


def test_more_inputs_than_the_queue_ever_holds_are_a_client_error():
    embeddings = Embeddings(SchedulerConfig(max_queued_requests=4))
    embeddings.add_group("g")
    refused = embeddings.submit(b"api", [EmbeddingsContext(f"e{i}", [1]) for i in range(5)])
    result = refused[b"api"]["e0"]
    assert result.error_kind is ErrorKind.INVALID_REQUEST
    assert result.error == "5 inputs at once; at most 4 may wait to be embedded"


# -- end to end: switchyard serve --embedding-model default ---------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    serve = ServeProcess(
        "--model", str(tiny_llama_dir), "--kv-cache-memory", "64MiB",
        "--embedding-model", "default",
    )  # fmt: skip
    yield serve
    serve.kill()


def embed(serve: ServeProcess, **body) -> httpx.Response:
    return httpx.post(f"{serve.base_url}/v1/embeddings", json=body, timeout=120)


def test_v1_embeddings_matches_sentence_transformers_for_100_inputs(served, model_dir):
    from sentence_transformers import SentenceTransformer

    inputs = texts(100)
    reply = embed(served, model="all-MiniLM-L6-v2", input=inputs)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [item["index"] for item in body["data"]] == list(range(100))
    got = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(inputs)
    cosine = (got * reference).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    num_tokens = sum(len(tokenizer.encode(text).ids) for text in inputs)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}

    models = httpx.get(f"{served.base_url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models][1] == ("all-MiniLM-L6-v2", 256)

    as_base64 = embed(served, model="all-MiniLM-L6-v2", input=inputs[0], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(as_base64.json()["data"][0]["embedding"]), "<f4")
    assert vector.shape == (384,) and np.allclose(vector, got[0], atol=1e-6)  # batched apart
    ids = tokenizer.encode(inputs[1]).ids
    by_ids = embed(served, model="all-MiniLM-L6-v2", input=[ids])
    assert np.allclose(by_ids.json()["data"][0]["embedding"], got[1], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "word " * 300}, 400, "input 0 has 302 tokens; this model takes at most 256"),
        (
            {"input": ["fine", "é" * 40000]},
            400,
            "input 1 takes 80000 bytes of text; this model takes at most 256 tokens, so at most "
            "65536 bytes",
        ),
        ({"input": []}, 400, "input must not be empty"),
        ({"input": ["fine", ""]}, 400, "input 1 is empty"),
        ({"input": [[1, 99999999]]}, 400, "input 0 has token ids outside [0, 30522)"),
        ({"input": "x", "dimensions": 8}, 400, "384 dimensions; it cannot shorten them"),
        ({"input": "x", "model": "tiny-llama0"}, 404, "The model `tiny-llama0` does not exist."),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": [[True, 5]]}, 400, "input"),
    ],
)
def test_v1_embeddings_refuses_bad_input_with_openai_errors(served, body, status, message):
    reply = embed(served, **{"model": "all-MiniLM-L6-v2", **body})
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]


# -- the embedding model alone: switchyard serve --model none --------------------------------------


def test_serve_model_none_serves_the_embedding_model_alone(served):
    inputs = texts(8)
    alone = ServeProcess(
        "--model", "none", "--embedding-model", "default", "--embedding-model-name", "minilm"
    )
    try:
        workers = [args for _, args in alone.children() if args.startswith("switchyard-worker")]
        assert len(workers) == 1  # the embedding worker; no text generation worker
        assert httpx.get(f"{alone.base_url}/ready", timeout=10).status_code == 200
        models = httpx.get(f"{alone.base_url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("minilm", 256)]

        reply = embed(alone, model="minilm", input=inputs)
        assert reply.status_code == 200, reply.text
        beside = embed(served, model="all-MiniLM-L6-v2", input=inputs).json()["data"]
        for got, expected in zip(reply.json()["data"], beside, strict=True):
            assert np.allclose(got["embedding"], expected["embedding"], atol=1e-6)

        refusals = {
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"model": "minilm", "prompt": "hi"},
            "/tokenize": {"prompt": "hi"},
        }
        for route, body in refusals.items():
            refused = httpx.post(f"{alone.base_url}{route}", json=body, timeout=10)
            assert refused.status_code == 404, (route, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "model_not_found"
            assert "This server serves only embeddings" in error["message"]
            named = "`minilm` is an embedding model: only POST /v1/embeddings serves it."
            assert (named in error["message"]) == ("model" in body)
        other = {"model": "gpt-4o", "prompt": "hi"}
        refused = httpx.post(f"{alone.base_url}/v1/completions", json=other, timeout=10)
        assert "The model `gpt-4o` does not exist." in refused.json()["error"]["message"]
        metrics = httpx.get(f"{alone.base_url}/metrics", timeout=10).text
        assert 'switchyard:num_requests_running{model_name="minilm"} 0.0' in metrics
    finally:
        alone.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "--model none serves nothing without --embedding-model"),
        (
            ["--embedding-model", "default", "--tensor-parallel-size", "2"],
            "--tensor-parallel-size configure the text generation model; --model none serves none",
        ),
        (
            ["--embedding-model", "default", "--kv-cache-memory", "1GiB", "--dtype", "float16"],
            "--kv-cache-memory, --dtype configure the text generation model",
        ),
        (["--embedding-model", "default", "--served-model-name", "x"], "describe --model"),
        (["--embedding-model-name", "x"], "--embedding-model-name names --embedding-model"),
    ],
)
def test_serve_model_none_refuses_flags_that_need_a_model(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "switchyard", "serve", "--model", "none", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
