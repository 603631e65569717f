"""Structured output: a request's constraint (JSON schema, any JSON object, regex, a choice among
strings, or a Lark grammar) as a token mask on its logits, on llguidance.

`Grammars` compiles a request's `StructuredOutputs` once (validated against this model's
tokenizer, cached: the server compiles it on its own thread, the engine reuses it) and gives every
sequence its own matcher. `allowed_tokens` says which tokens may come next for a batch of matchers
(computed in parallel, as bitmasks, then unpacked in one tensor op); a matcher advances with each
sampled token (`accept`) and says when the constraint is complete and allows nothing more but the
end (`done`): the request then stops.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import cache

import llguidance
import torch

from pdserve.sampling_params import InvalidParameter, StructuredOutputs

CACHED_GRAMMARS = 64
MAX_ERROR_CHARS = 400  # of llguidance's message, in a 400's body
MAX_MASK_THREADS = 8
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> str | None:
        """Advance past a sampled token; why not, if the grammar refuses it (it was masked: a bug)."""
        return None if self.matcher.consume_token(token_id) else self.matcher.get_error() or "refused"

    @property
    def done(self) -> bool:
        """The constraint is complete and nothing more can follow (only the end of the sequence)."""
        return self.matcher.is_stopped()


def allowed_tokens(matchers: list[GrammarMatcher], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(matchers), vocab_size) bools: which tokens each grammar allows next (a logit past the
    tokenizer's vocabulary never)."""
    words = -(-vocab_size // 32)
    bits = torch.zeros((len(matchers), words), dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                                        words * 4, len(matchers))
    allowed = ((bits.unsqueeze(-1) >> _BITS) & 1).view(len(matchers), -1)[:, :vocab_size]
    return allowed.bool().to(device)


@cache
def _executor() -> llguidance.LLExecutor:
    # Masks are computed between forward passes, while torch's threads wait: as many as they are.
    return llguidance.LLExecutor(max(1, min(MAX_MASK_THREADS, torch.get_num_threads())))


class Grammars:
    """Compiles requests' constraints for one tokenizer; safe to call from the server's threads."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json, self._vocab_size, self._eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of spec, validated; InvalidParameter names the field at fault."""
        key = json.dumps(spec.to_wire(), sort_keys=True)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = _grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg_tokenizer())
        if error:
            message = " ".join(line.strip() for line in error.splitlines() if line.strip())
            raise InvalidParameter(spec.field, f"invalid {spec.kind} constraint: {message[:MAX_ERROR_CHARS]}")
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), self.compile(spec), log_level=0)
        if matcher.is_error():
            raise InvalidParameter(spec.field, f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer


def _grammar(spec: StructuredOutputs) -> str:
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":  # Lark string literals are JSON's
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    return llguidance.LLMatcher.grammar_from_lark(spec.value)  # grammar
