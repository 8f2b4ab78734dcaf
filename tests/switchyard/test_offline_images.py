"""Images in the offline pipeline, as lmdeploy's VLM pipeline takes them: ``(text, image)``
tuples over the tiny random LLaVA, through the same shared memory as the server's images."""

from __future__ import annotations

import base64
import io
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from interfaces import envs
from interfaces.shared_memory import segment_paths
from switchyard import EngineConfig, GenerationConfig, pipeline

GREEDY = GenerationConfig(max_new_tokens=8, ignore_eos=True)
NAMESPACE = secrets.token_hex(4)
"""The shared-memory namespace of this module's pipeline: its segments, and no one else's."""


def random_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envs.SHM_NAMESPACE_VARIABLE, NAMESPACE)  # the pipeline's and its engine's
        engine = EngineConfig(cache_max_entry_count="64MiB")
        with pipeline(str(tiny_llava_dir), backend_config=engine) as started:
            yield started


def transformers_greedy(model_dir, image: Image.Image, text: str, num_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``image`` then ``text`` as one user turn."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    content = [{"type": "image"}, {"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=num_tokens)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def shown(path: Path) -> str:
    """``path`` as an error names it: whole up to 80 characters, else its first 77 and "..."
    (tmp_path's length varies with the user, the run's number and pytest-xdist's worker)."""
    text = str(path)
    return text if len(text) <= 80 else text[:77] + "..."


def test_images_as_pil_images_and_paths_beside_bad_ones(llava, tiny_llava_dir, tmp_path):
    image = random_image(0)
    image.save(tmp_path / "picture.png")
    png = io.BytesIO()
    image.save(png, format="PNG")
    (tmp_path / "notes.png").write_text("not an image")
    text = "What is in this picture?"
    prompts = [
        (text, image),
        ([str(tmp_path / "picture.png")], text),  # lmdeploy's other order
        (text, "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()),
        (text, str(tmp_path / "missing.png")),
        (text, tmp_path / "notes.png"),
        (text, [image] * 9),
        (text, Image.new("RGB", (0, 0))),
        (text, str(tmp_path / ("long-" * 20 + ".png"))),  # named by its first 77 characters
    ]
    responses = llava.infer(prompts, GREEDY)
    expected = transformers_greedy(tiny_llava_dir, image, text, 8)
    assert responses[0].token_ids == expected
    for response in responses[1:3]:  # the same image from a path and a data URL
        assert (response.text, response.token_ids) == (responses[0].text, expected)
    failed = [(r.finish_reason, r.generate_token_len, r.index) for r in responses[3:]]
    assert failed == [("error", 0, index) for index in range(3, 8)]
    assert (
        responses[3].text == f"image 0 ({shown(tmp_path / 'missing.png')}): the file does not exist"
    )
    assert responses[4].text.startswith(
        f"image 0 ({shown(tmp_path / 'notes.png')}): the image cannot"
    )
    assert responses[5].text == "9 images in one prompt; at most 8 are taken"
    assert responses[6].text == "image 0 (a 0 x 0 PIL image): the image has no pixels"
    long_path = str(tmp_path / ("long-" * 20 + ".png"))
    assert responses[7].text == f"image 0 ({long_path[:77]}...): the file does not exist"
    pieces = list(llava.stream_infer([(text, image)], GREEDY))
    assert [token for piece in pieces for token in piece.token_ids] == expected
    # do_preprocess=False sends the text as it is: its image placeholders are the caller's.
    tokenizer = llava.tokenizer
    # Text without a placeholder for its image fails alone, beside one that has it.
    raw, unplaced = llava([("<image>" + text, image), (text, image)], GREEDY, do_preprocess=False)
    assert raw.input_token_len == len(tokenizer.encode_now("<image>" + text)) + 15
    assert raw.generate_token_len == 8
    assert unplaced.finish_reason == "error"
    assert "0 image placeholder token" in unplaced.text
    # The scheduler unlinks each image's segment once its request has left (just after its
    # last result).
    deadline = time.monotonic() + 10
    while remaining := segment_paths(NAMESPACE):
        assert time.monotonic() < deadline, f"{len(remaining)} segments remain"
        time.sleep(0.05)
