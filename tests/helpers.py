"""Reference computations used by several tests."""

from __future__ import annotations

import torch

from pdserve.engine.detokenizer import NoText
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams


def make_request(tokens: list[int], rid: str = "r", max_tokens: int = 4, params: SamplingParams | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> Request:
    """A request for the scheduler, block manager or sampler alone: no detokenizer; no stop token
    unless `eos_token_ids` (with `params` that do not ignore EOS)."""
    params = params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, NoText(), eos_token_ids, 10_000, None)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, never stopping at EOS (like ignore_eos)."""
    input_ids = torch.tensor([prompt_ids])
    out = model(input_ids=input_ids, use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens


def hf_with_weights_of(llm):
    """transformers' Llama on the weights pdserve's model computes with (the dequantized ones, when
    quantized), float32: the reference for a quantized engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model, cfg = llm.engine.model_runner.model, llm.engine.model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = {}
    for name, tensor in model.state_dict().items():
        name = "model." + name if not name.startswith("lm_head") else name
        if name.endswith("qkv_proj.weight"):
            for part, t in zip("qkv", tensor.float().split([q, kv, kv])):
                weights[name.replace("qkv_proj", f"{part}_proj")] = t
        elif name.endswith("gate_up_proj.weight"):
            for part, t in zip(("gate", "up"), tensor.float().chunk(2)):
                weights[name.replace("gate_up_proj", f"{part}_proj")] = t
        else:
            weights[name] = tensor.float()
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llm.engine.model_dir), dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    reference.tie_weights()
    return reference.eval()


def push_in_chunks(sender, request_id: str, target, chunks: list[tuple[list[int], list[int]]], num_layers: int,
                   first_token: int | None = None) -> None:
    """Push (P blocks, D blocks) chunks as a chunked prefill's steps do: every layer of each step
    through the forward pass's hook, the last chunk ending the session (with the token its step
    sampled, `first_token`)."""
    from pdserve.kv.push import SaveSpec

    for i, (src, dst) in enumerate(chunks):
        last = i == len(chunks) - 1
        sender.begin_step([SaveSpec(request_id, target, [src], [dst], last=last)])  # one KV group
        for layer in range(num_layers):
            sender.save_kv_layer(layer)
        sender.wait_for_save({request_id: first_token} if last and first_token is not None else {})


# Two greedy paths (PD and colocated, quantized kernels and transformers) may part only where the
# two tokens are a genuine near-tie of the float32 logits: within this, in logprob.
PATH_TIE_MARGIN = 0.25


def divergence_margin(llm, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> tuple[int, float] | None:
    """Where two greedy continuations of `prompt_ids` first differ: (the index, how far apart the two
    tokens' logprobs are in `llm`'s float32 logits there, given the common prefix). None where they
    do not differ (one may stop earlier). A token outside the 20 most likely counts as infinitely far."""
    from pdserve.sampling_params import SamplingParams

    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is None:
        return None
    [out] = llm.generate([prompt_ids + ours[:index]], SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    top = dict(out.logprobs[0].top)
    a, b = top.get(ours[index]), top.get(theirs[index])
    return index, float("inf") if a is None or b is None else abs(a - b)


def every_transport() -> list:
    """Every registered KV transport as a test parameter; one whose library cannot load here (a
    transfer engine not installed) is skipped, the reason printed."""
    import pytest

    from pdserve.kv.transport import TRANSPORTS, transport_class

    return [pytest.param(name, marks=pytest.mark.skipif(bool(transport_class(name).unavailable()),
                                                        reason=str(transport_class(name).unavailable())))
            for name in TRANSPORTS]


def corrupting(transport):
    """Fault injection for the verified handoff (issue 39), test-only: `transport` (a real one, on a
    node's pools) corrupts one bit of the first block of each transfer it drives: a read (pull)
    lands it flipped; a write (push) sends it flipped (our copy is flipped back once the bytes are
    out, so our own digest is of the right bytes)."""
    import torch

    def flip(piece, local_ids, layers):
        pool = transport.pools[piece.rank]
        pool.tensor[layers.start, 0, local_ids[0], 0].view(torch.int16)[0] ^= 1

    read, write = transport.read, transport.write

    def corrupt_read(conn, peer, piece, remote_ids, local_ids, layers):
        moved = read(conn, peer, piece, remote_ids, local_ids, layers)
        flip(piece, local_ids, layers)
        return moved

    def corrupt_write(conn, peer, piece, local_ids, remote_ids, layers):
        flip(piece, local_ids, layers)
        try:
            return write(conn, peer, piece, local_ids, remote_ids, layers)
        finally:
            flip(piece, local_ids, layers)

    transport.read, transport.write = corrupt_read, corrupt_write
    return transport
