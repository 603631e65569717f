"""What the proxy predicts a placement costs, from a `pdserve profile` file.

The proxy reads the profile's fitted models (features and coefficients, as plan/profile.py writes
them) without the planning package: prefill chunk = a + b * tokens + c * tokens * (context before
+ tokens / 2); decode step = a + b * sequences + c * KV tokens; transfer = latency + bytes /
bandwidth per transport; plus what serving adds per request hop. tests/test_placement.py checks
that these predictions are the planner's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    chunk: tuple[float, float, float]  # one, tokens, attention pairs
    step: tuple[float, float, float]  # one, sequences, KV tokens
    transfer: dict[str, tuple[float, float]]  # transport -> (latency s, s per byte)
    request_hop_s: float
    kv_bytes_per_token: int
    chunk_size: int  # the nodes' token budget: a prompt is prefilled in chunks of this many

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """ValueError naming what is wrong with the file, in one line."""
        try:
            return cls.of(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise ValueError(f"--profile {path}: {exc.strerror} (make one with `pdserve profile --out ...`)") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--profile {path}: not a pdserve profile ({type(exc).__name__}: {exc})") from None

    @classmethod
    def of(cls, data: dict) -> CostModel:
        """From a profile as plan/profile.py writes it (the simulator passes its Profile's dict)."""
        chunk = _coefficients(data["prefill_chunk"], ["one", "tokens", "attention_pairs"])
        step = _coefficients(data["decode_step"], ["one", "seqs", "kv_tokens"])
        transfer = {name: _coefficients(fit, ["one", "bytes"]) for name, fit in data["transfer"].items()}
        node = data["meta"]["node"]
        return cls(chunk, step, transfer, float(data.get("serving", {}).get("request_s", 0.0)),
                   int(node["kv_bytes_per_token"]), int(node["max_num_batched_tokens"]))

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """Seconds to prefill tokens [cached, tokens) in chunks of the token budget."""
        a, b, c = self.chunk
        total, done = 0.0, cached
        while done < tokens:
            n = min(self.chunk_size, tokens - done)
            total += a + n * (b + c * (done + n / 2))
            done += n
        return total

    def step_s(self, seqs: int, kv_tokens: int) -> float:
        a, b, c = self.step
        return a + b * seqs + c * kv_tokens

    def transfer_s(self, tokens: int, transport: str = "shm") -> float:
        latency, per_byte = self.transfer.get(transport) or next(iter(self.transfer.values()))
        return latency + per_byte * tokens * self.kv_bytes_per_token


def _coefficients(fit: dict, features: list[str]) -> tuple[float, ...]:
    if fit["features"] != features:
        raise ValueError(f"expected features {features}, got {fit['features']}")
    return tuple(float(c) for c in fit["coefficients"])
