"""`DecoderLM`: what every decoder family's model class shares around its own layers.

The token embedding, the float32 residual stream through the layers (models/layers.py's
DecoderLayer), the final norm and the float32 output head; the dtypes, kernels, quantization and
packing over the shared layers; loading weights once they are named and sliced as the model's. A
family subclasses it, builds its layers and rotary embedding, and maps HF weight names to its own
(`load_hf_state_dict`): models/llama.py, models/deepseek.py.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable, Iterable

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, DecodeKernel, PrefillKernel
from pdserve.models.contract import LayerHook
from pdserve.models.decode_stack import build_decode_stack, runs_fused
from pdserve.models.layers import MLP, Linear, OutputHead, RMSNorm, RotaryEmbedding, Rotation
from pdserve.models.parallel import TensorParallel
from pdserve.models.quantization import INT8_GROUP, MAX_QUANTIZED_ROWS, can_quantize, max_quantized_rows
from pdserve.platform import onednn_float32_works

logger = logging.getLogger(__name__)


class DecoderLM(nn.Module):
    # Decode attention: models/attention.py's over K and V planes (pdserve's C++ kernel where built,
    # else SDPA); a family with its own names it.
    decode_attention = "paged"
    # Names (suffixes) of matrices kept in float32 whatever the dtype: the output head (float32
    # logits) and the embedding (tied to it in many models; the residual stream is float32 anyway).
    float32_weights: tuple[str, ...] = ("embed_tokens.weight", "lm_head.weight")
    compute_dtype: torch.dtype = torch.float32
    # The fused decode step (models/decode_stack.py), where pdserve's kernels can run these layers,
    # for steps of at most decode_stack_rows decodes (what its int4 projections take).
    decode_stack: Any = None
    decode_stack_rows = MAX_QUANTIZED_ROWS

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layers: Iterable[nn.Module],
                 rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = rope
        self.lm_head = OutputHead(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],  # one for every layer, or each layer's (its KV group's)
        after_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        # The residual stream stays in float32 whatever the weights' dtype: it carries activations
        # in the tens of thousands, where bfloat16 would round away the layers' contributions.
        residual = self.embed(input_ids)
        if self.decode_stack is not None and after_layer is None and runs_fused(meta, self.decode_stack_rows):
            group = meta.decode_groups[0]
            delta = self.decode_stack.forward(residual, positions, self.rope.cos, self.rope.sin, kv_caches,
                                              meta.slot_mapping, group.block_tables, group.context_lens,
                                              group.partition_blocks)
            return self.norm(delta, residual)
        rotations = self.rotations(positions)
        delta = None
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        for i, layer in enumerate(self.layers):
            delta = layer(residual, delta, rotations[i], kv_caches[i], metas[i])
            if after_layer is not None:
                after_layer(i)
        return self.norm(delta, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the tokens' embeddings, float32."""
        return self.embed_tokens(input_ids).float()

    def rotations(self, positions: torch.Tensor) -> list[Rotation]:
        """Each layer's rotation of this step's positions (built once per step); one RoPE for all here."""
        return [self.rope.rotation(positions, self.compute_dtype)] * len(self.layers)

    def reset_buffers(self, device: torch.device | str) -> None:
        self.rope.reset_tables(device)

    def compute_logits(self, hidden: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        """float32 logits of the final norm's float32 output."""
        return self.lm_head(hidden, decode_rows)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Projections in `dtype`; norms, the residual stream, the embedding, the output head and
        `float32_weights` in float32 (the final norm's output too: it feeds the head)."""
        # Their float32 tensors are put back after the cast, not cast back from `dtype`: a quantized
        # model is loaded in float32 and then cast, and a round trip through bf16 would round them.
        norms = {f"{name}.{p}" for name, m in self.named_modules() if isinstance(m, RMSNorm) for p, _ in
                 m.named_parameters()}
        kept = {name: p.data for name, p in self.named_parameters(remove_duplicate=False)
                if p.dtype == torch.float32 and (name in norms or name.endswith(self.float32_weights))}
        self.to(dtype)
        self.compute_dtype = dtype
        for name, p in self.named_parameters(remove_duplicate=False):
            if name in kept:
                p.data = kept[name]
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.float()
                module.out_dtype = dtype
        self.embed_tokens.float()
        self.lm_head.float()
        self.norm.out_dtype = torch.float32

    def decode_kernel(self, ops: ModuleType | None) -> DecodeKernel | None:
        """pdserve's C++ paged decode attention, where it is built and this model decodes through the
        K/V paged attention."""
        return ops.paged_decode_attention if ops is not None and self.decode_attention == "paged" else None

    def prefill_kernel(self, ops: ModuleType | None) -> PrefillKernel | None:
        """pdserve's C++ causal prefill attention (bf16, built where the CPU has bf16 dot products),
        where this model attends through the K/V paged attention."""
        return getattr(ops, "prefill_attention", None) if ops is not None and self.decode_attention == "paged" else None

    def set_batch_invariant(self) -> None:
        """Every projection computes each row independently of the batch (models/batch_invariant.py);
        the engine's attention does its part (ModelRunner)."""
        if self.decode_attention != "paged":
            raise ValueError(f"--batch-invariant: {type(self).__name__} has its own attention "
                             f"({self.decode_attention}), which has no batch-invariant path yet")
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = True
        self.decode_stack = None  # its kernels compute rows alone, but its attention partitions by batch

    def use_native_kernels(self, ops: ModuleType) -> None:
        """Run the elementwise chains on pdserve's C++ kernels (models/native.py), as many decode rows
        on the quantized kernels as they take (more on AMX tiles), and float32 GEMMs on oneDNN."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, MLP, OutputHead)):
                module.native = ops
            if isinstance(module, Linear):
                module.max_quantized_rows = max_quantized_rows(module.quantized, ops)
                module.onednn_float32 = module.weight is not None and module.weight.is_cpu and onednn_float32_works()
        self.decode_stack = build_decode_stack(self, ops, one_rope=type(self).rotations is DecoderLM.rotations)
        self.decode_stack_rows = min((m.max_quantized_rows for m in self.layers.modules() if isinstance(m, Linear)),
                                     default=MAX_QUANTIZED_ROWS)

    def quantize(self, method: str, int4_kernel: Callable | None = None) -> dict[str, int]:
        """Quantize the projections to `method` (int4 | int8; int4 laid out for `int4_kernel`, pdserve's,
        where given) and the output head to int8 in groups (the logits are the most sensitive: GGUF
        files keep it at 8 bits too). Returns bytes by format."""
        nbytes: dict[str, int] = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            kind = "int8" if module is self.lm_head else method
            if module is self.lm_head and module.weight.shape[1] % INT8_GROUP:
                logger.warning("the output head %s stays dense: K is no multiple of %d", tuple(module.weight.shape),
                               INT8_GROUP)
                continue
            if not can_quantize(kind, module.weight):
                logger.warning("%s %s stays dense: torch's %s kernel does not take this shape", name,
                               tuple(module.weight.shape), kind)
                continue
            module.quantize(kind, int4_kernel)
            nbytes[kind] = nbytes.get(kind, 0) + module.quantized.nbytes
        return nbytes

    def pack_for_cpu(self) -> None:
        """Pre-pack every bf16 projection for oneDNN (where pdserve.platform chose the onednn path)."""
        for module in self.modules():
            if isinstance(module, Linear) and module.weight.is_cpu and module.weight.dtype == torch.bfloat16:
                module.pack_for_cpu()

    def own_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF weights under this model's names: "model." dropped, no rotary tables, no lm_head when
        tied to the embedding."""
        tied = self.config.tie_word_embeddings
        named = ((name.removeprefix("model."), t) for name, t in weights.items() if "rotary_emb" not in name)
        return {name: t for name, t in named if not (tied and name == "lm_head.weight")}

    def load_own_state_dict(self, own: dict[str, torch.Tensor]) -> None:
        """Load weights already named and sliced as this model's; ValueError naming any that do not fit."""
        missing, unexpected = self.load_state_dict(own, strict=False)
        self.tie_weights()
        if self.config.tie_word_embeddings:
            missing = [m for m in missing if m != "lm_head.weight"]
        if unexpected or missing:
            raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
