"""Engine behaviour on the real SmolLM2: batching, prefix cache, chunking, preemption, sampling."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def long_prompt(llm: LLM, words: int, noun: str = "item") -> list[int]:
    text = " ".join(f"{noun}{i % 97} is number {i}." for i in range(words))
    return llm.tokenizer.encode(text)


@pytest.fixture(scope="module")
def prompts(llm_fp32):
    tok = llm_fp32.tokenizer
    texts = [
        "Hello",
        "The three primary colors are",
        "Water boils at a temperature of",
        "A list of prime numbers: 2, 3, 5, 7,",
        "The first law of thermodynamics states that energy",
        "In computer science, a hash table is a data structure that",
        "Photosynthesis converts light energy into chemical energy. The process begins when",
    ]
    return [tok.encode(t) for t in texts] + [long_prompt(llm_fp32, 20)]


@pytest.fixture(scope="module")
def solo_outputs(llm_fp32, prompts):
    return [llm_fp32.generate(p, GREEDY)[0].token_ids for p in prompts]


def test_batch_invariance(llm_fp32, prompts, solo_outputs):
    assert len({len(p) for p in prompts}) == len(prompts)  # 8 different lengths
    batched = llm_fp32.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == solo_outputs
    assert llm_fp32.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_reuses_blocks_and_keeps_output(llm_fp32, prompts):
    shared = long_prompt(llm_fp32, 30, noun="zebra")
    first = llm_fp32.generate(shared + [100, 200], GREEDY)[0]
    second = llm_fp32.generate(shared + [100, 200], GREEDY)[0]
    bs = llm_fp32.engine.config.block_size
    assert first.metrics.num_cached_tokens < bs  # nothing of it was cached before
    assert second.metrics.num_cached_tokens >= (len(shared) // bs - 1) * bs
    assert second.token_ids == first.token_ids
    other = llm_fp32.generate(shared + [300], GREEDY)[0]  # same prefix, different tail
    assert other.metrics.num_cached_tokens >= (len(shared) // bs - 1) * bs
    assert other.token_ids == LLM_NO_CACHE(llm_fp32).generate(shared + [300], GREEDY)[0].token_ids


_no_cache: dict[str, LLM] = {}


def LLM_NO_CACHE(llm: LLM) -> LLM:
    if "llm" not in _no_cache:
        _no_cache["llm"] = LLM(str(llm.engine.model_dir), dtype="float32", quantization="none", num_kv_blocks=256, enable_prefix_caching=False)
    return _no_cache["llm"]


def test_chunked_prefill_same_tokens(llm_fp32, prompts, solo_outputs):
    llm = LLM(str(llm_fp32.engine.model_dir), dtype="float32", quantization="none", num_kv_blocks=256,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == solo_outputs
    assert llm.engine.block_manager.num_used_blocks == 0


def test_preemption_under_tiny_kv_budget(llm_fp32, prompts, solo_outputs):
    # 20 blocks of 16 = 320 tokens: all 8 requests (up to ~250 tokens each with output) can't coexist.
    llm = LLM(str(llm_fp32.engine.model_dir), dtype="float32", quantization="none", num_kv_blocks=20, max_model_len=320,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == solo_outputs
    assert llm.engine.block_manager.num_used_blocks == 0


def test_no_deadlock_when_one_request_needs_the_whole_pool(llm_fp32):
    llm = LLM(str(llm_fp32.engine.model_dir), dtype="float32", quantization="none", num_kv_blocks=4, max_model_len=64,
              max_num_batched_tokens=8)
    prompt = list(range(1000, 1040))
    outs = llm.generate([prompt, prompt[:20], prompt[:30]], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [23, 23, 23]
    assert outs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm_fp32, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm_fp32.generate(prompts[2], params)[0].token_ids
    in_batch = llm_fp32.generate([prompts[0], prompts[2], prompts[5]], params)[1].token_ids
    assert alone == in_batch
    other_seed = llm_fp32.generate(prompts[2], SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm_fp32, prompts, solo_outputs):
    out = llm_fp32.generate(prompts[3], SamplingParams(temperature=1.3, top_k=1, max_tokens=24, ignore_eos=True))
    assert out[0].token_ids == solo_outputs[3]


def test_stop_conditions(llm_fp32, prompts, solo_outputs):
    tok = llm_fp32.tokenizer
    expected = solo_outputs[1]
    full_text = tok.decode(expected)
    # A stop string from the middle of the greedy text: output ends right before it.
    stop = full_text[10:16]
    out = llm_fp32.generate(prompts[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.index(stop)]
    # A stop token id: generation ends with it.
    out = llm_fp32.generate(prompts[1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[expected[4]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == expected[: expected.index(expected[4]) + 1]
    out = llm_fp32.generate(prompts[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == expected[:5]


def test_eos_stops_unless_ignored(llm_fp32):
    prompt = llm_fp32.tokenizer.encode(llm_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]))
    out = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    out = llm_fp32.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64


def test_timings_are_reported(llm_fp32, prompts):
    out = llm_fp32.generate(prompts[4], GREEDY)[0]
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0
    assert len(m.token_times) == len(out.token_ids) == 24
    assert len(m.inter_token_latencies) == 23 and all(t >= 0 for t in m.inter_token_latencies)


def test_streaming_deltas_add_up_to_text(llm_fp32, prompts):
    engine = llm_fp32.engine
    engine.add_request(prompts[5], SamplingParams(temperature=0, max_tokens=30, stop=["zzz-never"]), "stream-1")
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.text_delta)
            final = out
    assert final.finished and "".join(pieces) == final.text and final.text


def test_abort_frees_blocks(llm_fp32, prompts):
    engine = llm_fp32.engine
    engine.add_request(prompts[7], GREEDY, "to-abort")
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    [out] = engine.abort_request("to-abort")
    assert out.finished and out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request("unknown") == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts(llm_fp32):
    with pytest.raises(ValueError, match="empty"):
        llm_fp32.generate("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm_fp32.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_fp32.generate([1, 2, 49152], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_fp32.generate([1, -5], GREEDY)
    too_long = [5] * llm_fp32.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate(too_long, GREEDY)
    assert not llm_fp32.engine.has_unfinished_requests()  # nothing half-queued


def capped_llm(llm_fp32: LLM, cap: int) -> LLM:
    """The float32 model with a 256-token budget and --max-prefill-tokens-while-decoding `cap`."""
    return LLM(str(llm_fp32.engine.model_dir), dtype="float32", quantization="none", num_kv_blocks=256,
               max_num_batched_tokens=256, max_prefill_tokens_while_decoding=cap, enable_prefix_caching=False)


def test_a_prefill_cap_while_decoding_takes_small_chunks_beside_streams_and_keeps_every_token(llm_fp32, prompts,
                                                                                              solo_outputs):
    """--max-prefill-tokens-while-decoding 8: beside a decoding stream a long prompt advances at most 8
    tokens a step (each of the stream's gaps grows by an 8-token chunk, not by the whole prefill);
    alone it takes the whole budget; every answer is the one computed alone."""
    llm = capped_llm(llm_fp32, 8)
    engine = llm.engine
    stream = engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.step()
    assert stream.num_output_tokens == 1  # its prompt in one step: nothing was decoding
    long = engine.add_request(prompts[-1], GREEDY)
    assert len(prompts[-1]) > 100
    advanced = []
    while long.num_output_tokens == 0:
        before, tokens = long.num_computed_tokens, stream.num_output_tokens
        engine.step()
        advanced.append(long.num_computed_tokens - before)
        assert stream.num_output_tokens == tokens + 1  # the stream got its token every step
    assert max(advanced) == 8 and sum(advanced) == len(prompts[-1])
    while engine.has_unfinished_requests():
        engine.step()
    alone = engine.add_request(prompts[-1], GREEDY)
    engine.step()
    assert alone.num_computed_tokens == len(prompts[-1])  # no stream decoding: the whole budget
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == alone.output_token_ids == solo_outputs[-1]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == solo_outputs
    assert engine.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="needs chunked prefill"):
        LLM(str(llm_fp32.engine.model_dir), max_prefill_tokens_while_decoding=8, enable_chunked_prefill=False)


def test_a_zero_prefill_cap_runs_a_prompt_only_once_the_streams_have_finished(llm_fp32, prompts, solo_outputs):
    """--max-prefill-tokens-while-decoding 0: a prompt that arrives while a stream decodes computes
    nothing until that stream's last token (every step of the stream is a decode step alone), then
    takes the whole budget at once; both answers are the ones computed alone."""
    llm = capped_llm(llm_fp32, 0)
    engine = llm.engine
    stream = engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    long = engine.add_request(prompts[-1], GREEDY)
    while stream.num_output_tokens < 12:
        engine.step()
        assert long.num_computed_tokens == 0
    engine.step()
    assert long.num_computed_tokens == len(prompts[-1]) and long.num_output_tokens == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == solo_outputs[-1]
    assert stream.output_token_ids == llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=12,
                                                                                ignore_eos=True))[0].token_ids
    assert engine.block_manager.num_used_blocks == 0
