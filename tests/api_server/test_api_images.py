"""Images in chat messages, API server side: sources, decoding, preprocessing, prompt expansion
and the shared-memory segments handed to the scheduler, against transformers' own processors.

Every segment this process creates is recorded (``created``); a refused request must leave none
of them in /dev/shm. (Counting all of /dev/shm would also count segments that tests running
beside this one create.) The fake scheduler never unlinks, so each test unlinks what it got.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Response
from fastapi.responses import RedirectResponse
from PIL import Image

from api_server.app import create_app
from api_server.choices import Generation
from api_server.config import ApiServerConfig, EngineClientConfig, MediaConfig
from api_server.errors import invalid_request
from api_server.image_processor import ImageProcessor
from api_server.image_segments import ImageSegments, prepared_image
from api_server.request_limits import OutputBudget
from api_server.vision import VisionModel
from interfaces.shared_memory import SEGMENT_PREFIX, SharedMemoryArray
from tests.conftest import LLAVA_IMAGE_TOKEN_ID
from tests.support.fake_scheduler import FakeScheduler, UvicornThread

CHAT = "/v1/chat/completions"
NUM_IMAGE_TOKENS = 16


class LlavaHarness:
    """The tiny LLaVA behind a real API server and a fake scheduler (None: nothing listens)."""

    def __init__(self, model_dir: Path, work_dir: Path, media: MediaConfig, scheduler=True):
        address = f"ipc://{work_dir}/scheduler.ipc"
        self.scheduler = FakeScheduler(address).start() if scheduler else None
        engine = EngineClientConfig(
            address, submit_timeout_s=1.0, scheduler_timeout_s=1.0, heartbeat_interval_s=0.1
        )
        config = ApiServerConfig(model_dir, "tiny-llava", 256, engine, media=media)
        self.server = UvicornThread(create_app(config)).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=10)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        if self.scheduler is not None:
            self.scheduler.stop()


def picture(seed: int, size=(40, 52), mode="RGB", fmt="PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 4), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def chat(client: httpx.Client, content: list, **extra) -> httpx.Response:
    return client.post(CHAT, json={"messages": [{"role": "user", "content": content}], **extra})


def bad_request(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert all(word in error["message"] for word in words), error["message"]


def live(names: list[str]) -> list[str]:
    return [name for name in names if (Path("/dev/shm") / name).exists()]


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(picture(5))
    (tmp_path_factory.getbasetemp() / "secret.png").write_bytes(picture(6))
    (root / "escape.png").symlink_to(tmp_path_factory.getbasetemp() / "secret.png")
    return root


@pytest.fixture(scope="module")
def llava(tiny_llava_dir, media_root, tmp_path_factory):
    harness = LlavaHarness(
        tiny_llava_dir,
        tmp_path_factory.mktemp("llava"),
        MediaConfig(media_root, max_images_per_prompt=20),
    )
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def image_server():
    """Images over HTTP on 127.0.0.1, and redirects to the same and another host."""
    app = FastAPI()
    app.get("/cat.png")(lambda: Response(picture(7), media_type="image/png"))
    app.get("/same")(lambda: RedirectResponse("/cat.png"))
    app.get("/other")(lambda: RedirectResponse(f"http://localhost:{port}/cat.png"))
    app.get("/big.png")(lambda: Response(b"\0" * 20000, media_type="image/png"))
    server = UvicornThread(app).start()
    port = server.url.rsplit(":", 1)[1]
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def remote(tiny_llava_dir, tmp_path_factory):
    media = MediaConfig(allowed_media_domains=("127.0.0.1",), max_image_bytes=10000)
    harness = LlavaHarness(tiny_llava_dir, tmp_path_factory.mktemp("remote"), media)
    yield harness
    harness.close()


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch):
    """Names of the segments created during the test; all unlinked afterwards."""
    names: list[str] = []
    create = SharedMemoryArray.create.__func__

    def recording_create(cls, array):
        segment = create(cls, array)
        names.append(segment.name)
        return segment

    monkeypatch.setattr(SharedMemoryArray, "create", classmethod(recording_create))
    yield names
    for name in names:
        SharedMemoryArray(name, (0,), "float32").unlink()


@pytest.fixture(scope="module")
def reference(tiny_llava_dir):
    from transformers import AutoImageProcessor, AutoProcessor

    return AutoImageProcessor.from_pretrained(tiny_llava_dir), AutoProcessor.from_pretrained(
        tiny_llava_dir
    )


@pytest.mark.parametrize(
    ("size", "mode"),
    [((32, 32), "RGB"), ((40, 90), "RGB"), ((91, 33), "RGBA"), ((17, 5), "L"), ((64, 48), "P")],
)
def test_preprocessing_equals_transformers(reference, tiny_llava_dir, size, mode) -> None:
    from transformers import SiglipImageProcessor

    image = Image.open(io.BytesIO(picture(sum(size), size, mode)))
    ours = ImageProcessor.from_model_dir(tiny_llava_dir).preprocess(image)
    expected = reference[0](image, return_tensors="np")["pixel_values"][0]
    assert ours.dtype == np.float32 and ours.shape == expected.shape == (3, 32, 32)
    assert np.allclose(ours, expected, atol=1e-5)
    siglip = SiglipImageProcessor(size={"height": 24, "width": 20})
    ours = ImageProcessor.from_config(siglip.to_dict()).preprocess(image)
    assert np.allclose(ours, siglip(image, return_tensors="np")["pixel_values"][0], atol=1e-5)


@pytest.mark.parametrize(
    ("tower", "strategy", "num_tokens"),
    [
        ("clip_vision_model", "default", 16),
        ("clip_vision_model", "full", 17),
        ("siglip_vision_model", "default", 15),
        ("siglip_vision_model", "full", 16),
    ],
)
def test_image_token_count_follows_the_vision_tower(
    tiny_llava_dir, tmp_path, tower, strategy, num_tokens
) -> None:
    config = json.loads((tiny_llava_dir / "config.json").read_text())
    config["vision_config"]["model_type"] = tower
    config["vision_feature_select_strategy"] = strategy
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_llava_dir / "preprocessor_config.json", tmp_path)
    vision = VisionModel.load(tmp_path)
    assert vision.num_image_tokens == num_tokens
    expanded = vision.expand_image_tokens([5, LLAVA_IMAGE_TOKEN_ID, 6], 1)
    assert expanded == [5, *[LLAVA_IMAGE_TOKEN_ID] * num_tokens, 6]
    assert vision.image_spans(expanded) == [(1, 1 + num_tokens)]


def test_prompt_positions_and_pixels_equal_llava_processor(llava, reference, created) -> None:
    images = [picture(1), picture(2, (60, 30), "RGBA", "WEBP"), picture(3, fmt="JPEG")]
    kinds = ["png", "webp", "jpeg"]
    parts = [image_part(data_url(d, f"image/{k}")) for d, k in zip(images, kinds, strict=True)]
    content = [{"type": "text", "text": "Look:"}, parts[0], {"type": "text", "text": "and"}]
    content += parts[1:]
    reply = chat(llava.client, content, max_tokens=5)
    assert reply.status_code == 200, reply.text
    context = llava.scheduler.submitted[-1]
    image_processor, processor = reference
    hf_content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": hf_content}], add_generation_prompt=True
    )
    pil_images = [Image.open(io.BytesIO(data)) for data in images]
    expected_ids = processor(images=pil_images, text=prompt)["input_ids"][0]
    assert context.prompt_token_ids == expected_ids
    assert context.max_length == len(expected_ids) + 5
    positions = [i for i, t in enumerate(expected_ids) if t == LLAVA_IMAGE_TOKEN_ID]
    starts = positions[::NUM_IMAGE_TOKENS]
    assert [(i.start_idx, i.end_idx) for i in context.images] == [
        (start, start + NUM_IMAGE_TOKENS) for start in starts
    ]
    assert starts[2] == starts[1] + NUM_IMAGE_TOKENS  # adjacent images stay apart
    for image, pil_image in zip(context.images, pil_images, strict=True):
        pixels = image.pixel_values.read()
        expected = image_processor(pil_image, return_tensors="np")["pixel_values"][0]
        assert pixels.dtype == np.float32 and np.allclose(pixels, expected, atol=1e-5)
        digest = hashlib.sha256(b"<f4" + b"(3, 32, 32)" + pixels.tobytes()).hexdigest()
        assert image.image_hash == digest
    assert sorted(image.pixel_values.name for image in context.images) == sorted(created)
    assert all(name.startswith(SEGMENT_PREFIX) for name in created)


def test_exif_orientation_is_applied_as_transformers_load_image_does(
    llava, reference, created
) -> None:
    from transformers.image_utils import load_image

    pixels = np.random.default_rng(12).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated 90 degrees
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", exif=exif)
    assert chat(llava.client, [image_part(data_url(buffer.getvalue()))]).status_code == 200
    upright = load_image(Image.open(io.BytesIO(buffer.getvalue())))
    assert upright.size == (30, 50)
    expected = reference[0](upright, return_tensors="np")["pixel_values"][0]
    ours = llava.scheduler.submitted[-1].images[0].pixel_values.read()
    assert np.allclose(ours, expected, atol=1e-5)
    assert not np.allclose(ours, hf_pixels(reference, buffer.getvalue()), atol=1e-2)


def test_the_n_choices_share_one_segment(llava, created) -> None:
    content = [image_part(data_url(picture(4, fmt="GIF"), "image/gif"))]
    reply = chat(llava.client, content, n=3, max_tokens=2, stream=True)
    assert reply.status_code == 200, reply.text
    assert reply.text.endswith("data: [DONE]\n\n")
    contexts = llava.scheduler.submitted[-3:]
    assert len({context.request_id for context in contexts}) == 3
    names = {context.images[0].pixel_values.name for context in contexts}
    assert len(names) == 1 and names == set(created)
    assert live(created) == created  # sent: the scheduler unlinks it, not the API server
    assert len({context.images[0].image_hash for context in contexts}) == 1


def test_local_files_only_inside_the_allowed_directory(
    llava, reference, media_root, created
) -> None:
    reply = chat(llava.client, [image_part((media_root / "cat.png").as_uri())])
    assert reply.status_code == 200, reply.text
    pixels = llava.scheduler.submitted[-1].images[0].pixel_values.read()
    assert np.allclose(pixels, hf_pixels(reference, (media_root / "cat.png").read_bytes()))
    refused = {
        "file:///etc/passwd": "outside the directory",
        (media_root / "escape.png").as_uri(): "outside the directory",
        (media_root / "missing.png").as_uri(): "does not exist",
        "file://example.com/cat.png": "file:///absolute/path",
    }
    for url, words in refused.items():
        bad_request(chat(llava.client, [image_part(url)]), "messages[0].content[0]", words)
    assert len(created) == 1


def test_remote_urls_need_allowed_domains(llava, remote, image_server, reference, created) -> None:
    url = f"{image_server}/cat.png"
    param = "messages[0].content[1]"
    text = {"type": "text", "text": "hi"}
    bad_request(chat(llava.client, [text, image_part(url)]), param, "'127.0.0.1'", "refused")
    reply = chat(remote.client, [text, image_part(url)])
    assert reply.status_code == 200, reply.text
    pixels = remote.scheduler.submitted[-1].images[0].pixel_values.read()
    assert np.allclose(pixels, hf_pixels(reference, picture(7)), atol=1e-5)
    assert chat(remote.client, [image_part(f"{image_server}/same")]).status_code == 200
    for path, words in {
        "/other": "redirects to another host",
        "/no": "HTTP 404",
        "/big.png": "larger than 10000 bytes",
    }.items():
        bad_request(chat(remote.client, [text, image_part(image_server + path)]), param, words)
    bad_request(chat(remote.client, [text, image_part("file:///etc/passwd")]), param, "local")
    assert len(created) == 2


def hf_pixels(reference, data: bytes) -> np.ndarray:
    return reference[0](Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(picture(1)[:60]), ("cannot be decoded",)),
        (data_url(b"not an image at all"), ("cannot be decoded",)),
        (data_url(picture(1, fmt="BMP")), ("cannot be decoded",)),
        (data_url(picture(1, size=(1, 30000))), ("30000 x 1 pixels", "at most 200 times")),
        ("data:text/plain;base64,aGVsbG8=", ("'text/plain'", "not accepted")),
        (data_url(b"<svg/>", "image/svg+xml"), ("'image/svg+xml'",)),
        ("data:image/png;base64,%%%", ("base64",)),
        ("ftp://example.com/cat.png", ("data: URL",)),
    ],
)
def test_unusable_images_are_400s_that_leave_no_segment(llava, created, url, words) -> None:
    content = [image_part(data_url(picture(2))), image_part(url)]
    bad_request(chat(llava.client, content), "messages[0].content[1]", *words)
    assert created == []  # refused before any segment was made


def test_prompt_and_images_must_agree(llava, created) -> None:
    one_image = [image_part(data_url(picture(3)))]
    text_with_token = [{"type": "text", "text": "<image>"}, *one_image]
    bad_request(chat(llava.client, text_with_token), "messages", "2 image placeholder", "1 image")
    too_many = one_image * 16  # 256 image tokens in a 256-token context
    bad_request(chat(llava.client, too_many), "messages", "16 images take 256", "fewer images")
    more_than_allowed = one_image * 21
    words = ("21 images in one request", "at most 20 (--max-images-per-prompt)")
    bad_request(chat(llava.client, more_than_allowed), "messages", *words)
    response = llava.client.post("/v1/completions", json={"prompt": "<image> hi"})
    bad_request(response, "prompt", "1 image placeholder", "0 image")
    system = {"role": "system", "content": one_image}
    response = llava.client.post(CHAT, json={"messages": [system]})
    bad_request(response, "messages[0].content[0]", "only allowed in user messages")
    assert created == []


def test_images_to_a_text_model_are_refused(client: httpx.Client, created) -> None:
    response = chat(client, [image_part(data_url(picture(1)))])
    bad_request(response, "messages[0].content[0]", "not a vision-language model")
    assert created == []


def test_tokenize_counts_each_image_as_its_tokens(llava) -> None:
    content = [{"type": "text", "text": "Look:"}, image_part("http://not-fetched/x.png")]
    body = {"messages": [{"role": "user", "content": content}]}
    tokens = llava.client.post("/tokenize", json=body).json()["tokens"]
    assert tokens.count(LLAVA_IMAGE_TOKEN_ID) == NUM_IMAGE_TOKENS


def test_segments_are_unlinked_when_the_submit_fails_or_the_client_leaves(
    tiny_llava_dir, tmp_path, created
) -> None:
    harness = LlavaHarness(tiny_llava_dir, tmp_path, MediaConfig(), scheduler=False)
    try:
        content = [image_part(data_url(picture(8)))]
        assert chat(harness.client, content, n=2).status_code == 503  # nothing takes the submit
        assert len(created) == 1 and live(created) == []  # shared by both choices
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while the submit waits
            harness.client.post(
                CHAT, json={"messages": [{"role": "user", "content": content}]}, timeout=0.3
            )
        assert len(created) == 2
        deadline = time.monotonic() + 5
        while live(created) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live(created) == []
    finally:
        harness.close()


def test_a_failing_fan_out_unlinks_the_shared_segment(llava, created, monkeypatch) -> None:
    def refuse(budget, context) -> None:  # after the choices share the prompt's segment
        raise invalid_request("too many tokens", param="max_tokens")

    monkeypatch.setattr(OutputBudget, "add", refuse)
    with httpx.Client(base_url=llava.server.url, timeout=10) as client:
        response = chat(client, [image_part(data_url(picture(9)))], n=2)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "too many tokens"
    assert len(created) == 1 and live(created) == []


def test_the_owner_unlinks_the_segments_unless_it_handed_them_over(created) -> None:
    with ImageSegments() as sent:
        sent.create([prepared_image(np.ones((3, 2, 2), np.float32))], [(0, 4)])
        sent.hand_over()  # a choice reached the scheduler: the segment is its now
    assert live(created) == created
    with ImageSegments() as unsent:
        images = unsent.create([prepared_image(np.zeros((3, 2, 2), np.float32))], [(0, 4)])
        assert [image.pixel_values.name for image in images] == created[1:]
        assert live(created) == created
    assert live(created) == created[:1]  # no choice was sent: closing unlinks it
    unsent.close()  # closing again changes nothing
    assert live(created) == created[:1]


def test_choices_that_never_start_have_their_segments_unlinked(llava, created, monkeypatch):
    async def ends_before_its_stream_starts(choice, queue) -> None:
        queue.put_nowait(None)

    monkeypatch.setattr(Generation, "_pump", staticmethod(ends_before_its_stream_starts))
    response = chat(llava.client, [image_part(data_url(picture(11)))], n=2)
    assert response.status_code == 200
    assert len(created) == 1 and live(created) == []


def test_the_media_flags_reach_the_api_server(tiny_llava_dir, media_root) -> None:
    from api_server.__main__ import build_config, parse_args
    from api_server.config import ApiServerSettings
    from switchyard.cli import build_parser
    from switchyard.launcher import Launcher
    from switchyard.serve_config import ServeConfig

    flags = ["--allowed-local-media-path", str(media_root), "--allowed-media-domains", "A.com,b"]
    flags += ["--allowed-media-domains", "c"]
    api_args = ["--model", str(tiny_llava_dir), "--scheduler-addr", "ipc://s", *flags]
    config = build_config(parse_args(api_args))
    assert config.max_model_len == 512  # config.json's text_config
    media = config.media
    assert (media.allowed_local_media_path, media.allowed_media_domains) == (
        media_root.resolve(),
        ("a.com", "b", "c"),
    )
    assert build_config(parse_args(api_args[:4])).media == MediaConfig()
    with pytest.raises(ValueError, match="is not a directory"):
        build_config(parse_args([*api_args[:4], "--allowed-local-media-path", "/nonexistent"]))
    args = build_parser().parse_args(["serve", *flags])
    assert (args.allowed_local_media_path, args.allowed_media_domains) == (
        str(media_root),
        ["A.com,b", "c"],
    )
    assert (
        build_parser().parse_args(["serve", "--max-images-per-prompt", "3"]).max_images_per_prompt
        == 3
    )
    media = MediaConfig(media_root, ("a.com", "b", "c"), max_images_per_prompt=3)
    config = ServeConfig(tiny_llava_dir, "m", api_server=ApiServerSettings(media=media))
    launcher = Launcher(config)
    try:
        argv = launcher._api_server_argv("ipc://frontend", 3)
    finally:
        launcher.shutdown()
    assert argv[-6:] == [
        *("--allowed-local-media-path", str(media_root)),
        *("--allowed-media-domains", "a.com,b,c"),
        *("--max-images-per-prompt", "3"),
    ]
    assert build_config(parse_args([*api_args, *argv[-2:]])).media.max_images_per_prompt == 3
