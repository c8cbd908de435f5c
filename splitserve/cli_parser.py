"""The `splitserve` command.

  serve         the control plane plus locally spawned data-plane ranks, one command
  controlplane  the control plane alone (gRPC API; binds the ZeroMQ port data planes connect to)
  dataplane     the data plane alone (connects to a control plane)
  frontend      (internal) a gRPC front-end process; serve and controlplane start theirs
  generate      stream a completion from a running server
  health        exit 0 only when a server is SERVING
  demo-model    write the default tiny random-weight model to a directory (for containers)
  link-keys     write CURVE key pairs that authenticate the link between the planes

Each subcommand imports only what it runs: `controlplane`, `frontend`, `generate` and `health`
never load torch.
"""
# (This module builds the argument parser; splitserve/cli.py runs the commands.)

import argparse
import pathlib
import re
from collections.abc import Callable

DEFAULT_PORT = 50051


def _number(kind: type, low: float, high: float | None = None, *, above: bool = False
            ) -> Callable[[str], float]:
    """An argparse type: a `kind` at least `low` (above it with `above`) and at most `high`; a
    value outside is a usage error naming the range, not a traceback from deep inside."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: "
                                             f"{text!r}") from None
        if value < low or (above and value == low) or (high is not None and value > high):
            bound = f"> {low}" if above else f">= {low}"
            raise argparse.ArgumentTypeError(
                f"must be {bound}{f' and <= {high}' if high is not None else ''}, not {text}")
        return value
    parse.__name__ = kind.__name__  # (argparse names the type in its messages)
    return parse


_PORT = _number(int, 0, 65535)
_POSITIVE = _number(int, 1)
_COUNT = _number(int, 0)
_SECONDS = _number(float, 0)
_POSITIVE_SECONDS = _number(float, 0, above=True)
_UINT32 = _number(int, 0, 2**32 - 1)  # (the API's uint32 fields)
_ZMQ_ADDRESS = re.compile(r"(tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(\d{1,5})|ipc://.+|inproc://.+)")


def _zmq_address(text: str) -> str:
    """tcp://HOST:PORT, ipc://PATH or inproc://NAME, checked here: ZeroMQ's own error comes
    from the link's thread, which the process outlives."""
    match = _ZMQ_ADDRESS.fullmatch(text)
    if match is None or (match[3] is not None and not 0 < int(match[3]) <= 65535):
        raise argparse.ArgumentTypeError(f"not a ZeroMQ address (tcp://HOST:PORT, ipc://PATH): "
                                         f"{text!r}")
    return text


def _add_model(p: argparse.ArgumentParser, required: bool) -> None:
    help_text = "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"
    if not required:
        help_text += ("; default: a small Qwen3 with seeded random weights (gibberish output), "
                      "written once to ~/.cache/splitserve ($SPLITSERVE_CACHE or "
                      "$XDG_CACHE_HOME/splitserve where set)")
    p.add_argument("--model", type=pathlib.Path, required=required, help=help_text)


def _add_api(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address (default %(default)s)")
    p.add_argument("--port", type=_PORT, default=DEFAULT_PORT,
                   help="gRPC port; 0 picks a free one (default %(default)s)")
    p.add_argument("--max-num-seqs", type=_POSITIVE, default=256,
                   help="most requests in one step (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=_POSITIVE, default=8192,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default %(default)s)")
    p.add_argument("--max-model-len", type=_POSITIVE, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--max-waiting-requests", type=_COUNT, default=1024,
                   help="queue bound: requests that wait beyond the free sequence slots "
                        "(--max-num-seqs; none while the KV cache is full); beyond it Generate "
                        "fails fast with RESOURCE_EXHAUSTED (0: no queue) (default %(default)s)")
    p.add_argument("--metrics-port", type=_PORT, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (vLLM's names "
                        "under splitserve:; 0: a free port, logged) (default: off)")
    p.add_argument("--max-logprobs", type=_COUNT, default=20,
                   help="largest top-N a request may ask for (default %(default)s)")
    p.add_argument("--stream-interval", type=_POSITIVE, default=1, metavar="TOKENS",
                   help="a stream message waits for this many tokens (the last one may have "
                        "fewer): larger values send fewer messages, for less control-plane CPU "
                        "per token with many streams (default %(default)s). Tokens that pile up "
                        "while a message is being written go out together in any case")
    p.add_argument("--pipeline-depth", type=_POSITIVE, default=3, metavar="STEPS",
                   help="steps in flight at once: with 2 the next step is scheduled and sent "
                        "while the data plane runs the current one; 3 keeps one more queued on "
                        "the device, so that a host that turns a step around late still finds "
                        "it busy (a new request waits one step more for its first token) "
                        "(default %(default)s)")
    p.add_argument("--frontends", type=_COUNT, default=1, metavar="N",
                   help="gRPC front-end processes: they hold the client connections and write "
                        "the stream messages, so that the engine's loop does not; they share "
                        "the port and gRPC's own bound on concurrent RPCs; 0 serves gRPC in the "
                        "engine's process (default %(default)s)")
    _add_grpc_security(p)
    p.add_argument("--reattach-timeout", type=_SECONDS, default=30.0, metavar="SECONDS",
                   help="after a data-plane loss, how long requests wait for one to (re)attach "
                        "before they end UNAVAILABLE (default %(default)s)")
    p.add_argument("--drain-timeout", type=_SECONDS, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long live requests may still run (default %(default)s)")
    p.add_argument("--step-timeout", type=_POSITIVE_SECONDS, default=120.0, metavar="SECONDS",
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


def _add_supervised(p: argparse.ArgumentParser) -> None:
    """A command `serve` runs as a supervised child: the Supervisor adds --parent-pid."""
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def _add_dataplane(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default %(default)s)")
    p.add_argument("--tp", type=_POSITIVE, default=1,
                   help="tensor-parallel ranks (default %(default)s)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: the checkpoint's dtype (default %(default)s)")
    p.add_argument("--block-size", type=_POSITIVE, default=None,
                   help="tokens per KV block, unless the attention backend needs another "
                        "(flash_attn forces 128, 256 with FlashAttention 2.x); default: the "
                        "backend's fastest, 128 for triton_fa4, else 16")
    p.add_argument("--num-kv-blocks", type=_POSITIVE, default=None,
                   help="cap on the number of KV blocks (small-memory runs, tests)")
    p.add_argument("--kv-cache-gib", type=_number(float, 0, above=True), default=1.0,
                   help="KV cache budget per rank on CPU, GiB (default %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=_number(float, 0, 1, above=True), default=0.9,
                   help="share of each GPU's memory the data plane may hold; the KV cache gets "
                        "what weights, a profiled worst-case step and the CUDA graphs' memory "
                        "leave (default %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (by default decode steps replay whole-step graphs and "
                        "steps with prompt tokens piecewise ones, up to 16384 tokens a step)")
    p.add_argument("--no-prompt-graphs", action="store_true",
                   help="run steps that carry prompt tokens eagerly (decode steps keep theirs)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the Triton kernels without programmatic dependent launch (on by "
                        "default on Hopper and later: a kernel starts while the one before it "
                        "finishes, fetching its weights, and waits on the device for its inputs)")
    p.add_argument("--load-format", choices=("safetensors", "dummy"), default="safetensors",
                   help="dummy: random weights instead of the checkpoint's (benchmarks; the "
                        "model directory then needs only config.json and tokenizer.json)")
    p.add_argument("--attention-backend",
                   choices=("auto", "torch", "triton", "triton_fa4", "flash_attn"), default="auto",
                   help="auto: torch on CPU; on CUDA triton_fa4 on Hopper GPUs where "
                        "FlashAttention-4 imports, else triton (the log says why FA4 did "
                        "not; if FA4 fails to compile at start-up on one GPU, triton on "
                        "the same blocks); triton_fa4: triton with "
                        "FlashAttention-4 for steps of 4096 or more prompt tokens in "
                        "fp16/bf16 unless the longest prompt x query heads per KV head <= "
                        "256, on "
                        "128-token blocks unless --block-size names another (FA4 gathers "
                        "those, 5-12%% slower) (default %(default)s)")


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


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="(case-insensitive; default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_serve_command, _add_controlplane_command, _add_dataplane_command,
                        _add_frontend_command, _add_generate_command, _add_tool_commands,
                        _add_health_command):
        add_command(sub)
    return parser


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    """Both planes from one command."""
    serve = sub.add_parser("serve", help="control plane + local data plane, one command")
    _add_model(serve, required=False)
    _add_api(serve)
    _add_dataplane(serve)
    _add_logging(serve)


def _add_controlplane_command(sub: argparse._SubParsersAction) -> None:
    """The control plane alone, binding the link for data planes."""
    cp = sub.add_parser("controlplane", help="the control plane alone")
    _add_model(cp, required=True)
    cp.add_argument("--dataplane-address", required=True, type=_zmq_address,
                    help="ZeroMQ endpoint to bind for data planes, e.g. tcp://0.0.0.0:5555")
    cp.add_argument("--link-secret-key", type=pathlib.Path, default=None,
                    help="CURVE: this control plane's secret key file (splitserve link-keys)")
    cp.add_argument("--link-authorized-keys", type=pathlib.Path, default=None,
                    help="CURVE: directory of data-plane public keys allowed to connect")
    _add_api(cp)
    _add_logging(cp)


def _add_dataplane_command(sub: argparse._SubParsersAction) -> None:
    """The data plane alone, connecting to a control plane."""
    dp = sub.add_parser("dataplane", help="the data plane alone")
    _add_model(dp, required=True)
    dp.add_argument("--controlplane-address", required=True, type=_zmq_address,
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
    dp.add_argument("--controlplane-grace", type=_SECONDS, default=30.0, metavar="SECONDS",
                    help="exit when no control plane was heard for this long after one was "
                         "(default %(default)s)")
    _add_supervised(dp)
    _add_logging(dp)


def _add_frontend_command(sub: argparse._SubParsersAction) -> None:
    """A gRPC front-end process, spawned by the control plane."""
    fe = sub.add_parser("frontend", help="(internal) a gRPC front-end of a control plane")
    fe.add_argument("--engine-address", required=True, help="the engine process's ipc:// socket")
    fe.add_argument("--host", default="127.0.0.1")
    fe.add_argument("--port", type=_PORT, required=True)
    fe.add_argument("--max-concurrent-rpcs", type=int, default=None)
    _add_grpc_security(fe)
    _add_supervised(fe)
    _add_logging(fe)


def _add_generate_command(sub: argparse._SubParsersAction) -> None:
    """The gRPC client: stream one completion."""
    gen = sub.add_parser("generate", help="stream a completion from a running server",
                         description="Stream a completion to stdout; usage goes to stderr. "
                                     "Unset sampling flags take the server's defaults.")
    gen.add_argument("prompt")
    _add_client(gen)
    gen.add_argument("--max-tokens", type=_number(int, 1, 2**32 - 1), default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=_number(int, -1, 2**31 - 1), default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=None)
    gen.add_argument("--frequency-penalty", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=_number(int, 0, 2**64 - 1), default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", dest="stop_token_ids", type=_UINT32, action="append",
                     default=None, help="stop token id (repeatable)")
    gen.add_argument("--min-tokens", type=_UINT32, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                     help="wait up to this long for the server to be SERVING first")


def _add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """One-shot helpers: CURVE keys and the demo model."""
    keys = sub.add_parser("link-keys", help="write CURVE key pairs for the link to DIR")
    keys.add_argument("dir", type=pathlib.Path)

    demo = sub.add_parser("demo-model", help="write the default tiny model (seeded random "
                          "weights) to DIR unless it is there; prints DIR")
    demo.add_argument("dir", type=pathlib.Path, nargs="?", default=None,
                      help="(default: the cache, ~/.cache/splitserve; $SPLITSERVE_CACHE or "
                           "$XDG_CACHE_HOME/splitserve where set)")


def _add_health_command(sub: argparse._SubParsersAction) -> None:
    """The probe for container healthchecks."""
    health = sub.add_parser(
        "health", help="exit 0 when the server is SERVING (or a liveness file is fresh)",
        description="Probe for healthchecks. Over gRPC: exit 0 when the service is SERVING; the "
                    "default service \"\" is SERVING only while a data plane is attached (a "
                    "readiness check); \"liveness\" is SERVING while the control plane's loop "
                    "runs. With --file: exit 0 when the data plane touched the file within "
                    "--max-age seconds. Prints the status, or why the check failed (e.g. "
                    "UNAVAILABLE: no server at the address; NOT_FOUND: no such service).")
    _add_client(health)
    health.add_argument("--service", default="", help="health service name (default: \"\")")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    health.add_argument("--file", type=pathlib.Path, default=None,
                        help="a data plane's --liveness-file instead of a gRPC check")
    health.add_argument("--max-age", type=float, default=30.0, help="seconds (with --file; default 30)")
