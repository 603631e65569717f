"""Turn the last-position logits of a batch into next tokens.

Greedy rows take the argmax. Other rows are scaled by temperature and filtered by top-k / top-p
in one batched pass; each then draws from its own generator, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

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
