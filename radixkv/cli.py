"""The `radixkv` command: `generate` text, `serve` the OpenAI-compatible API, `bench` a scenario."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights never come from a hub at run time
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion for one prompt")
    generate.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    generate.add_argument("--model", default=None, help="HF folder or .gguf file; default SmolLM2-135M-Instruct")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--dtype", default="auto")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None, help="accepted bearer key (repeatable)")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--num-pages", type=int, default=None)

    bench = commands.add_parser("bench", help="run a scenario under scenarios/ side by side with peers")
    bench.add_argument("scenario")
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from radixkv.server.app import serve as run_server

        return run_server(args)
    return _bench(args)


def _generate(args: argparse.Namespace) -> int:
    from radixkv import LLM, InvalidRequest, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            output = llm.generate([args.prompt], params)[0]
    except InvalidRequest as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(output.text)
    print(
        f"[{output.num_prompt_tokens} prompt tokens, {output.num_cached_tokens} cached, "
        f"{len(output.token_ids)} generated, finish: {output.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    try:
        module = importlib.import_module(f"scenarios.{args.scenario}")
    except ModuleNotFoundError:
        print(f"error: no scenario named {args.scenario!r} under scenarios/ (run from the repository root)", file=sys.stderr)
        return 2
    return int(module.main(args.rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
