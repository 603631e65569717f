"""Shared fixtures: the real SmolLM2 model (converted once into the user cache) and its reference;
the connect guard (guard/connect_guard.py) over every Python process of the session, and what the
session leaves behind, read before it starts (tests/test_footprint.py compares, last)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch
from servers import NODE, start_pdserve

from pdserve.models.locate import default_gguf_path, resolve_model_dir
from pdserve.models.native import native_ops
from pdserve.testing.random_models import save_random_model

GUARD_DIR = os.path.join(os.path.dirname(__file__), "guard")
sys.path.insert(0, GUARD_DIR)
import connect_guard  # noqa: E402

connect_guard.SESSION_START = connect_guard.footprint()
connect_guard.SESSION_START_POOLS = connect_guard.shm_pools()
_guard_tmp = tempfile.mkdtemp(prefix="pdserve-connect-guard-")
os.environ[connect_guard.LOG_ENV] = os.path.join(_guard_tmp, "connects.jsonl")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (GUARD_DIR, os.environ.get("PYTHONPATH")) if p)
connect_guard.install()


def pytest_collection_modifyitems(items):
    """tests/test_footprint.py runs last: it reads what the whole session did."""
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") == "test_footprint")


def pytest_terminal_summary(terminalreporter):
    """The CPU the suite ran on, in the summary's last lines (CI shows the tail): kernels, dtypes
    and rounding differ between CPU kinds, so a failure reads with its CPU."""
    from pdserve.platform import CpuInfo

    cpu = CpuInfo.detect()
    features = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu.flags)
    terminalreporter.write_line(f"CPU: {cpu.model}, {os.cpu_count()} cores, ISA {cpu.isa}, {features or 'no AVX'}")


def pytest_unconfigure(config):
    shutil.rmtree(_guard_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm_dir():
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def gguf_path():
    return default_gguf_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_dir):
    """transformers' own Llama implementation on the same converted weights, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llm_fp32(smollm_dir):
    from pdserve import LLM

    # Unquantized: the GGUF's float weights, exactly what transformers loads (quantized: test_quantization).
    return LLM(str(smollm_dir), dtype="float32", quantization="none", kv_cache_memory_gib=0.25)


@pytest.fixture(scope="session")
def ops():
    """pdserve's C++ kernels (models/native.py); skipped where no compiler can build them."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the engine runs the portable torch path (tested everywhere)")
    built = native_ops()
    assert built is not None, "a C++ compiler is here, yet the kernels did not build (see the log)"
    return built


@pytest.fixture(scope="session")
def fp32_node(tmp_path_factory):
    """One float32 node (`pdserve serve`) for the API tests: logprobs, n, structured output, tools."""
    child = start_pdserve(["serve", *NODE], tmp_path_factory.mktemp("fp32-node"), "node")
    yield child
    child.stop()


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory):
    """A seeded random Llama (8 heads, 2 KV heads, every bias): TP 2 splits its KV heads, TP 4
    replicates each on two ranks."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("random-llama")
    # Random biases and norms: every row-parallel bias must be added exactly once.
    save_random_model(config, path, perturbed=("bias", "norm"))
    return str(path)


MLA_CONFIG = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, initializer_range=0.1)


def save_random_deepseek(path, **overrides) -> str:
    """A seeded tiny random DeepSeek-V3 (MLA, one dense layer then MoE) saved by transformers, with
    SmolLM2's tokenizer; random norms and router biases, so that every weight counts."""
    import transformers

    save_random_model(transformers.DeepseekV3Config(**{**MLA_CONFIG, **overrides}), path,
                      perturbed=("norm", "e_score"))
    return str(path)


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory):
    """The tiny random DeepSeek-V3 (4 heads, kv_lora_rank 64, qk_rope_head_dim 16: a 80-value latent)."""
    return save_random_deepseek(tmp_path_factory.mktemp("deepseek-v3"))
