"""Agent tools: an OpenAI Agents SDK agent (long system prompt, a list of function tools) runs a
conversation of several user turns against `radixkv serve`, once with the prefix cache and once
without; reports each model call's cached share of the prompt (the server's usage) and wall time.

    radixkv bench agent_tools [--turns 4 --system-repeats 3 --max-output-tokens 48 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radixkv.scenarios.harness import TEXT
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.plots import pyplot, save

QUESTIONS = [
    "Where is my order 1042? I need it before Friday.",
    "Search the docs for how to reset my password.",
    "What is 17 times 23 plus 5?",
    "What is on my calendar for 2025-03-14?",
    "Convert 250 US dollars to euros.",
    "Is it going to rain in Oslo tomorrow?",
]
API_KEY = "sk-agent-tools"
SERVER_START_TIMEOUT_S = 300.0


@dataclass(slots=True)
class CallRecord:
    """One model call of the agent, as the server reported it."""

    mode: str  # "cache" or "nocache"
    turn: int  # the user turn it served (0-based)
    call: int  # its place among that turn's calls
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    wall_s: float
    tool_calls: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--turns", type=int, default=4, help="user turns of the conversation")
    parser.add_argument("--system-repeats", type=int, default=3, help="copies of the ~230-token text in the system prompt")
    parser.add_argument("--max-output-tokens", type=int, default=256, help="a reply cut short fails its turn (the SDK's rule)")
    parser.add_argument("--max-calls-per-turn", type=int, default=3, help="the SDK's max_turns for each user turn")
    parser.add_argument("--modes", default="cache,nocache", help="cache, nocache or both")
    parser.add_argument("--out", default="out/agent_tools")
    return parser.parse_args(argv)


# -- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, cache: bool, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`radixkv serve` in a subprocess, and its base URL once /health answers."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(port), "--dtype", args.dtype, "--api-key", API_KEY]
    if args.model:
        command += ["--model", args.model]
    if not cache:
        command.append("--no-prefix-caching")
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"radixkv serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise RuntimeError(f"radixkv serve did not answer within {SERVER_START_TIMEOUT_S:.0f} s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def served_model(base_url: str) -> str:
    import httpx

    reply = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    return reply.json()["data"][0]["id"]


# -- the agent -------------------------------------------------------------------------------


def build_tools() -> list[Any]:
    from agents import function_tool

    @function_tool
    def lookup_order(order_id: int) -> str:
        """Look up an order by its number: status, carrier and expected delivery date."""
        return f"Order {order_id}: shipped by DHL, expected Thursday."

    @function_tool
    def search_docs(query: str, max_results: int) -> str:
        """Search the product documentation; returns the titles of the best matching pages."""
        return f"'{query}': 1. Account settings 2. Security and passwords"

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return "396"

    @function_tool
    def calendar(date: str) -> str:
        """List the events of a day, given as YYYY-MM-DD."""
        return f"{date}: 10:00 standup, 14:00 design review"

    @function_tool
    def convert_currency(amount: float, source: str, target: str) -> str:
        """Convert an amount of money between two ISO 4217 currencies at today's rate."""
        return f"{amount} {source} = {amount * 0.92:.2f} {target}"

    @function_tool
    def weather(city: str, days_ahead: int) -> str:
        """The weather forecast for a city, today (0) or up to 7 days ahead."""
        return f"{city}: light rain, 9 C"

    return [lookup_order, search_docs, calculator, calendar, convert_currency, weather]


class CallTimer:
    """RunHooks that time every model call and keep the usage the server reported for it."""

    def __init__(self, mode: str) -> None:
        from agents import RunHooks

        timer = self

        class Hooks(RunHooks):
            async def on_llm_start(self, context, agent, system_prompt, input_items) -> None:
                timer.started_s = time.perf_counter()

            async def on_llm_end(self, context, agent, response) -> None:
                timer.record(response)

        self.hooks = Hooks()
        self.mode = mode
        self.turn = 0
        self.started_s = 0.0
        self.records: list[CallRecord] = []
        self.failed_turns: list[str] = []  # "turn N: why" for turns the SDK gave up on

    def record(self, response: Any) -> None:
        usage = response.usage
        calls = sum(getattr(item, "type", None) == "function_call" for item in response.output)
        call = sum(r.turn == self.turn for r in self.records)
        self.records.append(
            CallRecord(
                self.mode, self.turn, call, usage.input_tokens, usage.input_tokens_details.cached_tokens,
                usage.output_tokens, time.perf_counter() - self.started_s, calls,
            )
        )


async def run_conversation(args: argparse.Namespace, base_url: str, mode: str) -> CallTimer:
    import openai
    from agents import Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, Runner
    from agents import set_default_openai_api, set_default_openai_client
    from agents import set_tracing_disabled

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    set_tracing_disabled(True)  # no network here, and nothing to trace to
    agent = Agent(
        name="support",
        instructions="You are a customer support agent. Use the tools to answer.\n" + TEXT * args.system_repeats,
        model=served_model(base_url),
        tools=build_tools(),
        # Small models do not call tools unasked; the SDK resets this to auto after a call.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=args.max_output_tokens),
    )
    timer = CallTimer(mode)
    history: list[Any] = []
    for turn in range(args.turns):
        timer.turn = turn
        question = {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}
        try:
            result = await Runner.run(agent, history + [question], max_turns=args.max_calls_per_turn, hooks=timer.hooks)
            history = result.to_input_list()
        except (MaxTurnsExceeded, ModelBehaviorError) as error:
            # Too many calls, or a reply cut by max_output_tokens (which the SDK refuses): the
            # turn's items are lost with the exception, the conversation goes on without them.
            timer.failed_turns.append(f"turn {turn}: {type(error).__name__}")
            history = history + [question]
    await client.close()
    return timer


# -- the report ------------------------------------------------------------------------------


def print_table(records: list[CallRecord], modes: list[str]) -> None:
    by_mode = {m: [r for r in records if r.mode == m] for m in modes}
    first = max(by_mode.values(), key=len)
    header = f"{'turn':>4}{'call':>5}{'input':>7}{'tools':>6}" + "".join(f"{m + ' cached':>14}{m + ' s':>11}" for m in modes)
    print("\nagent_tools: per model call (cached share of the prompt, from the server's usage)")
    print(header)
    print("-" * len(header))
    for i, row in enumerate(first):
        line = f"{row.turn:>4}{row.call:>5}{row.input_tokens:>7}{row.tool_calls:>6}"
        for m in modes:
            other = by_mode[m][i] if i < len(by_mode[m]) else None
            line += f"{other.cached_share:>14.0%}{other.wall_s:>11.2f}" if other else f"{'-':>14}{'-':>11}"
        print(line)
    print("-" * len(header))
    for m in modes:
        rows = by_mode[m]
        total_in = sum(r.input_tokens for r in rows)
        share = sum(r.cached_tokens for r in rows) / total_in if total_in else 0.0
        print(f"{m}: {len(rows)} calls, {total_in} input tokens, {share:.0%} cached, {sum(r.wall_s for r in rows):.2f} s")


def write_report(records: list[CallRecord], modes: list[str], out_dir: Path, meta: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"scenario": "agent_tools", **meta, "calls": [{**asdict(r), "cached_share": r.cached_share} for r in records]}
    (out_dir / "agent_tools.json").write_text(json.dumps(report, indent=2))
    _plot(records, modes, out_dir)
    return report


def _plot(records: list[CallRecord], modes: list[str], out_dir: Path) -> None:
    plt = pyplot()

    fig, (share_ax, wall_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        rows = [r for r in records if r.mode == m]
        x = range(len(rows))
        share_ax.plot(x, [100 * r.cached_share for r in rows], marker="o", label=m)
        wall_ax.plot(x, [r.wall_s for r in rows], marker="o", label=m)
    share_ax.set(title="cached share of each call's prompt", xlabel="model call", ylabel="% of input tokens")
    wall_ax.set(title="wall time of each call", xlabel="model call", ylabel="s")
    share_ax.legend()
    wall_ax.legend()
    save(fig, out_dir / "agent_tools.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("cache", "nocache") for m in modes):
        raise SystemExit(f"--modes takes cache, nocache or both, got {args.modes!r}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[CallRecord] = []
    failed: dict[str, list[str]] = {}
    for mode in modes:
        print(f"running the agent with the prefix cache {'on' if mode == 'cache' else 'off'} ...", flush=True)
        process, base_url = start_server(args, mode == "cache", out_dir / f"serve_{mode}.log")
        try:
            timer = asyncio.run(run_conversation(args, base_url, mode))
        finally:
            stop_server(process)
        records += timer.records
        failed[mode] = timer.failed_turns
    print_table(records, modes)
    for mode, turns in failed.items():
        if turns:
            print(f"{mode}: the SDK gave up on {', '.join(turns)}")
    from radixkv.model import resolve_device, resolve_dtype

    limits = machine_limits(resolve_dtype(args.dtype, resolve_device("cpu")))
    print(f"\n{limits['cpu']}: read {limits['read_bandwidth_gb_s']:.1f} GB/s, {limits['matmul_dtype']} matmul "
          f"{limits['matmul_gflops']:.0f} GFLOP/s, measured after the runs")  # fmt: skip
    meta = {
        "model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype, "turns": args.turns,
        "failed_turns": failed, **limits,
    }
    write_report(records, modes, out_dir, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
