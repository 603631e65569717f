"""What a request asks of generation, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's default max_logprobs)
MAX_N = 128  # the most sequences one request may ask for (each is a request in the engine)


class InvalidParameter(ValueError):
    """A ValueError that names the offending request parameter (for HTTP 400 bodies)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputs:
    """What the output must match (engine/grammar.py), in vLLM's structured_outputs terms."""

    kind: str  # json (a JSON schema) | json_object (any JSON object) | regex | choice | grammar (Lark)
    value: Any = None  # the schema, regex, list of choices or grammar; None for json_object
    field: str = "structured_outputs"  # the request field it came from: errors name it

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidParameter:
            return InvalidParameter(self.field, message)

        if self.kind == "json":
            if isinstance(self.value, str):
                try:
                    self.value = json.loads(self.value)
                except json.JSONDecodeError as exc:
                    raise bad(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(self.value, (dict, bool)):
                raise bad(f"a JSON schema must be an object, got {type(self.value).__name__}")
        elif self.kind in ("regex", "grammar"):
            if not isinstance(self.value, str) or not self.value:
                raise bad(f"the {self.kind} must be a non-empty string")
        elif self.kind == "choice":
            if (not isinstance(self.value, list) or not self.value
                    or not all(isinstance(c, str) and c for c in self.value)):
                raise bad("choice must be a non-empty list of non-empty strings")
        elif self.kind != "json_object":
            raise bad(f"unknown structured output kind {self.kind!r}")

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # sequences sampled for the prompt; they share its KV blocks (engine/scheduler.py: _fork)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Logit controls (engine/logits.py), in vLLM's and OpenAI's meanings:
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (HF's CTRL rule)
    min_tokens: int = 0  # stop tokens and stop strings do not end the output before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report each sampled token's logprob and this many most likely (engine/sampler.py: token_logprobs)
    prompt_logprobs: int | None = None  # the same for each prompt token (the prompt is computed in full, no cache)
    structured: StructuredOutputs | None = None  # a constraint the output must match (masks on the logits)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidParameter("max_tokens", f"max_tokens must be an integer >= 1 (0 only with prompt logprobs: "
                                                 f"echo's scoring call), got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise InvalidParameter("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidParameter("top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidParameter("stop", "stop strings must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise InvalidParameter("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                                 f"got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidParameter(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not -100 <= bias <= 100:
                raise InvalidParameter("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def decodes_from_given_token(self) -> bool:
        """Whether a decode node may start from the first output token a prefill node sampled,
        instead of computing the last prompt token to sample it again: one sequence (n > 1 samples
        n first tokens), no logprobs (P's are not carried over) and no seeded draw (the decode
        node's generator would be a draw behind a colocated node's, and its tokens would differ)."""
        return self.n == 1 and self.logprobs is None and (self.greedy or self.seed is None)

    def check_vocab(self, vocab_size: int) -> None:
        """What only the model can say: whether logit_bias names tokens it has."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidParameter("logit_bias", f"token id {max(self.logit_bias)} is outside the vocabulary "
                                                 f"[0, {vocab_size})")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit control is set (the sampler leaves other rows alone)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.structured)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
