"""Wire the control plane together and run it: link, engine, and the gRPC API with health and
reflection, served by front-end processes (controlplane/frontend.py) or, with no front-ends, in
this process; drain on SIGTERM."""

import asyncio
import contextlib
import faulthandler
import logging
import os
import pathlib
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health

from common.errors import ConfigError
from common.model_info import ModelInfo
from common.process import StopSignals
from common.transport import LinkConfig, check_tcp_port_free, private_ipc_address, \
    remove_private_ipc, reserve_tcp_port
from controlplane.api_server import GenerationServicer
from controlplane.dataplane_link import DataPlaneLink
from controlplane.engine import Engine, EngineConfig
from controlplane.frontend_link import FrontendLink
from controlplane.grpc_server import GrpcServerConfig, set_health, start_server
from controlplane.metrics import serve_metrics
from controlplane.scheduler import SchedulerConfig
from controlplane.tokenizer import Tokenizer
from protos import generation_pb2_grpc, link_pb2

log = logging.getLogger("splitserve.controlplane")

FRONTEND_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ControlPlaneConfig:
    model_dir: pathlib.Path
    dataplane_address: str  # where the control plane binds its ZeroMQ ROUTER
    # where clients connect (its max_concurrent_rpcs unset: the server derives it)
    grpc: GrpcServerConfig = field(default_factory=GrpcServerConfig)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_logprobs: int = 20
    stream_interval: int = 1  # tokens a stream message waits for (the last may have fewer)
    pipeline_depth: int = EngineConfig.pipeline_depth  # steps in flight at once
    reattach_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    link: LinkConfig = field(default_factory=LinkConfig)
    num_frontends: int = 1  # gRPC front-end processes; 0: gRPC in this process
    metrics_port: int | None = None  # Prometheus metrics over HTTP on grpc.host (0: a free one)

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 0 or self.drain_timeout_s < 0 or self.num_frontends < 0:
            raise ValueError("max_waiting_requests, drain_timeout_s and frontends must be >= 0")
        # the engine's own checks, now rather than once a data plane has started
        EngineConfig(reattach_timeout_s=self.reattach_timeout_s,
                     stream_interval=self.stream_interval, pipeline_depth=self.pipeline_depth)

    @property
    def max_concurrent_rpcs(self) -> int:
        """gRPC's own bound on RPCs in progress: every admitted request plus room for the
        small RPCs; beyond it gRPC answers RESOURCE_EXHAUSTED itself."""
        return self.max_num_seqs + self.max_waiting_requests + 256

    def engine_config(self, model: ModelInfo) -> EngineConfig:
        max_model_len = self.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's "
                              f"max_position_embeddings {model.max_position_embeddings}")
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                    max_num_batched_tokens=self.max_num_batched_tokens,
                                    max_model_len=max_model_len,
                                    enable_prefix_caching=self.enable_prefix_caching)
        return EngineConfig(scheduler=scheduler, reattach_timeout_s=self.reattach_timeout_s,
                            step_timeout_cap_s=self.link.step_timeout_s,
                            stream_interval=self.stream_interval,
                            pipeline_depth=self.pipeline_depth)


class ControlPlane:
    """Everything the control plane runs, built from its config (see `start`).
    `on_dataplane_lost` is called when the link loses a data plane (serve restarts its child).
    `spawn(argv, name)` starts a supervised `splitserve <argv>` child and returns its supervisor
    (something with `async stop()` and a `task` that ends when it gives up restarting): the
    front-ends are started with it."""

    def __init__(self, config: ControlPlaneConfig, on_dataplane_lost=None, spawn=None) -> None:
        assert spawn is not None or config.num_frontends == 0, "front-ends need `spawn`"
        self.config = config
        self._spawn = spawn
        self.frontend_supervisors: list = []
        self.frontend_link: FrontendLink | None = None
        self._port_reservation: socket.socket | None = None
        self.model = ModelInfo.from_dir(config.model_dir)
        self.engine_config = config.engine_config(self.model)
        self._on_dataplane_lost = on_dataplane_lost or (lambda: None)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        scheduler = self.engine_config.scheduler
        limits = link_pb2.Configure(
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=scheduler.max_model_len, max_logprobs=config.max_logprobs)
        self.link = DataPlaneLink(config.dataplane_address, self.model, limits, config.link,
                                  on_change=self._on_link_change)
        tokenizer = Tokenizer.from_dir(config.model_dir, self.model.vocab_size)
        self.engine = Engine(self.engine_config, tokenizer, self.link,
                             on_state_change=self._refresh_health)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.engine_task: asyncio.Task | None = None
        self.metrics_server: WSGIServer | None = None  # (controlplane/metrics.py)

    def _on_link_change(self, attached: bool) -> None:
        self.engine.on_link_change(attached)
        self._refresh_health()
        if not attached:
            self._on_dataplane_lost()

    def _refresh_health(self) -> None:
        """What health reports: in this process's gRPC server, or through the front-ends."""
        if self.frontend_link is not None:
            self.frontend_link.state_changed()
        else:
            set_health(self.health, serving=self.is_serving, live=True)

    @property
    def is_serving(self) -> bool:
        return self.link.is_attached and self.engine.is_serving

    async def start(self) -> int:
        """Bind the link, start the engine and serve gRPC (through the front-ends, once one
        reported it serves); returns the gRPC port."""
        self._refresh_health()
        # what the user's flags may get wrong first, while there is nothing to undo
        if self.config.grpc.port:
            check_tcp_port_free(self.config.grpc.host, self.config.grpc.port)
        if self.config.metrics_port is not None:
            self.metrics_server, _, port = serve_metrics(
                self.engine, self.model.name, self.config.grpc.host, self.config.metrics_port)
            log.info("serving Prometheus metrics on http://%s:%d/metrics", self.config.grpc.host,
                     port)
        await self.link.start()
        servicer = GenerationServicer(self.engine, self.model,
                                      self.engine_config.scheduler.max_model_len,
                                      self.config.max_waiting_requests, self.config.max_logprobs)
        self.engine_task = asyncio.create_task(self.engine.run(), name="engine")
        if self.config.num_frontends:
            self.port = await self._start_frontends(servicer)
        else:
            self.port = await self._start_grpc(servicer)
        log.info("serving gRPC on %s:%d; data planes connect to %s", self.config.grpc.host,
                 self.port, self.config.dataplane_address)
        return self.port

    async def _start_frontends(self, servicer: GenerationServicer) -> int:
        # Every front-end binds the same port (gRPC sets SO_REUSEPORT), so one is chosen here;
        # a port chosen here stays reserved while the server runs (a restarted front-end binds
        # it again later). (A given port was checked free of another server in start.)
        port = self.config.grpc.port
        if not port:
            self._port_reservation = reserve_tcp_port(self.config.grpc.host)
            port = self._port_reservation.getsockname()[1]
        address = private_ipc_address("frontend")
        self.frontend_link = FrontendLink(address, servicer, serving=lambda: self.is_serving)
        started = asyncio.Event()
        self.frontend_link.on_hello = lambda _: started.set()
        await self.frontend_link.start()
        argv = self._frontend_argv(address, port)
        self.frontend_supervisors = [self._spawn(argv, "gRPC front-end")
                                     for _ in range(self.config.num_frontends)]
        try:
            await asyncio.wait_for(started.wait(), FRONTEND_START_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"no gRPC front-end started within {FRONTEND_START_TIMEOUT_S:.0f}s"
                               ) from None
        return port

    def _frontend_argv(self, address: str, port: int) -> list[str]:
        c = self.config
        g = c.grpc
        per_frontend = -(-c.max_concurrent_rpcs // c.num_frontends)  # gRPC's own bound, shared
        argv = ["frontend", "--engine-address", address, "--host", g.host, "--port", str(port),
                "--max-concurrent-rpcs", str(per_frontend),
                "--log-level", logging.getLevelName(logging.getLogger().level)]
        for flag, path in (("--api-key-file", g.api_key_file), ("--tls-cert", g.tls_cert),
                           ("--tls-key", g.tls_key), ("--tls-client-ca", g.tls_client_ca)):
            if path is not None:
                argv += [flag, str(path)]
        return argv

    async def _start_grpc(self, servicer: GenerationServicer) -> int:
        c = self.config
        self.server, port = await start_server(
            lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
            self.health, replace(c.grpc, max_concurrent_rpcs=c.max_concurrent_rpcs))
        return port

    async def drain_and_stop(self) -> None:
        """SIGTERM: NOT_SERVING at once, no new requests, live ones get up to drain_timeout_s,
        the rest end UNAVAILABLE; then the server stops."""
        log.info("draining: %d live requests, up to %.0fs", len(self.engine.streams),
                 self.config.drain_timeout_s)
        cut = await self.engine.drain(self.config.drain_timeout_s)
        if cut:
            log.warning("drain over: %d requests ended UNAVAILABLE", cut)
        await self.stop()

    async def stop(self, grace_s: float = 1.0, after_failure: bool = False) -> None:
        """Stop what start started. After a failure its steps are DEBUG lines: the caller
        raises the failure, whose line the operator should not find under the cleanup's."""
        level = logging.DEBUG if after_failure else logging.INFO
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.shutdown)  # (waits for its poll: 0.5 s)
            self.metrics_server.server_close()
        if self.server is not None:
            log.log(level, "stopping the gRPC server")
            await self.server.stop(grace_s)
        if self.frontend_supervisors:
            log.log(level, "stopping the gRPC front-ends")
            await asyncio.gather(*(frontend.stop(after_failure=after_failure)
                                   for frontend in self.frontend_supervisors))
        if self.frontend_link is not None:
            await self.frontend_link.close()
            remove_private_ipc(self.frontend_link.address)
        if self._port_reservation is not None:
            self._port_reservation.close()
        if self.engine_task is not None:
            log.log(level, "stopping the engine")
            self.engine.close()
            await asyncio.gather(self.engine_task, return_exceptions=True)
        log.log(level, "closing the link")
        await self.link.close()


async def run_until_signal(control_plane: ControlPlane, children: Sequence = (),
                           signals: StopSignals | None = None) -> None:
    """Serve until SIGTERM/SIGINT (then drain), or until the engine loop dies or the supervisor
    of a child (a front-end, or one of `children`: serve's data plane) gives up restarting it
    (then raise). A signal while it starts stops what started (nothing to drain)."""
    signals = signals or StopSignals()
    waiter = asyncio.create_task(signals.event.wait())
    if signals.event.is_set() or not await _started(control_plane, waiter):
        log.info("stopping on %s, before serving", signals.first)
        await control_plane.stop()
        return
    engine_task = control_plane.engine_task
    # A child whose supervisor gave up restarting it: without a front-end nobody can reach this
    # server, without its data plane it can serve nobody.
    supervised = {s.task: s.name for s in [*control_plane.frontend_supervisors, *children]}
    done, _ = await asyncio.wait({waiter, engine_task, *supervised},
                                 return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if engine_task.done():
        await control_plane.stop(after_failure=True)
        raise RuntimeError("the engine loop stopped") from engine_task.exception()
    gave_up = [task for task in done if task in supervised]
    if gave_up:
        await control_plane.stop(after_failure=True)
        if isinstance(gave_up[0].exception(), ConfigError):  # (it refused its flags)
            raise gave_up[0].exception()
        raise RuntimeError(f"the {supervised[gave_up[0]]} keeps exiting; stopping")
    log.info("stopping on %s", signals.first)
    _exit_if_stuck(control_plane.config.drain_timeout_s + 15)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second one: no more waiting
        loop.add_signal_handler(sig, _cut_drain, control_plane.engine)
    await control_plane.drain_and_stop()


async def _started(control_plane: ControlPlane, signalled: asyncio.Task) -> bool:
    """Start the control plane; False when a signal came first (what started is left to stop).
    Raises what failed the start, after undoing it."""
    starting = asyncio.create_task(control_plane.start())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False
    if starting.exception() is not None:  # (a port or the link's address in use): undo it
        signalled.cancel()
        with contextlib.suppress(Exception):
            await control_plane.stop(after_failure=True)
        raise starting.exception()
    return True


def _cut_drain(engine: Engine) -> None:
    log.warning("a second signal: ending the %d live requests now", len(engine.streams))
    engine.cut_drain()


def _exit_if_stuck(after_s: float) -> None:
    """A stop must end the process: if it is still alive `after_s` from now, print every
    thread's stack and every asyncio task's (to find out why) and exit with status 1."""
    loop = asyncio.get_running_loop()

    def give_up() -> None:
        log.error("still not stopped %.0fs after the signal; exiting", after_s)
        faulthandler.dump_traceback()
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
        os._exit(1)
    timer = threading.Timer(after_s, give_up)
    timer.daemon = True
    timer.start()
