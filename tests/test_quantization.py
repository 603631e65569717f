"""Weight-only quantization (int4 / int8): exact GGUF codes, kernels that compute the dequantized
weights, greedy output equal to transformers on those weights up to ties, and PD = colocated."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from helpers import PATH_TIE_MARGIN, divergence_margin, hf_with_weights_of
from safetensors import safe_open
from servers import Procs
from test_model_vs_transformers import CHATS, PROMPTS, assert_bf16_logits_close, pdserve_prompt_logits

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.models.native import native_ops
from pdserve.models.registry import read_model_config
from pdserve.models.tokenizer import Tokenizer
from pdserve.models.quantization import (
    INT4_GROUP,
    INT8_GROUP,
    NativeInt4Weight,
    can_quantize,
    int4_codes,
    max_quantized_rows,
    native_int4_kernel,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
    resolve_quantization,
)
from pdserve.platform import kernel_mode
from pdserve.proxy.health import engine_info

# A token is "tied" with the reference's argmax when its reference logit is within this of the
# maximum. The quantized kernels take bf16 activations, which moves logits (span +-35) by up to
# ~0.2 here; a wrong weight or kernel moves them by whole units.
TIE_MARGIN = 0.5


@pytest.fixture(scope="module")
def llm_int4(smollm_dir):
    return LLM(str(smollm_dir), dtype="float32", quantization="int4", kv_cache_memory_gib=0.1)


def test_auto_follows_the_gguf(smollm_dir):
    assert read_model_config(smollm_dir).gguf_weight_type == "Q4_1"
    assert resolve_quantization("auto", "Q4_1", "cpu") == "int4"
    assert resolve_quantization("auto", "Q8_0", "cpu") == "int8"
    assert resolve_quantization("auto", "F16", "cpu") == "none"
    assert resolve_quantization("auto", None, "cpu") == "none"  # an HF checkpoint
    assert resolve_quantization("auto", "Q4_1", "cuda") == "none"  # torch's kernels here are CPU ones
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_quantization("int4", None, "cuda:0")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        EngineConfig(quantization="int3")


def test_int4_recovers_the_gguf_q4_1_codes(smollm_dir):
    """Requantizing the float weights dequantized from Q4_1 gives back the file's codes exactly."""
    with safe_open(str(smollm_dir / "model.safetensors"), framework="pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
            weight = f.get_tensor(name)
            codes, step, low = int4_codes(weight)
            rebuilt = (codes * step + low).reshape(weight.shape)
            # float32 rounding only: a wrong code would be off by a whole step (~1e-2 here).
            assert (rebuilt - weight).abs().max() <= 1e-6 * weight.abs().max(), name
            assert ((rebuilt - weight).abs() / step.min()).max() < 1e-3


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_kernels_compute_the_dequantized_weight(method, rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 128) * 0.05, torch.randn(rows, 128)
    quantized, dequantized = (quantize_int4 if method == "int4" else quantize_int8)(weight)
    # Quantization error within half a step of the original ...
    if method == "int4":
        steps = (weight.reshape(96, -1, INT4_GROUP).aminmax(dim=-1))
        step = ((steps.max - steps.min) / 15).repeat_interleave(INT4_GROUP, 1)
    else:
        step = (weight.abs().amax(-1, keepdim=True) / 127).expand_as(weight)
    assert ((dequantized - weight).abs() <= 0.51 * step + 1e-2 * weight.abs()).all()
    # ... and the kernel computes x @ dequantized.T (bf16 activations and output).
    out = quantized(x.bfloat16()).float()
    torch.testing.assert_close(out, F.linear(x.bfloat16().float(), dequantized), rtol=1e-2, atol=1e-2)


@pytest.fixture(params=["amx", "avx512"])
def kernel_path(request, ops):
    """pdserve's kernels on AMX tiles (where the CPU has them) or on AVX-512 alone."""
    if request.param == "amx" and not ops.amx_available():
        pytest.skip("this CPU has no AMX tiles (or the OS does not grant them)")
    previous = ops.set_amx(request.param == "amx")
    yield request.param
    ops.set_amx(previous)


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 33])
def test_native_int4_computes_the_dequantized_weight_in_float32(ops, kernel_path, rows):
    """pdserve's int4_linear (AVX512-BF16, AMX tiles where present): x rounded to bf16 times the
    dequantized weight, summed in float32 (torch's kernel rounds its output to bf16); the bf16
    result is the float32 one rounded. 17 and 33 rows take AMX's chunks of 9 / 11 rows, padded."""
    kernel = native_int4_kernel(ops)
    if kernel is None:
        pytest.skip("this CPU has no AVX512-BF16: int4 decodes on torch's kernel (tested above)")
    torch.manual_seed(rows)
    weight, x = torch.randn(192, 96) * 0.05, torch.randn(rows, 96)  # 3 panels, 3 groups
    quantized, dequantized = quantize_int4(weight, kernel)
    assert isinstance(quantized, NativeInt4Weight)
    torch.testing.assert_close(quantized(x), F.linear(x.bfloat16().float(), dequantized), rtol=1e-5, atol=1e-5)
    assert torch.equal(quantized(x.bfloat16()), quantized(x).bfloat16())
    # The same codes and scales as torch's layout, so either kernel computes the same weight.
    torch.testing.assert_close(quantized(x), quantize_int4(weight)[0](x.bfloat16()).float(), rtol=2e-2, atol=2e-2)
    # An output size that is no multiple of its 64-row panel keeps torch's layout and kernel.
    assert not isinstance(quantize_int4(torch.randn(80, 96), kernel)[0], NativeInt4Weight)


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17])
def test_int8_head_computes_float32_logits(ops, kernel_path, rows):
    """The int8 head (AVX-512 or AMX tiles, where x is split into three bf16 parts) equals a float64
    product with the dequantized weight to float32 rounding; rows_alone keeps a row's logits the same
    alone as in any batch."""
    torch.manual_seed(rows)
    head = quantize_int8_groups(torch.randn(96, 160) * 0.05)  # 6 blocks of 16 columns, 5 groups
    weight = (head.codes.double().reshape(96, -1, INT8_GROUP) * head.scales.double().unsqueeze(-1)).reshape(96, 160)
    x = torch.randn(rows, 160) * 3
    out = ops.int8_head(x, head.codes, head.scales)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ weight.t(), atol=1e-5, rtol=1e-6)
    batched = ops.int8_head(x, head.codes, head.scales, rows_alone=True)
    alone = torch.cat([ops.int8_head(x[i:i + 1].contiguous(), head.codes, head.scales, rows_alone=True)
                       for i in range(rows)])
    assert torch.equal(alone, batched)


def test_decode_rows_on_the_quantized_kernels_follow_the_tiles(ops, kernel_path, smollm_dir):
    """Up to 32 decode rows a step on pdserve's kernels where they run on AMX tiles (the loaded
    model's projections, head and fused step), 16 on AVX-512 and on torch's kernels."""
    rows = 32 if kernel_path == "amx" else 16
    if native_int4_kernel(ops) is not None:
        assert max_quantized_rows(quantize_int4(torch.randn(64, 64), native_int4_kernel(ops))[0], ops) == rows
    assert max_quantized_rows(quantize_int4(torch.randn(64, 64))[0], ops) == 16  # torch's int4 kernel
    assert max_quantized_rows(quantize_int8(torch.randn(64, 64))[0], ops) == 16  # torch's int8 kernel
    engine = LLM(str(smollm_dir), dtype="bfloat16", quantization="int4", kv_cache_memory_gib=0.02).engine
    model = engine.model_runner.model
    if not engine.plan.compiled:  # PDSERVE_KERNELS=portable: torch's kernels, 16 rows
        rows = 16
    assert model.lm_head.max_quantized_rows == rows
    if native_int4_kernel(ops) is not None and engine.plan.compiled:
        assert model.layers[0].mlp.gate_up_proj.max_quantized_rows == model.decode_stack_rows == rows


@pytest.mark.parametrize("rows_alone", [True, False])
def test_native_int4_row_alone_equals_it_in_a_batch(ops, kernel_path, rows_alone):
    """A row's result does not depend on its neighbours or their count once it takes a given path;
    rows_alone (batch-invariant mode) keeps one path at every count, so a row alone equals it in any
    batch. Without it, AMX hands a lone row to AVX-512: equal up to float32 reassociation."""
    kernel = native_int4_kernel(ops)
    if kernel is None:
        pytest.skip("this CPU has no AVX512-BF16: int4 decodes on torch's kernel (tested above)")
    torch.manual_seed(7)
    weight, x = torch.randn(128, 160) * 0.05, torch.randn(20, 160).bfloat16()  # 2 panels, 5 groups
    quantized, _ = quantize_int4(weight, kernel)
    batch = quantized(x.float(), rows_alone=rows_alone)
    assert torch.equal(quantized(x[3:11].float(), rows_alone=rows_alone), batch[3:11])  # 8 of 20 rows
    alone = torch.cat([quantized(x[i:i + 1].float(), rows_alone=rows_alone) for i in range(len(x))])
    if rows_alone or kernel_path == "avx512":
        assert torch.equal(alone, batch)
    else:
        torch.testing.assert_close(alone, batch, rtol=1e-5, atol=1e-5)


def test_shapes_the_kernels_refuse_stay_dense():
    assert can_quantize("int4", torch.empty(960, 576)) and can_quantize("int8", torch.empty(7, 64))
    assert not can_quantize("int4", torch.empty(40, 64))  # N % 16
    assert not can_quantize("int4", torch.empty(64, 48))  # K % 32
    assert not can_quantize("int8", torch.empty(7, 5))  # K % 8 (torch's kernel crashes on it)


def test_prefill_runs_the_dequantized_weights_exactly(llm_int4):
    """Prefill rows take the dense path: transformers on the dequantized weights gives the same logits."""
    reference = hf_with_weights_of(llm_int4)
    assert llm_int4.engine.labels()["quantization"] == "int4"
    for prompt in PROMPTS[:2]:
        ids = llm_int4.tokenizer.encode(prompt)
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(pdserve_prompt_logits(llm_int4, ids), expected, atol=1e-2, rtol=1e-3)


def test_greedy_int4_equals_transformers_up_to_ties(llm_int4):
    """Greedy decode on int4 against transformers on the dequantized weights, token by token.

    The reference scores the engine's own sequence (teacher forcing): at every step the engine's
    token must be the reference's argmax, or tied with it within TIE_MARGIN; an untied pick fails.
    """
    reference = hf_with_weights_of(llm_int4)
    tok = llm_int4.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(tok.apply_chat_template(c)) for c in CHATS]
    outputs = llm_int4.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    exact = steps = 0
    for ids, out in zip(prompts, outputs):
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        gap = logits.max(-1).values - chosen
        assert gap.max() <= TIE_MARGIN, (tok.decode(ids), int(gap.argmax()), float(gap.max()))
        exact += int((gap == 0).sum())
        steps += len(out.token_ids)
    assert exact / steps >= 0.95  # ties are rare (5 of 320 steps when measured)
    answer = llm_int4.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32))
    assert answer.text == "The capital of France is Paris."


def test_int4_decodes_with_fewer_weight_bytes(llm_int4):
    model = llm_int4.engine.model_runner.model
    layer = model.layers[0].mlp.gate_up_proj
    # 4-bit codes plus a bf16 scale and offset per 32: 0.625 bytes a weight against float32's 4.
    assert layer.quantized.nbytes == layer.weight.numel() * 5 // 8
    assert model.lm_head.quantized.codes.dtype == torch.int8  # the output head stays 8-bit


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_bf16_with_int4_matches_transformers_on_the_dequantized_weights(smollm_dir, llm_int4, kernels):
    """int4 decode on a bf16 model (the default where the CPU has bf16 arithmetic): the dense path
    runs bf16 weights, pre-packed for oneDNN on `auto` where oneDNN takes bf16 (so not readable
    back: the float32 int4 model's dequantized weights, the same ones, are the reference's)."""
    llm = LLM(str(smollm_dir), dtype="bfloat16", quantization="int4", kernels=kernels, kv_cache_memory_gib=0.05)
    assert llm.engine.labels()["quantization"] == "int4"
    assert_bf16_logits_close(llm, hf_with_weights_of(llm_int4))
    outs = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16))
    assert all(len(o.token_ids) == 16 for o in outs)


# -- PD on the default (quantized) path ------------------------------------------------------------

MODEL = "SmolLM2-135M-Instruct"
NODE = ["--kv-cache-memory", "0.1"]  # default dtype and --quantization auto: int4 for this GGUF


def test_pd_on_int4_answers_as_colocated(tmp_path, smollm_dir):
    """P + D on the default path (bf16 + int4 where the CPU has bf16 arithmetic, float32 + int4
    elsewhere) give the colocated node's answers, up to genuine ties.

    Exact equality of long greedy runs needs a path whose rows do not depend on the batch (float32
    unquantized: test_pd_pull, test_pd_push): a row's last bits follow the batch it runs in (a GEMM's
    kernel is chosen by the call's shape; D computes the last prompt token alone where it cannot
    decode from P's first token, a colocated node inside the prompt's GEMM), and a near-tie many
    tokens later can flip. So: the first token (P's, from the prompt's GEMM on both sides) and the README's
    answer must be equal, and 32-token runs equal or parting only at a near-tie of the float32 logits
    (helpers.PATH_TIE_MARGIN), whose margin is reported.
    """
    tok = Tokenizer(smollm_dir)
    with Procs(tmp_path) as procs:
        both = procs.start(["serve", "--role", "both", *NODE], "both")
        p = procs.start(["serve", "--role", "prefill", *NODE], "p")
        d = procs.start(["serve", "--role", "decode", *NODE], "d")
        proxy = procs.start(["proxy", "--prefill", p.url, "--decode", d.url], "proxy")
        colocated, pd = (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
                         for url in (both.url, proxy.url))
        for prompt in PROMPTS:
            first = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
                     for c in (colocated, pd)]
            assert first[0] == first[1], prompt
        answers = [c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=32, temperature=0)
                   .choices[0].message.content for c in (colocated, pd)]
        assert answers == ["The capital of France is Paris."] * 2
        runs = {prompt: [c.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0].text
                         for c in (colocated, pd)] for prompt in PROMPTS}
        # Whether a node's kernels run on AMX tiles, as this machine offers them.
        ops = native_ops() if kernel_mode() == "auto" else None
        amx = str(ops is not None and ops.amx()).lower()
        for node in (both, p, d):
            info = engine_info(httpx.get(node.url + "/metrics").text)
            assert (info["quantization"], info["amx_tiles"]) == ("int4", amx)
    reference = LLM(str(smollm_dir), kv_cache_memory_gib=0.05)  # the nodes' defaults, in this process
    for prompt, (ours, theirs) in runs.items():
        ids = tok.encode(prompt)
        parted = divergence_margin(reference, ids, tok.encode(ours, add_bos=False), tok.encode(theirs, add_bos=False))
        print(f"{prompt[:30]!r}: " + ("equal" if parted is None else f"part at token {parted[0]}, margin {parted[1]:.4f}"))
        assert parted is None or parted[1] <= PATH_TIE_MARGIN, (prompt, ours, theirs, parted)
