"""Turn a GGUF file into an HF model directory (config, float weights, tokenizer, chat template).

The directory is the on-disk cache of the conversion: the engine, transformers and other servers
(vLLM) can all load it, and a second start skips the slow dequantisation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # where transformers' model_type is not the GGUF architecture

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms the attention's and the MLP's outputs too; its ffn_norm is the pre-MLP norm.
_GEMMA3_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                         "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    layer_tensors = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in layer_tensors:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{layer_tensors[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_TENSORS:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_TENSORS[stem]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves the two rotary halves of each Q/K head."""
    half_dim = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": HF_MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
        # What `--quantization auto` follows: the type most matrices were stored in.
        "gguf_weight_type": main_weight_type(reader),
    }
    if arch == "gemma3":
        config.update(gemma3_config(reader, config))
    return config


GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global; llama.cpp's gemma3 fixes it too (no GGUF key)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # the sliding layers' RoPE base (llama.cpp: rope_freq_base_train_swa)


def gemma3_config(reader, config: dict) -> dict:
    """Gemma 3's fields beyond a Llama's, as transformers' Gemma3TextConfig names them."""
    layers = config["num_hidden_layers"]
    return {
        "sliding_window": _field(reader, "gemma3.attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
                            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}},
        "query_pre_attn_scalar": config["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim) for every size but 27B
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def main_weight_type(reader) -> str:
    """The GGUF type most of the file's matrices are stored in (Q4_1 for the embedded SmolLM2)."""
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else "F32"


def read_weights(reader, config: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    arch = config["model_type"]
    permute = arch == "llama"  # llama.cpp permutes Q/K only for this architecture
    gemma = arch == "gemma3_text"
    weights = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF weights", unit="tensor"):
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if permute and re.search(r"\.attn_q\.", tensor.name):
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif permute and re.search(r"\.attn_k\.", tensor.name):
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        elif gemma and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w; HF keeps w
        weights[hf_tensor_name(tensor.name, "gemma3" if gemma else "llama")] = torch.from_numpy(np.ascontiguousarray(array))
    return weights


def build_tokenizer(reader, gguf_path: str | Path):
    """The GGUF's tokenizer: byte-level BPE (gpt2) built here, as transformers builds it from GGUF;
    another kind (Gemma's sentencepiece) by transformers' own GGUF tokenizer conversion."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gguf_path))
        return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [  # token type 3 = CONTROL, e.g. <|im_start|>; kept whole, skipped on decode
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == 3 and set(tok) <= byte_alphabet
    ]
    tokenizer.add_special_tokens(control)
    return tokenizer


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF model directory for `gguf_path` into `out_dir` (atomically) and return it."""
    from gguf import GGUFReader

    out_dir = Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    config = read_hf_config(reader)
    tmp = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")  # one per process: no clashes
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(read_weights(reader, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(reader, gguf_path).save(str(tmp / "tokenizer.json"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    tokenizer_config = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": tokens[config["bos_token_id"]] if config["bos_token_id"] is not None else None,
        "eos_token": tokens[config["eos_token_id"]] if config["eos_token_id"] is not None else None,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished the same conversion first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").exists():
            raise
    return out_dir
