"""The recipes of docs/architecture.md hold: a proxy flow, a routing policy and a placement rule,
added by a plugin module (tests/plugins/throwaway_recipes.py, named in PDSERVE_PLUGINS) without
touching a pdserve file, become CLI choices and run end to end: the flow and policy through a real
proxy over real nodes, the placement rule through `pdserve simulate` (the proxy's own Placer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
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
