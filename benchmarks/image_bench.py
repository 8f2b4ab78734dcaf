"""What an image costs on its way to the worker, for a llava-1.5-sized model (CLIP at 336 px).

Measures, on one seeded 1024 x 768 photo-like JPEG:

- the API server's work: decode (Pillow) and preprocess (resize the shortest edge to 336,
  center crop, rescale, normalize: ``api_server.image_processor``) to float32 (3, 336, 336),
  then the SHA-256 the prefix cache keys on;
- the hand-off as Switchyard does it: the pixels into a shared-memory segment
  (``SharedMemoryArray.create``), a ``SubmitRequest`` holding only the reference sent over a
  ZeroMQ ipc socket and decoded, the worker's copy out of the segment (``read``) and the unlink;
- the same hand-off with the pixels inline: the array itself in the message (msgpack-numpy),
  sent and decoded, as it would travel without shared memory.

Each is the median of --repeats runs after a warm-up.

Run: ``python benchmarks/image_bench.py [--repeats 50]``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Callable

import msgspec
import numpy as np
import zmq
from PIL import Image

from api_server.image_processor import ImageProcessor
from api_server.image_segments import pixels_hash
from api_server.images import decode_image
from interfaces import (
    ImageMetadata,
    SharedMemoryArray,
    TextContext,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.api_to_scheduler import ApiToSchedulerMessage, SubmitRequest

LLAVA_15 = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 336},
    "crop_size": {"height": 336, "width": 336},
}
NUM_IMAGE_TOKENS = 576
MAX_PIXELS = 32 * 1024 * 1024


class InlinePixels(msgspec.Struct, array_like=True):
    """The message as it would be with the pixels inline."""

    context: TextContext
    pixels: np.ndarray


def photo_jpeg(seed: int = 0) -> bytes:
    """A smooth, noisy 1024 x 768 picture (JPEG compresses it as it does photos)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:768, 0:1024]
    base = np.stack([x / 4, y / 3, (x + y) / 7], axis=-1) % 256
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def context_with(images: list[ImageMetadata]) -> TextContext:
    prompt = [1] * 10 + [32000] * NUM_IMAGE_TOKENS + [2] * 10
    return TextContext("bench", prompt, len(prompt) + 64, images=images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    processor = ImageProcessor.from_config(LLAVA_15)
    data = photo_jpeg()
    pixels = processor.preprocess(decode_image(data, MAX_PIXELS))
    print(f"JPEG {len(data) / 1024:.0f} KiB -> pixels {pixels.shape} {pixels.dtype}, "
          f"{pixels.nbytes / 2**20:.2f} MiB")  # fmt: skip
    decode = median_ms(lambda: decode_image(data, MAX_PIXELS), args.repeats)
    preprocess_ms = median_ms(
        lambda: processor.preprocess(decode_image(data, MAX_PIXELS)), args.repeats
    )
    hash_ms = median_ms(lambda: pixels_hash(pixels), args.repeats)
    print(f"API server: decode {decode:.1f} ms, decode + preprocess {preprocess_ms:.1f} ms, "
          f"SHA-256 {hash_ms:.2f} ms")  # fmt: skip

    encode = msgpack_numpy_encoder()
    decode_api = msgpack_numpy_decoder(ApiToSchedulerMessage)
    decode_inline = msgpack_numpy_decoder(InlinePixels)
    with tempfile.TemporaryDirectory() as directory, zmq.Context() as context:
        sender, receiver = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        receiver.bind(f"ipc://{directory}/bench")
        sender.connect(f"ipc://{directory}/bench")
        sizes: dict[str, int] = {}

        def by_reference() -> None:
            segment = SharedMemoryArray.create(pixels)
            image = ImageMetadata(10, 10 + NUM_IMAGE_TOKENS, segment, "hash")
            frame = encode(SubmitRequest(context_with([image])))
            sizes["shared memory"] = len(frame)
            sender.send(frame, copy=False)
            message = decode_api(receiver.recv(copy=False).buffer)
            received = message.context.images[0].pixel_values
            received.read()  # the worker's copy
            received.unlink()  # the scheduler's, when the request ends

        def inline() -> None:
            frame = encode(InlinePixels(context_with([]), pixels))
            sizes["inline"] = len(frame)
            sender.send(frame, copy=False)
            decode_inline(receiver.recv(copy=False).buffer).pixels.copy()

        results = {
            "shared memory": median_ms(by_reference, args.repeats),
            "inline": median_ms(inline, args.repeats),
        }
        sender.close(linger=0)
        receiver.close(linger=0)
    for name, milliseconds in results.items():
        print(f"hand-off, {name}: {milliseconds:.2f} ms, message {sizes[name] / 1024:.1f} KiB")
    segment = SharedMemoryArray.create(pixels)
    read_ms = median_ms(segment.read, args.repeats)
    segment.unlink()
    create_and_unlink_ms = median_ms(
        lambda: SharedMemoryArray.create(pixels).unlink(), args.repeats
    )
    print(f"of which: create + unlink {create_and_unlink_ms:.2f} ms, "
          f"the worker's read {read_ms:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
