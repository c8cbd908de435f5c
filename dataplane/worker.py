"""The rank processes. Rank 0 talks to the control plane and forwards every Configure and Step to
the other ranks (raw protobuf bytes over the CPU group); every rank then runs the same step."""

import collections
import contextlib
import logging
import pathlib
import queue
import signal
import threading
import time
from collections.abc import Iterator

import zmq
from google.protobuf.message import DecodeError

from common.transport import PROTOCOL_VERSION, LinkConfig, close_inproc
from common.model_info import ModelInfo
from dataplane.distributed import broadcast_bytes, tp_size
from dataplane.link import LOST, ControlPlaneLink
from dataplane.model_runner import ModelRunner, PendingStep
from protos import link_pb2

log = logging.getLogger("splitserve.dataplane")

# What rank 0 forwards to the other ranks: a LinkMessage, or this marker to stop.
_STOP = b""
_IDLE_TICK_S = 1.0  # rank 0 wakes the followers this often when idle (their liveness)


class Liveness:
    """Touches a file while the process loop turns, for exec liveness probes
    (`splitserve health --file F --max-age S`)."""

    def __init__(self, path: pathlib.Path | None) -> None:
        self.path = path
        self._last = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last < 0.5:
            return
        self._last = now
        self.path.touch()

    @contextlib.contextmanager
    def beating(self, interval_s: float = 1.0) -> Iterator[None]:
        """A thread beats while the block runs: configure (kernel compiles, graph captures) can
        keep the loop away for longer than the probe's --max-age; if it hangs, the control
        plane's configure timeout drops this data plane."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval_s):
                self.beat()
        thread = threading.Thread(target=run, name="liveness", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def hello_for(runner: ModelRunner, model_info: ModelInfo) -> link_pb2.Hello:
    return link_pb2.Hello(
        protocol_version=PROTOCOL_VERSION, model_name=model_info.name,
        model_fingerprint=model_info.fingerprint, tp_size=tp_size(),
        dtype=str(runner.dtype).removeprefix("torch."), device=runner.config.device,
        block_size=runner.block_size, vocab_size=runner.vocab_size,
        attention_backend=runner.backend.name)


class EpochState:
    """Answers to repeated requests of the current epoch: the control plane repeats Configure
    and Step when an answer is late (lost on the way), and neither may run twice. The last few
    results are kept, since the control plane may have several steps in flight."""

    _KEEP = 8

    def __init__(self) -> None:
        self.epoch = 0
        self.ready: link_pb2.Ready | None = None
        self.last_step_id = 0
        self.results: collections.OrderedDict[int, link_pb2.StepResult] = collections.OrderedDict()

    def record(self, step_id: int, result: link_pb2.StepResult | None) -> None:
        if result is not None:
            self.results[step_id] = result
            while len(self.results) > self._KEEP:
                self.results.popitem(last=False)

    def is_repeat(self, message: link_pb2.LinkMessage) -> bool:
        kind = message.WhichOneof("body")
        return (kind == "configure" and message.epoch == self.epoch) or \
            (kind == "step" and message.step.step_id <= self.last_step_id)

    def repeat_answer(self, message: link_pb2.LinkMessage) -> link_pb2.LinkMessage | None:
        if message.WhichOneof("body") == "configure":
            return link_pb2.LinkMessage(epoch=message.epoch, ready=self.ready)
        result = self.results.get(message.step.step_id)
        if result is None:
            return None  # too old: its answer was used long ago
        return link_pb2.LinkMessage(epoch=message.epoch, step_result=result)


def _configure(runner: ModelRunner, message: link_pb2.LinkMessage, state: EpochState,
               liveness: Liveness) -> link_pb2.LinkMessage:
    with liveness.beating():
        num_blocks = runner.configure(message.configure)
    log.info("configured for epoch %d: %d KV blocks of %d tokens", message.epoch, num_blocks,
             runner.block_size)
    state.epoch, state.last_step_id = message.epoch, 0
    state.results.clear()
    state.ready = link_pb2.Ready(num_kv_blocks=num_blocks, block_size=runner.block_size,
                                 attention_backend=runner.backend.name)
    return link_pb2.LinkMessage(epoch=message.epoch, ready=state.ready)


class Completions:
    """Tells the main loop the moment a submitted step's device work is done: a thread waits on
    each step's CUDA event (which releases the GIL) and then writes to an inproc socket, so the
    loop sleeps in one poll on the link and this socket and wakes at once for either, instead of
    checking the event between polls of a fixed timeout."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self._address = f"inproc://completions-{id(self)}"
        self.socket = ctx.socket(zmq.PULL)  # the main thread's end
        self.socket.bind(self._address)
        self._steps: queue.SimpleQueue[PendingStep | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(ctx, self._address),
                                        name="completions", daemon=True)
        self._thread.start()

    def watch(self, pending: PendingStep) -> None:
        if pending.done is not None:
            self._steps.put(pending)

    def drain(self) -> None:
        while self.socket.poll(0):
            self.socket.recv()

    def close(self) -> None:
        self._steps.put(None)
        self._thread.join(timeout=2)
        close_inproc(self.socket, self._address)  # (the next one may get this one's id())

    def _run(self, ctx: zmq.Context, address: str) -> None:
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        try:
            while (pending := self._steps.get()) is not None:
                pending.done.synchronize()
                push.send(b"")
        finally:
            push.close(linger=0)


class Rank0:
    """Rank 0's loop: relays control messages to the other ranks and runs them. While the
    device works on a step, it keeps reading the link and submits the next step as soon as it
    arrives, so the device never waits for the host between steps."""

    def __init__(self, runner: ModelRunner, link: ControlPlaneLink, liveness: Liveness) -> None:
        self.runner = runner
        self.link = link
        self.liveness = liveness
        self.state = EpochState()
        self.pending: collections.deque[tuple[link_pb2.LinkMessage, PendingStep]] = collections.deque()
        # Steps that arrived before their predecessor, by the predecessor's id.
        self.early: dict[int, tuple[bytes, link_pb2.LinkMessage]] = {}
        # A Configure taken in while the previous epoch's steps finish (_on_configure).
        self._configure_waiting: tuple[bytes, link_pb2.LinkMessage] | None = None
        self.completions = Completions()
        self._refusal: str | None = None  # the last, logged once: Hello is retried each second
        self._idle_tick = link_pb2.LinkMessage(heartbeat=link_pb2.Heartbeat()).SerializeToString()

    def run(self) -> None:
        while True:
            self.liveness.beat()
            if self.pending:
                self._finish_oldest()
                continue
            received = self.link.recv(timeout_s=_IDLE_TICK_S)
            if received is not None:
                self._on_received(*received)
            elif tp_size() > 1:
                broadcast_bytes(self._idle_tick)

    def _on_received(self, kind: bytes, payload: bytes) -> None:
        if kind == LOST:
            log.warning("control plane silent; waiting for a new one")
            return
        message = link_pb2.LinkMessage()
        message.ParseFromString(payload)  # the I/O thread already parsed it once
        if self.state.is_repeat(message):  # answered from rank 0's cache, never re-run
            reply = self.state.repeat_answer(message)
            if reply is not None:
                self.link.send(reply)
            return
        body = message.WhichOneof("body")
        if body == "configure":
            self._on_configure(payload, message)
        elif body == "step":
            self._on_step(payload, message)
        elif body == "reject":
            self._on_refused(message.reject)

    def _on_refused(self, reject: link_pb2.Reject) -> None:
        if reject.reason == self._refusal:
            log.debug("refused again: %s", reject.reason)
        elif reject.another_is_attached:
            log.info("standby: %s; waiting to take over", reject.reason)
        else:
            log.error("the control plane refused this data plane: %s", reject.reason)
        self._refusal = reject.reason

    def _on_configure(self, payload: bytes, message: link_pb2.LinkMessage) -> None:
        """The previous epoch's steps end first. The control plane repeats its Configure each
        second until Ready comes, and those steps can take longer (a hung device, a long
        prompt): a Configure that arrives meanwhile replaces the one waiting if its epoch is
        as new, and only the newest runs, once."""
        self._refusal = None  # attached: a later refusal is news
        if self._configure_waiting is not None:  # (we are in the loop below, further up)
            if message.epoch >= self._configure_waiting[1].epoch:
                self._configure_waiting = (payload, message)
            return
        self._configure_waiting = (payload, message)
        try:
            while self.pending:
                self._finish_oldest()
            payload, message = self._configure_waiting
        finally:
            self._configure_waiting = None
        self.early.clear()
        broadcast_bytes(payload)
        self.link.send(_configure(self.runner, message, self.state, self.liveness))

    def _on_step(self, payload: bytes, message: link_pb2.LinkMessage) -> None:
        """Run steps strictly in the order they were sent: one whose predecessor has not run
        waits for it (the predecessor was lost and is on its way again)."""
        if message.step.previous_step_id != self.state.last_step_id:
            if len(self.early) < 16:
                self.early[message.step.previous_step_id] = (payload, message)
            return
        broadcast_bytes(payload)
        self.state.last_step_id = message.step.step_id
        try:
            pending = self.runner.submit(message.step)
        except Exception as e:  # the device state may be broken: report, then exit
            log.exception("step failed")
            _report_failure(self.link, message, e)
            raise
        self.pending.append((message, pending))
        self.completions.watch(pending)
        successor = self.early.pop(message.step.step_id, None)
        if successor is not None:
            self._on_step(*successor)

    def _finish_oldest(self) -> None:
        message, pending = self.pending[0]
        while not pending.is_done():  # meanwhile, take in (and submit) the next steps
            received = self.link.recv_or(self.completions.socket, timeout_s=0.1)
            if received is not None:
                self._on_received(*received)
            else:
                self.completions.drain()
        if not self.pending or self.pending[0][1] is not pending:
            return  # a Configure taken in meanwhile finished it (with all of its epoch)
        self.pending.popleft()
        try:
            result = self.runner.finish(pending)
        except Exception as e:
            log.exception("step failed")
            _report_failure(self.link, message, e)
            raise
        self.state.record(message.step.step_id, result)
        self.link.send(link_pb2.LinkMessage(epoch=message.epoch, step_result=result))


def run_rank0(runner: ModelRunner, model_info: ModelInfo, address: str, config: LinkConfig,
              liveness: Liveness) -> None:
    link = ControlPlaneLink(address, hello_for(runner, model_info), config)
    link.start()
    log.info("data plane %s connecting to %s", link.instance_id, address)
    rank0 = Rank0(runner, link, liveness)
    # SIGTERM (Kubernetes, serve's supervisor) stops it as Ctrl-C does: exit 0, followers
    # released, and a line that says why.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        rank0.run()
    except KeyboardInterrupt:
        if tp_size() > 1:  # a clean stop: release the followers (after a failure they may be stuck)
            broadcast_bytes(_STOP)
    finally:
        rank0.completions.close()
        link.close()


def _stop_on_sigterm(signum: int, frame) -> None:
    log.info("stopping on SIGTERM")
    raise KeyboardInterrupt


def _report_failure(link: ControlPlaneLink, message: link_pb2.LinkMessage, error: Exception) -> None:
    """Tell the control plane which step failed (it suspects that step's requests), then close
    the link so the message leaves before the process exits."""
    if message.WhichOneof("body") == "step":
        link.send(link_pb2.LinkMessage(epoch=message.epoch, step_error=link_pb2.StepError(
            step_id=message.step.step_id, message=f"{type(error).__name__}: {error}"[:1000])))
    link.close()


def run_follower(runner: ModelRunner, liveness: Liveness) -> None:
    """Ranks 1..N-1: run whatever rank 0 forwards until it says stop. They submit steps and
    never wait on them: the collectives keep them in step with rank 0."""
    state = EpochState()
    while True:
        liveness.beat()
        payload = broadcast_bytes(None)
        if payload == _STOP:
            return
        message = link_pb2.LinkMessage()
        try:
            message.ParseFromString(payload)
        except DecodeError:
            raise RuntimeError("rank 0 forwarded a malformed message") from None
        body = message.WhichOneof("body")
        if body == "configure":
            _configure(runner, message, state, liveness)
        elif body == "step":
            runner.submit(message.step)
