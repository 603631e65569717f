"""Logit controls (presence, frequency and repetition penalties, min_tokens, logit_bias) and the
request fields pdserve refuses: the sampler's arithmetic by hand, the engine against transformers'
logits with the same rules, and a real node (PD: tests/test_pd_push.py)."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from helpers import make_request
from test_pd_pull import MODEL

from pdserve import SamplingParams
from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.engine.logits import apply_logit_controls
from pdserve.sampling_params import InvalidParameter

INF = float("inf")


def test_each_control_changes_its_row_as_vllm_and_openai_define_it():
    """Prompt [0, 1], output so far [3, 3, 4], EOS 2. Repetition 2: seen tokens 0, 1, 3, 4 halve if
    positive, double if negative; frequency 0.5 x count and presence 0.25 on 3 (twice) and 4 (once);
    logit_bias +10 on 5; min_tokens 4 masks EOS (3 tokens out). A row without controls is untouched."""
    params = SamplingParams(max_tokens=16, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={5: 10.0}, min_tokens=4)
    controlled = make_request([0, 1], "a", params=params, eos_token_ids=(2,))
    controlled.token_ids.extend([3, 3, 4])
    plain = make_request([0, 1], "b", params=SamplingParams(max_tokens=16), eos_token_ids=(2,))
    plain.token_ids.extend([3, 3, 4])
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 2)
    out = apply_logit_controls(logits, [controlled, plain])
    assert out[0].tolist() == pytest.approx([1.0, -2.0, -INF, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 11.0])
    assert out[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    controlled.token_ids.append(5)  # 4 tokens out: EOS may come now
    assert apply_logit_controls(torch.zeros(1, 6), [controlled])[0, 2] == 0.0


@pytest.mark.parametrize("bad,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 17}, "min_tokens"),
    ({"logit_bias": {7: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
])
def test_out_of_range_controls_name_their_field(bad, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(max_tokens=16, **bad)
    assert err.value.param == param


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", "end"),
    ("use_beam_search", True), ("modalities", ["text", "audio"]),
])
def test_a_known_field_pdserve_does_not_serve_is_refused_by_name(field, value):
    with pytest.raises(InvalidParameter) as err:
        CompletionRequest(prompt="hi", **{field: value}).to_sampling_params(4)
    assert err.value.param == field and field in str(err.value)


def test_fields_that_ask_for_nothing_pass_and_unknown_ones_are_logged_once(caplog):
    for unset in ({"logprobs": False}, {"echo": False}, {"best_of": 1}, {"response_format": {"type": "text"}},
                  {"tool_choice": "none"}, {"tools": []}):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **unset).to_sampling_params(4)
    with pytest.raises(InvalidParameter, match="echo on chat"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], echo=True).to_sampling_params(4)
    with pytest.raises(InvalidParameter, match="functions"):  # the deprecated form of tools
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                              functions=[{"name": "f"}]).to_sampling_params(4)
    with caplog.at_level(logging.WARNING, logger="pdserve.api.openai_protocol"):
        for _ in range(3):
            CompletionRequest(prompt="hi", frobnicate=1).to_sampling_params(4)
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(InvalidParameter, match="logit_bias keys must be token ids"):
        CompletionRequest(prompt="hi", logit_bias={"abc": 1}).to_sampling_params(4)


def reference_controls(logits: torch.Tensor, prompt: list[int], output: list[int], eos: int, p: SamplingParams):
    """The same rules, written out plainly on one row of transformers' logits."""
    row = logits.clone()
    if len(output) < p.min_tokens:
        row[eos] = -INF
    for token, bias in p.logit_bias.items():
        row[token] += bias
    for token in set(prompt + output):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


@torch.inference_mode()
def test_greedy_with_controls_matches_transformers_with_the_same_rules(llm_fp32, hf_smollm):
    """SmolLM2, float32: pdserve's greedy tokens under every control equal argmax over
    transformers' logits with the rules applied by reference_controls; and each control changes
    the output (so the comparison is not vacuous)."""
    tok = llm_fp32.tokenizer
    prompt = tok.encode("The cat sat on the mat. The cat sat on the mat. The cat")
    eos = llm_fp32.engine.eos_token_ids[0]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    controls = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4,
                              presence_penalty=0.3, logit_bias={tok.encode(" dog")[0]: 4.0}, min_tokens=3)
    got = llm_fp32.generate(prompt, controls)[0].token_ids
    expected: list[int] = []
    for _ in range(20):
        logits = hf_smollm(input_ids=torch.tensor([prompt + expected])).logits[0, -1].float()
        token = int(reference_controls(logits, prompt, expected, eos, controls).argmax())
        expected.append(token)
        if token == eos:
            break
    assert got == expected
    assert got != llm_fp32.generate(prompt, plain)[0].token_ids


def test_min_tokens_holds_back_eos_and_stop_strings(llm_fp32):
    """logit_bias +100 on EOS makes it the first token; min_tokens 5 makes it the sixth."""
    prompt = llm_fp32.tokenizer.encode("Hello")
    eos = llm_fp32.engine.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert llm_fp32.generate(prompt, forced)[0].token_ids[:1] == [eos]
    out = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0},
                                                   min_tokens=5))[0]
    assert out.token_ids[5] == eos and eos not in out.token_ids[:5] and out.finish_reason == "stop"


def test_a_node_serves_the_controls_and_refuses_what_it_cannot(fp32_node):
    url = fp32_node.url + "/v1/completions"
    ask = {"model": MODEL, "prompt": "The cat sat on the mat. The cat", "max_tokens": 12, "temperature": 0}
    plain = httpx.post(url, json=ask, timeout=60).json()["choices"][0]["text"]
    penalized = httpx.post(url, timeout=60, json={**ask, "repetition_penalty": 1.5, "frequency_penalty": 1.0})
    assert penalized.status_code == 200 and penalized.json()["choices"][0]["text"] != plain
    for body, param in (({**ask, "best_of": 2}, "best_of"), ({**ask, "logit_bias": {"999999": 1}}, "logit_bias"),
                        ({**ask, "min_tokens": 20}, "min_tokens")):
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
