"""What the engine, the loader and the TP ranks call on a model: the contract a model family's class
keeps (models/registry.py registers it by `model_type`). `DecoderLM` (models/decoder.py) implements
all of it but a family's layers and weight names; Llama and DeepSeek subclass it with their own
layers (composed from models/layers.py), and a relative of Llama subclasses Llama."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, ClassVar, Protocol

import torch

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, DecodeKernel
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.parallel import TensorParallel

# Called after each layer has written its KV (the hook for layer-wise KV push).
LayerHook = Callable[[int], None]


class CausalLM(Protocol):
    # Its decode attention: "paged" (models/attention.py over K/V planes) or a name of its own.
    decode_attention: ClassVar[str]
    # Names (suffixes) of matrices kept in float32 whatever the dtype (the output head, a router).
    float32_weights: ClassVar[tuple[str, ...]]

    # -- before any weight: the family's settings and what its KV cache holds ------------------
    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Its ModelConfig from an HF config.json dict (the family's rules applied)."""

    @classmethod
    def kv_cache_spec(cls, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> KVCacheSpec:
        """The KV cache this rank keeps, to size the pool before the weights load."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel) -> None: ...

    # -- loading (models/loader.py) ------------------------------------------------------------
    def set_compute_dtype(self, dtype: torch.dtype) -> None: ...
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None: ...
    def quantize(self, method: str, int4_kernel: Callable | None = None) -> dict[str, int]:
        """Quantize for decode (int4 | int8; int4 for pdserve's `int4_kernel` where given); bytes by format."""
    def pack_for_cpu(self) -> None: ...
    def reset_buffers(self, device: torch.device | str) -> None:
        """Fill the non-persistent buffers (RoPE tables) once the model is on its device."""

    # -- kernels (engine start, every rank) ----------------------------------------------------
    def use_native_kernels(self, ops: ModuleType) -> None: ...
    def decode_kernel(self, ops: ModuleType | None) -> DecodeKernel | None: ...
    def set_batch_invariant(self) -> None:
        """ValueError where the family has no batch-invariant path (models/batch_invariant.py)."""

    # -- every step ----------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata | list[AttentionMetadata], after_layer: LayerHook | None = None) -> torch.Tensor:
        """Final-norm hidden states of the step's tokens (float32), KV written into kv_caches; `meta`
        for every layer, or each layer's (that of its KV group, models/kv_spec.py)."""
    def compute_logits(self, hidden: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        """float32 logits; the first `decode_rows` rows are decodes."""
