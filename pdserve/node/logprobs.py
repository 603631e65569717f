"""The engine's per-token logprobs (engine/logprobs.py) in OpenAI's two formats:
completions' legacy one (tokens, token_logprobs, top_logprobs, text_offset) and chat's
(content: token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from typing import Any, Callable

from pdserve.engine.logprobs import TokenLogprob

TokenTexts = Callable[[list[int]], list[str]]


def _names(records: list[TokenLogprob], texts: TokenTexts) -> dict[int, str]:
    ids = sorted({r.token_id for r in records} | {t for r in records for t, _ in r.top})
    return dict(zip(ids, texts(ids)))


def completion_logprobs(records: list[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """`offset`: where the first token starts in the answer's text (a stream's earlier chunks)."""
    names = _names(records, texts)
    tokens = [names[r.token_id] for r in records]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    # vLLM's top_logprobs: the k most likely, and the sampled token (if it was not among them)
    top = [{**{names[t]: lp for t, lp in r.top}, **({} if any(t == r.token_id for t, _ in r.top)
                                                   else {names[r.token_id]: r.logprob})} for r in records]
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(records: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    names = _names(records, texts)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        name = names[token_id]
        return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}

    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}
