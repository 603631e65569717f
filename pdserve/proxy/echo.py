"""The prompt's part of an answer in PD: completions' `echo` (the prompt text, and with `logprobs`
its tokens' logprobs) and vLLM's `prompt_logprobs` field.

Only the node that computes the prompt can report its logprobs: P. So P is asked for them with
its one-token prefill request, D is asked for the answer alone, and the proxy puts P's prompt part
before D's answer: into the JSON body, or as the stream's first chunk (D's `text_offset`s then
shifted past the prompt's tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

PROMPT_FIELDS = ("echo", "prompt_logprobs")


def reports_prompt(body: dict[str, Any]) -> bool:
    return bool(body.get("echo")) or body.get("prompt_logprobs") is not None


def prompt_only(body: dict[str, Any]) -> bool:
    """The scoring call (echo or prompt logprobs, max_tokens 0): one node computes and reports the
    prompt, nothing is decoded, so no KV moves."""
    return reports_prompt(body) and 0 in (body.get("max_tokens"), body.get("max_completion_tokens"))


def for_prefill(body: dict[str, Any]) -> dict[str, Any]:
    """P's body: echo asks for its tokens' logprobs too (their texts make a token-id prompt's echo)."""
    if body.get("echo") and body.get("logprobs") is None:
        return {**body, "logprobs": 0}
    return body


def for_decode(body: dict[str, Any]) -> dict[str, Any]:
    """D's body: the answer alone (D does not compute the prompt)."""
    return {k: v for k, v in body.items() if k not in PROMPT_FIELDS}


@dataclass(frozen=True)
class PromptPart:
    echo: str | None  # the prompt's text, when the client asked for echo
    logprobs: dict[str, list] | None  # completions' lists for the prompt tokens, when echo and logprobs
    vllm: list | None  # vLLM's prompt_logprobs field, when asked for

    @classmethod
    def of(cls, body: dict[str, Any], p_answer: dict[str, Any]) -> PromptPart:
        """From the client's body and P's answer (prompt + P's one token)."""
        choice, n = p_answer["choices"][0], p_answer["usage"]["prompt_tokens"]
        lists = {k: v[:n] for k, v in (choice.get("logprobs") or {}).items()}
        echo = None
        if body.get("echo"):
            prompt = body.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) \
                else prompt
            echo = prompt if isinstance(prompt, str) else "".join(lists.get("tokens", []))
        wants_logprobs = body.get("echo") and body.get("logprobs") is not None
        return cls(echo, lists if wants_logprobs and lists else None, choice.get("prompt_logprobs"))

    @property
    def offset(self) -> int:
        """Where D's first token starts in the text the client sees."""
        return sum(map(len, self.logprobs["tokens"])) if self.logprobs else 0

    def before(self, choice: dict[str, Any], first: bool = True) -> None:
        """Put the prompt's part into one choice of D's answer (a whole answer, or a stream chunk)."""
        if first and self.echo is not None:
            choice["text"] = self.echo + choice.get("text", "")
        lp = choice.get("logprobs")
        if self.logprobs is not None and lp:
            shifted = [o + self.offset for o in lp.get("text_offset", [])]
            if first:
                lp.update({k: self.logprobs[k] + lp.get(k, []) for k in self.logprobs})
                lp["text_offset"] = self.logprobs["text_offset"] + shifted
            else:
                lp["text_offset"] = shifted
        if first and self.vllm is not None:
            choice["prompt_logprobs"] = self.vllm

    def into_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        for choice in answer["choices"]:  # each of the n sequences answers the same prompt
            self.before(choice)
        return answer

    async def into_stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """D's SSE stream with the prompt's part in each choice's first chunk and offsets shifted after."""
        buffer, started = b"", set()  # the choice indices already given the prompt's part
        async for raw in chunks:
            buffer += raw
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield self._event(event, started) + b"\n\n"
        if buffer:
            yield buffer

    def _event(self, event: bytes, started: set[int]) -> bytes:
        """The event with the prompt's part applied to its choices."""
        if not event.startswith(b"data: {"):
            return event
        data = json.loads(event[len(b"data: "):])
        if not data.get("choices"):
            return event
        for choice in data["choices"]:
            index = choice.get("index", 0)
            self.before(choice, index not in started)
            started.add(index)
        return b"data: " + json.dumps(data).encode()
