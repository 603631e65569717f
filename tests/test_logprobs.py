"""Logprobs of generated tokens: the engine against transformers' log-softmax, and OpenAI's two
formats on a real node (completions' legacy one, chat's), streamed and not. Through the PD
proxy: tests/test_pd_push.py."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from servers import start_pdserve
from test_pd_pull import MODEL, NODE

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


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    child = start_pdserve(["serve", *NODE], tmp_path_factory.mktemp("logprobs"), "node")
    yield child
    child.stop()


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
