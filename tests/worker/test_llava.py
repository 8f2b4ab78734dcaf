"""A LLaVA-style vision-language model on the worker: greedy parity with transformers'
LlavaForConditionalGeneration for the same pixels and prompt ids, under chunked prefill (chunk
boundaries inside an image), prefix-cache hits, preemption and tensor parallelism; a request
whose pixels are gone fails alone; checkpoint layouts and the image token count.

Pixels come from transformers' own processor for the tiny model and reach the worker in shared
memory, as from the API server; each test unlinks its segments (the scheduler's job).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from interfaces import ImageMetadata, SamplingParams, SharedMemoryArray, TextContext
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import WorkerOutput
from tests.conftest import LLAVA_IMAGE_TOKEN_ID
from tests.support.engine import Engine
from tests.support.tensor_parallel_ranks import ScriptedRequest, run_group, scripted_steps
from worker import images as worker_images
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.models.config import ModelConfig
from worker.models.llava import checkpoint_name

NUM_NEW_TOKENS = 16
NUM_IMAGE_TOKENS = 16
SHORT = "<|im_start|>user\n<image>Hi<|im_end|>\n<|im_start|>assistant\n"
LONG = (
    "<|im_start|>user\n<image>What is in this picture? Describe it in a few words, "
    "please.<|im_end|>\n<|im_start|>assistant\n"
)
TWO_IMAGES = (
    "<|im_start|>user\nFirst <image> and then <image>: which is brighter?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    pixels: np.ndarray  # (num_images, channels, height, width), float32


@pytest.fixture(scope="module")
def encode(tiny_llava_dir: Path):
    """``encode(text, seeds)``: the processor's prompt ids and pixels for random images."""
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)

    def encode(text: str, seeds: tuple[int, ...]) -> Prompt:
        pictures = [random_image(seed) for seed in seeds] or None
        out = processor(text=text, images=pictures, return_tensors="np")
        pixels = out.get("pixel_values", np.zeros((0, 3, 32, 32)))
        return Prompt(out["input_ids"][0].tolist(), pixels.astype(np.float32))

    return encode


def random_image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def reference(tiny_llava_dir: Path):
    """transformers' greedy tokens for a prompt's ids and pixels, end-of-sequence off."""
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None

    @cache
    def generate(ids: tuple[int, ...], pixels: bytes) -> list[int]:
        input_ids = torch.tensor([ids])
        pixel_values = torch.tensor(np.frombuffer(pixels, np.float32)).reshape(-1, 3, 32, 32)
        images = {"pixel_values": pixel_values} if len(pixel_values) else {}
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                **images,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
            )
        return output[0, len(ids) :].tolist()

    return lambda prompt: generate(tuple(prompt.ids), prompt.pixels.tobytes())


@pytest.fixture
def share():
    """``share(prompt)``: its images in new shared-memory segments, unlinked after the test."""
    segments: list[SharedMemoryArray] = []

    def share(prompt: Prompt, image_token_id: int = LLAVA_IMAGE_TOKEN_ID) -> list[ImageMetadata]:
        positions = [i for i, token in enumerate(prompt.ids) if token == image_token_id]
        images = []
        for index, pixels in enumerate(prompt.pixels):
            start = positions[index * NUM_IMAGE_TOKENS]
            assert positions[(index + 1) * NUM_IMAGE_TOKENS - 1] == start + NUM_IMAGE_TOKENS - 1
            segments.append(SharedMemoryArray.create(pixels))
            digest = hashlib.sha256(pixels.tobytes()).hexdigest()
            images.append(ImageMetadata(start, start + NUM_IMAGE_TOKENS, segments[-1], digest))
        return images

    yield share
    for segment in segments:
        segment.unlink()


@pytest.fixture(scope="module")
def runner(tiny_llava_dir: Path) -> ModelRunner:
    config = WorkerConfig(tiny_llava_dir, device="cpu", kv_cache_memory=16 << 20, max_model_len=512)
    return ModelRunner(config)


@pytest.fixture
def encoded_images(monkeypatch, runner) -> list[int]:
    """How many images each pass through the vision tower encoded, in order."""
    passes: list[int] = []
    image_features = runner.model.image_features

    def counted(pixel_values: torch.Tensor) -> torch.Tensor:
        passes.append(len(pixel_values))
        return image_features(pixel_values)

    monkeypatch.setattr(runner.model, "image_features", counted)
    return passes


def context(request_id: str, prompt: Prompt, images: list[ImageMetadata]) -> TextContext:
    params = SamplingParams(top_k=1, ignore_eos=True)
    max_length = len(prompt.ids) + NUM_NEW_TOKENS
    return TextContext(request_id, prompt.ids, max_length, [2], params, images=images)


@dataclass
class Driven:
    context: TextContext
    chunks: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    sent: bool = False

    @property
    def request_id(self) -> str:
        return self.context.request_id


class Driver:
    """Plays the scheduler: every request in every step, prompts prefilled in the given chunks,
    then decoded to NUM_NEW_TOKENS; blocks from a pool never reused, so a later request may
    start past a prefix whose blocks it names (a prefix-cache hit). Refused requests drop out."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))[::-1]
        self.refusals: dict[str, str] = {}

    def run(self, requests: list[Driven]) -> dict[str, list[int]]:
        running, finished = list(requests), []
        while running:
            outputs = self.runner.next_token(self._step(running, finished))
            self.refusals.update(self.runner.take_refusals())
            for request in running:
                if request.request_id in outputs:
                    request.outputs += outputs[request.request_id].tokens
            finished = [r.request_id for r in running if len(r.outputs) == NUM_NEW_TOKENS]
            done = {*finished, *self.refusals}
            running = [r for r in running if r.request_id not in done]
        self.runner.next_token(ScheduledStep(0, finished_request_ids=finished))
        assert self.runner.requests == {}
        return {r.request_id: r.outputs for r in requests}

    def _step(self, running: list[Driven], finished: list[str]) -> ScheduledStep:
        new, cached, scheduled = [], [], {}
        for request in running:
            count = request.chunks.pop(0) if request.chunks else 1
            start, end = request.num_computed_tokens, request.num_computed_tokens + count
            num_needed = -(-end // self.runner.block_size) - len(request.block_ids)
            blocks = [self.free_blocks.pop() for _ in range(max(num_needed, 0))]
            request.block_ids = [*request.block_ids, *blocks]
            if request.sent:
                cached.append(CachedRequestData(request.request_id, blocks, start))
            else:
                new.append(NewRequestData(request.context, request.block_ids, start))
                request.sent = True
            scheduled[request.request_id] = count
            request.num_computed_tokens = end
        return ScheduledStep(0, new, cached, scheduled, finished)


# -- greedy parity -------------------------------------------------------------------------------


def test_one_image_matches_transformers(runner, encode, reference, share, encoded_images):
    prompt = encode(LONG, (0,))
    request = Driven(context("one", prompt, share(prompt)), [len(prompt.ids)])
    assert Driver(runner).run([request]) == {"one": reference(prompt)}
    assert encoded_images == [1]


def test_two_images_in_one_prompt_beside_a_text_only_request(
    runner, encode, reference, share, encoded_images
):
    two = encode(TWO_IMAGES, (1, 2))
    assert len(two.pixels) == 2
    text = encode("<|im_start|>user\nName two planets.<|im_end|>\n<|im_start|>assistant\n", ())
    requests = [
        Driven(context("two", two, share(two)), [len(two.ids)]),
        Driven(context("text", text, []), [len(text.ids)]),
    ]
    assert Driver(runner).run(requests) == {"two": reference(two), "text": reference(text)}
    assert encoded_images == [2]  # both images in one pass


def test_chunk_boundaries_inside_images_encode_each_image_once(
    runner, encode, reference, share, encoded_images
):
    """ "one" is split at 5, 12 and 21 (its image spans positions 3 to 19); "two"'s chunks end
    inside its first image and inside its second, while "one" is decoding."""
    one, two = encode(LONG, (3,)), encode(TWO_IMAGES, (4, 5))
    one_images, two_images = share(one), share(two)
    assert (one_images[0].start_idx, one_images[0].end_idx) == (3, 19)
    first, second = two_images
    ends = [3, first.start_idx + 6, second.start_idx + 2, len(two.ids)]  # after three 1s
    two_chunks = [1, 1, 1] + [end - start for start, end in itertools.pairwise(ends)]
    requests = [
        Driven(context("one", one, one_images), [5, 7, 9, len(one.ids) - 21]),
        Driven(context("two", two, two_images), two_chunks),
    ]
    assert Driver(runner).run(requests) == {"one": reference(one), "two": reference(two)}
    assert encoded_images == [1, 1, 1]  # "one" at its first chunk, then "two"'s images in turn


def test_a_prefix_hit_that_ends_inside_the_image_splices_only_the_rest(
    runner, encode, reference, share, encoded_images
):
    prompt = encode(SHORT, (6,))
    first = Driven(context("first", prompt, share(prompt)), [len(prompt.ids)])
    driver = Driver(runner)
    driver.run([first])
    hit = Driven(context("hit", prompt, share(prompt)), [len(prompt.ids) - 16], 16)
    hit.block_ids = first.block_ids[:1]  # positions 0 to 15: the image's first 13 tokens
    assert driver.run([hit]) == {"hit": reference(prompt)}
    assert first.outputs == reference(prompt)
    assert encoded_images == [1, 1]


def test_a_cached_image_is_never_read_again(runner, encode, reference, share, monkeypatch):
    """With the real scheduler: the second request's blocks cover the whole image, so its
    pixels are not even read."""
    engine = Engine(runner.config.model_dir, num_blocks=32, max_model_len=256, budget=256)
    reads = []
    read_pixels = worker_images._read_pixels

    def counted(image: ImageMetadata, index: int) -> torch.Tensor:
        reads.append(index)
        return read_pixels(image, index)

    monkeypatch.setattr(worker_images, "_read_pixels", counted)
    prompt = encode(LONG, (7,))
    tokens = run_engine(engine, [context("first", prompt, share(prompt))])
    num_first_steps = len(engine.steps)
    tokens.update(run_engine(engine, [context("second", prompt, share(prompt))]))
    num_cached = (len(prompt.ids) - 1) // 16 * 16
    assert num_cached >= 19  # past the image's positions 3 to 18
    assert engine.steps[num_first_steps].num_scheduled_tokens == {
        "second": len(prompt.ids) - num_cached
    }
    assert tokens == {"first": reference(prompt), "second": reference(prompt)}
    assert reads == [0]


def test_preempted_requests_read_their_images_again(runner, encode, reference, share):
    # 6 blocks of 16 tokens; each request needs up to 4, so the newest are preempted.
    engine = Engine(runner.config.model_dir, num_blocks=6, max_model_len=96, budget=256)
    prompts = {f"p{i}": encode(LONG, (10 + i,)) for i in range(3)}
    contexts = [context(rid, prompt, share(prompt)) for rid, prompt in prompts.items()]
    tokens = run_engine(engine, contexts)
    assert engine.scheduler.num_preemptions > 0
    assert tokens == {rid: reference(prompt) for rid, prompt in prompts.items()}


def run_engine(engine: Engine, contexts: list[TextContext]) -> dict[str, list[int]]:
    """Run ``contexts`` through the real scheduler and ``engine``'s worker to the end."""
    tokens: dict[str, list[int]] = {c.request_id: [] for c in contexts}
    for c in contexts:
        assert engine.scheduler.add_request(c, b"test") is None
    while engine.scheduler.has_unfinished_requests():
        step = engine.scheduler.schedule()
        engine.steps.append(step)
        outputs = engine.runner.next_token(step)
        output = WorkerOutput(step.step_id, outputs, engine.runner.take_refusals())
        for request_id, result in engine.scheduler.update_from_output(output)[b"test"].items():
            tokens[request_id] += result.result.tokens
        engine.scheduler.check_integrity()
    return tokens


# -- refusals ------------------------------------------------------------------------------------


def test_a_request_whose_pixels_are_gone_fails_alone(runner, encode, reference, share):
    ok, gone = encode(LONG, (20,)), encode(SHORT, (21,))
    ok_images, gone_images = share(ok), share(gone)
    gone_images[0].pixel_values.unlink()  # aborted meanwhile: the scheduler unlinked it
    driver = Driver(runner)
    outputs = driver.run(
        [
            Driven(context("ok", ok, ok_images), [len(ok.ids)]),
            Driven(context("gone", gone, gone_images), [len(gone.ids)]),
        ]
    )
    assert outputs == {"ok": reference(ok), "gone": []}
    assert driver.refusals == {
        "gone": (
            "image 0's pixels are not in this host's shared memory (the request ended, "
            "or this worker runs on another host than the API server)"
        )
    }
    assert np.array_equal(ok_images[0].pixel_values.read(), ok.pixels[0])  # never unlinked


def test_a_request_refused_for_another_reason_still_computes_its_image(
    runner, encode, reference, share
):
    # Its blocks are in the prefix cache from the moment it was scheduled, and another request
    # may share them (within the step, or after): they must hold the image, not its placeholder.
    prompt = encode(LONG, (22,))
    images = share(prompt)
    refused = msgspec.structs.replace(context("refused", prompt, images), logprobs=10**6)
    driver = Driver(runner)
    first = Driven(refused, [len(prompt.ids)])
    assert driver.run([first]) == {"refused": []}
    assert "logprobs must be in [0, 20]" in driver.refusals["refused"]
    full_blocks = first.block_ids[: (len(prompt.ids) - 1) // runner.block_size]
    sharing = Driven(
        context("sharing", prompt, images),
        [len(prompt.ids) - len(full_blocks) * runner.block_size],
        num_computed_tokens=len(full_blocks) * runner.block_size,
        block_ids=full_blocks,
    )
    assert driver.run([sharing]) == {"sharing": reference(prompt)}


def test_images_that_do_not_fit_the_model_are_refused(runner, encode, share):
    prompt = encode(SHORT, (30,))
    (image,) = share(prompt)
    small = SharedMemoryArray.create(prompt.pixels[0, :, :16, :16].copy())
    try:
        cases = {
            "short": [replace_image(image, end_idx=image.end_idx - 1)],
            "shifted": [replace_image(image, start_idx=image.start_idx - 1, end_idx=18)],
            "pixels": [replace_image(image, pixel_values=small)],
            "none": [],
        }
        requests = [
            Driven(context(rid, prompt, images), [len(prompt.ids)]) for rid, images in cases.items()
        ]
        driver = Driver(runner)
        driver.run(requests)
    finally:
        small.unlink()
    assert driver.refusals == {
        "short": "image 0 has 15 image tokens; this model takes 16 per image",
        "shifted": "image 0's positions [2, 18) are not image tokens",
        "pixels": "image 0 has pixels of shape (3, 16, 16); this model takes (3, 32, 32)",
        "none": "the prompt has image tokens outside its images' positions",
    }


def replace_image(image: ImageMetadata, **changes) -> ImageMetadata:
    fields = {name: getattr(image, name) for name in image.__struct_fields__}
    return ImageMetadata(**{**fields, **changes})


# -- tensor parallelism --------------------------------------------------------------------------


def test_tp2_matches_transformers(tiny_llava_dir, encode, reference, share):
    one, two = encode(LONG, (40,)), encode(TWO_IMAGES, (41, 42))
    requests = [
        ScriptedRequest(context("one", one, share(one)), [10, len(one.ids) - 10]),
        ScriptedRequest(context("two", two, share(two)), [len(two.ids)]),
    ]
    steps = scripted_steps(requests, NUM_NEW_TOKENS)
    driver, follower = run_group(tiny_llava_dir, 2, steps)
    tokens = {rid: [o.tokens[0] for o in outputs] for rid, outputs in driver["outputs"].items()}
    assert tokens == {"one": reference(one), "two": reference(two)}
    assert follower["tokens"] == tokens
    assert driver["refusals"] == follower["refusals"] == {}


# -- another tower, strategy, feature layers and checkpoint layout -------------------------------

NEWER_LAYOUT = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def test_siglip_full_strategy_and_several_layers_in_the_newer_layout(tmp_path, share):
    """A SigLIP tower (no class token), "full" features from two layers concatenated, tied
    embeddings, and the checkpoint renamed to the Hub's newer layout."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlavaConfig, SiglipVisionConfig

    config = LlavaConfig(
        vision_config=SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            image_size=32, patch_size=8, initializer_range=0.1,
        ),
        text_config=LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            initializer_range=0.1,
        ),
        image_token_index=500,
        vision_feature_select_strategy="full",
        vision_feature_layer=[-3, -1],
        projector_hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(1)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file(
        {renamed(name): tensor for name, tensor in weights.items()}, tmp_path / "model.safetensors"
    )

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (30,), generator=generator)
    ids[5:21] = 500  # (32 // 8) ** 2 = 16 patches, no class token
    pixels = torch.randn(1, 3, 32, 32, generator=generator)
    with torch.inference_mode():
        expected = model.generate(
            ids[None], pixel_values=pixels, attention_mask=torch.ones_like(ids[None]),
            do_sample=False, max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None,
        )[0, 30:].tolist()  # fmt: skip
    runner = ModelRunner(WorkerConfig(tmp_path, device="cpu", kv_cache_memory=4 << 20))
    assert runner.model_config.vision.num_image_tokens == 16
    prompt = Prompt(ids.tolist(), pixels.numpy())
    request = Driven(context("siglip", prompt, share(prompt, 500)), [12, 18])
    assert Driver(runner).run([request]) == {"siglip": expected}


def renamed(name: str) -> str:
    for old, new in NEWER_LAYOUT:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


# -- configuration -------------------------------------------------------------------------------


def test_image_token_count_is_the_processors(tiny_llava_dir, encode):
    vision = ModelConfig.from_dir(tiny_llava_dir).vision
    assert vision.image_token_id == LLAVA_IMAGE_TOKEN_ID
    assert vision.num_image_tokens == NUM_IMAGE_TOKENS
    assert encode(SHORT, (0,)).ids.count(LLAVA_IMAGE_TOKEN_ID) == NUM_IMAGE_TOKENS
    assert replace(vision, feature_select_strategy="full").num_image_tokens == 17
    siglip = {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14}
    assert replace(vision, tower=siglip, feature_select_strategy="full").num_image_tokens == 729


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("language_model.model.norm.weight", "language_model.model.norm.weight"),  # v5 saved
        ("language_model.lm_head.weight", "language_model.lm_head.weight"),
        ("vision_tower.embeddings.class_embedding", "vision_tower.embeddings.class_embedding"),
        ("multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias"),
        ("vision_tower.vision_model.pre_layrnorm.bias", "vision_tower.pre_layrnorm.bias"),  # hf
        ("model.language_model.norm.weight", "language_model.model.norm.weight"),  # newer
        ("lm_head.weight", "language_model.lm_head.weight"),
        ("model.vision_tower.vision_model.post_layernorm.bias", "vision_tower.post_layernorm.bias"),
        ("model.multi_modal_projector.linear_2.weight", "multi_modal_projector.linear_2.weight"),
    ],
)
def test_checkpoint_layouts_map_to_one_naming(name, expected):
    assert checkpoint_name(name) == expected
