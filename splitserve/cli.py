"""The `splitserve` command.

  serve         the control plane plus locally spawned data-plane ranks, one command
  controlplane  the control plane alone (gRPC API; binds the ZeroMQ port data planes connect to)
  dataplane     the data plane alone (connects to a control plane)
  frontend      (internal) a gRPC front-end process; serve and controlplane start theirs
  generate      stream a completion from a running server
  health        exit 0 only when a server is SERVING
  demo-model    write the default tiny random-weight model to a directory (for containers)
  link-keys     write CURVE key pairs that authenticate the link between the planes

Each subcommand imports only what it runs: `controlplane`, `generate` and `health` never load
torch.
"""

import argparse
import asyncio
import faulthandler
import logging
import pathlib
import signal
import sys

DEFAULT_PORT = 50051


def _add_model(p: argparse.ArgumentParser, required: bool) -> None:
    help_text = "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"
    if not required:
        help_text += ("; default: a small Qwen3 with seeded random weights (gibberish output), "
                      "written once to ~/.cache/splitserve (or $SPLITSERVE_CACHE)")
    p.add_argument("--model", type=pathlib.Path, required=required, help=help_text)


def _add_api(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="gRPC port; 0 picks a free one (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests in one step (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queue bound; beyond it Generate fails fast with RESOURCE_EXHAUSTED "
                        "(default %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest top-N a request may ask for (default %(default)s)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                   help="a stream message waits for this many tokens (the last one may have "
                        "fewer): larger values send fewer messages, for less control-plane CPU "
                        "per token with many streams (default %(default)s). Tokens that pile up "
                        "while a message is being written go out together in any case")
    p.add_argument("--frontends", type=int, default=1, metavar="N",
                   help="gRPC front-end processes: they hold the client connections and write "
                        "the stream messages, so that the engine's loop does not; they share "
                        "the port and gRPC's own bound on concurrent RPCs; 0 serves gRPC in the "
                        "engine's process (default %(default)s)")
    _add_grpc_security(p)
    p.add_argument("--reattach-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after a data-plane loss, how long requests wait for one to (re)attach "
                        "before they end UNAVAILABLE (default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long live requests may still run (default %(default)s)")
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="cap on a step's deadline; within it the deadline follows observed "
                        "step times (default %(default)s)")


def _add_grpc_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", type=pathlib.Path, default=None,
                   help="require 'authorization: Bearer <key>' on every RPC but health; one key "
                        "per line")
    p.add_argument("--tls-cert", type=pathlib.Path, default=None, help="serve TLS: certificate (PEM)")
    p.add_argument("--tls-key", type=pathlib.Path, default=None, help="serve TLS: private key (PEM)")
    p.add_argument("--tls-client-ca", type=pathlib.Path, default=None,
                   help="mutual TLS: clients must present a certificate signed by this CA")


def _add_dataplane(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default %(default)s)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: the checkpoint's dtype (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="cap on the number of KV blocks (small-memory runs, tests)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache budget per rank on CPU, GiB (default %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU's memory the data plane may hold; the KV cache gets "
                        "what weights and a profiled worst-case step leave (default %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps")
    p.add_argument("--load-format", choices=("safetensors", "dummy"), default="safetensors",
                   help="dummy: random weights instead of the checkpoint's (benchmarks; the "
                        "model directory then needs only config.json and tokenizer.json)")
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton", "flash_attn"),
                   default="auto", help="auto: torch on CPU, triton on CUDA (default %(default)s)")


def _add_client(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORT}", help="(default %(default)s)")
    p.add_argument("--api-key-file", type=pathlib.Path, default=None,
                   help="send the first key of this file as a bearer token")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--tls-ca", type=pathlib.Path, default=None,
                   help="CA certificate to verify the server with (implies --tls)")
    p.add_argument("--tls-cert", type=pathlib.Path, default=None,
                   help="client certificate for mutual TLS (implies --tls)")
    p.add_argument("--tls-key", type=pathlib.Path, default=None, help="client key for mutual TLS")


def _client(args: argparse.Namespace):
    from splitserve.client import Client
    api_key = None
    if args.api_key_file is not None:
        from controlplane.auth import read_api_keys
        api_key = read_api_keys(args.api_key_file)[0].decode()
    read = lambda path: path.read_bytes() if path else None  # noqa: E731
    tls = args.tls or bool(args.tls_ca or args.tls_cert)
    return Client(args.address, api_key=api_key, tls=tls, root_certificates=read(args.tls_ca),
                  certificate_chain=read(args.tls_cert), private_key=read(args.tls_key))


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="(default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="control plane + local data plane, one command")
    _add_model(serve, required=False)
    _add_api(serve)
    _add_dataplane(serve)
    _add_logging(serve)

    cp = sub.add_parser("controlplane", help="the control plane alone")
    _add_model(cp, required=True)
    cp.add_argument("--dataplane-address", required=True,
                    help="ZeroMQ endpoint to bind for data planes, e.g. tcp://0.0.0.0:5555")
    cp.add_argument("--link-secret-key", type=pathlib.Path, default=None,
                    help="CURVE: this control plane's secret key file (splitserve link-keys)")
    cp.add_argument("--link-authorized-keys", type=pathlib.Path, default=None,
                    help="CURVE: directory of data-plane public keys allowed to connect")
    _add_api(cp)
    _add_logging(cp)

    dp = sub.add_parser("dataplane", help="the data plane alone")
    _add_model(dp, required=True)
    dp.add_argument("--controlplane-address", required=True,
                    help="the control plane's ZeroMQ endpoint, e.g. tcp://controlplane:5555")
    _add_dataplane(dp)
    dp.add_argument("--rank", type=int, default=None,
                    help="this process's TP rank, for one rank per host or pod (default: start "
                         "rank 0 here and spawn ranks 1..tp-1 locally)")
    dp.add_argument("--dist-init-method", default=None,
                    help="tcp://host:port where rank 0 gathers the ranks (with --rank)")
    dp.add_argument("--liveness-file", type=pathlib.Path, default=None,
                    help="touched while the process loop turns, for `splitserve health --file`")
    dp.add_argument("--link-secret-key", type=pathlib.Path, default=None,
                    help="CURVE: this data plane's secret key file (splitserve link-keys)")
    dp.add_argument("--link-server-key", type=pathlib.Path, default=None,
                    help="CURVE: the control plane's public key file")
    dp.add_argument("--controlplane-grace", type=float, default=30.0, metavar="SECONDS",
                    help="exit when no control plane was heard for this long after one was "
                         "(default %(default)s)")
    dp.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    _add_logging(dp)

    fe = sub.add_parser("frontend", help="(internal) a gRPC front-end of a control plane")
    fe.add_argument("--engine-address", required=True, help="the engine process's ipc:// socket")
    fe.add_argument("--host", default="127.0.0.1")
    fe.add_argument("--port", type=int, required=True)
    fe.add_argument("--max-concurrent-rpcs", type=int, default=None)
    _add_grpc_security(fe)
    fe.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    _add_logging(fe)

    gen = sub.add_parser("generate", help="stream a completion from a running server",
                         description="Stream a completion to stdout; usage goes to stderr. "
                                     "Unset sampling flags take the server's defaults.")
    gen.add_argument("prompt")
    _add_client(gen)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=None)
    gen.add_argument("--frequency-penalty", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                     default=None, help="stop token id (repeatable)")
    gen.add_argument("--min-tokens", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                     help="wait up to this long for the server to be SERVING first")

    keys = sub.add_parser("link-keys", help="write CURVE key pairs for the link to DIR")
    keys.add_argument("dir", type=pathlib.Path)

    demo = sub.add_parser("demo-model", help="write the default tiny model (seeded random "
                          "weights) to DIR unless it is there; prints DIR")
    demo.add_argument("dir", type=pathlib.Path, nargs="?", default=None,
                      help="(default: the cache, ~/.cache/splitserve or $SPLITSERVE_CACHE)")

    health = sub.add_parser(
        "health", help="exit 0 when the server is SERVING (or a liveness file is fresh)",
        description="Probe for healthchecks. Over gRPC: exit 0 when the service is SERVING; the "
                    "default service \"\" is SERVING only while a data plane is attached (a "
                    "readiness check); \"liveness\" is SERVING while the control plane's loop "
                    "runs. With --file: exit 0 when the data plane touched the file within "
                    "--max-age seconds.")
    _add_client(health)
    health.add_argument("--service", default="", help="health service name (default: \"\")")
    health.add_argument("--timeout", type=float, default=5.0)
    health.add_argument("--file", type=pathlib.Path, default=None,
                        help="a data plane's --liveness-file instead of a gRPC check")
    health.add_argument("--max-age", type=float, default=30.0, help="seconds (with --file)")
    return parser


def _link_config(args: argparse.Namespace, server: bool):
    """The one place link settings come from the command line."""
    from common.transport import CurveKeys, LinkConfig
    secret = getattr(args, "link_secret_key", None)
    other = getattr(args, "link_authorized_keys" if server else "link_server_key", None)
    if (secret is None) != (other is None):
        raise SystemExit("splitserve: CURVE needs both --link-secret-key and " +
                         ("--link-authorized-keys" if server else "--link-server-key"))
    curve = None
    if secret is not None:
        curve = CurveKeys.server(secret, other) if server else CurveKeys.client(secret, other)
    kwargs = {"curve": curve}
    if hasattr(args, "step_timeout"):
        kwargs["step_timeout_s"] = args.step_timeout
    if hasattr(args, "controlplane_grace"):
        kwargs["controlplane_grace_s"] = args.controlplane_grace
    return LinkConfig(**kwargs)


def _controlplane_config(args: argparse.Namespace, model: pathlib.Path, address: str):
    from controlplane.server import ControlPlaneConfig
    return ControlPlaneConfig(
        model_dir=model, dataplane_address=address, host=args.host, port=args.port,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        max_waiting_requests=args.max_waiting_requests, max_logprobs=args.max_logprobs,
        stream_interval=args.stream_interval, api_key_file=args.api_key_file,
        tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, reattach_timeout_s=args.reattach_timeout,
        drain_timeout_s=args.drain_timeout, link=_link_config(args, server=True),
        num_frontends=args.frontends)


def _spawn(argv: list[str], name: str):
    """A supervised `splitserve <argv>` child (restarted when it dies); returns its supervisor,
    its run loop as `task`."""
    from splitserve.supervisor import Supervisor
    supervisor = Supervisor([sys.executable, "-m", "splitserve", *argv], name)
    supervisor.task = asyncio.create_task(supervisor.run())
    return supervisor


def _dataplane_argv(args: argparse.Namespace, model: pathlib.Path, address: str) -> list[str]:
    argv = ["--model", str(model), "--controlplane-address", address, "--device", args.device,
            "--tp", str(args.tp), "--dtype", args.dtype, "--block-size", str(args.block_size),
            "--kv-cache-gib", str(args.kv_cache_gib), "--attention-backend", args.attention_backend,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--load-format",
            args.load_format, "--log-level", args.log_level]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return argv


async def _serve(args: argparse.Namespace) -> None:
    from common.transport import private_ipc_address
    from controlplane.server import ControlPlane, run_until_signal
    from splitserve.default_model import ensure_default_model
    from splitserve.supervisor import Supervisor

    model = args.model or ensure_default_model()
    address = private_ipc_address()
    supervisor = Supervisor([sys.executable, "-m", "splitserve", "dataplane",
                             *_dataplane_argv(args, model, address)])
    # A data plane the control plane gave up on (hung, frozen) is killed and started again.
    control_plane = ControlPlane(_controlplane_config(args, model, address),
                                 on_dataplane_lost=supervisor.restart, spawn=_spawn)
    supervised = asyncio.create_task(supervisor.run())
    try:
        await run_until_signal(control_plane)
    finally:
        logging.getLogger("splitserve.supervisor").info("stopping the data plane")
        await supervisor.stop()
        supervised.cancel()


async def _controlplane(args: argparse.Namespace) -> None:
    from controlplane.server import ControlPlane, run_until_signal
    await run_until_signal(ControlPlane(_controlplane_config(args, args.model,
                                                             args.dataplane_address), spawn=_spawn))


async def _frontend(args: argparse.Namespace) -> None:
    from common.process import die_with_parent
    from controlplane.frontend import FrontendConfig, run_frontend
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    await run_frontend(FrontendConfig(
        engine_address=args.engine_address, host=args.host, port=args.port,
        max_concurrent_rpcs=args.max_concurrent_rpcs, api_key_file=args.api_key_file,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca))


def _dataplane(args: argparse.Namespace, argv: list[str]) -> None:
    from dataplane.main import DataPlaneConfig, run
    from dataplane.model_runner import RunnerConfig
    runner = RunnerConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                          attention_backend=args.attention_backend, block_size=args.block_size,
                          num_kv_blocks=args.num_kv_blocks, cpu_kv_cache_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager, load_format=args.load_format)
    config = DataPlaneConfig(runner=runner, controlplane_address=args.controlplane_address,
                             tp=args.tp, rank=args.rank, dist_init_method=args.dist_init_method,
                             parent_pid=args.parent_pid, liveness_file=args.liveness_file,
                             link=_link_config(args, server=False))
    run(config, _without_option(argv, "--parent-pid"))


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv minus `option VALUE` / `option=VALUE` (what followers must not inherit)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                  "min_tokens")


def _generate(args: argparse.Namespace) -> int:
    import grpc
    from protos import generation_pb2
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    with _client(args) as client:
        if args.wait and not client.wait_until_serving(args.wait):
            print(f"splitserve: {args.address} is not serving after {args.wait}s", file=sys.stderr)
            return 1
        last = None
        try:
            for chunk in client.generate_stream(args.prompt, request_id=args.request_id,
                                                timeout=args.timeout, ignore_eos=args.ignore_eos,
                                                **sampling):
                print(chunk.text, end="", flush=True)
                last = chunk
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    usage = last.usage
    print()
    print(f"[{usage.completion_tokens} tokens ({usage.prompt_tokens} prompt, "
          f"{usage.cached_tokens} cached), finish reason: "
          f"{generation_pb2.FinishReason.Name(last.finish_reason)}]", file=sys.stderr)
    return 0


def _health(args: argparse.Namespace) -> int:
    if args.file is not None:
        import time
        age = time.time() - args.file.stat().st_mtime if args.file.exists() else float("inf")
        print(f"{args.file}: {age:.1f}s old")
        return 0 if age <= args.max_age else 1
    with _client(args) as client:
        serving = client.is_serving(args.service, timeout=args.timeout)
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: for a process that seems stuck.
    faulthandler.register(signal.SIGUSR1)
    if hasattr(args, "log_level"):
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "controlplane", "dataplane", "frontend"):
        from common.process import tune_gc
        tune_gc()
    if args.command == "serve":
        asyncio.run(_serve(args))
    elif args.command == "controlplane":
        asyncio.run(_controlplane(args))
    elif args.command == "dataplane":
        _dataplane(args, argv[1:])
    elif args.command == "frontend":
        asyncio.run(_frontend(args))
    elif args.command == "generate":
        return _generate(args)
    elif args.command == "health":
        return _health(args)
    elif args.command == "link-keys":
        from common.transport import write_link_keys
        write_link_keys(args.dir)
        print(f"{args.dir}/controlplane.key_secret: --link-secret-key of the control plane\n"
              f"{args.dir}/authorized: its --link-authorized-keys\n"
              f"{args.dir}/dataplane.key_secret: --link-secret-key of the data plane\n"
              f"{args.dir}/controlplane.key: its --link-server-key")
    elif args.command == "demo-model":
        from splitserve.default_model import ensure_default_model
        print(ensure_default_model(args.dir))
    return 0
