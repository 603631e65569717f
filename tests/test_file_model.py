"""The file's model, on every path the defaults can pick (issue: bf16 logits answered the README's
question wrongly on AMX).

- The logits that reach the sampler are float32 on every dtype x quantization x kernels.
- The README's question gets "The capital of France is Paris." on bf16 + int4 (forced: oneDNN
  emulates bf16 where the CPU lacks it) and on the float32 defaults, through `LLM` and `pdserve up`.
- The dense weights are the GGUF's own dequantization (fp16 scales included): exactly in float32,
  rounded once in bf16; the output head's int8 codes are the file's Q8_0 codes.
- Prompt logprobs through a node on `--dtype float32` (int4 decode, the default) equal transformers
  on the same file within 1e-3.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors import safe_open
from servers import start_pdserve

import pdserve.engine.model_runner as model_runner
from pdserve import LLM, SamplingParams
from pdserve.models.tokenizer import Tokenizer
from pdserve.procs import ProcessGroup, up_child

README_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


@pytest.mark.parametrize("kernels", ["auto", "portable"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_reaching_the_sampler_are_float32(random_llama, monkeypatch, dtype, quantization, kernels):
    """Prefill rows, decode rows (the int8 head kernel) and a batch mixing both."""
    seen: list[torch.dtype] = []
    real_sample = model_runner.sample

    def recording_sample(logits, *args):
        seen.append(logits.dtype)
        return real_sample(logits, *args)

    monkeypatch.setattr(model_runner, "sample", recording_sample)
    llm = LLM(random_llama, dtype=dtype, quantization=quantization, kernels=kernels, kv_cache_memory_gib=0.02)
    assert llm.engine.labels()["quantization"] == quantization
    outs = llm.generate([[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert len(seen) >= 4 and set(seen) == {torch.float32}, seen


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", "int4"), ("float32", "auto")])
def test_the_readme_question_through_llm(smollm_dir, dtype, quantization):
    llm = LLM(str(smollm_dir), dtype=dtype, quantization=quantization, kv_cache_memory_gib=0.05)
    assert llm.chat(README_CHAT, SamplingParams(temperature=0, max_tokens=32)).text == PARIS


def test_the_readme_question_through_up_on_bf16_int4(tmp_path):
    up = up_child(["--kv-cache-memory", "0.15", "--dtype", "bfloat16", "--quantization", "int4"],
                  log_path=str(tmp_path / "up.log"))
    up.start()
    try:
        ProcessGroup().wait_ready([up], 240)
        answer = httpx.post(up.url + "/v1/chat/completions", json={"messages": README_CHAT, "temperature": 0},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == PARIS
    finally:
        assert up.stop(grace_s=30) == 0


def _file_weights(smollm_dir) -> dict[str, torch.Tensor]:
    """The converted directory's float32 weights: the gguf package's dequantization of the file."""
    with safe_open(str(smollm_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_weights_are_the_files_own_on_int4(smollm_dir, dtype):
    """Quantizing for decode leaves the dense weights (prefill, scoring) as the file holds them."""
    file = _file_weights(smollm_dir)
    llm = LLM(str(smollm_dir), dtype=dtype, quantization="int4", kernels="portable", kv_cache_memory_gib=0.02)
    model = llm.engine.model_runner.model
    want = torch.float32 if dtype == "float32" else torch.bfloat16
    qkv = torch.cat([file[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([file[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(model.layers[3].self_attn.qkv_proj.weight, qkv.to(want))  # rounded once, or exact
    assert torch.equal(model.layers[3].mlp.gate_up_proj.weight, gate_up.to(want))
    assert torch.equal(model.layers[3].mlp.down_proj.weight, file["model.layers.3.mlp.down_proj.weight"].to(want))
    # The embedding and the (tied) output head: float32 whatever the dtype, the file's values.
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, file["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight


def test_the_int8_head_holds_the_files_q8_0_codes(smollm_dir, gguf_path, ops):
    """SmolLM2's tied embedding / head is Q8_0 in the file: the head kernel's codes and scales are
    the file's own, so codes * scales gives back the file's weights exactly, and the kernel's
    float32 logits equal a float64 product with them to float32 rounding."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(gguf_path))
    [embd] = [t for t in reader.tensors if t.name == "token_embd.weight"]
    assert embd.tensor_type.name == "Q8_0"
    llm = LLM(str(smollm_dir), dtype="float32", quantization="int4", kv_cache_memory_gib=0.02)
    head = llm.engine.model_runner.model.lm_head
    n, k = head.weight.shape
    rebuilt = head.quantized.codes.reshape(n, k // 32, 32).float() * head.quantized.scales.unsqueeze(-1)
    assert torch.equal(rebuilt.reshape(n, k), head.weight)
    blocks = np.asarray(embd.data).reshape(n, k // 32, 34)  # Q8_0: an fp16 scale, then 32 int8 codes
    file_scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16).astype(np.float32)).squeeze(-1)
    assert torch.equal(head.quantized.scales, file_scales)
    x = torch.randn(5, k)
    out = ops.int8_head(x, head.quantized.codes, head.quantized.scales)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ head.weight.double().t(), atol=1e-4, rtol=1e-5)
    # Batch-invariant callers: a row's logits do not depend on the rows batched with it.
    batched = ops.int8_head(x, head.quantized.codes, head.quantized.scales, rows_alone=True)
    alone = torch.cat([ops.int8_head(x[i : i + 1].contiguous(), head.quantized.codes, head.quantized.scales,
                                     rows_alone=True) for i in range(5)])
    assert torch.equal(alone, batched)


def test_prompt_logprobs_on_float32_defaults_equal_transformers_on_the_file(tmp_path, hf_smollm, smollm_dir):
    """A node on `--dtype float32` and otherwise the defaults (int4 decode for this GGUF): prompt
    logprobs (the scoring path lm-eval's loglikelihood reads) within 1e-3 of transformers on the
    file's weights."""
    node = start_pdserve(["serve", "--dtype", "float32", "--kv-cache-memory", "0.05"], tmp_path, "node")
    try:
        info = httpx.get(node.url + "/metrics").text
        assert 'quantization="int4"' in info
        tokenizer = Tokenizer(smollm_dir)
        prompts = ["The history of the Roman Empire began", "import numpy as np\n\ndef softmax(x):\n    return"]
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            r = httpx.post(node.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True,
                                                                "logprobs": 1, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            served = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            with torch.inference_mode():
                logits = hf_smollm(torch.tensor([ids])).logits[0].double()
            expected = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            got = torch.tensor(served[1 : len(ids)], dtype=torch.float64)
            assert served[0] is None and (got - expected).abs().max() < 1e-3, (prompt, (got - expected).abs().max())
    finally:
        node.stop()
