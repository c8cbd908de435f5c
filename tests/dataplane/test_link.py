"""Rank 0's link thread judging the control plane's silence and its refusals (dataplane/link.py's
_IOLoop), driven by hand over inproc sockets: heartbeats that queued while the thread was kept
off the GIL are not silence; nothing queued is."""

import time

import pytest
import zmq

from common import framing
from common.transport import LinkConfig, close_inproc
from dataplane.link import LOST, RELAY, ControlPlaneLink, _IOLoop
from protos import link_pb2

EPOCH = 7


@pytest.fixture
def loop():
    """An _IOLoop configured in EPOCH, its DEALER facing a ROUTER (the control plane), and the
    main thread's end of its relay; its thread is never started."""
    ctx = zmq.Context.instance()
    link = ControlPlaneLink("inproc://unused", link_pb2.Hello(instance_id="dp"), LinkConfig())
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://control-plane")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"dp")
    dealer.connect("inproc://control-plane")
    pair = ctx.socket(zmq.PAIR)
    pair.connect(link._inproc)
    io = _IOLoop(link, dealer, pair)
    io.epoch = EPOCH
    yield io, router, link
    for sock in (dealer, pair):
        sock.close(linger=0)
    close_inproc(router, "inproc://control-plane")  # the next test binds both addresses again
    link.close()


def relayed(link: ControlPlaneLink) -> list[bytes]:
    kinds = []
    while link._main.poll(50):
        kinds.append(link._main.recv_multipart()[0])
    return kinds


def heartbeat(router: zmq.Socket, seq: int) -> None:
    router.send_multipart([b"dp", *framing.encode(link_pb2.LinkMessage(
        seq=seq, epoch=EPOCH, heartbeat=link_pb2.Heartbeat()))])


def test_heartbeats_queued_during_a_stall_are_not_silence(loop):
    io, router, link = loop
    heartbeat(router, 1)
    assert io.dealer.poll(1000)  # queued, unread: the thread was busy elsewhere
    now = time.monotonic()
    io.last_heard = now - 10 * link.config.heartbeat_timeout_s
    io._tick(now)
    assert relayed(link) == [] and io.lost_since is None
    io._on_frames(io.dealer.recv_multipart())  # read at last: heard just now
    io._tick(time.monotonic())
    assert relayed(link) == [] and io.lost_since is None


def test_silence_with_nothing_queued_is_lost(loop):
    io, router, link = loop
    now = time.monotonic()
    io.last_heard = now - 10 * link.config.heartbeat_timeout_s
    io._tick(now)
    assert relayed(link) == [LOST] and io.lost_since == now


def test_refused_at_the_handshake_after_its_control_plane_went_it_waits_as_a_standby(loop):
    """A control plane restarted on the same address took another data plane first: its refusal
    (epoch 0) was dropped as another epoch's, and this one exited after the grace period."""
    io, router, link = loop
    now = time.monotonic()
    io.last_heard = now - 10 * link.config.heartbeat_timeout_s
    io._tick(now)
    assert relayed(link) == [LOST]
    router.send_multipart([b"dp", *framing.encode(link_pb2.LinkMessage(
        seq=1, epoch=0, reject=link_pb2.Reject(reason="data plane b is attached and alive",
                                               another_is_attached=True)))])
    assert io.dealer.poll(1000)
    io._on_frames(io.dealer.recv_multipart())
    assert (io.epoch, io.lost_since) == (0, None)  # not configured: no grace period runs
    assert relayed(link) == [RELAY]  # the refusal, for rank 0's log
    io._tick(now + 2 * link.config.controlplane_grace_s)  # still here, saying Hello
    assert router.poll(1000)
    _, *frames = router.recv_multipart()
    assert framing.decode(frames).WhichOneof("body") == "hello"


def test_refused_as_incompatible_after_its_control_plane_went_it_keeps_its_grace_period(loop):
    """Only a refusal for another attached data plane makes a standby: one that a restarted
    control plane cannot use (another model, protocol) still exits after the grace period."""
    io, router, link = loop
    now = time.monotonic()
    io.last_heard = now - 10 * link.config.heartbeat_timeout_s
    io._tick(now)
    router.send_multipart([b"dp", *framing.encode(link_pb2.LinkMessage(
        seq=1, epoch=0, reject=link_pb2.Reject(reason="model mismatch")))])
    assert io.dealer.poll(1000)
    io._on_frames(io.dealer.recv_multipart())
    assert (io.epoch, io.lost_since) == (EPOCH, now)


def test_a_goodbye_in_its_epoch_starts_the_grace_period_without_a_warning(loop, caplog):
    """A control plane stopped with SIGTERM says Goodbye: the data plane waits for the next as
    for a silent one (Hello in its epoch), saying so at INFO, and relays nothing (the main
    thread warned 'control plane silent'). A Goodbye of another epoch is dropped."""
    io, router, link = loop
    for seq, epoch in ((1, EPOCH - 1), (2, EPOCH)):
        router.send_multipart([b"dp", *framing.encode(link_pb2.LinkMessage(
            seq=seq, epoch=epoch, goodbye=link_pb2.Goodbye()))])
        assert io.dealer.poll(1000)
        with caplog.at_level("INFO", logger="splitserve.dataplane"):
            io._on_frames(io.dealer.recv_multipart())
        if epoch != EPOCH:
            assert (io.lost_since, link.num_dropped) == (None, 1)
    assert io.lost_since is not None and relayed(link) == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "control plane closed; waiting up to 30s for it to come back")]
    io._tick(time.monotonic() + 10 * link.config.heartbeat_timeout_s)
    assert relayed(link) == []
    assert router.poll(1000)
    _, *frames = router.recv_multipart()
    hello = framing.decode(frames)
    assert (hello.WhichOneof("body"), hello.epoch) == ("hello", EPOCH)


def test_a_closed_link_frees_its_address_at_once():
    """libzmq closes a socket later, in its reaper thread; close() unbinds first, so the next
    link with the same instance id (the same inproc address) binds it at once."""
    for _ in range(200):
        link = ControlPlaneLink("inproc://unused", link_pb2.Hello(instance_id="again"),
                                LinkConfig())
        link.close()


def test_a_data_plane_no_control_plane_answers_says_so_every_half_minute(loop, caplog):
    """One at a wrong address, or with CURVE keys the control plane does not take, said nothing
    after 'connecting to' and kept saying Hello unheard."""
    io, router, link = loop
    io.epoch = 0  # never configured
    start = io.last_heard
    with caplog.at_level("WARNING", logger="splitserve.dataplane"):
        for seconds in range(0, 95, 5):
            io._tick(start + seconds)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3, warnings  # after 30, 60 and 90 s
    assert "no control plane has answered at inproc://unused for 30s" in warnings[0], warnings
