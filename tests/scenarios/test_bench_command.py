"""`radixkv bench` as installed: the console script finds the scenarios (shipped as
radixkv.scenarios) from the repository root and from any other directory, passes a scenario its
own arguments, and names the scenarios when asked for one that does not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.scenarios import scenario_names

REPO = Path(__file__).resolve().parents[2]
RADIXKV = Path(sys.executable).with_name("radixkv")  # the console script beside this Python


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert RADIXKV.exists(), f"{RADIXKV} is missing: install the package (make setup)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the install
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(RADIXKV), "bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_bench_runs_a_scenario_with_its_arguments(where, tmp_path):
    cwd = REPO if where == "repository root" else tmp_path
    out = tmp_path / "out"
    done = bench("bench_cache", "--sizes", "200", "--leaves", "200", "--out", str(out), cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert "operation" in done.stdout and "naive/sorted" in done.stdout  # its table
    assert json.loads((out / "bench_cache.json").read_text())["rows"]


def test_bench_passes_help_to_the_scenario(tmp_path):
    done = bench("agent_system_prompt", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--peers" in done.stdout and "--system-len" in done.stdout


def test_an_unknown_scenario_exits_2_naming_the_scenarios(tmp_path):
    done = bench("no_such_scenario", cwd=tmp_path)
    assert done.returncode == 2
    assert "no scenario named 'no_such_scenario'" in done.stderr
    names = scenario_names()
    assert {"agent_system_prompt", "bench_cache", "load_test"} <= set(names)
    assert not {"harness", "peers", "report"} & set(names)
    assert all(name in done.stderr for name in names)
