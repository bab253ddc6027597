"""The `radixkv` command: `generate` text, `serve` the OpenAI-compatible API, `cluster` (workers
behind sglang-router, radixkv.cluster), `bench` a scenario."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from radixkv.cluster import command as cluster_command
from radixkv.errors import ConfigError, InvalidRequest
from radixkv.scenarios import scenario_names

if TYPE_CHECKING:
    from radixkv.engine.engine import Engine
    from radixkv.server.limits import ServerLimits

logger = logging.getLogger(__name__)


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
    generate.add_argument("--weight-dtype", default="auto", help="how weights are held: auto (a GGUF's quantized blocks kept), float, int8 (EngineConfig.weight_dtype)")
    generate.add_argument("--kv-dtype", default="auto", help="KV pages' storage dtype: auto (the compute dtype), bf16, fp16, fp32, int8, fp8")

    serving = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serving.add_argument("--model", default=None)
    serving.add_argument("--host", default="127.0.0.1")
    serving.add_argument("--port", type=int, default=8000)
    serving.add_argument(
        "--api-key", action="append", default=None,
        help="accepted bearer key (repeatable; visible in the process list: prefer --api-key-file or $RADIXKV_API_KEYS)",
    )
    serving.add_argument("--api-key-file", default=None, help="file of accepted keys, one a line ('#' comments)")
    serving.add_argument("--allowed-origin", action="append", default=[], help="browser origin allowed to call a keyless server (repeatable)")
    serving.add_argument(
        "--public-operator-endpoints", "--public-metrics", action="store_true", dest="public_operator_endpoints",
        help="serve /metrics, /get_load, /server_info and /model_info without a key even when keys are set",
    )
    serving.add_argument("--max-body-bytes", type=int, default=None, help="largest request body accepted (default 8 MiB)")
    serving.add_argument("--max-connections", type=int, default=None, help="connections open at once; more get 503 (default 1024)")
    serving.add_argument(
        "--header-read-timeout-s", type=float, default=None, help="seconds a request's headers may take to arrive; then 408 (default 10)"
    )
    serving.add_argument(
        "--body-read-timeout-s", type=float, default=None, help="seconds a request's body may take to arrive; then 408 (default 60)"
    )
    serving.add_argument("--stream-send-timeout-s", type=float, default=None, help="abort a stream its client has not read for this long (default 30)")
    serving.add_argument("--max-requests-per-key", type=int, default=None, help="requests one key may have in flight (default 256)")
    serving.add_argument("--max-seqs-per-key", type=int, default=None, help="sequences (n summed) one key may have in flight (default 1024)")
    serving.add_argument("--max-parses-per-key", type=int, default=None, help="request bodies one key may have parsed at once (default 0: a quarter of the threads)")
    _per_key_option(
        serving, "--max-parse-cpu-share-per-key", "--parse-cpu-share-per-key", type=float,
        help="CPU seconds a second one key's request parsing may spend past a 2 s burst (default 0.25; 0: no share)",
    )
    serving.add_argument("--max-pinned-pages-per-key", type=int, default=None, help="KV pages one key's pins may lock (default: a quarter of the page pool)")
    serving.add_argument("--max-stored-responses-per-key", type=int, default=None, help="Responses one key may keep for previous_response_id (default 1024)")
    serving.add_argument(
        "--max-cache-diagnoses-per-key", type=int, default=None,
        help="answered prompts' fingerprints one key keeps for cache diagnostics (default 1024)",
    )
    serving.add_argument(
        "--max-stored-response-bytes-per-key", type=int, default=None, help="bytes of stored Responses one key may keep (default 64 MiB)"
    )
    serving.add_argument(
        "--no-exact-continuation", dest="exact_continuation", action="store_false", default=None,
        help="re-render earlier replies from their text instead of putting back the ids they were generated as",
    )
    serving.add_argument("--max-replies-per-key", type=int, default=None, help="replies one key's exact-continuation map keeps (default 4096)")
    serving.add_argument("--max-reply-tokens-per-key", type=int, default=None, help="token ids of those replies one key keeps (default 1 Mi)")
    serving.add_argument(
        "--max-spliced-replies", type=int, default=None, help="earlier replies one prompt gets back as their generated ids (default 64; 0: none)"
    )
    serving.add_argument(
        "--eviction-policy", default=None, help="slru (default: session marks honoured), lru, session, or predict (online dead-block predictor) (EngineConfig.eviction_policy)"
    )
    serving.add_argument("--pin-ttl-s", type=float, default=None, help="seconds a pin lasts unless unpinned; 0: forever (default 3600)")
    serving.add_argument(
        "--session-idle-s", type=float, default=None,
        help="seconds a session (prompt_cache_key, X-Radixkv-Session) keeps its newest turn retained after it ends (default 600)",
    )
    serving.add_argument("--max-session-idle-s", type=float, default=None, help="the most a request may ask for (default 3600)")
    serving.add_argument("--max-sessions-per-key", type=int, default=None, help="live sessions one key may hold (default 64)")
    serving.add_argument("--max-session-pages-per-key", type=int, default=None, help="KV pages one key's sessions may retain (default 1024)")
    serving.add_argument("--dtype", default="auto")
    serving.add_argument("--weight-dtype", default="auto", help="how weights are held: auto (a GGUF's quantized blocks kept), float, int8 (EngineConfig.weight_dtype)")
    serving.add_argument("--kv-dtype", default="auto", help="KV pages' storage dtype: auto (the compute dtype), bf16, fp16, fp32, int8, fp8")
    serving.add_argument(
        "--moe-kernel", default="auto",
        help="a mixture-of-experts model's experts: auto, native (tokens grouped by expert over the file's blocks), "
        "native_fp32 (float experts too), torch (EngineConfig.moe_kernel)",
    )
    serving.add_argument("--num-pages", type=int, default=None)
    serving.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full (for comparisons)")
    serving.add_argument("--kv-disk-dir", default=None, help="keep evicted KV blocks (and all of them at exit) in this directory; a restart finds them")
    serving.add_argument("--kv-disk-bytes", type=int, default=16 << 30, help="byte budget of --kv-disk-dir (default 16 GiB)")
    serving.add_argument("--kv-disk-prefetch-bytes", type=int, default=None, help="disk-hit bytes read ahead and not yet used, at most (default 256 MiB)")
    _per_key_option(
        serving, "--max-kv-disk-retained-bytes-per-key", "--kv-disk-retained-bytes-per-owner", type=int,
        dest="kv_disk_retained_bytes_per_owner", help="retained bytes one key may keep on disk (default 4 GiB)",
    )
    serving.add_argument(
        "--tenant-secret-file", default=None,
        help="owner-only file of the secret that keeps tenants' cache salts across restarts, made on first use "
        "(with --kv-disk-dir; default $XDG_CACHE_HOME/radixkv/tenant_secret, never inside the KV directory)",
    )
    serving.add_argument(
        "--admin-key", action="append", default=None,
        help="bearer key that may also flush the cache (repeatable; prefer --admin-key-file or $RADIXKV_ADMIN_KEYS)",
    )
    serving.add_argument("--admin-key-file", default=None, help="file of admin keys, one a line ('#' comments)")
    serving.add_argument(
        "--drain-timeout-s", type=float, default=30.0,
        help="on SIGTERM, refuse new requests and give in-flight ones this long to finish before aborting them (default 30)",
    )
    serving.add_argument("--no-access-log", action="store_true", help="do not log each request (a router's health checks, for one)")
    serving.add_argument("--threads", type=int, default=None, help="CPU threads the engine computes with (default: torch's)")
    serving.add_argument(
        "--kv-events", default=None, metavar="ENDPOINT",
        help="publish KV cache events in vLLM's schema on this ZMQ PUB endpoint, unauthenticated: ipc:///PATH binds this "
        "machine only (e.g. ipc:///tmp/radixkv-kv-events), tcp://*:5557 binds every interface, tcp://HOST:PORT connects",
    )
    serving.add_argument(
        "--kv-events-replay", default=None, metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint that replays missed KV-event batches (e.g. ipc:///tmp/radixkv-kv-replay); rate-limited per peer",
    )
    serving.add_argument(
        "--kv-events-token-ids", action="store_true",
        help="also send each stored block's token ids and cache salt (the tenants' prompts); default hashes only",
    )
    serving.add_argument("--kv-events-topic", default="", help="topic frame of every KV-event message (default empty)")

    cluster_command.add_parser(commands)

    bench = commands.add_parser(
        "bench", help="run a scenario side by side with peers", epilog="scenarios: " + ", ".join(scenario_names())
    )
    bench.add_argument("scenario", help="a scenario's name (listed below)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the scenario's own arguments (SCENARIO --help lists them)")

    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "cluster":
        return cluster_command.run(args)
    return _bench(args)


def _per_key_option(parser: argparse.ArgumentParser, name: str, *old_names: str, dest: str | None = None, **options: object) -> None:
    """A cap per API key, spelled `--max-<what>-per-key` as every other one; its earlier
    spellings stay accepted, hidden from --help, so scripts written for them keep working."""
    dest = dest or name.removeprefix("--max-").replace("-", "_")
    parser.add_argument(name, dest=dest, default=None, metavar=name.removeprefix("--").replace("-", "_").upper(), **options)
    if old_names:
        hidden = {key: value for key, value in options.items() if key != "help"}
        parser.add_argument(*old_names, dest=dest, default=None, help=argparse.SUPPRESS, **hidden)


def _generate(args: argparse.Namespace) -> int:
    from radixkv import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)
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


def served_model_name(model: str | None) -> str:
    """The name clients put in `model`: the default model's name, or the folder/file stem."""
    if model is None:
        from radixkv.model.loader import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def tenant_secret_for(args: argparse.Namespace, engine: Engine) -> bytes | None:
    """The secret the tenants' cache salts are made with: with a disk tier they must survive a
    restart, or their blocks on disk would be unreachable, so it is kept in an owner-only file
    (--tenant-secret-file, else the radixkv cache folder), never inside the KV directory, whose
    files are not to tell how to compute any key's salt. None (a fresh one per process) without."""
    from radixkv.server.guards.tenants import default_tenant_secret_path, persistent_secret

    kv_directory = engine.cache_view.disk_directory()
    if kv_directory is None:
        return None
    path = Path(args.tenant_secret_file or default_tenant_secret_path()).expanduser()
    if path.resolve().is_relative_to(kv_directory.resolve()):
        raise ConfigError(f"--tenant-secret-file must be outside --kv-disk-dir, got {path}", param="tenant_secret_file")
    return persistent_secret(path)


def serve(args: argparse.Namespace) -> int:
    """`radixkv serve`: load the model, start the engine thread, run uvicorn until stopped; on
    SIGTERM drain first (radixkv.server.guards.drain). 0 when stopped cleanly."""
    import uvicorn

    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app
    from radixkv.server.guards.drain import DrainingServer
    from radixkv.server.guards.connections import uvicorn_options
    from radixkv.server.guards.tenants import ADMIN_KEYS_ENV, load_api_keys

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.drain_timeout_s < 0 or (args.threads is not None and args.threads < 1):
        print("error: --drain-timeout-s must be >= 0 and --threads >= 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        api_keys = load_api_keys(args.api_key, args.api_key_file)
        admin_keys = load_api_keys(args.admin_key, args.admin_key_file, env_name=ADMIN_KEYS_ENV)
        keyless = not api_keys and not admin_keys
        limits = _server_limits(args, keyless_remote=keyless and not _is_loopback(args.host))
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            kv_dtype=args.kv_dtype,
            moe_kernel=args.moe_kernel,
            num_pages=args.num_pages,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_disk_dir=args.kv_disk_dir,
            kv_disk_bytes=args.kv_disk_bytes,
            **_given(args, "kv_disk_prefetch_bytes", "kv_disk_retained_bytes_per_owner"),
            **_session_options(args),
            **({"eviction_policy": args.eviction_policy} if args.eviction_policy is not None else {}),
            **_pin_options(args),
            kv_events_endpoint=args.kv_events,
            kv_events_replay_endpoint=args.kv_events_replay,
            kv_events_topic=args.kv_events_topic,
            kv_events_token_ids=args.kv_events_token_ids,
        )
        async_engine = AsyncEngine.build(lambda: Engine(config))
    except (ConfigError, InvalidRequest, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        tenant_secret = tenant_secret_for(args, async_engine.engine)
    except (ConfigError, OSError) as error:
        async_engine.shutdown()
        print(f"error: {error}", file=sys.stderr)
        return 2
    if keyless and not _is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    name = served_model_name(args.model)
    try:
        app = create_app(
            async_engine,
            api_keys=api_keys,
            model_name=name,
            model_aliases=[args.model] if args.model else [],
            tenant_secret=tenant_secret,
            admin_keys=admin_keys,
            limits=limits,
        )
        logger.info(
            "serving %s on http://%s:%d (%d KV pages of %d tokens, context %d)",
            name, args.host, args.port, async_engine.engine.pool.num_pages, async_engine.engine.pool.page_size, async_engine.max_context_tokens,
        )
        config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=10, log_level="info",
                                access_log=not args.no_access_log, **uvicorn_options(limits))
        server = DrainingServer(config, app.state.radixkv.drain, async_engine, args.drain_timeout_s)
        try:
            server.run()
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the SIGINT it stopped on; stopping was the point (as uvicorn.run)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        async_engine.shutdown()
    if not server.started:
        return 1  # the port was taken, or the like: uvicorn has said why
    return 0 if server.report is None or server.report.clean else 1


def _server_limits(args: argparse.Namespace, *, keyless_remote: bool) -> ServerLimits:
    """The server's limits from the command line; options not given keep ServerLimits' defaults."""
    from radixkv.server.limits import ServerLimits

    given = {
        "max_body_bytes": args.max_body_bytes,
        "stream_send_timeout_s": args.stream_send_timeout_s,
        "max_requests_per_key": args.max_requests_per_key,
        "max_seqs_per_key": args.max_seqs_per_key,
        "max_parses_per_key": args.max_parses_per_key,
        "parse_cpu_share_per_key": args.parse_cpu_share_per_key,
        "pin_ttl_s": args.pin_ttl_s,
        "max_stored_responses_per_key": args.max_stored_responses_per_key,
        "max_stored_response_bytes_per_key": args.max_stored_response_bytes_per_key,
        "max_cache_diagnoses_per_key": args.max_cache_diagnoses_per_key,
        "max_connections": args.max_connections,
        "header_read_timeout_s": args.header_read_timeout_s,
        "body_read_timeout_s": args.body_read_timeout_s,
        "exact_continuation": args.exact_continuation,
        "max_replies_per_key": args.max_replies_per_key,
        "max_reply_tokens_per_key": args.max_reply_tokens_per_key,
        "max_spliced_replies": args.max_spliced_replies,
    }
    options: dict = {name: value for name, value in given.items() if value is not None}
    # Served beyond loopback without a key, the operator chose an open server: any Host name.
    return ServerLimits(
        allowed_origins=tuple(args.allowed_origin), public_operator_endpoints=args.public_operator_endpoints,
        allowed_hosts=("*",) if keyless_remote else (), **options,
    )


def _pin_options(args: argparse.Namespace) -> dict:
    """--max-pinned-pages-per-key is the engine's cap per owner (one owner per key), which
    in-process pins get too: EngineConfig.max_pinned_pages_per_owner."""
    value = getattr(args, "max_pinned_pages_per_key", None)
    return {} if value is None else {"max_pinned_pages_per_owner": value}


def _session_options(args: argparse.Namespace) -> dict:
    """The session knobs the command line set, in EngineConfig's names (per key: per owner)."""
    names = {
        "session_idle_s": "session_idle_s", "max_session_idle_s": "max_session_idle_s",
        "max_sessions_per_key": "max_sessions_per_owner", "max_session_pages_per_key": "max_session_pages_per_owner",
    }  # fmt: skip
    return {config: getattr(args, flag) for flag, config in names.items() if getattr(args, flag, None) is not None}


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options among names the command line set: the rest keep EngineConfig's defaults."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bench(args: argparse.Namespace) -> int:
    """`radixkv bench NAME ARGS...`: NAME's main(ARGS) from radixkv.scenarios, which the package
    ships (scenarios/ is installed there), so it runs the same from any directory."""
    import importlib

    names = scenario_names()
    if args.scenario not in names:
        print(f"error: no scenario named {args.scenario!r}; the scenarios are: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"radixkv.scenarios.{args.scenario}")
    return int(module.main(args.rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
