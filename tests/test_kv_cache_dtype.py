"""--kv-cache-dtype: a float32 model keeping its KV cache in bf16 (half the pool, transfer and decode
read bytes) computes what float32 KV computes up to bf16's rounding, on both kernel paths; a P and a
D that keep different KV dtypes are refused naming the dtype; a bad value is an error."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cli import build_parser
from pdserve.config import EngineConfig
from pdserve.kv.pool import KVPool
from pdserve.kv.transport import NodeTransports
from pdserve.launcher import node_command

PROMPT = "The capital of France is"


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_a_float32_model_with_bf16_kv_computes_what_float32_kv_does(smollm_dir, kernels):
    def engine(kv: str) -> LLM:  # prompts in chunks of 8: later chunks read the cached (bf16) KV back
        return LLM(str(smollm_dir), dtype="float32", quantization="none", kv_cache_dtype=kv, kernels=kernels,
                   num_kv_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)

    full, half = engine("auto"), engine("bfloat16")
    assert full.engine.pool.tensor.dtype == torch.float32 and half.engine.pool.tensor.dtype == torch.bfloat16
    assert half.engine.kv_spec.bytes_per_token * 2 == full.engine.kv_spec.bytes_per_token
    assert half.engine.labels()["kv_cache_dtype"] == "bfloat16"
    ids = full.tokenizer.encode("Paris is the capital and largest city of France, on the Seine.")
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [a], [b] = full.generate([ids], scoring), half.generate([ids], scoring)
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(ids) > 10
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):  # each prompt token's logprob
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 0.05
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    [a], [b] = full.generate([full.tokenizer.encode(PROMPT)], greedy), half.generate([full.tokenizer.encode(PROMPT)], greedy)
    assert a.token_ids[:3] == b.token_ids[:3]  # " Paris." : far from any tie
    for x, y in zip(a.logprobs[:3], b.logprobs[:3]):
        assert abs(x.logprob - y.logprob) < 0.05


def test_peers_keeping_different_kv_dtypes_are_refused_naming_it():
    shape = (2, 2, 8, 4, 2, 8)
    ours, theirs = KVPool(shape, torch.bfloat16, "cpu"), KVPool(shape, torch.float32, "cpu")
    transports = NodeTransports([ours])
    try:
        refused = transports.to_serve("tcp", theirs.layout, 1, producer=True)
        assert isinstance(refused, str) and "dtype bfloat16 here, float32 on the peer" in refused
    finally:
        transports.close()


def test_the_flag_reaches_every_node_and_bad_values_are_refused():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    up = build_parser().parse_args(["up", "--kv-cache-dtype", "bfloat16"])
    command = node_command(up, None, "decode")
    assert command[command.index("--kv-cache-dtype") + 1] == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig(kv_cache_dtype="float16")


def test_a_model_with_its_own_attention_cache_refuses_another_kv_dtype(mla_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16: DeepseekV3.* keeps its own attention's cache"):
        LLM(mla_model, dtype="float32", quantization="none", kv_cache_dtype="bfloat16", kv_cache_memory_gib=0.05)
