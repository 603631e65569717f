"""n > 1: one prompt, n sequences that share its KV blocks. On the engine (seeds, block sharing,
aborts) and on a node (OpenAI's choices, whole and streamed). Through the PD proxy:
tests/test_pd_push.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_pd_pull import MODEL

from pdserve import SamplingParams

# ~40 tokens: two full 16-token blocks shared, the last one computed by each sequence.
PROMPT = ("A short story about a lighthouse keeper who finds a message in a bottle, written in the style of "
          "a fairy tale for children, with a happy ending and a lesson about kindness:")


def test_n_sequences_are_the_n_seeded_requests(llm_fp32):
    """Sequence i of a request seeded s draws what a lone request seeded s + i draws (vLLM's rule)."""
    params = dict(temperature=0.9, max_tokens=12, ignore_eos=True)
    outs = llm_fp32.generate(PROMPT, SamplingParams(n=3, seed=11, **params))
    assert [o.index for o in outs] == [0, 1, 2] and len({o.request_id for o in outs}) == 1
    alone = [llm_fp32.generate(PROMPT, SamplingParams(seed=11 + i, **params))[0] for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different draws, not one sequence three times


def test_the_sequences_share_the_prompts_full_blocks(llm_fp32):
    engine = llm_fp32.engine
    prompt = engine.tokenize_prompt("Shared: " + PROMPT)  # not in the prefix cache: the sharing is the fork's
    bs = engine.config.block_size
    first = engine.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=5), "family")
    engine.step()  # the first sequence computes the prompt; the other two fork from it
    shared = (len(prompt) - 1) // bs
    assert shared >= 2
    assert [engine.block_manager.ref_counts[b] for b in first.block_tables[0][:shared]] == [3] * shared
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    outs.sort(key=lambda o: o.index)
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, shared * bs, shared * bs]  # computed once
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids  # greedy: the same sequence
    assert outs[0].token_ids == llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].token_ids
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.families


@pytest.mark.parametrize("steps", [0, 1])
def test_aborting_the_request_aborts_every_sequence(llm_fp32, steps):
    """Before the fork (the others still wait for the prompt) and after it: nothing is left."""
    engine = llm_fp32.engine
    engine.add_request(PROMPT, SamplingParams(n=4, temperature=0.5, max_tokens=20), "gone")
    for _ in range(steps):
        engine.step()
    outs = engine.abort_request("gone")
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and {o.finish_reason for o in outs} == {"abort"}
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert not engine.scheduler.families and not engine.scheduler.forks


def test_every_sequence_reports_the_prompts_logprobs(llm_fp32):
    """Prompt logprobs with n = 2: the fork copies those of the shared tokens and computes the rest."""
    alone = llm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    outs = llm_fp32.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=2, prompt_logprobs=1))
    for out in outs:
        assert len(out.prompt_logprobs) == len(alone.prompt_logprobs) and out.prompt_logprobs[0] is None
        assert [r.token_id for r in out.prompt_logprobs[1:]] == [r.token_id for r in alone.prompt_logprobs[1:]]
        assert [r.logprob for r in out.prompt_logprobs[1:]] == pytest.approx(
            [r.logprob for r in alone.prompt_logprobs[1:]], abs=1e-4)


@pytest.fixture
def node(fp32_node):
    return fp32_node


def stream_choices(url: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Each choice's streamed text, and the chunks."""
    texts: dict[int, str] = {}
    chunks = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(chunk := json.loads(line[6:]))
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c.get("text", c.get("delta", {}).get("content", ""))
    return texts, chunks


def test_a_node_answers_n_choices_whole_and_streamed(node):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=5, n=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2] and len({c.text for c in done.choices}) > 1
    assert done.usage.completion_tokens == 30  # the prompt counted once, the three completions summed
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 3,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    texts, chunks = stream_choices(node.url + "/v1/completions", body)
    assert texts == {c.index: c.text for c in done.choices}
    assert chunks[-1]["usage"] == done.usage.model_dump(exclude_none=True)
    finishes = [c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=8, temperature=1.0, seed=3, n=2, logprobs=True)
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.logprobs.content and all(t.logprob <= 0 for t in c.logprobs.content) for c in chat.choices)
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
                 "temperature": 1.0, "seed": 3, "n": 2}
    texts, chunks = stream_choices(node.url + "/v1/chat/completions", chat_body)
    assert texts == {c.index: c.message.content for c in chat.choices}
    roles = [c["index"] for ch in chunks for c in ch["choices"] if c["delta"].get("role")]
    assert roles == [0, 1]  # each choice opens with its role


def test_echo_with_n_puts_the_prompt_before_every_choice(node):
    done = httpx.post(node.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2,
                                                           "temperature": 0, "echo": True, "logprobs": 1}).json()
    for choice in done["choices"]:
        assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
        assert choice["logprobs"]["token_logprobs"][0] is None
    assert done["choices"][0]["text"] == done["choices"][1]["text"]
