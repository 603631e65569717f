"""The win map's arithmetic (pdserve/benchmarks/winmap.py): cells from runs, the report, the plot,
and the simulated map over the planner's families, on hand-made runs and known costs."""

from __future__ import annotations

import pytest
from test_plan_simulator import known_profile

from pdserve.benchmarks.study import sweep_workload
from pdserve.benchmarks.winmap import (auto_at_rate_map, auto_shapes, cell, defaults, kind_families, markdown,
                                      measured_map, open_entry, planner_agreement, plot, simulated_auto_over_static,
                                      simulated_map, slo_sets)
from pdserve.plan.shape import shape_for
from pdserve.workload import GENERATE, SUMMARIZE


def test_a_cell_names_the_winner_its_margin_and_the_noise():
    c = cell({"a": [0.30, 0.34], "b": [0.40, 0.40], "c": [0.60, 0.50], "d": [0.20, 0.20], "e": [0.55, 0.60]})
    assert (c["winner"], c["kind"]) == ("e", "auto")
    assert c["margin"] == pytest.approx(0.575 / 0.55)  # over PD's best, the best other kind
    assert c["pd_over_colocated"] == pytest.approx(0.55 / 0.40)
    assert c["auto_over_static"] == pytest.approx(0.575 / 0.55)
    assert c["noise"] == pytest.approx(0.10 / 0.55)  # (c)'s runs spread the most
    nothing = cell({"a": [0.0], "c": [0.0]})
    assert nothing["pd_over_colocated"] == 1.0 and nothing["auto_over_static"] is None


def fake_run(rates: list[float], goodputs: list[float]) -> list[dict]:
    return [{"request_rate": r, "goodput_by_slos": {"ttft+tpot": g, "ttft+itl": g / 2, "itl": g / 4}}
            for r, g in zip(rates, goodputs)]


def test_the_measured_map_report_and_plot_from_runs(tmp_path):
    rates = [0.2, 0.3, 0.4]
    res = {"date": "2026-12-03", "cpu": "test CPU", "dtype": "bfloat16", "runs": 2, "min_prompts": 40,
           "slos_ms": {"ttft_ms": 2000.0, "tpot_ms": 20.0, "max_itl_ms": 60.0},
           "slo_sets": slo_sets({"ttft_ms": 2000.0, "tpot_ms": 20.0, "max_itl_ms": 60.0}),
           "workloads": {"summarize": {"rates": rates, "setups": {
               "a": [fake_run(rates, [0.2, 0.2, 0.12]), fake_run(rates, [0.2, 0.2, 0.12])],
               "c": [fake_run(rates, [0.1, 0.3, 0.36]), fake_run(rates, [0.1, 0.3, 0.36])]}}}}
    res["map"] = measured_map(res)
    cells = res["map"]["summarize"]["itl"]
    assert [c["winner"] for c in cells] == ["a", "c", "c"]
    assert cells[2]["pd_over_colocated"] == pytest.approx(3.0)
    assert set(res["slo_sets"]["itl"]) == {"max_itl_ms"}
    text = markdown(res)
    assert "| workload | SLOs | rate | a | c | winner | margin |" in text  # the setups this map ran
    assert "| summarize | itl | 0.4 | 0.03 | 0.09 | (c) PD | 3.00x | 3.00x | – | 0 % |" in text
    plot(res, tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 10_000
    # Auto runs once per SLO set: a cell judges only the auto run tuned to its own set.
    setups = res["workloads"]["summarize"]["setups"]
    setups["e:itl"] = [fake_run(rates, [1.6, 1.6, 1.6])]  # judged on itl: 0.4 req/s
    setups["e:ttft+tpot"] = [fake_run(rates, [0.0, 0.0, 0.0])]
    again = measured_map(res)
    assert [c["goodput"]["e"] for c in again["summarize"]["itl"]] == [0.4] * 3
    assert again["summarize"]["itl"][0]["winner"] == "e"
    assert [c["goodput"]["e"] for c in again["summarize"]["ttft+tpot"]] == [0.0] * 3
    assert "e" not in again["summarize"]["ttft+itl"][0]["goodput"]  # no auto run tuned to it
    # --add-to: auto tuned to the ITL sets runs again; the static runs and auto's others stay.
    setups["e"] = [fake_run(rates, [9.0, 9.0, 9.0])]  # an older map's single auto run
    entry = open_entry(res, "summarize", [1.0, 2.0, 3.0], [("e", "ttft+itl"), ("e", "itl")])
    assert entry["rates"] == rates and entry["setups"]["e:itl"] == entry["setups"]["e:ttft+itl"] == []
    assert len(entry["setups"]["a"]) == 2 and len(entry["setups"]["e:ttft+tpot"]) == 1 and "e" not in entry["setups"]
    assert open_entry(res, "chat", rates, [("a", "ttft+tpot")]) == {"rates": rates, "setups": {"a": []}}
    # --append: a second run of a point goes beside the first.
    again = open_entry(res, "summarize", rates, [("a", "ttft+tpot"), ("b", "ttft+tpot")], append=True)
    assert len(again["setups"]["a"]) == 2 and again["setups"]["b"] == []


def test_the_planners_pick_is_scored_against_the_measured_winner():
    def measured(goodputs: dict[str, float]) -> dict:
        return cell({k: [g] for k, g in goodputs.items()})

    res = {"map": {"chat": {"itl": [measured({"a": 0.5, "c": 0.2, "e": 0.4}),    # colocated wins
                                    measured({"a": 0.5, "c": 0.49, "e": 0.1}),   # colocated, PD within 5 %
                                    measured({"a": 0.1, "c": 0.2, "e": 0.6})]}},  # auto wins
           "simulated": {"2": {"chat": {"itl": [
               {"colocated": ("colocated:2", 0.45), "PD": ("pull:1P1D", 0.45), "auto": ("auto:2", 0.3)},  # a tie
               {"colocated": ("colocated:2", 0.3), "PD": ("pull:1P1D", 0.4), "auto": ("auto:2", 0.1)},
               {"colocated": ("colocated:2", 0.3), "PD": ("pull:1P1D", 0.4), "auto": ("auto:2", 0.1)}]}}}}
    assert planner_agreement(res) == {"cells": 3, "matched": 1, "near": 2, "near_share": 0.05}
    res.update({"date": "2026-12-03", "cpu": "test CPU", "dtype": "bfloat16", "runs": 1, "min_prompts": 40,
                "slos_ms": {"ttft_ms": 1.0, "tpot_ms": 1.0, "max_itl_ms": 1.0},
                "workloads": {"chat": {"rates": [0.5, 0.75, 1.0]}}})
    assert "the measured winner's kind in 1 of 3 cells, and measures within 5% of the winner in 2." in markdown(res)


def test_the_simulated_map_prices_each_kind_at_n_nodes():
    res = {"seconds_per_rate": 20.0, "slo_sets": {"itl": {"max_itl_ms": 400.0}},
           "workloads": {"chat": {"rates": [0.5]}}}
    sim = simulated_map(known_profile(), res, [2], 8)
    best = sim["2"]["chat"]["itl"][0]
    assert set(best) == {"colocated", "PD", "auto"}
    # auto as `pdserve up --mode auto --nodes 2` runs it: in the shape plan/shape.py picks for the SLOs
    shape = shape_for(known_profile(), "chat", {"max_itl_ms": 400.0}, 2)
    # (auto serves most here over nodes that cap their prefill while decoding (0.946 against 0.928 req/s
    # summed, plain): auto over kv_both nodes with that batching, as `up` starts it)
    cap = " (--max-prefill-tokens-while-decoding 144)"
    assert shape.setup == "colocated:2" + cap and best["auto"][0] == "auto:2" + cap
    assert best["PD"][0] in ("pull:1P1D", "push:1P1D")
    assert all(0 <= goodput <= 0.5 for _, goodput in best.values())


def test_auto_told_the_rate_runs_as_the_shape_picked_at_it():
    """--auto-at-rate: auto as `pdserve up --mode auto --nodes 2 --rate R` starts, its shape picked at
    the cell's rate (R = rate x N / 2) rather than over fractions of what idle nodes serve."""
    res = {"seconds_per_rate": 20.0, "slo_sets": {"itl": {"max_itl_ms": 400.0}},
           "workloads": {"chat": {"rates": [0.5, 2.0]}}}
    cells = auto_at_rate_map(known_profile(), res, [2], 8)["2"]["chat"]["itl"]
    # picked without the rate: nodes capping their prefill while decoding (the simulated map's test);
    # at 2 req/s nodes taking turns serve more
    assert [setup for setup, _ in cells] == ["auto:2 (--max-prefill-tokens-while-decoding 144)",
                                            "auto:2 (--max-prefill-tokens-while-decoding 0)"]
    assert shape_for(known_profile(), "chat", {"max_itl_ms": 400.0}, 2, [2.0]).family.prefill_cap == 0
    assert all(0 <= goodput <= rate for rate, (_, goodput) in zip([0.5, 2.0], cells))


def test_simulated_auto_is_compared_with_the_best_static_kind():
    res = {"workloads": {"chat": {"rates": [0.5, 1.0, 2.0, 4.0]}},
           "simulated": {"2": {"chat": {"itl": [
               {"colocated": ("colocated:2", 0.5), "PD": ("pull:1P1D", 0.4), "auto": ("auto:2", 0.5)},
               {"colocated": ("colocated:2", 0.8), "PD": ("pull:1P1D", 1.0), "auto": ("auto:2", 0.9)},
               {"colocated": ("colocated:2", 0.004), "PD": ("pull:1P1D", 0.0), "auto": ("auto:2", 0.001)},
               {"colocated": ("colocated:2", 1.0), "PD": ("pull:1P1D", 0.2), "auto": ("auto:2", 0.5)}]}}},
           "simulated_auto_at_rate": {"2": {"chat": {"itl": [("auto:2", 0.5), ("auto:1P1D", 1.1),
                                                             ("auto:2", 0.0), ("auto:2", 0.4)]}}}}
    # the third cell serves under 0.01 req/s either way: not compared; the fourth is past saturation
    # (its best setup meets the SLOs for a quarter of the 4 req/s offered): compared, but not servable
    picked = simulated_auto_over_static(res)["2"]
    assert (picked["worst"], picked["under"], picked["cells"]) == ((0.5, "chat", "itl", 4.0), 2, 3)
    assert picked["servable"] == {"worst": (0.9, "chat", "itl", 1.0), "under": 1, "cells": 2}
    at_rate = simulated_auto_over_static(res, at_rate=True)["2"]
    assert (at_rate["worst"], at_rate["under"], at_rate["cells"]) == ((0.4, "chat", "itl", 4.0), 1, 3)
    assert at_rate["servable"] == {"worst": (1.0, "chat", "itl", 0.5), "under": 0, "cells": 2}
    text = markdown({**res, "map": {}, "slo_sets": {"itl": {}}, "runs": 1, "min_prompts": 1, "date": "d",
                     "cpu": "c", "dtype": "bfloat16", "slos_ms": {"ttft_ms": 1.0, "tpot_ms": 1.0, "max_itl_ms": 1.0}})
    assert ("its shape picked without the rate (servable: the cells whose best setup meets the SLOs for 50% of the "
            "requests or more): 2 nodes worst 0.50x (chat, itl, 4 req/s a node pair), 2 of 3 under 0.99x, servable "
            "worst 0.90x (chat, itl, 1 req/s a node pair), 1 of 2 under 0.99x.") in text
    assert "requests or more): 2 nodes worst 0.40x (chat, itl, 4 req/s a node pair), 1 of 3" in text
    assert "- chat, itl: auto:2 0.50; auto:1P1D 1.10; auto:2 0.00; auto:2 0.40" in text


def test_named_workloads_sweep_at_their_shapes():
    summarize = sweep_workload("summarize", 0, 0.5, 60, 10)
    generate = sweep_workload("generate", 1, 0.1, 60, 10)
    assert len(summarize) == 30 and len(generate) == 10
    assert all(SUMMARIZE[0][0] <= r.input_len <= SUMMARIZE[0][1] for r in summarize)
    assert all(GENERATE[1][0] <= r.output_len <= GENERATE[1][1] for r in generate)


def test_add_to_defaults_to_the_earlier_maps_path_and_workloads(tmp_path):
    """`--add-to PATH` without --out / --workloads adds to PATH, for PATH's workloads only (it once
    wrote docs/results/winmap.json over and ran all three workloads)."""
    import argparse
    import json

    earlier = tmp_path / "map.json"
    earlier.write_text(json.dumps({"workloads": {"chat": {"rates": [0.5], "setups": {}}}}))
    args = argparse.Namespace(add_to=str(earlier), out=None, workloads=None)
    defaults(args)
    assert (args.out, args.workloads) == (str(earlier), ["chat"])
    fresh = argparse.Namespace(add_to=None, out=None, workloads=None)
    defaults(fresh)
    assert (fresh.out, fresh.workloads) == ("docs/results/winmap.json", ["chat", "summarize", "generate"])
    given = argparse.Namespace(add_to=str(earlier), out=str(tmp_path / "new.json"), workloads=["generate"])
    defaults(given)
    assert (given.out, given.workloads) == (str(tmp_path / "new.json"), ["generate"])


def test_the_map_records_the_shape_auto_ran_as():
    """Auto's runs pick their shape as `pdserve up` does; on the sixth look's profile and SLOs,
    colocated nodes taking turns (a prefill cap of 0) under every set (the planner offers taking
    turns under TTFT + TPOT too, where it won chat's cells at 0.4 and 0.5 req/s, tenth look)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "docs/results"
    res = json.loads((results / "winmap_nogil.json").read_text())
    res["profile_path"] = str(results / "winmap_first_token_profile.json")
    shapes = auto_shapes(res, "chat", {"itl", "ttft+itl", "ttft+tpot"})
    tuned = "colocated:2 (--max-prefill-tokens-while-decoding 0)"
    assert shapes == {"itl": tuned, "ttft+itl": tuned, "ttft+tpot": tuned}
    res["workloads"]["chat"]["auto_shapes"] = shapes
    res["map"] = measured_map(res)
    assert f"Auto (e) ran as: chat, ttft+tpot: {tuned}; chat, ttft+itl: {tuned}; chat, itl: {tuned}." \
        in markdown(res)


def test_the_simulated_map_prices_auto_as_the_shape_it_runs_as():
    """Auto's family in the simulated map is what `pdserve up --mode auto` starts: a colocated
    shape's batching (taking turns: a prefill cap of 0, under TTFT + TPOT too) over kv_both pairs;
    a PD shape with its per-role settings."""
    from pdserve.plan.planner import Family

    turns = Family("colocated", 0, 1, prefill_cap=0)
    kinds = kind_families(None, {"ttft_ms": 18000.0, "tpot_ms": 25.8}, turns)
    assert kinds["auto"] == [Family("auto", 0, 2, prefill_cap=0)] and turns in kinds["colocated"]
    assert kinds["auto"][0].setup(1) == "auto:2 (--max-prefill-tokens-while-decoding 0)"
    plain = kind_families(None, {"ttft_ms": 18000.0}, Family("colocated", 0, 1, chunked=False))
    assert plain["auto"] == [Family("auto", 0, 2, chunked=False)]
    pd = kind_families(None, {"ttft_ms": 18000.0}, Family("pull", 1, 1, decode_max_seqs=8))
    assert pd["auto"] == [Family("auto", 1, 1, decode_max_seqs=8)] and Family("pull", 1, 1) in pd["PD"]


@pytest.mark.parametrize("flags, message", [(["--nodes", "0"], "--nodes 0: expected 1 to 1000"),
                                            (["--nodes", "--auto-at-rate", "2", "1001"],
                                             "--auto-at-rate 1001: expected 1 to 1000")])
def test_node_counts_out_of_range_are_refused_by_name(tmp_path, flags, message):
    """A node count the planner cannot take stops the command before any work, naming its flag (it
    once surfaced as a traceback from deep in the simulation, naming --nodes for --auto-at-rate)."""
    import subprocess
    import sys

    out = tmp_path / "map.json"
    done = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.winmap", "--from-json", str(out), "--out",
                           str(out), *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"error: {message}" in done.stderr
    assert not out.exists()
