"""CURVE on a TCP link: a data plane with the right keys attaches; nobody else gets anything
through, with or without keys of their own."""

import time
import uuid

import pytest
import zmq
import zmq.auth

from common import framing
from common.model_info import ModelInfo
from common.transport import PROTOCOL_VERSION
from protos import link_pb2
from tests.integration import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def rogue_hello(model) -> list[bytes]:
    info = ModelInfo.from_dir(model)
    hello = link_pb2.Hello(protocol_version=PROTOCOL_VERSION, instance_id="rogue-" + uuid.uuid4().hex,
                           model_name=info.name, model_fingerprint=info.fingerprint, tp_size=1,
                           dtype="float32", device="cpu", block_size=16, vocab_size=info.vocab_size)
    return framing.encode(link_pb2.LinkMessage(seq=1, hello=hello))


def rogue_gets_nothing(address: str, model, curve: tuple[bytes, bytes, bytes] | None) -> bool:
    """A DEALER says a valid Hello for 2 s; True if nothing at all comes back."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                sock.send_multipart(rogue_hello(model), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no pipe now: ZeroMQ dropped it when the handshake failed, and will retry
            if sock.poll(200):
                return False
        return True
    finally:
        sock.close()


def test_curve_lets_only_authorized_data_planes_in(checkpoints, tmp_path):
    model = checkpoints["untied"]
    keys = tmp_path / "keys"
    assert harness.Process(["link-keys", str(keys)], tmp_path / "keys.log").popen.wait(30) == 0
    again = harness.Process(["link-keys", str(keys)], tmp_path / "again.log")
    assert again.popen.wait(30) == 2 and "already holds" in again.log()  # keys in use stay
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link,
                                  "--link-secret-key", str(keys / "controlplane.key_secret"),
                                  "--link-authorized-keys", str(keys / "authorized"))
    try:
        # no keys, and keys the control plane does not know
        stranger = tmp_path / "stranger"
        stranger.mkdir()
        zmq.auth.create_certificates(stranger, "x")
        public, secret = zmq.auth.load_certificate(stranger / "x.key_secret")
        server_public, _ = zmq.auth.load_certificate(keys / "controlplane.key")
        assert rogue_gets_nothing(link, model, None)
        assert rogue_gets_nothing(link, model, (public, secret, server_public))
        unkeyed = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "64", name="unkeyed")
        server.processes.append(unkeyed)
        assert not server.client.wait_until_serving(4)
        unkeyed.stop()
        assert "rogue-" not in server.log() and "connected" not in server.processes[0].log()
        server.processes.append(harness.dataplane(
            model, tmp_path, link, "--num-kv-blocks", "64",
            "--link-secret-key", str(keys / "dataplane.key_secret"),
            "--link-server-key", str(keys / "controlplane.key"), name="keyed"))
        server.wait_serving()
        completion = server.client.generate([1, 2, 3], ignore_eos=True, max_tokens=4)
        assert completion.completion_tokens == 4
    finally:
        server.stop()
