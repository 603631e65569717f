"""The soak benchmark end to end, shortened: real `pdserve up`, real requests, its own verdicts.

The RSS criterion is left to the full benchmark (memory targets do not belong in tests); this run
checks what must hold for any length: no errors, blocks back to baseline, no process left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.procinfo import alive


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_short_soak_has_no_errors_and_frees_every_block(tmp_path, mode):
    cmd = [sys.executable, "-m", "pdserve.benchmarks.soak", "--requests", "40", "--warmup", "10", "--rate", "10",
           "--settle", "0.5", "--mode", mode, "--dtype", "float32"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    section = "soak" if mode == "pull" else f"soak_{mode}"
    written = tmp_path / "docs" / "results" / f"{section}.json"
    assert written.exists(), f"exit {run.returncode}: {run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    res = json.loads(written.read_text())
    assert res["requests"] == 40 and res["errors"] == 0, res["first_errors"]
    assert set(res["rss_start_mib"]) == {"up", "prefill", "decode", "proxy"}
    assert res["blocks_end"] == res["blocks_start"] and len(res["blocks_end"]) == 4
    assert all(res["processes_alive_at_end"].values())
    assert f"<!-- {section}:start -->" in (tmp_path / "docs" / "benchmarks.md").read_text()
    # Exit status 0 iff the verdict is pass (RSS included, which a 40-request run may not meet).
    assert (run.returncode == 0) == res["pass"], run.stderr[-2000:]
    assert not [pid for pid in res["pids"].values() if alive(pid)]  # `pdserve up` stopped everything it started
