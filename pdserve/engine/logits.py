"""A request's logit controls, applied to its row before a token is drawn (greedy rows too), in
vLLM's order:
1. min_tokens: until the output has that many tokens, its stop tokens (EOS included) cannot be drawn;
2. logit_bias: added as given;
3. penalties: repetition (HF's CTRL rule: a positive logit divided by it, a negative one multiplied,
   for every token of the prompt and the output), then frequency and presence (OpenAI's: minus the
   token's count in the output times frequency_penalty, minus presence_penalty if it is there);
4. structured output: tokens the request's grammar does not allow next are masked (engine/grammar.py).
   Should the controls leave no allowed token a finite logit (min_tokens holding back the EOS
   that a complete grammar wants), the grammar wins: its allowed tokens are drawn evenly.
"""

from __future__ import annotations

import torch

from pdserve.engine.grammar import allowed_tokens
from pdserve.engine.request import Request


def apply_logit_controls(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """`logits` (one row per request, in order) with each request's controls applied, in place."""
    for row, req in zip(logits, requests):
        p = req.params
        if not p.adjusts_logits:
            continue
        device = row.device
        output = req.output_token_ids
        if len(output) < p.min_tokens and req.stop_token_ids:
            row[torch.tensor(sorted(req.stop_token_ids), device=device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.token_ids, device=device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and output:
            ids, counts = torch.tensor(output, device=device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    constrained = [i for i, req in enumerate(requests) if req.grammar is not None]
    if constrained:  # all rows' masks at once
        allowed = allowed_tokens([requests[i].grammar for i in constrained], logits.shape[-1], logits.device)
        rows = torch.tensor(constrained, device=logits.device)
        masked = logits[rows].masked_fill_(~allowed, float("-inf"))
        stuck = ~torch.isfinite(masked).any(dim=-1)
        if stuck.any():
            masked[stuck] = torch.zeros_like(masked[stuck]).masked_fill_(~allowed[stuck], float("-inf"))
        logits[rows] = masked
    return logits
