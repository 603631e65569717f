"""Least-squares cost models: time = sum of coefficient x feature, fitted on relative error.

Relative, not absolute: a profile spans 1 ms decode steps and 5 s prefills, and an absolute fit
would spend all its freedom on the long ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.proxy.costs import feature_value


@dataclass
class LinearFit:
    features: list[str]  # "one" is the constant term, "x>k" the hinge max(0, x - k)
    coefficients: list[float]  # seconds per unit of each feature
    mean_rel_error: float  # |predicted - measured| / measured over the samples fitted
    max_rel_error: float
    samples: int

    def predict(self, values: dict[str, float]) -> float:
        return sum(c * feature_value(f, values) for f, c in zip(self.features, self.coefficients))

    @classmethod
    def from_dict(cls, data: dict) -> LinearFit:
        return cls(**data)


def fit_linear(rows: list[dict[str, float]], times: list[float], features: list[str]) -> LinearFit:
    """Fit `times` (seconds, > 0) as a linear function of `features` of each row."""
    if len(rows) != len(times) or len(rows) < len(features):
        raise ValueError(f"need at least {len(features)} samples for features {features}, got {len(rows)}")
    if any(t <= 0 for t in times):
        raise ValueError("measured times must be > 0")
    x = torch.tensor([[feature_value(f, row) for f in features] for row in rows], dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    weights = 1.0 / y  # minimise relative error
    coef = torch.linalg.lstsq(x * weights[:, None], (y * weights)[:, None]).solution[:, 0]
    rel = ((x @ coef - y).abs() / y)
    return LinearFit(features, coef.tolist(), float(rel.mean()), float(rel.max()), len(rows))
