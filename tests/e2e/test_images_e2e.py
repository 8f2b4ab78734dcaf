"""End to end: `switchyard serve` with a tiny random LLaVA; images travel as shared memory.

The API server decodes and preprocesses each image and puts its pixels in a shared-memory
segment; the worker maps it; the scheduler unlinks it when the request leaves. These tests hold
the whole chain to transformers' greedy tokens and count the segments left behind.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import secrets
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from interfaces import envs
from interfaces.shared_memory import SharedMemoryArray, segment_paths
from tests.support.serve_process import ServeProcess

pytestmark = pytest.mark.slow


def png(seed: int, size: tuple[int, int] = (40, 52)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_part(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


NAMESPACE = secrets.token_hex(4)
"""The shared-memory namespace of the server under test: its segments, and no one else's."""


def segments() -> set[str]:
    return {path.name for path in segment_paths(NAMESPACE)}


@pytest.fixture(scope="module")
def served(tiny_llava_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envs.SHM_NAMESPACE_VARIABLE, NAMESPACE)  # serve keeps a namespace it is given
        serve = ServeProcess("--model", str(tiny_llava_dir), "--kv-cache-memory", "64MiB")
    yield serve
    serve.kill()


@pytest.fixture(scope="module")
def reference(tiny_llava_dir):
    """transformers' greedy tokens for (image PNGs, text) as one user turn."""
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32)
    model.eval()

    def generate(images: list[bytes], text: str, max_new_tokens: int) -> list[int]:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        pil_images = [Image.open(io.BytesIO(data)) for data in images]
        inputs = processor(images=pil_images, text=prompt, return_tensors="pt")
        with torch.inference_mode():
            output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        return output[0, inputs["input_ids"].shape[1] :].tolist()

    return generate, processor.tokenizer


def chat(served, content: list[dict], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_tokens_equal_transformers_for_the_same_images(served, reference, num_images):
    generate, tokenizer = reference
    images = [png(seed) for seed in range(num_images)]
    text = "What is in this picture?"
    reply = chat(
        served, [*map(image_part, images), {"type": "text", "text": text}], ignore_eos=True
    )
    assert reply.status_code == 200, reply.text
    expected = generate(images, text, max_new_tokens=8)
    assert reply.json()["choices"][0]["message"]["content"] == tokenizer.decode(
        expected, skip_special_tokens=True
    )
    assert reply.json()["usage"]["completion_tokens"] == len(expected)


def test_the_same_image_again_reuses_its_cached_blocks(served):
    def hits() -> float:
        metrics = httpx.get(f"{served.base_url}/metrics", timeout=10).text
        line = next(
            ln for ln in metrics.splitlines() if ln.startswith("switchyard:prefix_cache_hits_total")
        )
        return float(line.rsplit(" ", 1)[1])

    content = [image_part(png(7)), {"type": "text", "text": "Describe it."}]
    first = chat(served, content)
    before = hits()
    again = chat(served, content)
    assert again.json()["choices"] == first.json()["choices"]
    assert hits() - before >= 16  # at least the image's 16 tokens came from the cache
    before = hits()
    other = chat(served, [image_part(png(8)), {"type": "text", "text": "Describe it."}])
    assert other.status_code == 200
    assert hits() - before < 16  # another image: its blocks are not the cached ones


def test_no_segment_remains_after_50_requests_with_random_aborts(served):
    before = segments()
    rng = random.Random(0)
    plans = [rng.choice(["finish", "drop-after-first-token", "drop-at-once"]) for _ in range(50)]

    async def one(client: httpx.AsyncClient, index: int, plan: str) -> str:
        body = {
            "messages": [
                {
                    "role": "user",
                    "content": [image_part(png(index)), {"type": "text", "text": "Hi"}],
                }
            ],
            "max_tokens": 24,
            "stream": True,
        }
        try:
            async with asyncio.timeout(0.05 if plan == "drop-at-once" else 120):
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and plan == "drop-after-first-token":
                            return "dropped"
            return "finished"
        except TimeoutError:
            return "dropped"

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(plans)))

    outcomes = asyncio.run(run_all())
    assert outcomes.count("dropped") >= 10 and outcomes.count("finished") >= 10
    deadline = time.monotonic() + 30
    while served.gauges()["num_requests_running"] or segments() - before:
        assert time.monotonic() < deadline, f"{len(segments() - before)} segments remain"
        time.sleep(0.1)
    assert segments() - before == set()
    assert served.gauges() == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAA"}},
            "the image cannot be decoded",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}},
            "'text/plain'",
        ),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "example.com"),
    ],
)
def test_bad_images_get_a_400_and_leave_no_segment(served, part, message):
    before = segments()
    reply = chat(served, [image_part(png(1)), part, {"type": "text", "text": "Hi"}])
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert segments() - before == set()


def test_serve_sweeps_the_segments_a_crashed_process_left_behind(tiny_llava_dir, monkeypatch):
    from switchyard.launcher import Launcher
    from switchyard.serve_config import ServeConfig

    monkeypatch.delenv(envs.SHM_NAMESPACE_VARIABLE, raising=False)
    launcher = Launcher(ServeConfig(tiny_llava_dir, "tiny-llava"))  # a namespace of its own
    namespace = launcher.shm_namespace
    monkeypatch.setenv(envs.SHM_NAMESPACE_VARIABLE, namespace)  # as its children have it
    left = SharedMemoryArray.create(np.ones((3, 32, 32), dtype=np.float32))  # its API server's
    given = Launcher(ServeConfig(tiny_llava_dir, "x"))  # given one: maybe shared, never swept
    monkeypatch.setenv(envs.SHM_NAMESPACE_VARIABLE, secrets.token_hex(4))
    other = SharedMemoryArray.create(np.ones(4, dtype=np.float32))  # another deployment's
    try:
        assert given.shm_namespace == namespace
        given.shutdown()
        assert [path.name for path in segment_paths(namespace)] == [left.name]
        launcher.shutdown()
        assert segment_paths(namespace) == []
        assert Path("/dev/shm", other.name).exists()
    finally:
        left.unlink()
        other.unlink()
