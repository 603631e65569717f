"""Shared fixtures: the real SmolLM2 model (converted once into the user cache) and its reference."""

from __future__ import annotations

import shutil

import pytest
import torch
from servers import NODE, start_pdserve

from pdserve.models.locate import default_gguf_path, resolve_model_dir
from pdserve.models.native import native_ops


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
