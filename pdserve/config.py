"""Settings shared by the engine, the model and (later) the node server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: chosen from the device (pdserve.platform)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")  # auto: the model's compute dtype
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight-only, for decode (models/quantization.py)


def prefill_cap_label(cap: int | None) -> str:
    """--max-prefill-tokens-while-decoding as a node's engine info reports it, and the proxy reads
    it ("0": the node's prefill and decode take turns)."""
    return "budget" if cap is None else str(cap)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder, read from an HF `config.json` by its family's class
    (models/registry.py): the fields every family has; a family's own (Qwen's biases, MLA's ranks,
    MoE's experts) its model class reads from `hf`."""

    model_type: str  # the family (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    gguf_weight_type: str | None = None  # the main weight type of the GGUF it was converted from
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the config.json as read

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], **family: Any) -> "ModelConfig":
        """The common fields of `cfg`; `family`: fields its family sets otherwise (MLA: one KV head)."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn", None):
            raise ValueError(f"rope type {rope_type!r} is not supported (plain RoPE and YaRN)")
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "llama")
        common = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            gguf_weight_type=cfg.get("gguf_weight_type"),
            hf=cfg,
        )
        return cls(**{**common, **family})


# kv_both: a colocated node with a KV connector: it serves whole requests, and per request may also
# prefill for another kv_both node (and hold the KV for it to pull) or decode one prefilled there.
KV_ROLES = {"both": None, "prefill": "kv_producer", "decode": "kv_consumer", "kv_both": "kv_both"}


@dataclass
class KVTransferConfig:
    """How a node takes part in PD disaggregation (vLLM's kv_transfer_config, in short)."""

    role: str = "both"  # both (colocated) | prefill (kv_producer) | decode (kv_consumer) | kv_both
    host: str = "127.0.0.1"  # the side channel (and tcp data) listens here
    port: int = 0  # 0 = a free port
    transport: str = "auto"  # auto, or a name in kv/transport's registry (auto: shm when the peer is on this host)
    # P holds a prefill's blocks for a lease this long, which the D that admitted the request renews
    # (every third of it) until it pulls: blocks nobody will pull are freed this long after.
    lease_s: float = 10.0
    wait_timeout_s: float = 30.0  # D gives up on a transfer after this
    load_failure_policy: str = "recompute"  # recompute (prefill locally) | fail (return an error)
    # D compares a digest (xxh3) of each transfer's bytes with P's (a corrupt or misplaced block fails the
    # load); its cost is measured in docs/faults.md. The prompt and engine checks are always on.
    verify_digest: bool = True
    secret: str | None = None  # shared by the cluster's P and D nodes; None = $PDSERVE_KV_SECRET

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {sorted(KV_ROLES)}, got {self.role!r}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv load failure policy must be recompute or fail, got {self.load_failure_policy!r}")
        if self.lease_s <= 0 or self.wait_timeout_s <= 0:
            raise ValueError("kv lease and wait timeout must be > 0")

    @property
    def is_producer(self) -> bool:
        return self.role in ("prefill", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("decode", "kv_both")

    @property
    def takes_push(self) -> bool:
        """Layer-wise push needs a node of one KV role: a kv_both node moves KV by pull only."""
        return self.role in ("prefill", "decode")


@dataclass
class EngineConfig:
    """How the engine runs: memory for the KV pool, batching limits, precision, threads."""

    model: str | None = None  # HF dir or .gguf file; None = the embedded SmolLM2
    dtype: str = "auto"
    quantization: str = "auto"  # auto | none | int8 | int4 (models/quantization.py; auto follows the GGUF)
    # The KV cache's dtype: auto keeps the model's compute dtype; bfloat16 halves a float32 model's KV
    # bytes (pool, transfers, the decode read). P and D must agree (the side channel refuses otherwise).
    kv_cache_dtype: str = "auto"
    # Every row of a step computed independently of the rows beside it and of how its prompt was
    # chunked (models/batch_invariant.py): PD equals colocated on any dtype, output independent of load.
    batch_invariant: bool = False
    device: str = "cpu"
    kernels: str | None = None  # auto | portable; None = $PDSERVE_KERNELS, else auto
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    tensor_parallel_size: int = 1  # ranks, each a process holding its slice of the model and KV pool
    block_size: int = 16
    kv_cache_memory_gib: float = 0.5
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use tiny pools)
    max_model_len: int | None = None  # None = the model's context length, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # While streams decode, a step computes at most this many prompt tokens (None: the whole
    # budget): an inter-token SLO's bound on the stall a long prompt adds to every decoding stream.
    # 0: none, so prompts wait until the streams have finished (the node's phases take turns).
    max_prefill_tokens_while_decoding: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        from pdserve.platform import kernel_mode  # here: platform brings torch, which the proxy does without

        kernel_mode(self.kernels)  # a bad value (or $PDSERVE_KERNELS) is an error now, not at load
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and (cap < 0 or not self.enable_chunked_prefill):
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 0 and needs chunked prefill, got {cap}"
                             + ("" if self.enable_chunked_prefill else " with chunked prefill off"))

