"""Reference computations used by several tests."""

from __future__ import annotations

import torch


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
