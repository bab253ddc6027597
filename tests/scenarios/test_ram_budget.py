"""ram_budget on a tiny Gemma 3 (3 window layers of 8 tokens beside 1 full layer): the KV one
long sequence holds is the full layer's every token plus a window and a page per window layer,
as stats().cache.kv_bytes_in_use reports it, against 4 layers x every token."""

from __future__ import annotations

import json
from pathlib import Path

from radixkv.scenarios import ram_budget
from tests.helpers.tiny_models import make_tiny_model


def test_one_sequence_holds_the_full_layer_and_a_window(tmp_path: Path, capsys) -> None:
    model = make_tiny_model(tmp_path / "gemma3", "gemma3", seed=3)
    argv = ["--model", str(model), "--tokens", "96", "--new-tokens", "4", "--chunk", "16", "--page-size", "4", "--out", str(tmp_path / "out")]
    assert ram_budget.main(argv) == 0
    result = json.loads((tmp_path / "out" / "ram_budget.json").read_text())
    assert (result["full_layers"], result["window_layers"], result["window"]) == (1, 3, 8)
    per_token = result["token_layer_bytes"]
    # After the prompt: the full layer's 96 tokens, each window layer the 2 pages of its last 8
    # (the next token's page comes with the next step).
    assert result["kv_bytes_after_prefill"] == (96 + 3 * 2 * 4) * per_token
    assert result["kv_bytes_all_layers_every_token"] == 4 * 96 * per_token
    assert result["ratio_all_layers_to_measured"] > 2
    assert "kv_bytes_after_prefill" in capsys.readouterr().out
