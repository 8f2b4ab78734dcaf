"""``python -m api_server`` as the launcher starts it: real processes on an inherited socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from api_server.__main__ import build_config, parse_args, serve
from tests.support.clients import wait_until
from tests.support.fake_scheduler import FakeScheduler
from tests.support.serve_process import wait_until_ready

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_api_server_does_not_import_torch() -> None:
    code = (
        "import sys, api_server.app, api_server.__main__\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_a_gguf_file_is_refused_with_a_hint(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    result = subprocess.run(
        [sys.executable, "-m", "api_server", "--model", str(gguf), "--scheduler-addr", "ipc://x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "is a GGUF file" in result.stderr
    assert "`switchyard serve` converts it" in result.stderr


def test_config_from_flags(default_model_dir: Path) -> None:
    args = parse_args(
        ["--model", str(default_model_dir), "--scheduler-addr", "ipc://s", "--max-model-len", "100"]
    )
    config = build_config(args)
    assert config.served_model_name == default_model_dir.resolve().name
    assert config.max_model_len == 100
    assert config.engine.scheduler_addr == "ipc://s"
    assert config.logits_processor_names == ()
    processors = ["--logits-processors", "pkg.bans:Ban", "--logits-processors", "pkg:Force"]
    args = parse_args([*args_for(default_model_dir), *processors])
    assert build_config(args).logits_processor_names == ("Ban", "Force")
    args = parse_args(["--model", str(default_model_dir), "--scheduler-addr", "ipc://s"])
    assert build_config(args).max_model_len == 8192  # config.json's max_position_embeddings
    too_long = ["--max-model-len", "9000", "--served-model-name", "x"]
    with pytest.raises(ValueError, match="exceeds the model's context length 8192"):
        build_config(parse_args([*args_for(default_model_dir), *too_long]))


def args_for(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--scheduler-addr", "ipc://s"]


def test_two_processes_serve_one_inherited_socket(default_model_dir: Path, tmp_path: Path) -> None:
    scheduler = FakeScheduler(f"ipc://{tmp_path}/scheduler.ipc").start()
    scheduler.reply = [19556, 905]  # "Hello world"
    scheduler.eos_token_id = 2
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    argv = [sys.executable, "-m", "api_server", "--model", str(default_model_dir)]
    argv += ["--scheduler-addr", scheduler.address, "--fd", str(listener.fileno())]
    processes = [subprocess.Popen(argv, cwd=ROOT, pass_fds=(listener.fileno(),)) for _ in range(2)]
    try:
        wait_until_ready(url, {f"api-server-{i}": p for i, p in enumerate(processes)}, 60)
        models = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert [model["id"] for model in models["data"]] == [default_model_dir.resolve().name]
        for _ in range(6):
            body = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10).json()
            assert body["choices"][0]["text"] == "Hello world"
        # The socket answers once either process serves; the other may still be starting (on
        # a busy machine, seconds later), and it sets its title as it starts.
        titled = lambda: all(  # noqa: E731
            Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"switchyard-api-server")
            for p in processes
        )
        assert wait_until(titled, 60)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=15)
        listener.close()
        scheduler.stop()
    # A graceful SIGTERM shutdown exits 0 (uvicorn's re-raised signal is neutralised).
    assert [process.returncode for process in processes] == [0, 0]


def test_an_api_server_serves_embeddings_alone_or_refuses_to_serve_nothing() -> None:
    from interfaces.embeddings import default_embedding_model_dir

    embedding_model = ["--embedding-model", str(default_embedding_model_dir())]
    config = build_config(parse_args(["--scheduler-addr", "ipc://s", *embedding_model]))
    assert (config.model_dir, config.served_model_name, config.max_model_len) == (None, None, None)
    with pytest.raises(ValueError, match="give --model, --embedding-model or both"):
        build_config(parse_args(["--scheduler-addr", "ipc://s"]))
    with pytest.raises(ValueError, match="--served-model-name and --max-model-len describe"):
        build_config(
            parse_args(["--scheduler-addr", "ipc://s", "--max-model-len", "9", *embedding_model])
        )


def test_a_sigterm_while_starting_exits_cleanly_before_serving(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A server told to stop before it serves (Kubernetes scaling down a pod that is still
    loading, or the launcher stopping a process its sibling already made ready) exits 0 instead
    of dying of the signal, and never starts to serve."""
    scheduler = FakeScheduler(f"ipc://{tmp_path}/scheduler.ipc").start()
    listener = socket.create_server(("127.0.0.1", 0))
    argv = [sys.executable, "-m", "api_server", "--model", str(default_model_dir)]
    argv += ["--scheduler-addr", scheduler.address, "--fd", str(listener.fileno())]
    process = subprocess.Popen(
        argv, cwd=ROOT, pass_fds=(listener.fileno(),), stderr=subprocess.PIPE, text=True
    )
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline")
        deadline = time.monotonic() + 60
        # setproctitle runs first in main(): from then on the process is starting up.
        while not cmdline.read_bytes().startswith(b"switchyard-api-server"):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        listener.close()
        scheduler.stop()
    assert process.returncode == 0, stderr
    assert "received SIGTERM while starting" in stderr
    assert "Uvicorn running" not in stderr and "Application startup complete" not in stderr


def test_connections_on_an_inherited_socket_send_without_delay() -> None:
    """A listener bound as the launcher binds it, served as ``python -m api_server --fd N``
    serves it: the connections it accepts have TCP_NODELAY, so no small write (a streamed
    token, a body after its headers) waits for the client's delayed acknowledgement."""

    async def ok(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    listener = socket.socket(socket.AF_INET)  # as the launcher's: the protocol left unnamed
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    inherited = os.dup(listener.fileno())  # the server's own descriptor, which it closes
    config = uvicorn.Config(ok, fd=inherited, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=serve, args=(server, inherited), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 10, interval_s=0.01)
        with httpx.Client(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}") as client:
            for _ in range(3):  # one kept-alive connection
                assert client.get("/").text == "ok"
            connections = list(server.server_state.connections)
            assert len(connections) == 1
            accepted = connections[0].transport.get_extra_info("socket")
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
    assert not thread.is_alive()
