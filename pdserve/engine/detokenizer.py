"""Incremental detokenization: text grows token by token without re-decoding the whole output."""

from __future__ import annotations

from pdserve.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # decode from here so byte-level merges see their left context
        self._read_offset = 0  # tokens before this are already in `text`
        self._sent = 0  # characters of `text` already handed out by take_delta
        self._stopped = False

    def add(self, token_id: int) -> None:
        if self._stopped:
            return
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset :])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token to finish it.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def extend(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self.add(token_id)

    def truncate_at_stop(self, stops: list[str]) -> bool:
        """Cut the text before the first stop string it contains; True if one was found."""
        found = [i for i in (self.text.find(s) for s in stops) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self._sent = min(self._sent, len(self.text))
        self._stopped = True
        return True

    def take_delta(self, holdback: int, finished: bool) -> str:
        """New text since the last call, keeping back what could still become a stop string."""
        end = len(self.text) if finished or holdback == 0 else max(self._sent, len(self.text) - holdback + 1)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta


class NoText:
    """A detokenizer for token ids that stand for no text: the simulator's placeholder tokens, and
    tests of the scheduler alone."""

    text = ""

    def add(self, token_id: int) -> None:
        pass

    def extend(self, token_ids: list[int]) -> None:
        pass

    def take_delta(self, holdback: int, finished: bool) -> str:
        return ""
