"""Structured output: the request fields (OpenAI's response_format, vLLM's structured_outputs and
guided_*), the engine's masks (JSON that parses and fits its schema for 20 seeded prompts; regex,
choice, Lark grammar), and a node serving them. Through the PD proxy: tests/test_pd_push.py."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_pd_pull import MODEL

from pdserve import SamplingParams
from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.sampling_params import InvalidParameter, StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}


def chat_prompt(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, "json",
     "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs"),
    ({"guided_json": json.dumps(PERSON)}, "json", "guided_json"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "a"+'}, "grammar", "guided_grammar"),
    ({"guided_regex": "x+", "guided_decoding_backend": "guidance"}, "regex", "guided_regex"),
])
def test_each_request_field_asks_for_its_constraint(fields, kind, param):
    spec = CompletionRequest(prompt="hi", **fields).to_sampling_params(8).structured
    assert (spec.kind, spec.field) == (kind, param)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields).to_sampling_params(8).structured == spec


@pytest.mark.parametrize("fields, param, message", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
])
def test_a_bad_constraint_is_refused_naming_its_field(fields, param, message):
    with pytest.raises(InvalidParameter, match=message) as err:
        CompletionRequest(prompt="hi", **fields).to_sampling_params(8)
    assert err.value.param == param


def test_a_constraint_that_does_not_compile_is_refused_before_it_runs(llm_fp32):
    for spec, message in ((StructuredOutputs("regex", "[a-z", "guided_regex"), "unclosed character class"),
                          (StructuredOutputs("json", {"type": "frobnicate"}, "guided_json"), "frobnicate"),
                          (StructuredOutputs("grammar", "start: undefined_rule", "guided_grammar"), "undefined_rule")):
        with pytest.raises(InvalidParameter, match=message) as err:
            llm_fp32.generate("hi", SamplingParams(max_tokens=4, structured=spec))
        assert err.value.param == spec.field
    assert not llm_fp32.engine.has_unfinished_requests()


def test_json_output_parses_and_fits_its_schema_for_20_seeded_prompts(llm_fp32):
    people = ["a chef from Lyon", "a retired pilot", "a child who loves cats", "a painter", "a farmer with goats",
              "a student in Tokyo", "a doctor", "a fisherman", "a librarian", "a baker"]
    prompts = [chat_prompt(llm_fp32, f"Describe {p} as a JSON object with name, age, city and pets.") for p in people]
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=120, structured=StructuredOutputs("json", PERSON))
              for seed in range(20)]
    outs = llm_fp32.generate(prompts * 2, params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.finish_reason == "stop"  # the object closed: the grammar ended the request
    assert len({out.text for out in outs}) > 10  # sampled, not one answer twenty times


def test_regex_choice_and_grammar_are_matched_whole(llm_fp32):
    prompt = chat_prompt(llm_fp32, "What is the capital of France? Answer in one word.")
    cases = [
        (StructuredOutputs("regex", r"[A-Z][a-z]{2,10}, [0-9]{4}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,10}, [0-9]{4}", t)),
        (StructuredOutputs("choice", ["Paris", "London", "Berlin"]), lambda t: t in ("Paris", "London", "Berlin")),
        (StructuredOutputs("grammar", 'start: "The answer is " CITY "."\nCITY: /[A-Z][a-z]+/'),
         lambda t: re.fullmatch(r"The answer is [A-Z][a-z]+\.", t)),
    ]
    for spec, fits in cases:
        for temperature in (0, 1.0):
            out = llm_fp32.generate(prompt, SamplingParams(temperature=temperature, seed=3, max_tokens=24,
                                                           structured=spec))[0]
            assert fits(out.text), (spec.kind, out.text)
    greedy = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=5,
                                                      structured=StructuredOutputs("choice", ["Paris", "London"])))[0]
    assert greedy.text == "Paris"


def test_logprobs_stay_the_models_under_a_grammar(llm_fp32):
    """As vLLM reports them by default: the model's distribution, before the mask."""
    prompt = chat_prompt(llm_fp32, "Say yes or no.")
    free = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].logprobs[0]
    masked = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=3, structured=StructuredOutputs(
        "choice", ["maybe"])))[0].logprobs[0]
    assert [t for t, _ in masked.top] == [t for t, _ in free.top]
    assert [lp for _, lp in masked.top] == pytest.approx([lp for _, lp in free.top], abs=1e-4)  # prefix cache: chunked
    assert "maybe".startswith(llm_fp32.tokenizer.decode([masked.token_id])) and masked.token_id != free.token_id


@pytest.fixture
def node(fp32_node):
    return fp32_node


def test_a_node_serves_response_format_and_guided_fields(node):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Describe a sailor as a JSON object."}]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=120, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "stop" and isinstance(json.loads(anything.choices[0].message.content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        extra_body={"guided_choice": ["north", "south", "east", "west"]}) if c.choices)
    assert streamed in ("north", "south", "east", "west")
    done = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=12, temperature=1.0, seed=2, n=3,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", c.text) for c in done.choices)
    bad = httpx.post(node.url + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", bad.text
