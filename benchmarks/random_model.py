"""A model directory with a real model's shape and tokenizer but seeded random weights.

For speed measurements where the weights cannot travel (a GPU machine with no model hub and a
small upload): step times and throughput depend on the shapes, not on the weights' values, and
``--ignore-eos``-style benchmarks never stop on a token. Takes the configuration and the
tokenizer files from ``--shape-from`` and writes ``model.safetensors`` in ``--dtype``; the
weights are drawn on CUDA when it is available (seconds for a billion parameters).

  python benchmarks/random_model.py --shape-from DIR --output DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def write_random_model(shape_from: Path, output: Path, dtype_name: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape_from)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    model.save_pretrained(output)  # config.json too, naming the weights' dtype
    for name in COPIED_FILES:
        if (shape_from / name).is_file():
            shutil.copy(shape_from / name, output / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape-from", required=True, help="directory with config.json")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    shape_from = Path(args.shape_from)
    if not (shape_from / "config.json").is_file():
        parser.error(f"{shape_from} has no config.json")
    write_random_model(shape_from, Path(args.output), args.dtype)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
