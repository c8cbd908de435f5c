"""ZeroMQ settings both ends of the link use, set explicitly rather than left to defaults."""

import os
import tempfile
from dataclasses import dataclass

import zmq

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class LinkConfig:
    """Timing of the link. The data plane heartbeats from its own I/O thread, also while a step
    runs, so a silent data plane is a dead or frozen one."""

    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 2.0  # silence after which the peer is lost
    step_timeout_s: float = 300.0  # a step reply later than this means the data plane is stuck
    hello_retry_s: float = 1.0  # the data plane repeats Hello until it is configured
    max_message_bytes: int = 256 << 20
    high_water_mark: int = 1000

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")


def configure_socket(sock: zmq.Socket, config: LinkConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    # ZMTP heartbeats: the transport drops a dead TCP peer even when no message is due.
    interval_ms = int(config.heartbeat_interval_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(config.heartbeat_timeout_s * 1000))


def private_ipc_address(name: str = "link") -> str:
    """An ipc:// endpoint in a fresh directory only this user can enter."""
    directory = tempfile.mkdtemp(prefix="splitserve-")
    os.chmod(directory, 0o700)
    return f"ipc://{directory}/{name}.sock"
