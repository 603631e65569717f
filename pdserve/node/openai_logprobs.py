"""The engine's per-token logprobs (engine/sampler.py: token_logprobs) in OpenAI's two formats:
completions' legacy one (tokens, token_logprobs, top_logprobs, text_offset) and chat's
(content: token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from typing import Any, Callable

from pdserve.engine.messages import TokenLogprob

TokenTexts = Callable[[list[int]], list[str]]


def _names(records: list[TokenLogprob | None], texts: TokenTexts, ids: list[int] = ()) -> dict[int, str]:
    wanted = set(ids) | {r.token_id for r in records if r} | {t for r in records if r for t, _ in r.top}
    wanted = sorted(wanted)
    return dict(zip(wanted, texts(wanted)))


def completion_logprobs(records: list[TokenLogprob], texts: TokenTexts, offset: int = 0,
                        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict[str, Any]:
    """`offset`: where the first token starts in the text (a stream's earlier chunks). `prompt`:
    echo's prompt token ids and their logprobs first (the first token has none: null)."""
    prompt_ids, prompt_records = prompt or ([], [])
    entries = list(zip(prompt_ids, prompt_records)) + [(r.token_id, r) for r in records]
    names = _names([r for _, r in entries], texts, [t for t, _ in entries])
    tokens = [names[t] for t, _ in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    # vLLM's top_logprobs: the k most likely, and the token itself (if it was not among them)
    top = [None if r is None else {**{names[t]: lp for t, lp in r.top},
                                   **({} if any(t == r.token_id for t, _ in r.top) else {names[r.token_id]: r.logprob})}
           for _, r in entries]
    return {"tokens": tokens, "token_logprobs": [None if r is None else r.logprob for _, r in entries],
            "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(records: list[TokenLogprob | None], texts: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> logprob, rank, decoded_token, for
    the prompt's own token and the most likely ones; None for the first."""
    names = _names(records, texts)
    out: list[dict[str, Any] | None] = []
    for r in records:
        if r is None:
            out.append(None)
            continue
        ranked = {r.token_id: (r.logprob, r.rank)}
        for rank, (t, lp) in enumerate(r.top, start=1):
            ranked.setdefault(t, (lp, rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": names[t]} for t, (lp, rank) in ranked.items()})
    return out


def chat_logprobs(records: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    names = _names(records, texts)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        name = names[token_id]
        return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}

    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}
