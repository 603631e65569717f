"""Logprobs of generated tokens: the engine against transformers' log-softmax, and OpenAI's two
formats on a real node (completions' legacy one, chat's), streamed and not. Through the PD
proxy: tests/test_pd_push.py."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from test_pd_pull import MODEL

from pdserve import SamplingParams


@torch.inference_mode()
def test_the_engines_logprobs_are_transformers_log_softmax(llm_fp32, hf_smollm):
    """Greedy, 12 tokens, 5 alternatives: each token's logprob and its top 5 as transformers' model
    gives them over the same sequence (float32: within 2e-3; the tie-free top 5 in the same order)."""
    prompt = llm_fp32.tokenizer.encode("The three primary colors are")
    out = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    for i, record in enumerate(out.logprobs):
        reference = torch.log_softmax(hf_smollm(input_ids=torch.tensor([prompt + out.token_ids[:i]])).logits[0, -1], -1)
        assert record.token_id == out.token_ids[i]
        assert record.logprob == pytest.approx(float(reference[record.token_id]), abs=2e-3)
        values, ids = reference.topk(5)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [lp for _, lp in record.top] == pytest.approx(values.tolist(), abs=2e-3)
        assert record.top[0][0] == record.token_id  # greedy: the most likely token


def test_logprobs_are_the_models_whatever_the_sampling(llm_fp32):
    """Raw logprobs (vLLM's default): temperature and penalties change which token is drawn, not
    the distribution reported for the first one."""
    prompt = llm_fp32.tokenizer.encode("Once upon a time")
    greedy = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=4))[0].logprobs[0]
    hot = llm_fp32.generate(prompt, SamplingParams(temperature=1.5, seed=3, max_tokens=1, logprobs=4,
                                                   repetition_penalty=1.8))[0].logprobs[0]
    assert [t for t, _ in hot.top] == [t for t, _ in greedy.top]
    assert [lp for _, lp in hot.top] == pytest.approx([lp for _, lp in greedy.top], abs=1e-6)
    assert llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].logprobs is None


@pytest.fixture
def node(fp32_node):
    return fp32_node


def test_completions_logprobs_in_openais_legacy_format(node):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0,
                                     logprobs=2)
    lp, text = done.choices[0].logprobs, done.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens).startswith(text) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (2, 3) and top[token] == pytest.approx(logprob)
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                         temperature=0, logprobs=2, stream=True)
    tokens, logprobs = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_with_top_logprobs(node):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a color."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and bytes(c.bytes) == c.token.encode()
               for c in content)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content
    for body, param in (({"logprobs": False, "top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                                     "logprobs")):
        refused = httpx.post(node.url + "/v1/chat/completions", timeout=30,
                             json={"model": MODEL, "messages": messages, "max_tokens": 4, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


@torch.inference_mode()
def test_prompt_logprobs_are_transformers_in_chunks_and_past_the_prefix_cache(llm_fp32, hf_smollm):
    """max_tokens 0 with prompt logprobs (echo's scoring call): nothing generated, each prompt
    token's logprob and its top 3 as transformers gives them, the first token none; the same when
    the prompt is computed in 8-token chunks, and when its blocks are already cached (a request
    for prompt logprobs computes its whole prompt)."""
    prompt = llm_fp32.tokenizer.encode("The quick brown fox jumps over the lazy dog because it was tired of running")
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)
    out = llm_fp32.generate(prompt, params)[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.prompt_logprobs[0] is None
    reference = torch.log_softmax(hf_smollm(input_ids=torch.tensor([prompt])).logits[0], -1)
    assert len(out.prompt_logprobs) == len(prompt)
    for i, record in enumerate(out.prompt_logprobs[1:], start=1):
        assert record.token_id == prompt[i]
        assert record.logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=2e-3)
        assert [t for t, _ in record.top] == reference[i - 1].topk(3).indices.tolist()
        assert record.rank == int((reference[i - 1] > reference[i - 1, prompt[i]]).sum()) + 1
    scheduler = llm_fp32.engine.scheduler
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 8
    try:
        chunked = llm_fp32.generate(prompt, params)[0].prompt_logprobs  # its blocks are cached by now, too
    finally:
        scheduler.max_num_batched_tokens = budget
    assert [r and r.token_id for r in chunked] == [r and r.token_id for r in out.prompt_logprobs]
    assert [r and r.logprob for r in chunked[1:]] == pytest.approx([r.logprob for r in out.prompt_logprobs[1:]], abs=1e-4)


def test_echo_and_prompt_logprobs_on_a_node(node, llm_fp32):
    """lm-evaluation-harness's loglikelihood call (token ids, echo, logprobs 1, max_tokens 1):
    the prompt's logprobs, then the generated token's; the scoring call with max_tokens 0; vLLM's
    prompt_logprobs field; echo streamed as the first chunk."""
    prompt = llm_fp32.tokenizer.encode("Question: What color is the sky? Answer: blue")
    expected = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))[0]
    ask = {"model": MODEL, "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    scored = httpx.post(node.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]
    lp = scored["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:-1] == pytest.approx([r.logprob for r in expected.prompt_logprobs[1:]], abs=1e-4)
    assert scored["text"].startswith("".join(lp["tokens"][:len(prompt)]))
    zero = httpx.post(node.url + "/v1/completions", json={**ask, "prompt": "Hello there", "max_tokens": 0},
                      timeout=60).json()
    assert zero["choices"][0]["text"] == "Hello there" and zero["choices"][0]["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0 and len(zero["choices"][0]["logprobs"]["tokens"]) == zero["usage"]["prompt_tokens"]
    vllm = httpx.post(node.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hello there",
                                                                      "max_tokens": 2, "prompt_logprobs": 2}).json()
    field = vllm["choices"][0]["prompt_logprobs"]
    assert field[0] is None and all(1 <= len(pos) <= 3 and all(v["rank"] >= 1 for v in pos.values()) for pos in field[1:])
    with httpx.stream("POST", node.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "echo": True, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    assert '"text": "Hello there"' in first or '"text":"Hello there"' in first
