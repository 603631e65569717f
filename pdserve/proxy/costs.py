"""What the proxy predicts a placement costs, from a `pdserve profile` file.

The proxy reads the profile's fitted models (features and coefficients, as plan/profile.py writes
them) without the planning package: prefill chunk = a + b * tokens + c * tokens * (context before
+ tokens / 2); decode step = a + b * sequences + c * KV tokens + a hinge d_k * max(0, sequences - k)
at each batch size k measured between the smallest and the largest (so the step follows the
measured batches piecewise-linearly); transfer = latency + bytes / bandwidth per transport, plus
what a served pull's handoff adds; plus what serving adds per request hop. tests/test_placement.py
checks that these predictions are the planner's own. The planner's fits evaluate their features
with `feature_value` below.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DECODE_BASE = ["one", "seqs", "kv_tokens"]
_HINGE = re.compile(r"(\w+)>(\d+)$")  # "seqs>8": max(0, seqs - 8)


def feature_value(name: str, values: Mapping[str, float]) -> float:
    """One feature of a cost model: "one" is 1, "x>k" the hinge max(0, x - k), any other name its value."""
    if name == "one":
        return 1.0
    hinge = _HINGE.match(name)
    if hinge:
        return max(0.0, values[hinge[1]] - int(hinge[2]))
    return values[name]


def decode_hinges(fit: dict) -> tuple[tuple[float, float, float], tuple[tuple[int, float], ...]]:
    """A decode-step fit as (a, b, c) of a + b * seqs + c * kv_tokens and its (k, d_k) hinges;
    ValueError when it has other features."""
    features, coefficients = fit["features"], [float(c) for c in fit["coefficients"]]
    hinges = [_HINGE.match(h) for h in features[len(DECODE_BASE):]]
    if features[:len(DECODE_BASE)] != DECODE_BASE or not all(h and h[1] == "seqs" for h in hinges):
        raise ValueError(f"expected decode features {DECODE_BASE} and seqs>K hinges, got {features}")
    return tuple(coefficients[:3]), tuple((int(h[2]), d) for h, d in zip(hinges, coefficients[3:]))


@dataclass(frozen=True)
class CostModel:
    chunk: tuple[float, float, float]  # one, tokens, attention pairs
    step: tuple[float, float, float]  # one, sequences, KV tokens
    step_hinges: tuple[tuple[int, float], ...]  # (k, d): + d * max(0, sequences - k)
    transfer: dict[str, tuple[float, float]]  # transport -> (latency s, s per byte)
    request_hop_s: float
    kv_bytes_per_token: int
    chunk_size: int  # the nodes' token budget: a prompt is prefilled in chunks of this many
    pull_handoff_s: float = 0.0  # what a served pull adds to its bytes' transfer (side channel, D's loader)

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
        step, hinges = decode_hinges(data["decode_step"])
        transfer = {name: _coefficients(fit, ["one", "bytes"]) for name, fit in data["transfer"].items()}
        node = data["meta"]["node"]
        serving = data.get("serving", {})
        return cls(chunk, step, hinges, transfer, float(serving.get("request_s", 0.0)), int(node["kv_bytes_per_token"]),
                   int(node["max_num_batched_tokens"]), float(serving.get("pull_handoff_s", 0.0)))

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
        return a + b * seqs + c * kv_tokens + sum(d * max(0.0, seqs - k) for k, d in self.step_hinges)

    def transfer_s(self, tokens: int, transport: str = "shm") -> float:
        """D's wait for a pull of `tokens` tokens' KV: their bytes' transfer and the handoff around it."""
        latency, per_byte = self.transfer.get(transport) or next(iter(self.transfer.values()))
        return latency + per_byte * tokens * self.kv_bytes_per_token + self.pull_handoff_s


def _coefficients(fit: dict, features: list[str]) -> tuple[float, ...]:
    if fit["features"] != features:
        raise ValueError(f"expected features {features}, got {fit['features']}")
    return tuple(float(c) for c in fit["coefficients"])
