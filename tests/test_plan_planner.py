"""`pdserve plan`: the smallest passing size per family, the unit decomposition against a whole
simulated cluster, and bad input answered in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_plan_simulator import known_profile, two_thread_profile

from pdserve.plan.planner import Family, Planner, families, prefill_cap_for
from pdserve.plan.sim import Setup, simulate
from pdserve.workload import mixed_dataset

SLOS = {"ttft_ms": 3000.0, "tpot_ms": 60.0}


def requests(n: int = 600):
    return mixed_dataset(n, seed=3, long_fraction=0.1, short=(128, 64), long=(1024, 32))


def test_each_family_gets_its_smallest_passing_size():
    planner = Planner(known_profile(), requests(), 6.0, SLOS, 0.9, 16)
    result = planner.plan()
    assert result["pick"] is not None and result["pick"]["meets"]
    assert result["pick"]["nodes"] == min(r["nodes"] for r in result["setups"] if r["meets"])
    for family in (Family("colocated", 0, 1), Family("pull", 1, 2)):
        choice = planner.smallest(family)
        assert choice.meets and choice.summary["slo_attainment"] >= 0.9
        if choice.units > 1:  # one unit fewer misses the target: the size is the smallest
            assert planner.evaluate(family, choice.units - 1)["slo_attainment"] < 0.9


def test_a_search_from_a_guess_finds_the_same_size_and_needs_two_simulations_where_the_guess_is_right():
    """The planner tries a family first at the size of a solved family of its ratio (pull for push,
    colocated for colocated nodes of other settings): from any guess the search ends at the size a
    bisection over the whole range finds; from the right one, after 2 simulations (it and one fewer)."""
    planner = Planner(known_profile(), requests(300), 6.0, SLOS, 0.9, 40)
    runs = []
    evaluate = planner.evaluate
    planner.evaluate = lambda family, units, whole=False: runs.append(units) or evaluate(family, units, whole)
    sizes = {}
    for family in (Family("colocated", 0, 1), Family("pull", 1, 2)):
        plain = sizes[family] = planner.smallest(family)
        assert plain.meets and 3 <= plain.units < 40 // family.unit_cores, plain.units  # room above and below
        for guess in (1, plain.units - 2, plain.units - 1, plain.units + 1, plain.units + 5, 40 // family.unit_cores):
            found = planner.smallest(family, guess=guess)
            assert (found.units, found.meets) == (plain.units, True), (family, guess)
            assert found.summary["slo_attainment"] == plain.summary["slo_attainment"]
        runs.clear()
        assert planner.smallest(family, guess=plain.units).units == plain.units
        assert runs == [plain.units, plain.units - 1]
    # Where no size up to the largest passes, the search from a guess ends there, as the bisection does.
    colocated = Family("colocated", 0, 1)
    top = sizes[colocated].units - 1
    failing = planner.smallest(colocated, max_cores=top, guess=1)
    assert not failing.meets and failing.units == top
    assert failing.summary == planner.smallest(colocated, max_cores=top).summary  # run whole, for the report


def test_under_an_itl_slo_the_planner_also_tries_colocated_nodes_with_a_prefill_cap_that_fits_it():
    """Known costs: a decode step of 8 streams of 1024 tokens takes 20 + 40 + 81.92 ms; 75 % of a
    400 ms ITL leaves 158 ms for a chunk of 10 ms + 1 ms/token: 144 tokens (whole blocks). At 200 ms
    (150 ms: 8 ms for a chunk) not even 16 tokens fit: the capped families take turns (a cap of 0)."""
    profile = known_profile()
    assert prefill_cap_for(profile, 0.4) == 144 and prefill_cap_for(profile, 0.2) == 0
    tight = families(profile, {"max_itl_ms": 200.0})
    assert [f.prefill_cap for f in tight if f.prefill_cap is not None] == [0, 0]
    assert Family("colocated", 0, 1, prefill_cap=0) in tight and tight[-1] == Family("auto", 0, 2, prefill_cap=0)
    assert Family("colocated", 0, 1, prefill_cap=0).setup(2) == "colocated:2 (--max-prefill-tokens-while-decoding 0)"
    assert Family("colocated", 0, 1, prefill_cap=0).name == "colocated, prefill and decode take turns"
    assert Family("colocated", 0, 1, prefill_cap=144) not in families(profile, SLOS)
    slos = {"ttft_ms": 5000.0, "max_itl_ms": 400.0}
    assert Family("colocated", 0, 1, prefill_cap=144) in families(profile, slos)
    planner = Planner(profile, requests(300), 3.0, slos, 0.9, 16)
    result = planner.plan()
    capped = [r for r in result["setups"] if r["family"] == "colocated, prefill cap 144 while decoding"]
    assert len(capped) == 1 and capped[0]["setup"].endswith("(--max-prefill-tokens-while-decoding 144)")
    # The cap bounds each stream's longest gap: here 3 capped nodes meet the SLOs, plain colocated needs 5.
    plain = next(r for r in result["setups"] if r["family"] == "colocated")
    assert capped[0]["meets"] and capped[0]["nodes"] < plain["nodes"]


def test_the_planner_tunes_each_pd_familys_per_role_settings():
    """Known costs: a D step grows 5 ms a stream, so under a 100 ms ITL a D that takes at most 8
    streams keeps every gap within it where 64 do not; the tuned family needs fewer nodes than
    any family with the nodes' own settings, and the pick names the flag `pdserve up` takes."""
    result = Planner(known_profile(), requests(300), 4.0, {"ttft_ms": 5000.0, "max_itl_ms": 100.0}, 0.9, 16).plan()
    untuned = [r for r in result["setups"] if r["meets"] and "--decode-max-num-seqs" not in r["setup"]]
    assert result["pick"]["setup"].endswith("(--decode-max-num-seqs 8)"), result["pick"]
    assert result["pick"]["family"].endswith(", D at most 8 streams")
    assert result["pick"]["nodes"] < min(r["nodes"] for r in untuned)
    assert all(r["meets"] for r in result["setups"] if "--decode-max-num-seqs" in r["setup"])


def test_a_role_variant_that_fails_at_the_bound_stops_early_and_is_not_reported():
    """tuned() searches variants only up to the best choice's size; one that fails there cannot be
    the pick and is not shown, so its run stops once it cannot reach the attainment (the families
    themselves run their largest size whole: the report shows it)."""
    planner = Planner(known_profile(), requests(300), 4.0, {"ttft_ms": 5000.0, "max_itl_ms": 100.0}, 0.9, 16)
    bound = 2
    for variant in (Family("pull", 1, 1, prefill_budget=512), Family("pull", 1, 1, decode_max_seqs=64)):
        before = planner.simulated_requests
        choice = planner.smallest(variant, bound, report=False)
        assert not choice.meets and choice.summary.get("gave_up")
        assert planner.simulated_requests - before < len(planner.requests)
        reported = planner.smallest(variant, bound)
        assert not reported.meets and "p99_ttft_ms" in reported.summary  # whole: the report's figures


def test_the_planner_tries_p_or_d_nodes_of_more_threads_counting_their_cores():
    """A prefill-heavy load (1024-token prompts, 16 out) under a TTFT SLO, with a profile measured
    at 2 threads whose prefill runs 3x faster (past linear, to make the trade plain): a P node of 2
    threads does the work of 3 one-thread ones on 2 cores, so the pick has P nodes of 2 threads
    and needs fewer cores than any family of one-thread nodes. Its cores count both threads."""
    load = mixed_dataset(300, seed=3, long_fraction=1.0, short=(128, 16), long=(1024, 16))
    threads = {2: two_thread_profile(prefill=1 / 3, decode=1.0)}
    result = Planner(known_profile(), load, 3.0, {"ttft_ms": 4000.0}, 0.9, 16, thread_profiles=threads).plan()
    pick = result["pick"]
    assert pick["setup"].endswith("(--prefill-threads 2)"), pick
    assert pick["family"].endswith(", P of 2 threads") and pick["cores"] > pick["nodes"]
    one_thread = [r for r in result["setups"] if r["meets"] and "threads" not in r["setup"]]
    assert one_thread and pick["cores"] < min(r["cores"] for r in one_thread)
    assert all(r["cores"] == r["nodes"] for r in one_thread)
    without = Planner(known_profile(), load, 3.0, {"ttft_ms": 4000.0}, 0.9, 16).plan()
    assert not any("threads" in r["setup"] for r in without["setups"])


def test_a_family_that_cannot_beat_the_cheapest_so_far_is_not_sized_and_the_pick_is_the_same():
    """By default a family is searched only up to the cores of the cheapest passing family before
    it; one that fails there is reported as needing more. Against sizing every family: the same
    pick (a tuned per-role variant under the ITL SLO), the same row for each family sized, more
    cores for each one not sized, and fewer requests simulated."""
    for args in ((requests(), 6.0, SLOS), (requests(300), 4.0, {"ttft_ms": 5000.0, "max_itl_ms": 100.0})):
        every = Planner(known_profile(), *args, 0.9, 16, size_every_family=True).plan()
        bounded = Planner(known_profile(), *args, 0.9, 16).plan()
        assert bounded["pick"] == every["pick"] and every["not_sized"] == []
        exact = {r["family"]: r for r in every["setups"]}
        assert all(exact[r["family"]] == r for r in bounded["setups"])
        assert bounded["not_sized"], "nothing was left unsized: the test shows nothing"
        for r in bounded["not_sized"]:
            assert r["family"] not in {s["family"] for s in bounded["setups"]}
            assert exact[r["family"]]["cores"] > r["more_than_cores"] or not exact[r["family"]]["meets"]
        assert bounded["simulated_requests"] < every["simulated_requests"]
    assert every["pick"]["setup"].endswith("(--decode-max-num-seqs 8)")


def test_a_unit_with_thinned_arrivals_predicts_the_whole_round_robin_cluster():
    reqs, rate, units = requests(1200), 8.0, 4
    whole = simulate(known_profile(), Setup.parse(f"pull:{units}P{2 * units}D"), reqs, rate, 1.0, 0, SLOS, itls=False)
    unit = Planner(known_profile(), reqs[: len(reqs) // units], rate, SLOS, 0.9, 64).evaluate(Family("pull", 1, 2), units)
    assert unit["slo_attainment"] == pytest.approx(whole["slo_attainment"], abs=0.08)
    assert unit["median_ttft_ms"] == pytest.approx(whole["median_ttft_ms"], rel=0.15)
    assert unit["median_tpot_ms"] == pytest.approx(whole["median_tpot_ms"], rel=0.15)


def test_bad_planner_arguments_are_named():
    for kwargs, message in (({"attainment": 1.5}, "--attainment"), ({"max_nodes": 5000}, "--max-nodes"),
                            ({"rate": 0.0}, "--rate"), ({"slos": {}}, "--goodput")):
        args = {"profile": known_profile(), "requests": requests(10), "rate": 1.0, "slos": SLOS, "attainment": 0.9,
                "max_nodes": 8} | kwargs
        with pytest.raises(ValueError, match=message):
            Planner(**args)


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300)


def test_plan_cli_answers_and_refuses_bad_input(tmp_path):
    profile = tmp_path / "profile.json"
    known = known_profile()
    known.meta["model"] = "SmolLM2-135M-Instruct.Q4_1-abc"
    known.save(profile)
    out = tmp_path / "plan.json"
    common = ["--profile", str(profile), "--dataset", "mixed", "--num-prompts", "300"]
    ok = plan_cli(*common, "--rate", "2", "--goodput", "ttft:5000", "tpot:100", "--max-nodes", "8", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    data = json.loads(out.read_text())
    assert "cheapest: " + data["pick"]["setup"] in ok.stdout
    rate = data["simulated_requests"] / data["seconds"]  # the simulator's speed, reported
    assert data["simulated_requests"] >= 300
    assert f"requests simulated in {data['seconds']:.1f} s, {rate:,.0f} a second" in ok.stdout
    named = {r["family"] for r in data["setups"] + data["not_sized"]}
    assert named >= {"colocated", "colocated, no chunked prefill", "pull 1P:1D", "push 1P:3D"}
    assert all(r["meets"] for r in data["setups"] if r["family"].startswith("colocated"))
    for r in data["not_sized"]:  # each named, with the cores it needs more than
        assert f"{r['family']:40s} more than {r['more_than_cores']} cores: not sized" in ok.stdout
    every = plan_cli(*common, "--rate", "2", "--goodput", "ttft:5000", "tpot:100", "--max-nodes", "8",
                     "--size-every-family", "--out", str(out))
    assert every.returncode == 0 and "not sized" not in every.stdout
    assert "cheapest: " + data["pick"]["setup"] in every.stdout
    assert {r["family"] for r in json.loads(out.read_text())["setups"]} == named

    impossible = plan_cli(*common, "--rate", "4", "--goodput", "ttft:1", "--max-nodes", "4")
    assert impossible.returncode == 1
    assert "no setup of at most 4 cores meets the SLOs at 4 req/s: the closest" in impossible.stdout

    same_threads = plan_cli(*common, "--thread-profile", str(profile), "--rate", "1", "--goodput", "ttft:3000")
    assert same_threads.returncode == 2
    assert f"--thread-profile {profile}: measured at 1 thread(s), as --profile was" in same_threads.stderr
    other_model = plan_cli(*common, "--model", "Qwen", "--rate", "1", "--goodput", "ttft:3000")
    assert other_model.returncode == 2 and "not of 'Qwen'" in other_model.stderr
    not_profile = tmp_path / "bench.json"
    not_profile.write_text(json.dumps({"completed": 3}))
    wrong = plan_cli("--profile", str(not_profile), "--rate", "1", "--goodput", "ttft:3000")
    assert wrong.returncode == 2 and "not a pdserve profile (no meta, prefill_chunk" in wrong.stderr
