"""Two hosts on one machine: network namespaces joined by a veth pair, and an HTTP client that
runs inside one of them.

``two_hosts()`` makes namespaces A and B (names unique to this process), each with its loopback
and one end of a veth pair (A at 10.231.0.1/24, B at 10.231.0.2/24), and removes them on the way
out, ending whatever still runs inside them first. The addresses exist only inside these
namespaces, so parallel runs may use the same ones; only the names must differ. Making them needs
root and iproute2's ``ip``: ``two_hosts`` skips the test, saying why, where they cannot be made.

The test process stays in the root namespace, which reaches neither host: ``Host.command``
prefixes an argv with ``ip netns exec``, and ``python -m tests.support.netns URL TIMEOUT`` (run
that way by ``post_from``) is a client inside a host that waits for the API server's /ready,
sends the JSON bodies it reads on stdin to /v1/completions at once, and prints the answers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBNET_PREFIX = "10.231.0"
IP_TIMEOUT_S = 10
TCP_ESTABLISHED = "01"
_names = itertools.count()


@dataclass(frozen=True)
class Host:
    """One network namespace: its name and its address on the veth pair."""

    name: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def can_connect(self, address: str, port: int) -> bool:
        """Whether a TCP connection from this namespace to address:port is accepted."""
        probe = f"exec 3<>/dev/tcp/{address}/{port}"
        completed = subprocess.run(
            self.command(["timeout", "5", "bash", "-c", probe]),
            capture_output=True,
            timeout=IP_TIMEOUT_S,
        )
        return completed.returncode == 0

    def established_connections(self) -> set[tuple[str, str]]:
        """(local address, remote address) of every established TCP connection in this
        namespace (an IPv4-mapped IPv6 address as its IPv4 one)."""
        pairs = set()
        for table in ("tcp", "tcp6"):
            completed = subprocess.run(
                self.command(["cat", f"/proc/net/{table}"]),
                capture_output=True,
                text=True,
                timeout=IP_TIMEOUT_S,
                check=True,
            )
            for line in completed.stdout.splitlines()[1:]:
                _, local, remote, state, *_ = line.split()
                if state == TCP_ESTABLISHED:
                    pairs.add((_address(local), _address(remote)))
        return pairs


def _address(entry: str) -> str:
    """The address of a /proc/net/tcp{,6} ``HEX_ADDRESS:HEX_PORT`` (in host byte order words)."""
    words = bytes.fromhex(entry.partition(":")[0])
    packed = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B joined by a veth pair (see the module docstring); skips the test where
    they cannot be made. Removed on the way out, with every process left inside them killed."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip`, which is not on PATH")
    stem = f"sy{os.getpid()}n{next(_names)}"
    hosts = (Host(f"{stem}a", f"{SUBNET_PREFIX}.1"), Host(f"{stem}b", f"{SUBNET_PREFIX}.2"))
    made: list[Host] = []
    try:
        for host in hosts:
            _ip_or_skip("netns", "add", host.name)
            made.append(host)
        _join(*hosts)
        yield hosts
    finally:
        for host in made:
            _kill_processes_in(host)
            subprocess.run(["ip", "netns", "del", host.name], timeout=IP_TIMEOUT_S, check=True)


def _join(a: Host, b: Host) -> None:
    """A veth pair between ``a`` and ``b`` (deleted with the namespaces), every link up."""
    _ip("link", "add", a.name, "type", "veth", "peer", "name", b.name)
    for host in (a, b):
        _ip("link", "set", host.name, "netns", host.name)
        _ip("-n", host.name, "address", "add", f"{host.address}/24", "dev", host.name)
        _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("-n", host.name, "link", "set", host.name, "up")


def _ip_or_skip(*argv: str) -> None:
    completed = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if completed.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {completed.stderr.strip()}")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], capture_output=True, timeout=IP_TIMEOUT_S, check=True)


def _kill_processes_in(host: Host) -> None:
    """SIGKILL what still runs in ``host`` (only this test's processes can be there)."""
    listed = subprocess.run(
        ["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


# -- processes inside a host -----------------------------------------------------------------


@contextlib.contextmanager
def processes_in(
    commands: Mapping[str, tuple[Host, list[str]]], log_dir: Path
) -> Iterator[tuple[dict[str, subprocess.Popen], dict[str, Path]]]:
    """Each ``python -m`` argv of ``commands`` started in order inside its host, its output in
    ``log_dir/NAME.log``; yields (processes, logs), and terminates them (kills after 30 s) on
    the way out."""
    logs = {name: log_dir / f"{name}.log" for name in commands}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, (host, argv) in commands.items():
            with logs[name].open("w") as log:
                argv = host.command([sys.executable, "-m", *argv])
                processes[name] = subprocess.Popen(argv, stdout=log, stderr=log)
        yield processes, logs
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def post_from(
    host: Host,
    url: str,
    bodies: list[dict],
    timeout_s: float,
    servers: Mapping[str, subprocess.Popen],
    logs: Mapping[str, Path],
) -> list[dict]:
    """Once ``url``/ready answers 200, ``bodies`` sent at once to ``url``/v1/completions from
    inside ``host``: {"status": code, "body": JSON} for each, in order (status None: no answer
    in time). Fails (with the end of its log) as soon as one of ``servers`` exits, and when
    the client takes over ``timeout_s`` (plus its start)."""
    argv = host.command([sys.executable, "-m", "tests.support.netns", url, str(timeout_s)])
    client = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    answers: list[str] = []
    reader = threading.Thread(target=lambda: answers.extend(client.communicate(json.dumps(bodies))))
    reader.start()
    deadline = time.monotonic() + timeout_s + 10
    try:
        while reader.is_alive() and time.monotonic() < deadline:
            for name, server in servers.items():
                if server.poll() is not None:
                    log = logs[name].read_text()[-3000:]
                    raise AssertionError(f"{name} exited with {server.returncode}\n{log}")
            reader.join(timeout=0.2)
        timed_out = reader.is_alive()
    finally:
        client.kill()
        reader.join(timeout=10)
    assert not timed_out, f"the client in {host.name} took over {timeout_s + 10:g} s"
    assert client.returncode == 0, answers[1]
    return json.loads(answers[0])


def _serve_client(url: str, timeout_s: float) -> list[dict]:
    """The client's side of ``post_from``: wait for /ready, then post every body at once."""
    bodies = json.load(sys.stdin)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        while not _is_ready(client):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} was not ready within {timeout_s:g} s")
            time.sleep(0.1)
        answers: list[dict] = [{"status": None} for _ in bodies]

        def post(index: int) -> None:
            response = client.post("/v1/completions", json=bodies[index])
            answers[index] = {"status": response.status_code, "body": response.json()}

        threads = [
            threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(bodies))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))
    return answers


def _is_ready(client: httpx.Client) -> bool:
    try:
        return client.get("/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    print(json.dumps(_serve_client(sys.argv[1], float(sys.argv[2]))))
