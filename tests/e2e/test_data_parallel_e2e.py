"""``switchyard serve --data-parallel-size 2``: two hybrid worker groups behind one scheduler
serve concurrent requests with the same greedy tokens; when one group's worker is killed the
other serves on while the launcher starts the dead one again under its name. Every wait is
bounded."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from switchyard.launcher import serving_groups
from tests.support.clients import wait_until
from tests.support.metrics import parse_samples
from tests.support.serve_process import ServeProcess

GROUPS = ("hybrid-0", "hybrid-1")
MAX_TOKENS = 6
PROMPTS = [f"Request {index} asks for a few words about trains." for index in range(6)]
SERVING = re.compile(r"serving group '(hybrid-\d)' \(hybrid\): tiny on 1 rank\(s\)")
RESTART_TIMEOUT_S = 120
QUERIES = "switchyard:prefix_cache_queries_by_group_total"


def completions(base_url: str) -> list[str]:
    """Every prompt of ``PROMPTS`` at once, greedy: the text of each, in order."""

    def complete(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS}
        body |= {"temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def health(base_url: str) -> dict:
    response = httpx.get(f"{base_url}/health", timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def by_group(base_url: str, series: str) -> dict[str, float]:
    """A per-group series of /metrics, by group."""
    samples = parse_samples(httpx.get(f"{base_url}/metrics", timeout=5).text)
    return {
        dict(labels)["group"]: value for (name, labels), value in samples.items() if name == series
    }


def worker_pid(serve: ServeProcess, group: str) -> int:
    (pid,) = serve.pids_of(f"switchyard-worker tp0 {group}")
    return pid


def test_two_groups_serve_and_one_killed_leaves_the_other_serving(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    serve = ServeProcess(
        *("--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--device", "cpu"),
        *("--data-parallel-size", "2", "--kv-cache-memory", "32MiB"),
        log_path=log_path,
    )
    try:
        # serve is ready once both groups serve, not at the first
        assert serving_groups(serve.base_url) == set(GROUPS)
        assert sorted(SERVING.findall(log_path.read_text())) == list(GROUPS)
        both = completions(serve.base_url)
        assert health(serve.base_url) == {"status": "ok"}
        assert set(by_group(serve.base_url, QUERIES)) == set(GROUPS)
        pids = {group: worker_pid(serve, group) for group in GROUPS}

        os.kill(pids["hybrid-0"], signal.SIGKILL)
        assert wait_until(lambda: "groups_away" in health(serve.base_url), 10, interval_s=0.1)
        (away,) = health(serve.base_url)["groups_away"]
        assert (away["group"], away["reason"]) == ("hybrid-0", "worker_died")
        queries_before = by_group(serve.base_url, QUERIES)["hybrid-1"]
        assert completions(serve.base_url) == both  # the same greedy tokens
        assert by_group(serve.base_url, QUERIES)["hybrid-1"] > queries_before  # it served on

        assert wait_until(lambda: health(serve.base_url) == {"status": "ok"}, RESTART_TIMEOUT_S)
        assert SERVING.findall(log_path.read_text()).count("hybrid-0") == 2
        assert worker_pid(serve, "hybrid-0") != pids["hybrid-0"]
        assert worker_pid(serve, "hybrid-1") == pids["hybrid-1"]
        assert (
            "hybrid-0 exited with code -9; starting worker group 'hybrid-0' again (1 of 5 "
            "restarts a minute)" in log_path.read_text()
        )
        assert completions(serve.base_url) == both
        assert serve.terminate() == 0
    finally:
        serve.kill()
