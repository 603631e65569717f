"""Turn the last-position logits of a batch into next tokens, and report their logprobs.

Greedy rows take the argmax. Other rows are scaled by temperature and filtered by top-k / top-p
in one batched pass; each then draws from its own generator, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from pdserve.engine.messages import TokenLogprob
from pdserve.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest set of top tokens whose mass reaches top_p (the first always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Log probabilities as OpenAI and vLLM report them: the model's own distribution (vLLM's
    default, raw logprobs), log-softmax of the logits before temperature, top-k/top-p and the logit
    controls, so a request's logprobs do not depend on how it was sampled.

    Row i: the logprob of tokens[i] and the ks[i] most likely tokens, from raw logits."""
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
