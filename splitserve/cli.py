"""The `splitserve` command: each subcommand (splitserve/cli_parser.py lists them and their
flags) imports only what it runs: `controlplane`, `frontend`, `generate` and `health` never load
torch.
"""

import argparse
import asyncio
import faulthandler
import logging
import os
import pathlib
import signal
import sys

from common.errors import ConfigError
from common.process import StopSignals
from splitserve.cli_parser import build_parser


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


def _link_config(args: argparse.Namespace, server: bool):
    """The one place link settings come from the command line."""
    from common.transport import CurveKeys, LinkConfig
    secret = getattr(args, "link_secret_key", None)
    other = getattr(args, "link_authorized_keys" if server else "link_server_key", None)
    if (secret is None) != (other is None):
        raise ConfigError("CURVE needs both --link-secret-key and " +
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


def _grpc_config(args: argparse.Namespace):
    from controlplane.grpc_server import GrpcServerConfig
    return GrpcServerConfig(host=args.host, port=args.port,
                            max_concurrent_rpcs=getattr(args, "max_concurrent_rpcs", None),
                            api_key_file=args.api_key_file, tls_cert=args.tls_cert,
                            tls_key=args.tls_key, tls_client_ca=args.tls_client_ca)


def _controlplane_config(args: argparse.Namespace, model: pathlib.Path, address: str):
    from controlplane.server import ControlPlaneConfig
    return ControlPlaneConfig(
        model_dir=model, dataplane_address=address, grpc=_grpc_config(args),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        max_waiting_requests=args.max_waiting_requests, max_logprobs=args.max_logprobs,
        stream_interval=args.stream_interval, pipeline_depth=args.pipeline_depth,
        reattach_timeout_s=args.reattach_timeout,
        drain_timeout_s=args.drain_timeout, link=_link_config(args, server=True),
        num_frontends=args.frontends, metrics_port=args.metrics_port)


def _spawn(argv: list[str], name: str):
    """A supervised `splitserve <argv>` child, restarted when it dies (splitserve.supervisor);
    returns its supervisor."""
    from splitserve.supervisor import Supervisor
    return Supervisor([sys.executable, "-m", "splitserve", *argv], name).start()


def _dataplane_argv(args: argparse.Namespace, model: pathlib.Path, address: str) -> list[str]:
    argv = ["--model", str(model), "--controlplane-address", address, "--device", args.device,
            "--tp", str(args.tp), "--dtype", args.dtype,
            "--kv-cache-gib", str(args.kv_cache_gib), "--attention-backend", args.attention_backend,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--load-format",
            args.load_format, "--log-level", args.log_level]
    if args.block_size is not None:
        argv += ["--block-size", str(args.block_size)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.no_prompt_graphs:
        argv.append("--no-prompt-graphs")
    if args.no_pdl:
        argv.append("--no-pdl")
    if args.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return argv


async def _serve(args: argparse.Namespace) -> None:
    signals = StopSignals()  # (first: before the imports, and what a signal would leave behind)
    from common.transport import private_ipc_address, remove_private_ipc
    from splitserve.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    address = private_ipc_address()
    try:
        await _serve_on(args, model, address, signals)
    finally:
        remove_private_ipc(address)  # (its two ends are closed: the link, the data plane)


async def _serve_on(args: argparse.Namespace, model: pathlib.Path, address: str,
                    signals: StopSignals) -> None:
    from controlplane.server import ControlPlane, run_until_signal

    # invalid flags and model directories fail before any child starts; a data plane the
    # control plane gave up on (hung, frozen) is killed and started again
    control_plane = ControlPlane(_controlplane_config(args, model, address),
                                 on_dataplane_lost=lambda: supervisor.restart(), spawn=_spawn)
    supervisor = _spawn(["dataplane", *_dataplane_argv(args, model, address)], "data plane")
    failed = True
    try:
        await run_until_signal(control_plane, children=[supervisor], signals=signals)
        failed = False
    finally:  # (after a failure, quietly: its error is the line to read, printed next)
        logging.getLogger("splitserve.supervisor").log(
            logging.DEBUG if failed else logging.INFO, "stopping the data plane")
        await supervisor.stop(after_failure=failed)


async def _controlplane(args: argparse.Namespace) -> None:
    signals = StopSignals()
    from controlplane.server import ControlPlane, run_until_signal
    await run_until_signal(ControlPlane(_controlplane_config(args, args.model,
                                                             args.dataplane_address), spawn=_spawn),
                           signals=signals)


async def _frontend(args: argparse.Namespace) -> None:
    from common.process import die_with_parent
    from controlplane.frontend import FrontendConfig, run_frontend
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    await run_frontend(FrontendConfig(engine_address=args.engine_address,
                                      grpc=_grpc_config(args)))


def _dataplane(args: argparse.Namespace, argv: list[str]) -> None:
    from common.model_info import ModelInfo
    ModelInfo.from_dir(args.model)  # a wrong directory fails here, in one line, before torch
    from dataplane.main import DataPlaneConfig, run
    from dataplane.model_runner import RunnerConfig
    runner = RunnerConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                          attention_backend=args.attention_backend, block_size=args.block_size,
                          num_kv_blocks=args.num_kv_blocks, cpu_kv_cache_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager,
                          prompt_graphs=not args.no_prompt_graphs, pdl=not args.no_pdl,
                          load_format=args.load_format)
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
    from splitserve.client import finish_reason_name
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
        except KeyboardInterrupt:  # (leaving the client aborts the request on the server)
            print("\nsplitserve: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `| head`: nobody reads the rest
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (exit's flush)
            print("splitserve: output closed", file=sys.stderr)
            return 1
    usage = last.usage
    print()
    print(f"[{usage.completion_tokens} tokens ({usage.prompt_tokens} prompt, "
          f"{usage.cached_tokens} cached), finish reason: "
          f"{finish_reason_name(last.finish_reason)}]", file=sys.stderr)
    return 0


def _health(args: argparse.Namespace) -> int:
    if args.file is not None:
        import time
        if not args.file.exists():
            print(f"{args.file}: missing")
            return 1
        age = time.time() - args.file.stat().st_mtime
        print(f"{args.file}: {age:.1f}s old")
        return 0 if age <= args.max_age else 1
    import grpc
    with _client(args) as client:
        try:
            status = client.health(args.service, timeout=args.timeout)
        except grpc.RpcError as e:  # why the check failed: no server, no such service
            details = e.details() or (f"no such service {args.service!r}"
                                      if e.code() is grpc.StatusCode.NOT_FOUND else "")
            print(f"{e.code().name}: {details}")
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return _run(args, argv)
    except ConfigError as e:  # a wrong flag value or directory: one line, as argparse's errors
        print(f"splitserve {args.command}: error: {e}", file=sys.stderr)
        return ConfigError.EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C before a server handles it (imports, loading weights)
        print(f"splitserve {args.command}: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, argv: list[str]) -> int:
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
