"""MLA (pdserve/models/deepseek.py) against transformers' DeepseekV3ForCausalLM, on a seeded tiny random
config (4 layers, hidden 256, kv_lora_rank 64, qk_rope_head_dim 16, MoE after the first layer):
greedy tokens equal and logprobs close in float32, pdserve's paged latent cache (chunked prefill over
cached blocks, a prefix-cache hit, absorbed-weight decode in a batch) against transformers' unpaged
attention; TP 2 and 4 (the latent replicated) equal TP 1; and served disaggregated, P -> D over
pull and push, and from a P of TP 2 to a D of TP 1, equal to one node."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import save_random_deepseek
from servers import Procs, metric

from pdserve import LLM, SamplingParams

LATENT = 64 + 16  # kv_lora_rank + qk_rope_head_dim
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def token_prompts(lengths=(150, 40, 7), seed=1) -> list[list[int]]:
    """Random token ids: 150 tokens are three prefill chunks at a 64-token budget (the later ones
    attend to cached blocks), the others one step each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in lengths]


def new_llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", quantization="none", kv_cache_memory_gib=0.05, max_num_batched_tokens=64,
               **kwargs)


def hf_reference(path: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens for each prompt, and its logprob of each (its own unpaged attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            full = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)[0]
            logprobs = model(full[None, :-1]).logits[0, len(ids) - 1 :].log_softmax(-1)
            tokens = full[len(ids) :].tolist()
            out.append((tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]))
    return out


def assert_matches(outputs, reference) -> None:
    for out, (tokens, logprobs) in zip(outputs, reference, strict=True):
        assert out.token_ids == tokens
        assert [r.logprob for r in out.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def llm(mla_model):
    llm = new_llm(mla_model)
    yield llm
    llm.engine.close()


def test_the_kv_cache_is_one_latent_per_token_and_layer(llm):
    spec = llm.engine.kv_spec
    assert (spec.planes, spec.num_kv_heads, spec.head_dim, spec.model_kv_heads) == (1, 1, LATENT, 1)
    assert spec.bytes_per_token == 4 * LATENT * 4  # 4 layers x 80 float32 values; per-head K and V would be 4 x 2 x 4 x 48
    assert llm.engine.labels()["attention"] == "mla"  # MLA's own decode attention, not the K/V kernel


def test_greedy_tokens_equal_transformers_and_logprobs_are_close(llm, mla_model):
    prompts = token_prompts()
    assert_matches(llm.generate(prompts, GREEDY), hf_reference(mla_model, prompts, GREEDY.max_tokens))


def test_a_prefix_cache_hit_decodes_as_a_full_prefill(llm, mla_model):
    """The second prompt shares the first's 128-token prefix: its prefill reads 8 cached latent blocks."""
    first, = token_prompts((150,), seed=2)
    second = first[:128] + token_prompts((30,), seed=3)[0]
    llm.generate([first], GREEDY)
    out = llm.generate([second], GREEDY)
    assert out[0].metrics.num_cached_tokens == 128
    assert_matches(out, hf_reference(mla_model, [second], GREEDY.max_tokens))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's kind of config


@pytest.mark.parametrize("variant", [dict(rope_interleave=False), dict(q_lora_rank=None, first_k_dense_replace=0),
                                     dict(rope_parameters=YARN)])
def test_other_deepseek_layouts_equal_transformers(variant, tmp_path):
    """Rotary dimensions not interleaved; a query without low-rank compression and MoE in every layer;
    YaRN with DeepSeek's softmax scale, past the original context."""
    path = save_random_deepseek(tmp_path, **variant)
    prompts = token_prompts((300, 9))
    llm = new_llm(path)
    try:
        outputs = llm.generate(prompts, GREEDY)
    finally:
        llm.engine.close()
    assert_matches(outputs, hf_reference(path, prompts, GREEDY.max_tokens))


def test_tp2_and_tp4_equal_tp1(llm, mla_model):
    """The 4 heads split over the ranks; every rank keeps the whole latent."""
    prompts = token_prompts((70, 12))
    expected = llm.generate(prompts, GREEDY)
    for tp in (2, 4):
        parallel = new_llm(mla_model, tensor_parallel_size=tp)
        try:
            assert parallel.engine.kv_spec == llm.engine.kv_spec
            got = parallel.generate(prompts, GREEDY)
        finally:
            parallel.engine.close()
        for a, b in zip(got, expected, strict=True):
            assert a.token_ids == b.token_ids
            assert [r.logprob for r in a.logprobs] == pytest.approx([r.logprob for r in b.logprobs], abs=1e-4)


def test_served_disaggregated_equals_one_node(llm, mla_model, tmp_path):
    """Real P, D and proxy processes: pull (shm), push (tcp), and a P of TP 2 feeding a D of TP 1
    (D reads the latent once, from one P rank). D receives exactly the latent blocks' bytes."""
    node = ["--model", mla_model, "--served-model-name", "mla", "--dtype", "float32", "--quantization", "none",
            "--kv-cache-memory", "0.05"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Procs(tmp_path) as procs:
        p = procs.start(["serve", "--role", "prefill", "--kv-transport", "tcp", *node], "p")
        p2 = procs.start(["serve", "--role", "prefill", "-tp", "2", *node], "p2")
        d = procs.start(["serve", "--role", "decode", *node], "d")
        proxies = {name: procs.start(["proxy", "--mode", mode, "--prefill", prefill.url, "--decode", d.url],
                                     f"proxy-{name}")
                   for name, mode, prefill in (("pull", "pull", p), ("push", "push", p), ("tp2", "pull", p2))}
        for seed, (name, proxy) in enumerate(proxies.items()):
            prompts = token_prompts((150, 40), seed=10 + seed)  # new to D's prefix cache: every block moves
            expected = [out.text for out in llm.generate(prompts, greedy)]
            before = metric(d.url, "pdserve:kv_transfer_bytes_total", 'direction="received"')
            got = [completion_text(proxy.url, ids) for ids in prompts]
            assert got == expected, name
            moved = metric(d.url, "pdserve:kv_transfer_bytes_total", 'direction="received"') - before
            # D computes each prompt's last token itself: it receives the latents of the others' blocks.
            blocks = sum(-(-(len(ids) - 1) // 16) for ids in prompts)
            assert moved == blocks * 16 * 4 * LATENT * 4, name


def completion_text(url: str, prompt: list[int]) -> str:
    body = {"model": "mla", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]
