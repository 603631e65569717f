"""What is simulated: the setup (`--setup colocated:N|pull:xPyD|push:xPyD|auto:...`) and each
node's scheduler settings and KV pool."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

MODES = ("colocated", "pull", "push", "auto")


# Per-role settings of a P/D setup: the Setup field and its `pdserve up` / `pdserve simulate` flag.
ROLE_SETTINGS = {"prefill_budget": "--prefill-max-num-batched-tokens", "decode_max_seqs": "--decode-max-num-seqs",
                 "prefill_threads": "--prefill-threads", "decode_threads": "--decode-threads"}


def check_role_settings(values: dict[str, int | None], has_p_and_d: bool, shape: str) -> None:
    """ValueError where a per-role setting (flag -> value, None: not set) cannot apply (no P and D
    nodes) or is out of range."""
    for flag, value in values.items():
        if value is not None and not has_p_and_d:
            raise ValueError(f"{flag} sets P and D nodes by role; {shape} has none")
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class Setup:
    mode: str
    prefill: int  # P nodes (0 when colocated, or auto over colocated nodes)
    decode: int  # D nodes, or colocated nodes
    # Per-role settings of a P/D setup (`pdserve up --prefill-max-num-batched-tokens`,
    # `--decode-max-num-seqs`): None keeps the node's own.
    prefill_budget: int | None = None
    decode_max_seqs: int | None = None
    # Threads (cores) of each P / D node (`--prefill-threads`, `--decode-threads`): a node of more
    # threads is priced by a profile measured at that many (None: the profile's own, one).
    prefill_threads: int | None = None
    decode_threads: int | None = None

    def __post_init__(self) -> None:
        check_role_settings(self.role_settings, self.prefill > 0, f"{self.mode}:{self.decode}")

    @property
    def role_settings(self) -> dict[str, int | None]:
        """flag -> value of every per-role setting (None: the node's own)."""
        return {flag: getattr(self, name) for name, flag in ROLE_SETTINGS.items()}

    @property
    def role_flags(self) -> str:
        """The per-role settings as `pdserve up` / `pdserve simulate` take them ('' when none)."""
        return " ".join(f"{flag} {value}" for flag, value in self.role_settings.items() if value)

    @classmethod
    def parse(cls, text: str) -> Setup:
        """`colocated:N`, `pull:xPyD`, `push:xPyD`, `auto:N` (N kv_both nodes: per request, one prefills
        and decodes, or one prefills and another pulls and decodes)
        or `auto:xPyD` (per request: prefill on D, or on a P then pull); ValueError names what is wrong."""
        mode, _, shape = text.partition(":")
        if mode in ("colocated", "auto") and shape.isdigit() and int(shape) > 0:
            return cls(mode, 0, int(shape))
        match = re.fullmatch(r"(\d+)P(\d+)D", shape)
        if mode in ("pull", "push", "auto") and match and int(match[1]) > 0 and int(match[2]) > 0:
            return cls(mode, int(match[1]), int(match[2]))
        raise ValueError(f"--setup {text!r}: expected colocated:N, pull:xPyD, push:xPyD, auto:N or auto:xPyD "
                         "(e.g. pull:1P3D)")



@dataclass(frozen=True)
class Batching:
    """A node's scheduler settings (`pdserve serve`'s --max-num-batched-tokens, --no-chunked-prefill,
    --max-prefill-tokens-while-decoding, --max-num-seqs) and its KV pool."""

    budget: int
    chunked: bool
    max_seqs: int
    capacity: int  # KV pool, tokens
    block_size: int = 16
    prefill_cap: int | None = None  # prompt tokens a step takes while streams decode (None: the budget)

    @classmethod
    def of(cls, node: dict, budget: int | None = None, chunked: bool = True,
           prefill_cap: int | None = None) -> Batching:
        """The profiled node's settings, with the token budget and chunking a setup asks for.
        Without chunked prefill the budget is at least max_model_len, as the engine makes it."""
        budget = budget or node["max_num_batched_tokens"]
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        if not chunked:  # a profile without max_model_len: no prompt is too long for one step
            budget = max(budget, node.get("max_model_len", 1 << 30))
        if prefill_cap is not None and (prefill_cap < 0 or not chunked):
            raise ValueError("--max-prefill-tokens-while-decoding must be >= 0 and needs chunked prefill, "
                             f"got {prefill_cap}")
        return cls(budget, chunked, node["max_num_seqs"], node["kv_capacity_tokens"], node.get("block_size", 16),
                   prefill_cap)

    def for_role(self, setup: Setup, role: str) -> Batching:
        """This node's settings with the setup's per-role ones for `role` (prefill | decode)."""
        if role == "prefill" and setup.prefill_budget and self.chunked:  # unchunked, a whole prompt is a step
            return replace(self, budget=setup.prefill_budget)
        if role == "decode" and setup.decode_max_seqs:
            return replace(self, max_seqs=setup.decode_max_seqs)
        return self

    @property
    def num_blocks(self) -> int:
        return self.capacity // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
