"""A data plane may be silent while it configures (kernel compiles hold its GIL, so its I/O
thread cannot heartbeat): the control plane waits for its Ready past the heartbeat timeout, and
the data plane does not take the heartbeats queued meanwhile for a silent control plane."""

import itertools
import sys
import time

import pytest
import zmq

from common import framing
from common.transport import LinkConfig
from dataplane.link import LOST, RELAY, ControlPlaneLink
from protos import link_pb2
from tests.integration import harness
from tests.integration.test_link_security import rogue_hello

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def dealer(link: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link)
    return sock


def say_hello(sock: zmq.Socket, model) -> link_pb2.LinkMessage:
    """A data plane's Hello; returns the control plane's answer, a Configure."""
    sock.send_multipart(rogue_hello(model))
    assert sock.poll(10_000), "no Configure"
    configure = framing.decode(sock.recv_multipart())
    assert configure.WhichOneof("body") == "configure"
    return configure


@pytest.fixture
def control_plane(checkpoints, tmp_path):
    """A control plane that waits for a data plane: (the model, its link address, the server)."""
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(checkpoints["untied"], tmp_path, link)
    yield checkpoints["untied"], link, server
    server.stop()


def say_ready(sock: zmq.Socket, configure: link_pb2.LinkMessage, ready: link_pb2.Ready) -> None:
    sock.send_multipart(framing.encode(link_pb2.LinkMessage(seq=2, epoch=configure.epoch,
                                                            ready=ready)))


def test_a_data_plane_silent_while_configuring_is_attached_when_ready(control_plane):
    model, link, server = control_plane
    sock = dealer(link)
    try:
        configure = say_hello(sock, model)
        time.sleep(3.0)  # twice the heartbeat timeout, not a word (Configure repeats ignored)
        say_ready(sock, configure, link_pb2.Ready(num_kv_blocks=64, block_size=16))
        seq = itertools.count(3)

        def heartbeat_and_check() -> bool:
            """Attached, the fake must heartbeat like a data plane or be dropped 1.5 s on."""
            sock.send_multipart(framing.encode(link_pb2.LinkMessage(
                seq=next(seq), epoch=configure.epoch, heartbeat=link_pb2.Heartbeat())))
            return server.client.is_serving(timeout=1.0)
        assert harness.wait_until(heartbeat_and_check, 10), server.log()
        assert "silent" not in server.log()
    finally:
        sock.close()


def hold_the_gil(seconds: float) -> None:
    """What a kernel compile does to the data plane: no other thread of the process runs."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 10)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(switch_interval)


def await_configure(data_plane: ControlPlaneLink) -> link_pb2.LinkMessage:
    """The control plane's answer to the Hello of a started data-plane link."""
    kind, payload = data_plane.recv(timeout_s=10.0)
    configure = link_pb2.LinkMessage.FromString(payload)
    assert kind == RELAY and configure.WhichOneof("body") == "configure"
    return configure


def test_a_data_plane_stalled_while_configuring_does_not_lose_its_control_plane(control_plane):
    """The data plane's own link (its I/O thread) through a 3 s stall after Configure, twice
    the heartbeat timeout: the control plane's heartbeats wait unread meanwhile, which is not
    silence. It used to relay LOST and log "control plane silent" once configured (a
    triton_fa4 data plane's configure, 15-41 s of kernel compiles on an H100, did that)."""
    model, link, server = control_plane
    data_plane = ControlPlaneLink(link, framing.decode(rogue_hello(model)).hello, LinkConfig())
    data_plane.start()
    try:
        configure = await_configure(data_plane)
        hold_the_gil(3.0)
        data_plane.send(link_pb2.LinkMessage(epoch=configure.epoch, ready=link_pb2.Ready(
            num_kv_blocks=64, block_size=16)))
        kinds = []
        while (received := data_plane.recv(timeout_s=2.0)) is not None:  # LOST comes at once
            kinds.append(received[0])
        assert LOST not in kinds
        assert server.client.is_serving(timeout=5.0), server.log()
    finally:
        data_plane.close()


@pytest.mark.parametrize("ready", [link_pb2.Ready(num_kv_blocks=64, block_size=0),
                                   link_pb2.Ready(num_kv_blocks=64, block_size=8),
                                   link_pb2.Ready(num_kv_blocks=0, block_size=16)],
                         ids=["block-size-0", "not-its-hellos", "no-blocks"])
def test_a_ready_that_does_not_fit_its_hello_is_refused(control_plane, ready):
    """Blocks of 0 tokens (its Hello said 16) would have divided by zero in the scheduler and
    ended the control plane; a data plane that reports one is refused instead."""
    model, link, server = control_plane
    sock = dealer(link)
    try:
        say_ready(sock, say_hello(sock, model), ready)
        kinds = set()
        while "reject" not in kinds and sock.poll(10_000):
            kinds.add(framing.decode(sock.recv_multipart()).WhichOneof("body"))
        assert "reject" in kinds and not server.client.is_serving()
        assert "does not fit its Hello" in server.log()  # not for its silence, 1.5 s on
        again = dealer(link)
        say_hello(again, model)  # the control plane lives on: the next data plane is configured
        again.close()
    finally:
        sock.close()


@pytest.mark.parametrize("ready_backend, reported", [("triton", "triton"), ("", "triton_fa4")],
                         ids=["ready-says-triton", "ready-says-none"])
def test_model_info_names_the_backend_the_data_plane_configured(control_plane, ready_backend,
                                                                reported):
    """auto's triton_fa4 falls back to triton when FlashAttention-4 fails in its first compile,
    after the Hello named triton_fa4: GetModelInfo reports the Ready's backend, else the
    Hello's (a Ready without one)."""
    model, link, server = control_plane
    hello = framing.decode(rogue_hello(model)).hello
    hello.attention_backend = "triton_fa4"
    data_plane = ControlPlaneLink(link, hello, LinkConfig())
    data_plane.start()
    try:
        configure = await_configure(data_plane)
        data_plane.send(link_pb2.LinkMessage(epoch=configure.epoch, ready=link_pb2.Ready(
            num_kv_blocks=64, block_size=16, attention_backend=ready_backend)))
        assert harness.wait_until(lambda: server.client.is_serving(timeout=1.0), 10), server.log()
        assert server.client.model_info().attention_backend == reported
    finally:
        data_plane.close()
