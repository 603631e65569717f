"""Log probabilities of sampled tokens, as OpenAI and vLLM report them.

They are the model's own distribution (vLLM's default, raw logprobs): log-softmax of the logits
before temperature, top-k/top-p and the logit controls, so a request's logprobs do not depend on
how it was sampled.
"""

from __future__ import annotations

import torch

from pdserve.engine.messages import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob of tokens[i] and the ks[i] most likely tokens, from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k_max = max(ks)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks)):
        top = tuple(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else ()
        out.append(TokenLogprob(token, chosen[i], top, ranks[i]))
    return out
