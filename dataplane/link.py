"""Rank 0's side of the link: an I/O thread that owns the DEALER socket.

The thread heartbeats every `heartbeat_interval_s` (also while the main thread is inside a long
forward pass), repeats Hello until the control plane configures it, drops malformed, replayed
and stale messages, and relays the rest to the main thread over an inproc pair socket. It ends
the process when the control plane declares this data plane lost (a Reject in its epoch), or
when no control plane has been heard for `controlplane_grace_s` (counted from its Goodbye, when
it stopped cleanly).

A control plane silent for `heartbeat_timeout_s` may be gone or only frozen (stopped, starved of
CPU); one whose messages wait unread was not silent (this thread was kept off the GIL, by a
kernel compile at configure, say). The thread keeps its epoch and repeats Hello in it: the same
control plane, running again, resumes this data plane where it was (DataPlaneLink._on_hello); a
new one configures a new epoch, or refuses this data plane when it has another (this one then
waits as a standby, as one never configured does). The connection itself outlives such a
freeze: its transport heartbeats give up only after `transport_timeout_s` (a reconnect would
reach the ROUTER under a new routing id).
"""

import logging
import os
import threading
import time
import uuid

import zmq

from common import framing
from common.transport import LinkConfig, close_inproc, configure_socket
from protos import link_pb2

log = logging.getLogger("splitserve.dataplane")
_UNANSWERED_WARNING_S = 30.0  # how often a data plane nobody answers says so

RELAY = b"msg"  # a message from the control plane, as raw LinkMessage bytes
LOST = b"lost"  # the control plane went silent (the epoch is kept until a new Configure)
EXIT_DROPPED = 3  # exit code when the control plane dropped us or never came back


class ControlPlaneLink:
    def __init__(self, address: str, hello: link_pb2.Hello, config: LinkConfig) -> None:
        self.address = address
        self.hello = hello
        self.config = config
        self.instance_id = hello.instance_id or uuid.uuid4().hex
        self.hello.instance_id = self.instance_id
        self._ctx = zmq.Context.instance()
        self._inproc = f"inproc://cplink-{self.instance_id}"
        self._main = self._ctx.socket(zmq.PAIR)  # used by the main thread only
        self._main.bind(self._inproc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cp-link", daemon=True)
        self._pollers: dict[zmq.Socket, zmq.Poller] = {}
        self.num_dropped = 0  # malformed, replayed or stale messages

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the I/O thread (it sends what was queued first) and free the inproc address."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=2)
        close_inproc(self._main, self._inproc)

    # -- main thread ---------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> tuple[bytes, bytes] | None:
        """The next (kind, payload) from the I/O thread; None on timeout."""
        if timeout_s is not None and not self._main.poll(int(timeout_s * 1000)):
            return None
        kind, payload = self._main.recv_multipart()
        return kind, payload

    def recv_or(self, other: zmq.Socket, timeout_s: float) -> tuple[bytes, bytes] | None:
        """Like recv, but also return None as soon as `other` is readable (left unread)."""
        poller = self._pollers.get(other)
        if poller is None:
            poller = self._pollers[other] = zmq.Poller()
            poller.register(self._main, zmq.POLLIN)
            poller.register(other, zmq.POLLIN)
        if self._main not in dict(poller.poll(int(timeout_s * 1000))):
            return None
        kind, payload = self._main.recv_multipart()
        return kind, payload

    def send(self, message: link_pb2.LinkMessage) -> None:
        """Queue a message to the control plane (the I/O thread stamps its sequence number)."""
        self._main.send(message.SerializeToString())

    # -- I/O thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        configure_socket(dealer, self.config, server=False)
        dealer.setsockopt(zmq.ROUTING_ID, self.instance_id.encode())
        dealer.connect(self.address)
        pair = self._ctx.socket(zmq.PAIR)
        pair.connect(self._inproc)
        try:
            _IOLoop(self, dealer, pair).run(self._stop)
        finally:
            dealer.setsockopt(zmq.LINGER, 500)  # let the last messages (a StepError) leave
            dealer.close()
            pair.close()


class _IOLoop:
    def __init__(self, link: ControlPlaneLink, dealer: zmq.Socket, pair: zmq.Socket) -> None:
        self.link = link
        self.dealer = dealer
        self.pair = pair
        self.seq = 0
        self.epoch = 0  # the epoch we were configured in; 0 = not configured
        self.last_seq_in = 0
        self.last_heard = time.monotonic()
        self.lost_since: float | None = None  # set while a control plane we had is gone
        self.last_sent = 0.0
        self.last_hello = 0.0
        self.last_warned = 0.0  # that no control plane answers our Hellos

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.pair, zmq.POLLIN)
        interval = self.link.config.heartbeat_interval_s
        while not stop.is_set():
            events = dict(poller.poll(int(interval * 1000 / 2)))
            if self.pair in events:
                self._send_raw(self.pair.recv())
            if self.dealer in events:
                self._on_frames(self.dealer.recv_multipart())
            self._tick(time.monotonic())
        while self.pair.poll(100):  # what the main thread queued before close()
            self._send_raw(self.pair.recv())

    def _tick(self, now: float) -> None:
        config = self.link.config
        if self.epoch and self.lost_since is None and \
                now - self.last_heard > config.heartbeat_timeout_s and not self._unread():
            self.lost_since = now
            self.pair.send_multipart([LOST, b""])
        if self.lost_since is not None and now - self.lost_since > config.controlplane_grace_s:
            log.error("no control plane for %.0fs; exiting", config.controlplane_grace_s)
            os._exit(EXIT_DROPPED)
        if not self.epoch and self.lost_since is None and \
                now - max(self.last_heard, self.last_warned) >= _UNANSWERED_WARNING_S:
            self.last_warned = now
            log.warning("no control plane has answered at %s for %.0fs (none listens there, or "
                        "it does not take this data plane's CURVE keys); still saying Hello",
                        self.link.address, now - self.last_heard)
        if (not self.epoch or self.lost_since is not None) and \
                now - self.last_hello > config.hello_retry_s:
            self.last_hello = now  # in our epoch: the control plane that froze resumes us
            self._send(link_pb2.LinkMessage(epoch=self.epoch, hello=self.link.hello))
        elif now - self.last_sent > config.heartbeat_interval_s:
            self._send(link_pb2.LinkMessage(epoch=self.epoch, heartbeat=link_pb2.Heartbeat()))

    def _unread(self) -> bool:
        """Messages wait unread: judge the control plane's silence once they are read (they
        queue while this thread is kept off the GIL, by a kernel compile say)."""
        return bool(self.dealer.get(zmq.EVENTS) & zmq.POLLIN)

    def _send(self, message: link_pb2.LinkMessage) -> None:
        self.seq += 1
        message.seq = self.seq
        self.dealer.send_multipart(framing.encode(message))
        self.last_sent = time.monotonic()

    def _send_raw(self, data: bytes) -> None:
        message = link_pb2.LinkMessage()
        message.ParseFromString(data)
        self._send(message)

    def _on_frames(self, frames: list[bytes]) -> None:
        message = framing.decode(frames)
        if message is None:
            self.link.num_dropped += 1
            return
        kind = message.WhichOneof("body")
        if kind == "reject" and self.epoch and message.epoch == self.epoch:
            if self.lost_since is not None:  # dropped while it was silent: offer ourselves anew
                log.warning("the control plane dropped epoch %d: %s", self.epoch,
                            message.reject.reason)
                self.epoch, self.last_seq_in = 0, 0
                return
            log.error("the control plane dropped this data plane: %s", message.reject.reason)
            os._exit(EXIT_DROPPED)
        if kind == "reject" and not message.epoch and self.lost_since is not None and \
                message.reject.another_is_attached:
            # Our control plane is gone and the one that answered our Hello (a restarted one)
            # has another data plane: wait as a standby, as one never configured does, instead
            # of ignoring the refusal (another epoch's) and exiting after the grace period. (A
            # refusal for anything else leaves the grace period running.)
            log.warning("refused in epoch %d's stead; waiting as a standby", self.epoch)
            self.epoch, self.last_seq_in, self.lost_since = 0, 0, None
        if kind == "configure" and message.epoch > self.epoch:
            self.epoch, self.last_seq_in = message.epoch, 0  # a new epoch (or a new control plane)
            self.lost_since = None
        elif kind == "reject" and not self.epoch:
            pass  # refused at the handshake: relayed for the log, Hello is retried
        elif message.epoch != self.epoch or message.seq <= self.last_seq_in:
            self.link.num_dropped += 1
            return
        self.last_seq_in = message.seq
        if kind == "goodbye":
            self._on_goodbye()
            return
        self.last_heard = time.monotonic()
        if self.lost_since is not None:
            log.warning("control plane back after %.1fs", self.last_heard - self.lost_since)
            self.lost_since = None
        if kind != "heartbeat":
            self.pair.send_multipart([RELAY, frames[0]])

    def _on_goodbye(self) -> None:
        """The control plane stops (SIGTERM: a planned restart, say): wait for the next one as
        for one gone silent (Hello in this epoch, the grace period running), without its
        warning."""
        if self.epoch and self.lost_since is None:
            log.info("control plane closed; waiting up to %.0fs for it to come back",
                     self.link.config.controlplane_grace_s)
            self.lost_since = time.monotonic()
