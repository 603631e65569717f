"""The recipes of docs/architecture.md hold: a proxy flow, a routing policy, a placement rule and a
model family, added by a plugin module (tests/plugins/throwaway_recipes.py, named in
PDSERVE_PLUGINS) without touching a pdserve file, become choices and run end to end: the flow and
policy through a real proxy over real nodes, the placement rule through `pdserve simulate` (the
proxy's own Placer), the model family through LLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from safetensors.torch import load_file, save_file
from servers import MODEL, NODE, Procs
from test_plan_simulator import known_profile

from pdserve.registry import PLUGINS_ENV

PLUGINS_DIR = os.path.join(os.path.dirname(__file__), "plugins")


def with_plugin(env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGINS_DIR, env.get("PYTHONPATH")) if p)
    env[PLUGINS_ENV] = "throwaway_recipes"
    return env


def test_a_plugin_flow_and_policy_serve_through_a_real_proxy(tmp_path, fp32_node):
    with Procs(tmp_path) as procs:
        other = procs.start(["serve", *NODE], "other")
        procs.env = with_plugin()
        proxy = procs.start(["proxy", "--mode", "stamped", "--policy", "last_node", "--node", fp32_node.url,
                             "--node", other.url], "proxy")
        for _ in range(3):
            r = httpx.post(proxy.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                               "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.headers["x-stamped-by"] == other.url  # the plugin's flow, on the plugin's policy's choice
        served = {n["url"]: n["served"] for n in httpx.get(proxy.url + "/v1/nodes").json()["nodes"]}
        assert served == {fp32_node.url: 0, other.url: 3}
        assert httpx.get(proxy.url + "/health").json()["mode"] == "stamped"
    # The flow declares its roles: the membership and the flags follow them.
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", "--mode", "stamped", "--prefill",
                              "http://a:1", "--decode", "http://b:1"], capture_output=True, text=True, timeout=60,
                             env=with_plugin())
    assert refused.returncode == 2 and "stamped mode takes --node URLs, not --prefill" in refused.stderr, refused.stderr
    # Without the plugin, it is no choice.
    absent = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", "--mode", "stamped", "--node", "http://a:1"],
                            capture_output=True, text=True, timeout=60)
    assert absent.returncode == 2 and "invalid choice: 'stamped'" in absent.stderr


def test_a_plugin_placement_rule_places_every_request_in_the_simulator(tmp_path):
    path, out = tmp_path / "profile.json", tmp_path / "sim.json"
    known_profile().save(path)
    args = [sys.executable, "-m", "pdserve.cli", "simulate", "--profile", str(path), "--setup", "auto:1P2D",
            "--dataset", "mixed", "--num-prompts", "20", "--request-rate", "4", "--out", str(out)]
    for rule, local in (("always_local", 20), ("round_robin", 0)):
        done = subprocess.run([*args, "--placement", rule], capture_output=True, text=True, timeout=120,
                              env=with_plugin())
        assert done.returncode == 0, done.stderr
        data = json.loads(out.read_text())
        assert data["placement"] == rule and data["placement_counts"] == {"local": local, "remote": 20 - local}


def test_a_plugin_model_family_loads_and_generates(tmp_path, random_llama, monkeypatch):
    """The plugin's family (a Llama relative whose embeddings are scaled by sqrt(hidden)) under its
    own model_type equals the random Llama whose embedding weights carry that scale, on one rank and
    on two (a spawned TP rank loads the plugin itself)."""
    for name, value in with_plugin().items():
        monkeypatch.setenv(name, value)
    sys.path.insert(0, PLUGINS_DIR)
    import throwaway_recipes  # noqa: F401  (registers its classes in this process)

    from pdserve import LLM, SamplingParams

    family, scaled = tmp_path / "family", tmp_path / "scaled"
    shutil.copytree(random_llama, family)
    shutil.copytree(random_llama, scaled)
    config = json.loads((family / "config.json").read_text())
    (family / "config.json").write_text(json.dumps({**config, "model_type": "throwaway_scaled_llama"}))
    [weights_file] = scaled.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * config["hidden_size"] ** 0.5
    save_file(weights, weights_file)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [[1, 5, 9, 200, 31], [7, 7, 3000]]
    outputs = {}
    for name, path, tp in (("family", family, 1), ("scaled", scaled, 1), ("family TP 2", family, 2)):
        llm = LLM(str(path), dtype="float32", quantization="none", kv_cache_memory_gib=0.02, tensor_parallel_size=tp)
        outputs[name] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]
        llm.engine.close()
    assert outputs["family"] == outputs["scaled"]
    assert [tokens for tokens, _ in outputs["family TP 2"]] == [tokens for tokens, _ in outputs["family"]]
    (family / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with pytest.raises(ValueError, match="model_type must be one of llama, .*throwaway_scaled_llama, got 'no_such_family'"):
        LLM(str(family), kv_cache_memory_gib=0.02)
