"""Load a model's weights (models/locate.py finds the model)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.parallel import SINGLE, TensorParallel
from pdserve.models.registry import model_class, read_model_config

logger = logging.getLogger(__name__)

def kv_cache_spec(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> KVCacheSpec:
    """The KV cache the model of `config` keeps (on TP rank `tp`), known before its weights are
    loaded (to size the pool)."""
    return model_class(config).kv_cache_spec(config, dtype, tp)


def load_model(model_dir: Path, dtype: torch.dtype, device: str, max_positions: int,
               prepack: bool = False, quantization: str = "none", tp: TensorParallel = SINGLE,
               int4_kernel: Callable | None = None) -> torch.nn.Module:
    """The model (TP rank `tp`'s slices of it) with its weights in `dtype`; `prepack` re-lays its
    bf16 projections for oneDNN; `quantization` (int4 | int8, resolved) quantizes them for decode,
    from float32 (int4 for `int4_kernel`, pdserve's, where given)."""
    config = read_model_config(model_dir)
    cls = model_class(config)
    load_dtype = torch.float32 if quantization != "none" else dtype
    weights: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for f in files:  # one tensor at a time, cast at once: peak memory stays near one model copy
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                # Matrices take the compute dtype now; vectors (norms, biases) and the model's
                # float32 weights (a MoE router's) keep their precision.
                cast = tensor.dim() > 1 and not name.endswith(cls.float32_weights)
                weights[name] = tensor.to(load_dtype) if cast else tensor
    with torch.device("meta"):
        model = cls(config, max_positions, tp)
    model = model.to_empty(device=device)
    model.set_compute_dtype(load_dtype)
    model.load_hf_state_dict(weights)
    del weights
    if quantization != "none":
        sizes = model.quantize(quantization, int4_kernel)
        logger.info("quantized for decode: %s", ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sizes.items()))
        model.set_compute_dtype(dtype)  # the dense (dequantized) weights, for prefill
    model.reset_buffers(device)
    if prepack:
        model.pack_for_cpu()
    return model.eval()
