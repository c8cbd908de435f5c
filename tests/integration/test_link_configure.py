"""A data plane may be silent while it configures (kernel compiles hold its GIL, so its I/O
thread cannot heartbeat): the control plane waits for its Ready past the heartbeat timeout."""

import itertools
import time

import pytest
import zmq

from common import framing
from protos import link_pb2
from tests.integration import harness
from tests.integration.test_link_security import rogue_hello

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_data_plane_silent_while_configuring_is_attached_when_ready(checkpoints, tmp_path):
    model = checkpoints["untied"]
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link)
    try:
        sock.send_multipart(rogue_hello(model))
        assert sock.poll(10_000), "no Configure"
        configure = framing.decode(sock.recv_multipart())
        assert configure.WhichOneof("body") == "configure"
        time.sleep(3.0)  # twice the heartbeat timeout, not a word (Configure repeats ignored)
        ready = link_pb2.Ready(num_kv_blocks=64, block_size=16)
        sock.send_multipart(framing.encode(link_pb2.LinkMessage(seq=2, epoch=configure.epoch,
                                                                ready=ready)))
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
        server.stop()


@pytest.mark.parametrize("ready", [link_pb2.Ready(num_kv_blocks=64, block_size=0),
                                   link_pb2.Ready(num_kv_blocks=64, block_size=8),
                                   link_pb2.Ready(num_kv_blocks=0, block_size=16)],
                         ids=["block-size-0", "not-its-hellos", "no-blocks"])
def test_a_ready_that_does_not_fit_its_hello_is_refused(checkpoints, tmp_path, ready):
    """Blocks of 0 tokens (its Hello said 16) would have divided by zero in the scheduler and
    ended the control plane; a data plane that reports one is refused instead."""
    model = checkpoints["untied"]
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link)
    try:
        sock.send_multipart(rogue_hello(model))
        assert sock.poll(10_000), "no Configure"
        configure = framing.decode(sock.recv_multipart())
        sock.send_multipart(framing.encode(link_pb2.LinkMessage(seq=2, epoch=configure.epoch,
                                                                ready=ready)))
        kinds = set()
        while "reject" not in kinds and sock.poll(10_000):
            kinds.add(framing.decode(sock.recv_multipart()).WhichOneof("body"))
        assert "reject" in kinds and not server.client.is_serving()
        assert "does not fit its Hello" in server.log()  # not for its silence, 1.5 s on
        # and the control plane lives on: the next data plane is configured
        again = zmq.Context.instance().socket(zmq.DEALER)
        again.setsockopt(zmq.LINGER, 0)
        again.connect(link)
        again.send_multipart(rogue_hello(model))
        assert again.poll(10_000), server.log()
        assert framing.decode(again.recv_multipart()).WhichOneof("body") == "configure"
        again.close()
    finally:
        sock.close()
        server.stop()
