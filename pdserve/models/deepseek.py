"""DeepSeek-V3-style decoder: multi-head latent attention (MLA) and DeepSeek's MoE.

MLA caches one latent per token and layer, `kv_lora_rank + qk_rope_head_dim` values (the normalized
compressed KV, then the rotated shared key part), instead of K and V per head: the KV pool has one
plane of one "head" of that width (`kv_cache_spec`), which the pool, the prefix cache and the KV
transfers move like any other block. Every head reads the same latent, so under TP it is
replicated: each rank holds all of it, and a D rank reads it from one P rank.

Attention, two ways over the same cache:
- decode (absorbed weights): kv_b_proj's key half is folded into the query (q_nope W_UK), so the
  scores are one dot product of [q_latent, q_rope] with each cached latent, an MQA with one KV head of
  the latent's width (two batched matmuls); the value is the latent's first kv_lora_rank values, and
  W_UV maps the result back per head. A decode step reads only the latent, never per-head K / V.
- prefill chunks (expanded): the context's latents go through kv_b_proj into per-head keys and
  values, then SDPA; a long chunk is compute-bound and this costs no more than MHA.

DeepSeek lays the rotary dimensions out in interleaved pairs (`rope_interleave`); the loader
permutes the rows that produce them into halves, so the rotate-half RoPE (and pdserve's C++ kernel
for it) computes exactly what the interleaved one does.

MoE layers (from `first_k_dense_replace`): sigmoid router with a score-correction bias, group-limited
top-k, normalized and scaled weights; shared experts added to the routed ones. Under TP every
expert's intermediate size is split like a dense MLP's, and the layer all-reduces once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, DecodeGroup, gather_blocks
from pdserve.models.decoder import DecoderLM
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.layers import (
    MLP,
    DecoderLayer,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    Yarn,
    load_mlp,
    row_parallel,
    rows_of,
)
from pdserve.models.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class MLAConfig:
    """The fields of a DeepSeek-V3 config.json beyond a Llama's."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    yarn: Yarn | None  # the rotary part's context extension, which scales the softmax too

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> MLAConfig:
        hf = cfg.hf
        return cls(hf.get("q_lora_rank"), hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"],
                   hf["v_head_dim"], bool(hf.get("rope_interleave", True)), bool(hf.get("attention_bias", False)),
                   hf["moe_intermediate_size"], hf.get("n_routed_experts") or 0, hf.get("n_shared_experts") or 0,
                   hf.get("num_experts_per_tok") or 1, hf.get("n_group") or 1, hf.get("topk_group") or 1,
                   bool(hf.get("norm_topk_prob", True)), float(hf.get("routed_scaling_factor", 1.0)),
                   hf.get("first_k_dense_replace", 0) if hf.get("n_routed_experts") else cfg.num_layers,
                   Yarn.from_config(cfg))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk_head_dim); DeepSeek scales it by mscale^2 under YaRN (mscale_all_dim)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= Yarn.get_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mla: MLAConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.mla = tp, mla
        self.num_heads = len(tp.heads(cfg.num_heads))  # this rank's; o_proj's partial sums are all-reduced
        h, qk = self.num_heads, mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, mla.latent_dim, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        # A plain nn.Linear: never quantized or packed, since decode reads its weight as W_UK / W_UV.
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(h * mla.v_head_dim, cfg.hidden_size, bias=mla.attention_bias)
        self.scale = mla.softmax_scale

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK [H, nope, rank] and W_UV [H, v, rank]."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, rotate: Rotation, kv_cache: torch.Tensor, meta: AttentionMetadata):
        m, rows, h = self.mla, meta.num_decodes, self.num_heads
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, rows)), rows)
        else:
            q = self.q_proj(x, rows)
        q = q.view(-1, h, m.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x, rows)
        kv_norm = self.kv_a_layernorm(latent[:, : m.kv_lora_rank].contiguous())
        # The query heads' and the shared key's rotary parts, rotated in one pass.
        rope = rotate(torch.cat((q[..., m.qk_nope_head_dim :], latent[:, None, m.kv_lora_rank :].to(q.dtype)), 1))
        q_nope, q_rope, k_rope = q[..., : m.qk_nope_head_dim], rope[:, :h], rope[:, h]
        entry = torch.cat((kv_norm.to(kv_cache.dtype), k_rope.to(kv_cache.dtype)), dim=-1)  # [T, latent]
        kv_cache.view(-1, m.latent_dim).index_copy_(0, meta.slot_mapping, entry)

        out = q.new_empty(q.shape[0], h, m.v_head_dim)
        if meta.decode_groups:
            w_uk, w_uv = self._absorbed()
            query = torch.cat((torch.einsum("thn,hnr->thr", q_nope[:rows], w_uk), q_rope[:rows]), dim=-1)
            for group in meta.decode_groups:
                out[group.start : group.end] = self._decode(query[group.start : group.end], kv_cache, group, w_uv)
        for chunk in meta.prefills:
            n, ctx = chunk.end - chunk.start, chunk.context_len
            if chunk.block_table is None:
                context = entry[chunk.start : chunk.end]
            else:
                context = gather_blocks(kv_cache, chunk.block_table)[0, :ctx, 0]  # [ctx, latent]
            keys_nope, values = self.kv_b_proj(context[:, : m.kv_lora_rank]).view(ctx, h, -1).split(
                [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            keys = torch.cat((keys_nope, context[:, None, m.kv_lora_rank :].expand(ctx, h, -1)), dim=-1)
            query = torch.cat((q_nope[chunk.start : chunk.end], q_rope[chunk.start : chunk.end]), dim=-1)
            # Query i sits at position ctx - n + i and sees keys up to there (bottom-right causal).
            mask = torch.ones(n, ctx, dtype=torch.bool, device=x.device).tril(ctx - n)
            o = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                               values.transpose(0, 1)[None], attn_mask=mask, scale=self.scale)
            out[chunk.start : chunk.end] = o[0].transpose(0, 1)
        return self.tp.all_reduce(self.o_proj(out.flatten(1), rows))

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                w_uv: torch.Tensor) -> torch.Tensor:
        """MQA over the cached latents: [B, H, latent] queries, one key of the latent's width, the
        value its first kv_lora_rank values; W_UV turns each head's result into its value."""
        latents = gather_blocks(kv_cache, group.block_tables)[0, :, :, 0]  # [B, L, latent]
        # One KV head for all H query heads: two batched matmuls over [B, H, L] scores (an SDPA would
        # expand the latent to every head first). The group's mask hides each row's padding (the
        # engine builds masked groups for a model with its own decode attention).
        scores = torch.bmm(query, latents.transpose(1, 2)).mul_(self.scale) + group.mask[:, 0].to(query.dtype)
        probs = scores.float().softmax(dim=-1).to(query.dtype)
        o = torch.bmm(probs, latents[..., : self.mla.kv_lora_rank])  # [B, H, rank]
        return torch.einsum("bhr,hvr->bhv", o, w_uv)


class Router(nn.Module):
    """DeepSeek-V3's: sigmoid scores plus a correction bias choose the experts (within the best
    groups); the weights are the uncorrected scores, normalized and scaled. Kept in float32."""

    def __init__(self, hidden_size: int, mla: MLAConfig) -> None:
        super().__init__()
        self.mla = mla
        self.weight = nn.Parameter(torch.zeros(mla.n_routed_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(mla.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, tokens = self.mla, x.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = m.n_routed_experts // m.n_group
        group_scores = choice.view(tokens, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(m.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * m.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mla: MLAConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg.hidden_size, mla)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, mla.moe_intermediate_size, False, tp)
                                     for _ in range(mla.n_routed_experts))
        self.shared_experts = (MLP(cfg.hidden_size, mla.moe_intermediate_size * mla.n_shared_experts, False, tp)
                               if mla.n_shared_experts else None)

    def forward(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        experts, weights = self.gate(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in experts.unique().tolist():  # each expert once, on the tokens routed to it
            tokens, slot = torch.where(experts == e)
            y = self.experts[e](x[tokens], reduce=False) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.float())
        if self.shared_experts is not None:
            out += self.shared_experts(x, decode_rows, reduce=False).float()
        return self.tp.all_reduce(out.to(x.dtype))


class DeepseekV3ForCausalLM(DecoderLM):
    """The shared decoder (models/decoder.py) over MLA and MoE layers."""

    decode_attention = "mla"  # its own: absorbed weights over the latents (not the K/V paged kernel)
    float32_weights = (*DecoderLM.float32_weights, "mlp.gate.weight")  # and the router's, as DeepSeek keeps it

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """MLA caches one latent per token, shared by every head: one KV "head" (replicated under TP)."""
        return ModelConfig.from_hf_dict(hf, num_kv_heads=1)

    @classmethod
    def kv_cache_spec(cls, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> KVCacheSpec:
        """One latent per token and layer, replicated on every TP rank."""
        return KVCacheSpec(cfg.num_layers, 1, MLAConfig.from_model_config(cfg).latent_dim, dtype, planes=1,
                           model_kv_heads=1)

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        mla = MLAConfig.from_model_config(cfg)
        tp.check(cfg.num_heads, 1, cfg.intermediate_size)
        moe = mla.n_routed_experts and mla.first_k_dense_replace < cfg.num_layers
        if moe and mla.moe_intermediate_size % tp.size:
            raise ValueError(f"tensor parallel size {tp.size} does not divide the experts' {mla.moe_intermediate_size} rows")
        if moe and (mla.n_routed_experts % mla.n_group or mla.n_routed_experts // mla.n_group < 2):
            raise ValueError(f"{mla.n_routed_experts} experts do not form {mla.n_group} groups of two or more")
        layers = (DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, MLAttention(cfg, mla, tp),
                               MLP(cfg.hidden_size, cfg.intermediate_size, False, tp)
                               if i < mla.first_k_dense_replace else MoE(cfg, mla, tp))
                  for i in range(cfg.num_layers))
        super().__init__(cfg, tp, layers, RotaryEmbedding(mla.qk_rope_head_dim, cfg.rope_theta, max_positions, mla.yarn))
        self.mla = mla

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        super().set_compute_dtype(dtype)
        for module in self.modules():
            if isinstance(module, Router):
                module.float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """HF names: this rank's heads and MLP rows (TP), gate / up fused, the rotary rows in halves."""
        cfg, mla, tp = self.config, self.mla, self.tp
        own = self.own_names(weights)
        heads = tp.heads(cfg.num_heads)
        q_rows = rows_of(heads, mla.qk_head_dim)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            q_name = f"{p}self_attn.q_b_proj.weight" if mla.q_lora_rank else f"{p}self_attn.q_proj.weight"
            q = own[q_name].view(cfg.num_heads, mla.qk_head_dim, -1)
            kv_a = own[f"{p}self_attn.kv_a_proj_with_mqa.weight"]
            if mla.rope_interleave:  # the rotary rows, pairs (x0, x1), (x2, x3) ... -> evens then odds
                order = torch.cat((torch.arange(0, mla.qk_rope_head_dim, 2), torch.arange(1, mla.qk_rope_head_dim, 2)))
                q = torch.cat((q[:, : mla.qk_nope_head_dim], q[:, mla.qk_nope_head_dim :][:, order]), dim=1)
                kv_a = torch.cat((kv_a[: mla.kv_lora_rank], kv_a[mla.kv_lora_rank :][order]))
                bias = own.get(f"{p}self_attn.kv_a_proj_with_mqa.bias")
                if bias is not None:
                    own[f"{p}self_attn.kv_a_proj_with_mqa.bias"] = torch.cat(
                        (bias[: mla.kv_lora_rank], bias[mla.kv_lora_rank :][order]))
            own[q_name] = q.reshape(-1, q.shape[-1])[q_rows]
            own[f"{p}self_attn.kv_a_proj_with_mqa.weight"] = kv_a
            kv_b = own[f"{p}self_attn.kv_b_proj.weight"]
            own[f"{p}self_attn.kv_b_proj.weight"] = kv_b[rows_of(heads, mla.qk_nope_head_dim + mla.v_head_dim)]
            row_parallel(own, f"{p}self_attn.o_proj", rows_of(heads, mla.v_head_dim), tp)
            if isinstance(layer.mlp, MoE):
                experts = rows_of(tp.rows(mla.moe_intermediate_size), 1)
                for e in range(mla.n_routed_experts):
                    load_mlp(own, f"{p}mlp.experts.{e}.", experts, tp)
                if mla.n_shared_experts:
                    load_mlp(own, f"{p}mlp.shared_experts.",
                             rows_of(tp.rows(mla.moe_intermediate_size * mla.n_shared_experts), 1), tp)
            else:
                load_mlp(own, f"{p}mlp.", rows_of(tp.rows(cfg.intermediate_size), 1), tp)
        self.load_own_state_dict(own)
