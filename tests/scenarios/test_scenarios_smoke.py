"""Every scenario runs end to end at a tiny size on a tiny model, so the scripts cannot rot."""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model

SCENARIOS = {
    "agent_system_prompt": ["--groups", "2", "--system-len", "40", "--question-len", "6", "--decode-profile", "0"],
    "multi_turn_chat": ["--turns", "2", "--system-len", "20", "--question-len", "8", "--reply-len", "6"],
    "few_shot_template": ["--shots", "2"],
    "tree_of_thought": ["--branching", "2", "--depth", "2", "--root-len", "30", "--thought-len", "8"],
    "no_sharing": ["--prompt-len", "24"],
}


# The one scenario whose peers run in their own processes, as `radixkv bench` runs them: the
# rest run each peer's own entry point (peers._main) in this process, since a fresh Python that
# imports torch and transformers costs more than a tiny peer's whole run.
PEERS_IN_SUBPROCESSES = "no_sharing"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("scenario-model"), "llama", seed=4)


def run_peers_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """peers.run_in_subprocess as it is (workload file, result file, output count check), with
    its `python -m radixkv.scenarios.peers PEER SPEC RESULT` run by peers._main in process."""
    from radixkv.scenarios import peers

    def run(command: list[str], **_options) -> subprocess.CompletedProcess[str]:
        assert command[1:3] == ["-m", "radixkv.scenarios.peers"], command
        peers._main(command[3:])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(peers, "subprocess", SimpleNamespace(run=run))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_runs_and_reports(name, tiny_model, tmp_path, capsys, monkeypatch):
    if name != PEERS_IN_SUBPROCESSES:
        run_peers_in_process(monkeypatch)
    peers = "radixkv,radixkv-nocache,hf-generate" if name == "agent_system_prompt" else "radixkv,radixkv-nocache"
    if name == "few_shot_template":  # one round: transformers' batch manager starts once
        peers += ",hf-batch"
    module = importlib.import_module(f"radixkv.scenarios.{name}")
    argv = ["--model", str(tiny_model), "--dtype", "float32", "--device", "cpu", "--num-requests", "4", "--output-len", "3"]
    assert module.main(argv + ["--peers", peers, "--out", str(tmp_path)] + SCENARIOS[name]) == 0
    report = json.loads((tmp_path / f"{name}.json").read_text())
    rows = {row["peer"]: row for row in report["rows"]}
    assert set(rows) == set(peers.split(","))
    for row in rows.values():
        assert row["error"] is None, row["error"]
        assert row["output_tokens"] > 0
    # Caching never computes more prompt tokens than not caching, and never changes outputs.
    assert rows["radixkv"]["prefill_tokens_computed"] <= rows["radixkv-nocache"]["prefill_tokens_computed"]
    assert rows["radixkv"]["same_tokens_as_nocache"] == report["num_requests"]
    assert report["min_prefill_tokens"] <= rows["radixkv"]["prefill_tokens_computed"]
    assert (tmp_path / f"{name}.png").exists()
    out = capsys.readouterr().out
    assert "x radixkv" in out
    if name == "agent_system_prompt":  # fp32: token-exact with transformers' generate; the bound
        assert rows["radixkv"]["same_tokens_as_hf_generate"] == report["num_requests"]
        assert report["bound"]["bound_s"] > 0 and "wall / bound" in out
        assert rows["radixkv"]["wall_over_bound"] > 0


@pytest.mark.parametrize("mode", [[], ["--shared-prefix", "40", "--own-tokens", "8", "--group-size", "2", "--group-sizes", "1,4"]])
def test_decode_profile_runs_and_reports(mode, tiny_model, tmp_path, capsys):
    module = importlib.import_module("radixkv.scenarios.decode_profile")
    argv = ["--model", str(tiny_model), "--dtype", "float32", "--num-seqs", "4", "--context", "48", "--steps", "2", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split rows' turns need two threads (tests run on one)
    try:
        assert module.main(argv + mode) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    if mode:
        result = json.loads((tmp_path / "decode_profile_shared_prefix.json").read_text())
        assert result["on"]["kv_tokens_shared_per_step"] == 0  # 40-token prefixes: no whole 256-key chunk to share
        assert result["off"]["kv_tokens_shared_per_step"] == 0 and len(result["sweep"]) == 2
        assert "off / on" in out
    else:
        result = json.loads((tmp_path / "decode_profile_float32.json").read_text())
        assert result["ideal_ms"] > 0 and result["breakdown_ms"]["linears (incl. lm_head)"] > 0
        assert result["fused_decode"] == bool(result["fused_breakdown_ms"])
        if result["fused_decode"]:  # the fused step as run, by phase, timed inside the native call
            parts = result["fused_breakdown_ms"]
            assert parts["attention"] > 0 and "fused step's time" in out
            # What lies outside the layers, part by part: the lm_head and sampling ran every step.
            assert parts["  lm_head"] > 0 and parts["  engine: sample"] > 0 and parts["  embedding"] > 0
            # Split rows on and off, in turns over the same requests.
            assert set(result["split_rows_turns_ms"]) == {"on", "off"} and "on / off" in out
        assert "x the bound" in out


def test_step_profile_runs_and_reports(tiny_model, tmp_path, capsys):
    module = importlib.import_module("radixkv.scenarios.step_profile")
    argv = ["--model", str(tiny_model), "--dtype", "float32", "--device", "cpu", "--num-seqs", "3", "--context", "40", "--steps", "2"]
    assert module.main(argv + ["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_profile.json").read_text())
    assert report["device"] == "cpu" and report["native_kernels"] and report["step_ms"] > 0 and report["host_ops_ms_per_step"] > 0
    assert report["top_host_ops"] and report["top_device_ops"] == []  # no device time on a CPU
    assert (tmp_path / "step_profile.png").exists() and "top operators by host time" in capsys.readouterr().out


def test_cascade_threshold_reports_each_case_by_its_shared_bytes(tmp_path, capsys):
    from radixkv.cpu import native

    if native.load() is None:
        pytest.skip("the cascade bench needs the native kernels (no C compiler here)")
    module = importlib.import_module("radixkv.scenarios.cascade_threshold")
    argv = ["--out", str(tmp_path), "--repeats", "1", "--layers", "1", "--shared", "32", "64", "--members", "2", "--flush-mib", "4"]
    assert module.main(argv) == 0
    report = json.loads((tmp_path / "cascade_threshold.json").read_text())
    rows = report["rows"]
    assert len(rows) == len(module.HEADS) * 2 and all(row["plain_over_cascade"] > 0 for row in rows)
    # 32 tokens of the 1B's heads (8 KV heads of 64) in fp32 or bf16 pages.
    one_b = next(row for row in rows if row["heads"] == "32/8x64" and row["shared"] == 32)
    assert one_b["shared_kib_per_layer"] in (32 * 2 * 8 * 64 * 4 / 1024, 32 * 2 * 8 * 64 * 2 / 1024)
    assert "l2_bytes" in report and (tmp_path / "cascade_threshold.png").exists()
    assert "plain/cascade" in capsys.readouterr().out


def test_cascade_ab_times_off_on_and_auto_and_says_where_auto_groups(tmp_path, capsys):
    from radixkv.cpu import decode, native

    if native.load() is None:
        pytest.skip("the cascade bench needs the native kernels (no C compiler here)")
    module = importlib.import_module("radixkv.scenarios.cascade_threshold")
    argv = ["--ab", "--out", str(tmp_path), "--rounds", "1", "--layers", "1", "--shared", "0", "512", "--members", "2", "16", "--flush-mib", "4"]
    assert module.main(argv) == 0
    report = json.loads((tmp_path / "cascade_ab.json").read_text())
    rows = {(row["members"], row["shared"]): row for row in report["rows"]}
    assert len(rows) == 4 and all(row["off_ms"] > 0 and row["on_ms"] > 0 and row["auto_ms"] > 0 and row["no_tiles_ms"] > 0 and row["bi_ms"] > 0 for row in rows.values())
    # Auto groups exactly where the thresholds say: never a pair of GQA 3, never over 0 tokens.
    auto = decode.cascade_thresholds(*module.HEADS["SmolLM2-135M"], 2 if report["dtype"] == "torch.bfloat16" else 4)
    for (members, shared), row in rows.items():
        assert row["auto_groups"] == module.groups(auto, members, shared)
    assert not rows[(2, 512)]["auto_groups"] and not rows[(16, 0)]["auto_groups"]
    assert (tmp_path / "cascade_ab.png").exists() and "off/auto" in capsys.readouterr().out


def test_cpu_kernels_bench_runs_and_reports(tmp_path, capsys):
    import torch

    from radixkv.cpu import extend, native
    from radixkv.cpu.features import cpu_features
    from radixkv.cpu.linear import available_linear_kernels, can_prepack

    if native.load() is None:
        pytest.skip("the CPU kernel bench needs the native kernels (no C compiler here)")
    module = importlib.import_module("radixkv.scenarios.cpu_kernels")
    argv = ["--out", str(tmp_path), "--repeats", "1", "--layers", "1", "--context", "40", "--flush-mib", "8", "--quant-scale", "64"]
    assert module.main(argv) == 0
    rows = json.loads((tmp_path / "cpu_kernels.json").read_text())["rows"]
    # What runs depends on the CPU: each dtype's native linears, oneDNN's packing (bf16), the
    # prefill kernel where it takes the dtype, cascade's tiles in the dtype models load in.
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    linear_dtypes = [dtype for dtype in names if available_linear_kernels(dtype)]
    assert linear_dtypes, "every x86 CPU with AVX2 has the fp32 kernel"
    peers = {f"radixkv {kernel}" for kernel in available_linear_kernels()} | {"F.linear"}
    peers |= {"radixkv paged kernel", "gather + SDPA", "radixkv cascade", "radixkv plain"}
    if torch.bfloat16 in linear_dtypes and can_prepack(torch.bfloat16, torch.device("cpu")):
        peers.add("oneDNN prepacked")
    prefill = [dtype for dtype in names if extend.fits(dtype, 64, 3)]
    if prefill:
        peers.add("radixkv prefill kernel")
    assert {row["peer"] for row in rows if row["part"] != "quant linear"} == peers
    cascade = "bfloat16" if cpu_features().avx512_bf16 else "float32"
    parts = {f"linears {names[dtype]}" for dtype in linear_dtypes} | {"decode attention bfloat16", "decode attention float32"}
    parts |= {f"cascade decode {cascade}"} | {f"prefill attention {names[dtype]}" for dtype in prefill}
    from radixkv.cpu.quant_linear import available_quant_kernels

    if available_quant_kernels():
        parts.add("quant linear")
        quant = [row for row in rows if row["part"] == "quant linear"]
        assert {row["peer"] for row in quant} >= {f"q8_0 {kernel}" for kernel in available_quant_kernels()} | {"fp32 F.linear"}
    assert {row["part"] for row in rows} == parts
    assert all(row["ms"] > 0 for row in rows)
    assert (tmp_path / "cpu_kernels.png").exists()
    assert "x radixkv" in capsys.readouterr().out


def test_native_ab_times_two_builds_in_one_process(tmp_path, capsys):
    import torch

    from radixkv.cpu import extend, native
    from radixkv.cpu.linear import available_linear_kernels

    loaded = native.load()
    if loaded is None:
        pytest.skip("the native A/B needs the native kernels (no C compiler here)")
    if not (Path(__file__).resolve().parents[2] / ".git").exists():
        pytest.skip("the native A/B reads its baseline from git")
    module = importlib.import_module("radixkv.scenarios.native_ab")
    argv = ["--out", str(tmp_path), "--rounds", "2", "--layers", "1", "--num-seqs", "3", "--context", "40", "--prefill-len", "40", "--flush-mib", "8"]
    assert module.main(argv) == 0
    rows = json.loads((tmp_path / "native_ab.json").read_text())["rows"]
    decode = [(f"decode attention {dtype}", order) for dtype in ("float32", "bfloat16") for order in module.ORDERS]
    assert [(row["part"], row["case"]) for row in rows[: len(decode)]] == decode
    with_kernel = [dtype for dtype in (torch.float32, torch.bfloat16) if available_linear_kernels(dtype)]
    linears = [(f"linears {str(dtype)[6:]}", f"{count} rows") for dtype in with_kernel for count in (1, 32, 512)]
    prefill_dtypes = [dtype for dtype in (torch.float32, torch.bfloat16) if extend.fits(dtype, 64, 3)]
    prefill = [(f"prefill attention {str(dtype)[6:]}", case) for dtype in prefill_dtypes for case in ("1 x 40 new / 0", "3 x 64 new / 40")]
    assert [(row["part"].split(" (")[0], row["case"]) for row in rows[len(decode) :]] == linears + prefill
    assert all(row["ratio"] > 0 for row in rows)
    csrc = str(native.CSRC)
    if subprocess.run(["git", "-C", csrc, "diff", "--quiet", "HEAD", "--", csrc]).returncode == 0:
        # HEAD's sources are the tree's (as in CI): the same code gives the same bits in every layout.
        assert all(row["identical"] for row in rows)
    assert native.load() is loaded  # the build under test is back after each turn
    assert (tmp_path / "native_ab.png").exists() and "tree / base" in capsys.readouterr().out


def test_native_ab_times_cascade_plans_and_holds_the_exact_one_to_no_plans_bits(tmp_path):
    from radixkv.cpu import native

    if native.load() is None:
        pytest.skip("the native A/B needs the native kernels (no C compiler here)")
    if not (Path(__file__).resolve().parents[2] / ".git").exists():
        pytest.skip("the native A/B reads its baseline from git")
    module = importlib.import_module("radixkv.scenarios.native_ab")
    argv = ["--out", str(tmp_path), "--rounds", "1", "--layers", "1", "--parts", "cascade", "--shared-prefix", "256", "--flush-mib", "8"]
    # cascade_ab raises where a build's batch-invariant plan gives other bits than no plan.
    assert module.main(argv) == 0
    rows = json.loads((tmp_path / "native_ab.json").read_text())["rows"]
    cases = [(f"cascade {dtype}", f"{kind} plan") for dtype in ("float32", "bfloat16") for kind in ("none", "exact", "tiles")]
    assert [(row["part"], row["case"]) for row in rows] == cases


def test_native_ab_names_a_bad_revision(tmp_path, capsys):
    from radixkv.cpu import native

    if native.find_compiler() is None:
        pytest.skip("the native A/B needs a C compiler")
    if not (Path(__file__).resolve().parents[2] / ".git").exists():
        pytest.skip("the native A/B reads its baseline from git")
    module = importlib.import_module("radixkv.scenarios.native_ab")
    assert module.main(["--base", "no-such-revision", "--out", str(tmp_path)]) == 2
    assert "no-such-revision" in capsys.readouterr().out


def test_kv_dtype_times_each_page_dtype_and_measures_divergence(tmp_path, capsys):
    from radixkv.cpu import native

    if native.load() is None:
        pytest.skip("the KV dtype bench needs the native kernels (no C compiler here)")
    module = importlib.import_module("radixkv.scenarios.kv_dtype")
    argv = ["--out", str(tmp_path), "--repeats", "1", "--layers", "1", "--context", "48", "--num-seqs", "2",
            "--new-tokens", "3", "--flush-mib", "4"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    written = list(tmp_path.glob("*.json"))
    assert written and all(name in out for name in ("bf16", "int8"))


def test_moe_row_profile_times_two_native_calls_a_layer(tmp_path, capsys):
    """The experts layers of a Q4_K_M Qwen3-MoE GGUF at one token: two native calls each (the
    router, the experts) timed as they run, the Python around them what is left."""
    from radixkv.cpu import native
    from radixkv.scenarios import moe_row_profile
    from tests.helpers.gguf_files import write_tiny_moe_gguf

    if native.load() is None:
        pytest.skip("the native kernels did not build (no C compiler)")
    from radixkv.cpu.features import cpu_features
    from radixkv.cpu.linear import available_linear_kernels
    from radixkv.model.device import resolve_dtype

    dtype = resolve_dtype("auto", torch.device("cpu"))
    if not available_linear_kernels(dtype):  # the router's linear then runs on torch: no native call to time
        missing = cpu_features().missing_bf16 if dtype == torch.bfloat16 else "avx2"
        pytest.skip(f"no native {dtype} linear kernel for the router: this CPU lacks {missing}")
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", "Q4_K_M")
    out = tmp_path / "out"
    assert moe_row_profile.main(["--model", str(path), "--calls", "5", "--limits", "0", "--out", str(out)]) == 0
    result = json.loads((out / "moe_row_profile.json").read_text())
    assert result["layers"] >= 1 and set(moe_row_profile.GAPS) <= set(result["mean_us"])
    for us in result["per_layer_us"].values():
        assert 0 < us["kernels"] < us["wall"] and 0 < us["python"] < us["wall"]
    assert "python" in capsys.readouterr().out
