"""Auto mode's shape at N nodes (plan/shape.py), on the profile the sixth look's win map was measured with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.plan.profile import Profile
from pdserve.plan.shape import REQUESTS, ROLE_MARGIN, candidates, pick_shape
from pdserve.workload import named_dataset

RESULTS = Path(__file__).resolve().parent.parent / "docs/results"


@pytest.fixture(scope="module")
def sixth_look():
    """(profile, chat requests, the map's SLO sets, the map's measured cells)."""
    winmap = json.loads((RESULTS / "winmap_nogil.json").read_text())
    profile = Profile.load(RESULTS / "winmap_first_token_profile.json")
    return profile, named_dataset("chat", REQUESTS, seed=0), winmap["slo_sets"], winmap["map"]["chat"]


def test_the_shape_is_the_kind_that_won_the_measured_map(sixth_look):
    """Measured at 2 nodes (docs/benchmarks.md, sixth look): colocated with chunks won every
    TTFT + TPOT cell, 1P1D every cell with an ITL SLO. The pick at the load's default rates agrees."""
    profile, requests, slo_sets, measured = sixth_look
    for name, slos in slo_sets.items():
        pick = pick_shape(profile, requests, slos, 2)
        kinds = {"colocated" if cell["winner"] in "ab" else "PD" for cell in measured[name]}
        assert kinds == {"PD" if pick.disaggregated else "colocated"}, (name, pick.describe())
        shapes = {"colocated:2", "colocated:2 (no chunked prefill)", "pull:1P1D"}
        # a P/D pick's per-role variants are simulated too, a colocated pick's none
        tuned = {f"pull:1P1D ({f})" for f in ("--prefill-max-num-batched-tokens 512", "--decode-max-num-seqs 4",
                                              "--decode-max-num-seqs 8", "--decode-max-num-seqs 16")}
        assert set(pick.goodput) == (shapes | tuned if pick.disaggregated else shapes)
        assert len(pick.rates) == 3 and pick.rates[0] < pick.rates[1] < pick.rates[2]
    assert pick_shape(profile, requests, slo_sets["itl"], 2).setup.startswith("pull:1P1D")
    assert pick_shape(profile, requests, slo_sets["ttft+tpot"], 2).setup == "colocated:2"


def test_a_pd_shape_takes_a_per_role_setting_only_where_it_gains_the_role_margin(sixth_look):
    """Under the ITL SLO the simulator finds a D of at most 8 streams better than the node's own 64
    (a shorter step); the pick takes the best variant, and keeps the node's own settings where no
    variant gains ROLE_MARGIN."""
    profile, requests, slo_sets, _ = sixth_look
    pick = pick_shape(profile, requests, slo_sets["itl"], 2)
    best = max((s for s in pick.goodput if s.startswith("pull:1P1D")), key=lambda s: sum(pick.goodput[s]))
    assert pick.setup == best != "pull:1P1D" and pick.family.decode_max_seqs is not None
    assert sum(pick.goodput[best]) > (1 + ROLE_MARGIN) * sum(pick.goodput["pull:1P1D"])
    assert f"--decode-max-num-seqs {pick.family.decode_max_seqs}" in pick.setup


def test_pd_must_beat_colocated_by_the_margin(sixth_look):
    profile, requests, slo_sets, _ = sixth_look
    pick = pick_shape(profile, requests, slo_sets["itl"], 2)
    pd, colocated = sum(pick.goodput["pull:1P1D"]), sum(pick.goodput["colocated:2"])
    assert pd > 1.1 * colocated
    wide = pick_shape(profile, requests, slo_sets["itl"], 2, margin=pd / colocated)  # a tie within the margin
    assert wide.setup == "colocated:2" and not wide.disaggregated


def test_only_shapes_of_exactly_n_nodes_are_candidates(sixth_look):
    profile, requests, slo_sets, _ = sixth_look
    assert {f.unit_nodes for f in candidates(profile, slo_sets["itl"], 3)} == {1, 3}
    assert all(f.mode in ("colocated", "pull") for f in candidates(profile, slo_sets["itl"], 12))
    assert pick_shape(profile, requests, slo_sets["itl"], 1).setup == "colocated:1"
    pick = pick_shape(profile, requests, slo_sets["itl"], 4, rates=[0.5, 1.0])
    assert pick.rates == [0.5, 1.0] and pick.units * pick.family.unit_nodes == 4


def test_bad_shape_questions_are_named(sixth_look):
    profile, requests, slo_sets, _ = sixth_look
    with pytest.raises(ValueError, match="--nodes 0: expected 1 to 1000"):
        pick_shape(profile, requests, slo_sets["itl"], 0)
    with pytest.raises(ValueError, match="--nodes 1001: expected 1 to 1000"):
        pick_shape(profile, requests, slo_sets["itl"], 1001)
    for rate in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="expected a finite number of requests per second > 0"):
            pick_shape(profile, requests, slo_sets["itl"], 2, rates=[0.5, rate])
    with pytest.raises(ValueError, match="give --slo"):
        pick_shape(profile, requests, {}, 2)


def test_plan_nodes_answers_whether_n_nodes_should_disaggregate(tmp_path):
    """`pdserve plan --nodes 2`: every shape of 2 nodes at the rate, and the one auto runs as."""
    import subprocess
    import sys

    def plan(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--profile",
                               str(RESULTS / "winmap_first_token_profile.json"), "--dataset", "chat", "--rate", "0.5",
                               "--num-prompts", "200", *flags], capture_output=True, text=True, timeout=120)

    itl = plan("--goodput", "itl:69", "--nodes", "2", "--out", str(tmp_path / "shape.json"))
    assert itl.returncode == 0, itl.stderr
    assert itl.stdout.strip().splitlines()[-1] == ("run as pull:1P1D (--decode-max-num-seqs 8) "
                                                   "(pull 1P:1D, D at most 8 streams): disaggregate")
    answer = json.loads((tmp_path / "shape.json").read_text())
    assert answer["pick"] == "pull:1P1D (--decode-max-num-seqs 8)" and answer["disaggregated"] is True
    assert answer["goodput"]["pull:1P1D"] > 1.1 * answer["goodput"]["colocated:2"]
    tpot = plan("--goodput", "ttft:18000", "tpot:25.8", "--nodes", "2")
    assert "run as colocated:2 (colocated): do not disaggregate" in tpot.stdout, tpot.stdout
    bad = plan("--goodput", "itl:69", "--nodes", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == "pdserve: error: --nodes 0: expected 1 to 1000"
