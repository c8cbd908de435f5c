"""The control plane's side of the link: a ZeroMQ ROUTER that data-plane rank 0 connects to.

One data plane is attached at a time. Its Hello is checked (protocol, model), answered with
Configure in a new epoch, and it is attached once it reports Ready. It is lost when its
connection drops (seen at once through a socket monitor), when it goes silent for
`heartbeat_timeout_s` (it heartbeats from an I/O thread, also during a step; while it
configures, `configure_timeout_s`, since a kernel compile can keep that thread off the GIL),
when a step reply misses its deadline, or when it reports a failed step. A step whose reply is late is sent again
(with backoff) before its deadline, so a lost message costs a retransmission, not a data plane. Loss fails the step in flight with
DataPlaneLost, and the lost data plane is told to exit (a Reject in its epoch), except when the
control plane itself stops: it says Goodbye, and a data plane waits `--controlplane-grace` for
the next one, weights loaded.

A control plane that froze (stopped, starved of CPU) past the heartbeat timeout has not lost its
data plane. On waking it judges neither the data plane's silence nor a step's deadline before it
has read what queued meanwhile, and it resumes a data plane that says Hello in the current epoch
(the connection outlives the freeze: LinkConfig.transport_timeout_s). Only the heartbeat probes
lose a data plane over a send that finds no connection; a step or a reply to a Hello that does
not go out is repeated or dropped.
"""

import asyncio
import logging
import time

import zmq
import zmq.asyncio
import zmq.auth.asyncio
import zmq.utils.monitor

from common import framing
from common.model_info import ModelInfo
from common.transport import PROTOCOL_VERSION, LinkConfig, bind_error, configure_socket, \
    warn_if_exposed
from controlplane.dataplane_client import DataPlaneInfo, DataPlaneLost
from protos import link_pb2

log = logging.getLogger("splitserve.link")
_MAX_REFUSALS_REMEMBERED = 64


class _Peer:
    def __init__(self, identity: bytes, hello: link_pb2.Hello, epoch: int) -> None:
        self.identity = identity
        self.hello = hello
        self.epoch = epoch
        self.last_heard = time.monotonic()
        self.configure_sent = 0.0
        self.info: DataPlaneInfo | None = None  # set once Ready arrives


class DataPlaneLink:
    def __init__(self, address: str, model: ModelInfo, limits: link_pb2.Configure,
                 config: LinkConfig = LinkConfig(), on_change=None) -> None:
        self.address = address
        self.model = model
        self.limits = limits
        self.config = config
        self._on_change = on_change or (lambda attached: None)
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor_sock: zmq.asyncio.Socket | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._tasks: list[asyncio.Task] = []
        self._peer: _Peer | None = None
        # Epochs start at the wall clock in microseconds, so a restarted control plane's epochs
        # are newer than any its predecessor used and a data plane never mistakes one for a replay.
        self._epoch = int(time.time() * 1e6)
        self._seq = 0
        self._last_seq_in: dict[bytes, int] = {}
        self._attached = asyncio.Event()
        self._pending: dict[int, asyncio.Future] = {}
        # Why each data plane was last refused: a refused one says Hello again every second,
        # and its log line is worth writing when the reason is new, not each time.
        self._instance_to_refusal: dict[str, str] = {}
        self.last_loss_reason: str | None = None  # (DataPlaneClient)
        self.num_dropped = 0  # malformed, replayed or stale messages
        self.num_retransmits = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def is_attached(self) -> bool:
        return self._peer is not None and self._peer.info is not None

    async def start(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        if self.config.curve is not None:
            self._auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.config.curve.authorized_dir))
        self._sock = ctx.socket(zmq.ROUTER)
        configure_socket(self._sock, self.config, server=True)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        warn_if_exposed(self.address, self.config)
        self._monitor_sock = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._monitor_sock.close()
            self._sock = None
            raise bind_error(f"--dataplane-address {self.address}", e) from None
        self._tasks = [asyncio.create_task(self._reader(), name="link-reader"),
                       asyncio.create_task(self._watchdog(), name="link-watchdog"),
                       asyncio.create_task(self._monitor(self._monitor_sock), name="link-monitor")]

    async def close(self) -> None:
        """Stop. The data plane is told first (Goodbye), so that it waits for the next control
        plane without taking this one's silence for a fault."""
        if self._peer is not None and self._sock is not None:
            await self._send(self._peer, link_pb2.LinkMessage(goodbye=link_pb2.Goodbye()),
                             fatal=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._detach("control plane closing")
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor_sock.close()
            self._sock.close(linger=500)  # (the Goodbye may still be on its way out)
        if self._auth is not None:
            self._auth.stop()

    async def attach(self) -> DataPlaneInfo:
        while not self.is_attached:
            await self._attached.wait()
            if not self.is_attached:
                self._attached.clear()
        return self._peer.info

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        peer = self._peer
        if peer is None or peer.info is None or peer.epoch != epoch:
            raise DataPlaneLost("the data plane of this epoch is gone")
        future = asyncio.get_running_loop().create_future()
        self._pending[step.step_id] = future
        deadline = time.monotonic() + timeout_s
        retry_s = self.config.retransmit_s
        try:
            while True:
                # A send that finds no connection is repeated like a lost one: a killed data
                # plane is lost through _monitor's probe, a reconnecting one may be back.
                await self._send(peer, link_pb2.LinkMessage(step=step), fatal=False)
                left = deadline - time.monotonic()
                if left <= 0:
                    # After a stall of this process its reply may be waiting unread: read first.
                    await asyncio.sleep(self.config.heartbeat_interval_s)
                    if future.done():
                        return future.result()
                    self._lose(f"step {step.step_id} got no reply within its {timeout_s:.1f}s deadline")
                    raise DataPlaneLost("step deadline passed")
                try:
                    return await asyncio.wait_for(asyncio.shield(future), min(retry_s, left))
                except TimeoutError:
                    # The step or its result may have been lost on the way: send it again (the
                    # data plane runs a step once and answers repeats from its cache).
                    self.num_retransmits += 1
                    retry_s *= 2
        finally:
            self._pending.pop(step.step_id, None)

    # -- internals -----------------------------------------------------------------------------

    async def _send(self, peer: _Peer, message: link_pb2.LinkMessage, fatal: bool = True) -> None:
        """fatal: a send that finds no connection loses the data plane (else it is dropped)."""
        self._seq += 1
        message.seq, message.epoch = self._seq, peer.epoch
        frames = framing.encode(message)
        self.bytes_sent += len(frames[0])
        try:
            await self._sock.send_multipart([peer.identity, *frames])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer's connection is gone
            if fatal:
                self._lose(f"send failed: {e}")
                raise DataPlaneLost(str(e)) from None

    def drop(self, reason: str) -> None:
        self._lose(reason)

    def _lose(self, reason: str, failed_step_id: int | None = None) -> None:
        peer = self._peer
        if peer is None:
            return
        log.warning("data plane %s lost: %s", peer.hello.instance_id, reason)
        was_attached = self.is_attached
        self._detach(reason, failed_step_id)
        if was_attached:
            self._on_change(False)
        # If it still runs (hung, partitioned), it must not serve a stale epoch: tell it to exit.
        self._reject_soon(peer, f"declared lost: {reason}")

    def _detach(self, reason: str, failed_step_id: int | None = None) -> None:
        """Forget the data plane and fail the steps it owes. On close, only this: the data plane
        is not lost (its supervisor stops it, or it waits for the next control plane), and the
        owner of the closing link gets no call to replace it."""
        self._peer = None
        self.last_loss_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(DataPlaneLost(reason, failed_step_id))
        self._attached.set()  # wake attach() waiters so they re-check

    def _log_refusal(self, instance_id: str, problem: str, is_standby: bool) -> None:
        if self._instance_to_refusal.get(instance_id) == problem:
            log.debug("refusing data plane %s again: %s", instance_id, problem)
            return
        if len(self._instance_to_refusal) >= _MAX_REFUSALS_REMEMBERED:
            self._instance_to_refusal.clear()  # (instances that went away; a line again at worst)
        self._instance_to_refusal[instance_id] = problem
        if is_standby:
            log.info("data plane %s is a standby: %s", instance_id, problem)
        else:
            log.warning("refusing data plane %s: %s", instance_id, problem)

    def _reject_soon(self, peer: _Peer, reason: str) -> None:
        if self._sock is None or self._sock.closed:
            return
        message = link_pb2.LinkMessage(reject=link_pb2.Reject(reason=reason))
        self._seq += 1
        message.seq, message.epoch = self._seq, peer.epoch
        try:
            sent = self._sock.send_multipart([peer.identity, *framing.encode(message)],
                                             flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # already disconnected: nothing to tell
        # (an asyncio socket reports a failed send on the future: nobody waits for it here)
        sent.add_done_callback(lambda future: future.cancelled() or future.exception())

    async def _watchdog(self) -> None:
        interval = self.config.heartbeat_interval_s
        skipped = False
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - before > 2 * interval and not skipped:
                skipped = True  # this process stalled: read what queued meanwhile, then judge
                continue
            skipped = False
            peer = self._peer
            if peer is None:
                continue
            limit = self.config.heartbeat_timeout_s if peer.info is not None \
                else self.config.configure_timeout_s
            if now - peer.last_heard > limit:
                during = "" if peer.info is not None else " while configuring"
                self._lose(f"silent for more than {limit}s{during}")
                continue
            if peer.info is None and now - peer.configure_sent > self.config.hello_retry_s:
                await self._configure(peer)  # Configure or Ready may have been lost on the way
            await self._probe(peer)

    async def _probe(self, peer: _Peer) -> None:
        """A heartbeat; sending to a disconnected peer fails at once (ROUTER_MANDATORY)."""
        try:
            await self._send(peer, link_pb2.LinkMessage(heartbeat=link_pb2.Heartbeat()))
        except DataPlaneLost:
            pass

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection (a killed process) is seen here at once; which peer it was is
        found by probing the attached one."""
        while True:
            zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
            if self._peer is not None:
                await self._probe(self._peer)

    async def _reader(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.bytes_received += sum(len(f) for f in frames[1:2])
            message = self._accept(frames)
            if message is not None:
                await self._dispatch(frames[0], message)

    def _accept(self, frames: list[bytes]) -> link_pb2.LinkMessage | None:
        """Strict decoding: anything malformed, unknown or replayed is dropped and counted."""
        message = framing.decode(frames[1:]) if len(frames) == 3 else None
        identity = frames[0]
        if message is None or message.seq <= self._last_seq_in.get(identity, 0):
            self.num_dropped += 1
            return None
        self._last_seq_in[identity] = message.seq
        return message

    async def _dispatch(self, identity: bytes, message: link_pb2.LinkMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "hello":
            await self._on_hello(identity, message.hello, message.epoch)
            return
        peer = self._peer
        if peer is None or identity != peer.identity or message.epoch != peer.epoch:
            self.num_dropped += 1  # a late message of a previous data plane or epoch
            return
        peer.last_heard = time.monotonic()
        if kind == "ready":
            self._on_ready(peer, message.ready)
        elif kind == "step_result":
            future = self._pending.get(message.step_result.step_id)
            if future is not None and not future.done():
                future.set_result(message.step_result)
        elif kind == "step_error":
            error = message.step_error
            self._lose(f"step {error.step_id} failed: {error.message}", error.step_id)

    async def _configure(self, peer: _Peer) -> None:
        """Send (or repeat) Configure; a data plane configured in this epoch answers a repeat
        with its Ready again, without configuring twice."""
        peer.configure_sent = time.monotonic()
        await self._send(peer, link_pb2.LinkMessage(configure=self.limits), fatal=False)

    async def _on_hello(self, identity: bytes, hello: link_pb2.Hello, epoch: int) -> None:
        peer = self._peer
        if peer is not None and peer.identity == identity and peer.info is None:
            return  # a repeated Hello while its Configure is on the way (the watchdog repeats it)
        if peer is not None and peer.identity == identity and epoch == peer.epoch:
            # it lost our heartbeats while this process was frozen, and kept its state
            log.warning("data plane %s resumed in epoch %d", hello.instance_id, epoch)
            peer.last_heard = time.monotonic()
            # (not fatal: the watchdog's next heartbeat judges the connection)
            await self._send(peer, link_pb2.LinkMessage(heartbeat=link_pb2.Heartbeat()),
                             fatal=False)
            return
        problem = self._incompatibility(hello)
        another_is_attached = problem is None and peer is not None and \
            peer.identity != identity and \
            time.monotonic() - peer.last_heard < self.config.heartbeat_timeout_s
        if another_is_attached:
            problem = f"data plane {peer.hello.instance_id} is attached and alive"
        if problem is not None:
            self._log_refusal(hello.instance_id, problem, another_is_attached)
            # not fatal: this peer is the refused newcomer, not the attached data plane
            reject = link_pb2.Reject(reason=problem, another_is_attached=another_is_attached)
            await self._send(_Peer(identity, hello, 0), link_pb2.LinkMessage(reject=reject),
                             fatal=False)
            return
        self._lose("a new data plane said hello")
        # newer than the epoch its Hello carries, should this host's clock be behind the last
        self._epoch = max(self._epoch, epoch) + 1
        self._peer = _Peer(identity, hello, self._epoch)
        log.info("data plane %s (%s, tp=%d, %s) connected; configuring epoch %d",
                 hello.instance_id, hello.device, hello.tp_size, hello.dtype, self._epoch)
        await self._configure(self._peer)

    def _incompatibility(self, hello: link_pb2.Hello) -> str | None:
        if hello.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version}, expected {PROTOCOL_VERSION}"
        if hello.model_fingerprint != self.model.fingerprint:
            return (f"it serves model {hello.model_name!r} (config sha256 "
                    f"{hello.model_fingerprint[:12]}), the control plane {self.model.name!r} "
                    f"({self.model.fingerprint[:12]})")
        return None

    def _on_ready(self, peer: _Peer, ready: link_pb2.Ready) -> None:
        if peer.info is not None:
            return  # the answer to a repeated Configure
        h = peer.hello
        if ready.num_kv_blocks < 1 or ready.block_size != h.block_size or h.block_size < 1:
            self._lose(f"its Ready ({ready.num_kv_blocks} KV blocks of {ready.block_size} tokens) "
                       f"does not fit its Hello (blocks of {h.block_size})")
            return
        peer.info = DataPlaneInfo(epoch=peer.epoch, instance_id=h.instance_id,
                                  num_kv_blocks=ready.num_kv_blocks, block_size=ready.block_size,
                                  tp_size=h.tp_size, dtype=h.dtype, device=h.device,
                                  # Ready's: configure may have fallen back to another
                                  attention_backend=ready.attention_backend
                                  or h.attention_backend)
        log.info("data plane %s ready: %d KV blocks of %d tokens, attention backend %s",
                 h.instance_id, ready.num_kv_blocks, ready.block_size, peer.info.attention_backend)
        self._attached.set()
        self._on_change(True)
