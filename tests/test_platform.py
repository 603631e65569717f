"""dtype and kernels chosen from what the CPU reports: the choice for AVX2-only and AVX-512 CPUs,
the real detection on this machine, bf16 on both kernel paths against transformers, and a real
AVX2-only run (oneDNN, ATen and MKL capped at AVX2, as on an AMD EPYC without AVX-512)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_model_vs_transformers import CHATS, PROMPTS, assert_bf16_logits_close, pdserve_prompt_logits

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.platform import AVX2_EMULATION, KERNELS_ENV, CpuInfo, onednn_bf16_prepack_works, plan_kernels

EPYC_AVX2 = CpuInfo("AMD EPYC 7B13 64-Core Processor", "AVX2", frozenset({"avx", "avx2", "fma", "f16c"}), False)
AVX512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
XEON_AVX512 = CpuInfo("Intel(R) Xeon(R) Processor", "AVX512", AVX512, True)  # oneDNN emulates bf16
XEON_AVX512_BF16 = CpuInfo("Intel(R) Xeon(R) Processor", "AVX512", AVX512 | {"avx512_bf16"}, True)
HOST = CpuInfo.detect()
HOST_PACKS_BF16 = HOST.onednn_bf16 and onednn_bf16_prepack_works()  # the onednn path runs here
NO_ONEDNN_BF16 = f"oneDNN takes no bf16 on this CPU ({HOST.bf16_missing()})"


@pytest.fixture(autouse=True)
def no_forced_kernels(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)  # these tests say what they force


def test_avx2_only_cpu_gets_float32_on_the_portable_path():
    plan = plan_kernels("auto", cpu=EPYC_AVX2)
    assert (plan.dtype, plan.kernels, plan.warning) == ("float32", "portable", None)
    assert "avx512bw" in plan.reason and plan.device_name.startswith("AMD EPYC") and plan.isa == "AVX2"


def test_bfloat16_asked_for_on_an_avx2_cpu_runs_portable_with_one_warning_naming_the_features():
    plan = plan_kernels("bfloat16", cpu=EPYC_AVX2)
    assert (plan.dtype, plan.kernels) == ("bfloat16", "portable")
    assert "avx512bw, avx512vl, avx512dq" in plan.warning and "avx_ne_convert" in plan.warning
    assert plan_kernels("float32", cpu=EPYC_AVX2).warning is None


@pytest.mark.skipif(not HOST_PACKS_BF16, reason=NO_ONEDNN_BF16)
def test_avx512_bf16_cpu_keeps_the_bf16_fast_path():
    # The pack check itself runs on this CPU, so it needs one where oneDNN takes bf16.
    plan = plan_kernels("auto", cpu=XEON_AVX512_BF16)
    assert (plan.dtype, plan.kernels, plan.prepack, plan.warning) == ("bfloat16", "onednn", True, None)
    assert plan_kernels("float32", cpu=XEON_AVX512_BF16).kernels == "portable"


@pytest.mark.skipif(not HOST_PACKS_BF16, reason=NO_ONEDNN_BF16)
def test_avx512_cpu_without_bf16_arithmetic_gets_float32():
    # oneDNN takes bf16 there but emulates it: 3.7x slower than float32 in prefill (docs/benchmarks.md).
    plan = plan_kernels("auto", cpu=XEON_AVX512)
    assert (plan.dtype, plan.kernels, plan.warning) == ("float32", "portable", None)
    assert "avx512_bf16" in plan.reason and "emulates" in plan.reason
    asked = plan_kernels("bfloat16", cpu=XEON_AVX512)  # the faster bf16 path there is, with a warning
    assert (asked.dtype, asked.kernels) == ("bfloat16", "onednn") and "avx512_bf16" in asked.warning


def test_forced_portable_path(monkeypatch):
    assert plan_kernels("auto", kernels="portable", cpu=XEON_AVX512_BF16).dtype == "float32"
    monkeypatch.setenv(KERNELS_ENV, "portable")
    plan = plan_kernels("auto", cpu=XEON_AVX512_BF16)
    assert (plan.dtype, plan.kernels) == ("float32", "portable")
    plan = plan_kernels("bfloat16", cpu=XEON_AVX512_BF16)
    assert (plan.dtype, plan.kernels, plan.warning) == ("bfloat16", "portable", None)  # asked for, not a fallback


def test_bad_kernel_setting_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="kernels .PDSERVE_KERNELS. must be one of auto, portable, got 'fast'"):
        EngineConfig(kernels="fast")
    monkeypatch.setenv(KERNELS_ENV, "avx9000")
    with pytest.raises(ValueError, match="'avx9000'"):
        EngineConfig()
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        EngineConfig(dtype="int3")


def test_detection_reports_what_torch_and_onednn_report():
    assert HOST.isa == torch.backends.cpu.get_cpu_capability()
    assert HOST.model
    if sys.platform == "linux":
        assert HOST.flags  # read from /proc/cpuinfo
    assert HOST.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.cpu._is_avx512_bf16_supported():  # torch's own reading (cpuinfo) agrees with ours
        assert "avx512_bf16" in HOST.flags
    fast = HOST_PACKS_BF16 and HOST.native_bf16
    plan = plan_kernels("auto")
    assert (plan.dtype, plan.kernels) == (("bfloat16", "onednn") if fast else ("float32", "portable"))
    assert set(plan.labels()) == {"device", "device_name", "isa", "dtype", "kernels"}


# -- bf16 on both kernel paths against transformers (float32) ------------------------------------


@pytest.fixture(scope="module")
def bf16_llms(smollm_dir):
    llms = {"portable": LLM(str(smollm_dir), dtype="bfloat16", kernels="portable", quantization="none", kv_cache_memory_gib=0.05)}
    if HOST_PACKS_BF16:  # natively or emulated: the same kernels either way
        llms["onednn"] = LLM(str(smollm_dir), dtype="bfloat16", kernels="auto", quantization="none", kv_cache_memory_gib=0.05)
    return llms


@pytest.mark.parametrize("kernels", ["onednn", "portable"])
def test_bf16_kernel_path_matches_transformers(bf16_llms, hf_smollm, kernels):
    if kernels not in bf16_llms:
        pytest.skip(NO_ONEDNN_BF16)
    llm = bf16_llms[kernels]
    assert (llm.engine.plan.dtype, llm.engine.plan.kernels) == ("bfloat16", kernels)
    assert_bf16_logits_close(llm, hf_smollm)
    assert llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32)).text == "The capital of France is Paris."


def test_bf16_kernel_paths_agree(bf16_llms):
    if "onednn" not in bf16_llms:
        pytest.skip(NO_ONEDNN_BF16)
    for prompt in PROMPTS:
        ids = bf16_llms["portable"].tokenizer.encode(prompt)
        fast, portable = (pdserve_prompt_logits(bf16_llms[k], ids) for k in ("onednn", "portable"))
        torch.testing.assert_close(fast, portable, atol=0.5, rtol=0.02)


# -- a real AVX2-only run ------------------------------------------------------------------------


def generate_as_on_avx2(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **AVX2_EMULATION}
    env.pop(KERNELS_ENV, None)
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--max-tokens", "12", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_avx2_only_cpu_generates_with_no_flags():
    run = generate_as_on_avx2()
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "The capital of France is Paris."
    assert "(AVX2): float32 on portable kernels" in run.stderr
    assert "Traceback" not in run.stderr


def test_avx2_only_cpu_runs_an_explicit_bf16_with_one_warning():
    # Unquantized: this answer's first token is a near-tie (The 25.5 against L 25.4), which bf16 with
    # int4 weights tips the other way; the warning is what this test is about.
    run = generate_as_on_avx2("--dtype", "bfloat16", "--quantization", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "The capital of France is Paris."
    warnings = [line for line in run.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "no native bf16 GEMMs" in warnings[0]
    assert "avx512bw" in warnings[0] or "ONEDNN_MAX_CPU_ISA" in warnings[0]  # a real AVX2 CPU, or this emulation
    assert "Traceback" not in run.stderr
