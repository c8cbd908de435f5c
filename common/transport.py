"""ZeroMQ settings both ends of the link use, set explicitly rather than left to defaults, and
CURVE keys for links that leave the host."""

import errno
import ipaddress
import logging
import os
import socket
import pathlib
import shutil
import tempfile
import urllib.parse
from dataclasses import dataclass

import zmq
import zmq.asyncio
import zmq.auth

from common.errors import ConfigError

PROTOCOL_VERSION = 1
_PRIVATE_IPC_PREFIX = "splitserve-"
log = logging.getLogger("splitserve.transport")


@dataclass(frozen=True)
class CurveKeys:
    """This end's CURVE key pair, and the peer's public key (client side) or the directory of
    public keys allowed to connect (server side). Key files are pyzmq certificate files, as
    `splitserve link-keys DIR` writes them."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None
    authorized_dir: pathlib.Path | None = None

    @classmethod
    def server(cls, secret_file: pathlib.Path, authorized_dir: pathlib.Path) -> "CurveKeys":
        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key")
        return cls(public, secret, authorized_dir=authorized_dir)

    @classmethod
    def client(cls, secret_file: pathlib.Path, server_file: pathlib.Path) -> "CurveKeys":
        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key")
        server_public, _ = zmq.auth.load_certificate(server_file)
        return cls(public, secret, server_public=server_public)


def write_link_keys(directory: pathlib.Path) -> None:
    """Key pairs for a control plane and a data plane, and the authorized-keys directory. Keys
    already there are kept (ConfigError): planes may run with them."""
    existing = [p.name for p in (directory / "controlplane.key_secret",
                                 directory / "dataplane.key_secret") if p.exists()]
    if existing or directory.is_file():
        raise ConfigError(f"{directory} already holds {', '.join(existing) or 'a file'}; "
                          "remove it or name another directory")
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("controlplane", "dataplane"):
        zmq.auth.create_certificates(directory, name)
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    (authorized / "dataplane.key").write_bytes((directory / "dataplane.key").read_bytes())


@dataclass(frozen=True)
class LinkConfig:
    """Timing and security of the link. The data plane heartbeats from its own I/O thread, also
    while a step runs, so a silent data plane is a dead or frozen one."""

    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.5  # silence after which the peer is lost
    # Silence allowed while a data plane configures (sizes its KV cache, compiles kernels,
    # captures CUDA graphs): a kernel compile holds the GIL, so its I/O thread may not heartbeat
    # for seconds. A data plane that dies meanwhile is still seen at once (its connection drops).
    configure_timeout_s: float = 600.0
    step_timeout_s: float = 120.0  # cap on the step deadline (see controlplane.deadline)
    retransmit_s: float = 0.25  # a step unanswered this long is sent again (then 2x, 4x, ...)
    hello_retry_s: float = 1.0  # the data plane repeats Hello until it is configured
    # A data plane whose control plane went silent waits this long for one to come back, then
    # exits (its orchestrator restarts it).
    controlplane_grace_s: float = 30.0
    # ZeroMQ's own (ZMTP) heartbeats drop a connection only after this long, on both sides, so
    # that a control plane frozen for a few seconds finds its data plane's connection still
    # there (a reconnect reaches the ROUTER under another routing id). The link's heartbeats
    # above still lose a silent peer after heartbeat_timeout_s; a process that dies closes its
    # connections at once.
    transport_timeout_s: float = 10.0
    max_message_bytes: int = 256 << 20
    high_water_mark: int = 1000
    curve: CurveKeys | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.configure_timeout_s < self.heartbeat_timeout_s:
            raise ValueError("need configure_timeout_s >= heartbeat_timeout_s")
        if self.transport_timeout_s < self.heartbeat_timeout_s:
            raise ValueError("need transport_timeout_s >= heartbeat_timeout_s")


def unbounded_socket(kind: int) -> zmq.asyncio.Socket:
    """An asyncio socket for the engine <-> front-end link (ipc on one host): no linger and no
    high-water marks. At a mark (the default is 1000) the engine's ROUTER drops what a front-end
    that stalled for a second or two has not read yet, without an error, and a front-end's DEALER
    blocks its sends; the engine bounds its queues instead, by forgetting a front-end that stays
    silent. (A front-end's queue toward a stalled engine is not bounded.)"""
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def close_inproc(sock: zmq.Socket, address: str) -> None:
    """Close a socket bound to an inproc:// address, the address free again on return. libzmq
    closes a socket later, in its reaper thread: a bind to the same address right after close()
    can fail with EADDRINUSE (a new link with the same instance id, an id() reused). Unbinding
    an inproc address is synchronous. A closed socket is left as it is."""
    if sock.closed:
        return
    sock.unbind(address)
    sock.close(linger=0)


def configure_socket(sock: zmq.Socket, config: LinkConfig, server: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    # ZMTP heartbeats: the transport drops a dead TCP peer even when no message is due.
    # TIMEOUT: this side's wait for the peer; TTL: the wait it asks of the peer (in each PING).
    # Both long (LinkConfig.transport_timeout_s): after a freeze libzmq runs its due timers
    # before it reads what queued, so a short one drops a live connection.
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(config.heartbeat_interval_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.transport_timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(config.transport_timeout_s * 1000))
    keys = config.curve
    if keys is None:
        return
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.server_public


def warn_if_exposed(address: str, config: LinkConfig) -> None:
    """A TCP link beyond loopback without CURVE: anyone who can reach the port can drive it."""
    url = urllib.parse.urlparse(address)
    if url.scheme != "tcp" or config.curve is not None:
        return
    host = url.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning("the link %s is not on loopback and has no CURVE keys: restrict it by "
                    "network policy or pass --link-secret-key", address)


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for tests, benchmarks and the rank
    rendezvous; another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_tcp_port(host: str) -> socket.socket:
    """A socket bound to a free TCP port of `host` ("[::]" as gRPC writes it, too) with
    SO_REUSEPORT, not listening: while it is open only sockets that set SO_REUSEPORT as well
    (gRPC's do; a program of another user cannot) can bind the port; it gets no connections,
    as it does not listen. Holds the first address `host` resolves to (for "localhost", not
    both). Read the port with getsockname()[1]; close it when the port is no longer needed."""
    family, kind, proto, address = _resolve(host, 0)
    holder = socket.socket(family, kind, proto)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        _bind(holder, address, host, 0)
    except ConfigError:
        holder.close()
        raise
    return holder


def check_tcp_port_free(host: str, port: int) -> None:
    """Raise ConfigError unless a server could bind `port` of `host`: gRPC binds with
    SO_REUSEPORT, which would let a second server of this user share the port with the first,
    each getting some of the clients. (Checked, not held: a held port would keep a restarted
    server from binding over its old connections in TIME_WAIT. Two servers started in the same
    instant can both pass.)"""
    family, kind, proto, address = _resolve(host, port)
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT does not count)
        _bind(probe, address, host, port)


def _resolve(host: str, port: int) -> tuple:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    return family, kind, proto, address


def _bind(sock: socket.socket, address: tuple, host: str, port: int) -> None:
    try:
        sock.bind(address)
    except OSError as e:
        raise bind_error(f"port {port} of {host}", e) from None


def bind_error(what: str, error: OSError | zmq.ZMQError) -> ConfigError:
    """The one-line error for an address of the user's that could not be bound."""
    why = "is in use (another server?)" if error.errno == errno.EADDRINUSE else "cannot be bound"
    return ConfigError(f"{what} {why}: {error.strerror}")


def private_ipc_address(name: str = "link") -> str:
    """An ipc:// endpoint in a fresh directory only this user can enter. Its maker removes it
    (remove_private_ipc) once done with it."""
    directory = tempfile.mkdtemp(prefix=_PRIVATE_IPC_PREFIX)
    os.chmod(directory, 0o700)
    return f"ipc://{directory}/{name}.sock"


def remove_private_ipc(address: str) -> None:
    """Remove the directory private_ipc_address made for `address`, its sockets closed, so that
    a server that stops leaves nothing in /tmp. An address it did not make is left alone."""
    directory = pathlib.Path(address.removeprefix("ipc://")).parent
    if address.startswith("ipc://") and directory.name.startswith(_PRIVATE_IPC_PREFIX):
        # (errors ignored: libzmq unlinks a closed socket's file later, in its own thread)
        shutil.rmtree(directory, ignore_errors=True)
