"""Models with random weights, built by transformers from a config and saved as model directories
that pdserve serves: for benchmarks whose costs do not depend on the weights' values, and for tests
that compare pdserve with transformers on architectures no small checkpoint exists for offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def save_random_model(config, path: str | Path, perturbed: tuple[str, ...] = ()):
    """A transformers model of `config` with seeded random weights, saved to `path` with the embedded
    SmolLM2's tokenizer; returns the model. Parameters whose names contain one of `perturbed` (norms,
    biases: ones and zeros at init) get noise too, so that a comparison sees every weight."""
    import transformers

    from pdserve.models.locate import resolve_model_dir

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in perturbed):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_dir(None) / f, Path(path) / f)
    return model
