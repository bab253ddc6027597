"""disk_restart at its smallest on a tiny model: the restart row is served from disk, the
recompute row is not, and the JSON and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from radixkv.scenarios import disk_restart
from tests.helpers.tiny_models import make_tiny_model


def test_disk_restart_runs_and_reports(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama", seed=2)
    argv = ["--model", str(model), "--dtype", "float32", "--system-len", "40", "--question-len", "4"]
    assert disk_restart.main(argv + ["--dir", str(tmp_path / "kv"), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "disk_restart.json").read_text())
    cached = [row["cached_tokens"] for row in report["rows"]]
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] >= 32 and cached[3] == 0
    assert report["persist_blocks"] > 0 and (tmp_path / "out" / "disk_restart.png").exists()
