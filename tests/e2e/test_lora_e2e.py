"""LoRA adapters end to end: ``switchyard serve --lora-modules`` with the tiny Llama, adapters
loaded and unloaded at run time while requests for the base model and two adapters run at once,
every answer's greedy text that of PEFT's greedy tokens for its adapter; bad adapters refused
by name."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.engine import greedy_tokens
from tests.support.serve_process import ServeProcess

PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: any will do for a random model
NUM_TOKENS = 6
LONG_TOKENS = 400
RUNNING_ADAPTERS = re.compile(r'running_lora_adapters="([^"]*)"')
"""Long enough to be running still when its adapter is unloaded."""


def peft_greedy(model_dir: Path, adapter_dir: Path | None, num_tokens: int) -> list[int]:
    """PEFT's greedy continuation of ``PROMPT`` (EOS ignored, as the requests ask)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_tokens(model, PROMPT, num_tokens)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_lora_adapters) -> dict[tuple[str | None, int], str]:
    """PEFT's greedy text by (adapter name (None: the base model), number of tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    expected = {}
    for name in (None, *tiny_lora_adapters):
        adapter = None if name is None else tiny_lora_adapters[name]
        tokens = peft_greedy(tiny_llama_dir, adapter, LONG_TOKENS)
        for num_tokens in (NUM_TOKENS, LONG_TOKENS):
            expected[name, num_tokens] = tokenizer.decode(tokens[:num_tokens])
    assert len({expected[name, NUM_TOKENS] for name in (None, *tiny_lora_adapters)}) == 3
    return expected


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_lora_adapters, tmp_path_factory):
    serve = ServeProcess(
        *("--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--device", "cpu"),
        *("--kv-cache-memory", "32MiB", "--max-loras", "2", "--max-lora-rank", "8"),
        *("--lora-modules", f"alpha={tiny_lora_adapters['alpha']}"),
        "--allow-runtime-lora-updating",
        log_path=tmp_path_factory.mktemp("lora-serve") / "serve.log",
    )
    yield serve
    serve.kill()


def generate(base_url: str, model: str, num_tokens: int = NUM_TOKENS) -> str:
    """The greedy text of ``model`` (the base model's name or an adapter's)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": num_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "skip_special_tokens": False}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == num_tokens
    return response.json()["choices"][0]["text"]


def test_mixed_batches_load_unload_and_reload_under_traffic(server, expected, tiny_lora_adapters):
    url = server.base_url
    models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert models == ["tiny", "alpha"]  # --lora-modules loaded before serve reported ready
    beta = {"lora_name": "beta", "lora_path": str(tiny_lora_adapters["beta"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=beta).status_code == 200

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        # Base, alpha and beta in the same steps, twice over; a long alpha stream runs on
        # while alpha is unloaded, and finishes with alpha's tokens.
        long_alpha = pool.submit(generate, url, "alpha", LONG_TOKENS)
        mixed = {
            (model, i): pool.submit(generate, url, model)
            for model in ("tiny", "alpha", "beta")
            for i in range(2)
        }
        for (model, _), future in mixed.items():
            name = None if model == "tiny" else model
            assert future.result() == expected[name, NUM_TOKENS], model
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert unloaded.status_code == 200
        running = RUNNING_ADAPTERS.search(httpx.get(f"{url}/metrics").text)
        if not long_alpha.done():  # running when the metrics were read: its adapter is held
            # for it, and reported as running (beta too, for as long as the scheduler's stats
            # lag its last requests). Read before asking, not after: on a loaded machine the
            # stream could end in between.
            assert "alpha" in running.group(1).split(",")
        assert long_alpha.result() == expected["alpha", LONG_TOKENS]

    gone = httpx.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "x"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    again = {"lora_name": "alpha", "lora_path": str(tiny_lora_adapters["alpha"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=again).status_code == 200
    assert generate(url, "alpha") == expected["alpha", NUM_TOKENS]
    assert generate(url, "beta") == expected["beta", NUM_TOKENS]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'switchyard:lora_requests_info{max_lora="2"' in metrics


def test_bad_adapters_are_refused_by_name_while_others_serve(
    server, expected, tiny_lora_adapters, tmp_path
):
    url = server.base_url
    load = f"{url}/v1/load_lora_adapter"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}).is_success
    missing = httpx.post(load, json={"lora_name": "m", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "load_invalid_path"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q"]}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    refused = httpx.post(load, json={"lora_name": "b", "lora_path": str(broken)})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "load_invalid_adapter" and "--max-lora-rank" in error["message"]
    beta = {"lora_name": "beta", "lora_path": str(tiny_lora_adapters["beta"])}
    assert httpx.post(load, json=beta).is_success  # the refused loads left no slot taken
    full = httpx.post(load, json={"lora_name": "c", "lora_path": str(broken)})
    assert full.status_code == 400 and "--max-loras (2)" in full.json()["error"]["message"]
    exists = httpx.post(load, json={"lora_name": "beta", "lora_path": str(broken)})
    assert exists.json()["error"]["code"] == "load_name_exists"
    assert generate(url, "tiny") == expected[None, NUM_TOKENS]
    assert generate(url, "beta") == expected["beta", NUM_TOKENS]


def test_serve_stops_at_a_lora_module_the_model_cannot_serve(tiny_llama_dir, tmp_path):
    rank_too_high = tmp_path / "big"
    rank_too_high.mkdir()
    (rank_too_high / "adapter_config.json").write_text(json.dumps({"r": 64}))
    (rank_too_high / "adapter_model.safetensors").write_bytes(b"")
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "switchyard", "serve", "--model", str(tiny_llama_dir)),
            *("--port", "0", "--lora-modules", f"big={rank_too_high}"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed.stderr
    error = completed.stderr.strip().splitlines()[-1]
    assert error.startswith("switchyard: error: LoRA adapter 'big': ")
    assert "--max-lora-rank (16)" in error and "Traceback" not in completed.stderr
