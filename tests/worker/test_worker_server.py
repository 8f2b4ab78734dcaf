"""The worker process end to end over ZeroMQ: ready, a step, a garbage frame, shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM

from interfaces import (
    TextContext,
    TextGenerationOutput,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_worker import (
    CachedRequestData,
    NewRequestData,
    ScheduledStep,
    Shutdown,
)
from interfaces.worker_to_scheduler import (
    CPU_STEP_TOKENS,
    KVLayout,
    WorkerFailure,
    WorkerOutput,
    WorkerReady,
    WorkerToSchedulerMessage,
)
from tests.support.clients import wait_until
from tests.support.hostile import hostile_frames

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 4093, 198, 57, 5248, 3946, 288]
STARTUP_TIMEOUT_MS = 60_000
STEP_TIMEOUT_MS = 20_000

encode = msgpack_numpy_encoder()
decode = msgpack_numpy_decoder(WorkerToSchedulerMessage)


@pytest.fixture
def router(tmp_path):
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/backend.ipc"
    socket.bind(address)
    yield socket, address
    socket.close(linger=0)
    context.term()


def start_worker(model_dir: Path, address: str, *flags: str, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "worker", "--model", str(model_dir), *flags]
    command += ["--scheduler-addr", address, "--kv-cache-memory", "1MiB", "--device", "cpu"]
    command += ["--served-model-name", "tiny"]
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, **popen
    )


def receive(socket: zmq.Socket, timeout_ms: int) -> tuple[bytes, WorkerToSchedulerMessage]:
    assert socket.poll(timeout_ms, zmq.POLLIN), "no message from the worker in time"
    identity, frame = socket.recv_multipart()
    return identity, decode(frame)


def expected_greedy_tokens(model_dir: Path, num_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    generated = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=num_tokens)
    return generated[0, len(PROMPT) :].tolist()


@pytest.fixture
def worker(tiny_llama_dir, router):
    _, address = router
    process = start_worker(tiny_llama_dir, address)
    yield process
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def test_worker_serves_steps_survives_hostile_frames_and_shuts_down(
    tiny_llama_dir, router, worker, tmp_path
):
    socket, _ = router
    identity, ready = receive(socket, STARTUP_TIMEOUT_MS)
    assert ready.group.startswith("hybrid@")  # the role, the host and the pid
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    assert ready == WorkerReady(
        PROTOCOL_VERSION,
        "tiny",
        128,
        16,
        512,
        group=ready.group,
        kv_layout=layout,
        vocab_size=49152,
        step_tokens=CPU_STEP_TOKENS,  # the step budget a CPU worker suggests
    )
    expected = expected_greedy_tokens(tiny_llama_dir, 2)

    context = TextContext("r1", PROMPT, 64, eos_token_ids=[2])
    step = ScheduledStep(0, [NewRequestData(context, [3], 0)], num_scheduled_tokens={"r1": 7})
    socket.send_multipart([identity, encode(step)])
    assert receive(socket, STEP_TIMEOUT_MS)[1] == WorkerOutput(
        0, {"r1": TextGenerationOutput("r1", [expected[0]])}
    )

    marker = tmp_path / "unpickled"
    for frame in hostile_frames(marker):
        socket.send_multipart([identity, frame])
    socket.send_multipart([identity, b"two", b"frames"])
    socket.send_multipart([identity, encode(ScheduledStep(1, num_scheduled_tokens={"zz": 1}))])
    failure = receive(socket, STEP_TIMEOUT_MS)[1]
    assert isinstance(failure, WorkerFailure) and failure.step_id == 1
    assert "'zz' is not known" in failure.error

    step = ScheduledStep(
        2, cached_requests=[CachedRequestData("r1", [], 7)], num_scheduled_tokens={"r1": 1}
    )
    socket.send_multipart([identity, encode(step)])
    assert receive(socket, STEP_TIMEOUT_MS)[1] == WorkerOutput(
        2, {"r1": TextGenerationOutput("r1", [expected[1]])}
    )

    socket.send_multipart([identity, encode(Shutdown())])
    assert worker.wait(timeout=20) == 0
    assert not marker.exists()


def test_a_worker_refused_for_its_protocol_version_logs_both_and_exits_1(tiny_llama_dir, router):
    socket, address = router
    process = start_worker(tiny_llama_dir, address, stderr=subprocess.PIPE, text=True)
    identity, ready = receive(socket, STARTUP_TIMEOUT_MS)
    assert ready.protocol_version == PROTOCOL_VERSION
    reason = (  # what a scheduler of the next version answers
        f"the worker speaks protocol version {PROTOCOL_VERSION}, and this scheduler speaks "
        f"protocol version {PROTOCOL_VERSION + 1}: run the same Switchyard version on every process"
    )
    socket.send_multipart([identity, encode(Shutdown(reason))])
    _, log = process.communicate(timeout=20)
    assert process.returncode == 1
    assert f"the scheduler refused this worker: {reason}" in log


def test_a_worker_registers_again_with_a_scheduler_back_at_its_address(
    tiny_llama_dir, router, worker
):
    """The scheduler goes away mid-request: the worker forgets its requests and registers on
    a new connection with the scheduler started again at the same address, which it serves
    without loading the model again."""
    socket, address = router
    identity, ready = receive(socket, STARTUP_TIMEOUT_MS)
    expected = expected_greedy_tokens(tiny_llama_dir, 1)
    context = TextContext("r1", PROMPT, 64)
    step = ScheduledStep(0, [NewRequestData(context, [3], 0)], num_scheduled_tokens={"r1": 7})
    socket.send_multipart([identity, encode(step)])
    receive(socket, STEP_TIMEOUT_MS)
    socket.close(linger=0)

    restarted = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        restarted.bind(address)
        new_identity, again = receive(restarted, STEP_TIMEOUT_MS)
        assert again == ready and new_identity != identity
        assert worker.poll() is None
        follow_up = ScheduledStep(
            0, cached_requests=[CachedRequestData("r1", [], 7)], num_scheduled_tokens={"r1": 1}
        )
        restarted.send_multipart([new_identity, encode(follow_up)])
        failure = receive(restarted, STEP_TIMEOUT_MS)[1]
        assert isinstance(failure, WorkerFailure) and "'r1' is not known" in failure.error
        restarted.send_multipart([new_identity, encode(step)])  # the same request, anew
        assert receive(restarted, STEP_TIMEOUT_MS)[1] == WorkerOutput(
            0, {"r1": TextGenerationOutput("r1", [expected[0]])}
        )
        restarted.send_multipart([new_identity, encode(Shutdown())])
        assert worker.wait(timeout=20) == 0
    finally:
        restarted.close(linger=0)


def test_a_stopped_worker_fails_its_liveness_probe_and_passes_it_again_when_continued(
    tiny_llama_dir, router, tmp_path
):
    socket, address = router
    alive = tmp_path / "alive"
    process = start_worker(tiny_llama_dir, address, "--liveness-file", str(alive))
    try:
        receive(socket, STARTUP_TIMEOUT_MS)
        probe = [sys.executable, "-m", "worker.liveness", str(alive), "--max-age", "2"]
        assert wait_until(lambda: subprocess.run(probe, timeout=60).returncode == 0, 10)
        process.send_signal(signal.SIGSTOP)
        time.sleep(3)
        stopped = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 1 and "the worker last beat" in stopped.stderr
        process.send_signal(signal.SIGCONT)
        assert wait_until(lambda: subprocess.run(probe, timeout=60).returncode == 0, 10)
    finally:
        process.kill()
        process.wait(timeout=10)


def test_worker_sets_its_title_and_exits_cleanly_on_sigterm(router, worker):
    socket, _ = router
    receive(socket, STARTUP_TIMEOUT_MS)
    assert Path(f"/proc/{worker.pid}/cmdline").read_bytes().startswith(b"switchyard-worker tp0")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0


def test_worker_exits_1_for_a_missing_model(tmp_path, router):
    _, address = router
    process = start_worker(tmp_path / "no-such-model", address)
    assert process.wait(timeout=60) == 1
