"""What every gRPC server of the control plane serves besides its Generation handlers, whether
the engine's process serves gRPC itself (--frontends 0) or front-end processes do
(controlplane/frontend.py): the health services, reflection, API keys and TLS."""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane.auth import ApiKeyInterceptor, read_api_keys
from controlplane.interceptors import MalformedRequestInterceptor
from protos import generation_pb2

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
# SERVING while the server answers (behind a front-end: while it hears from the engine): for
# liveness probes, which must not fail just because no data plane is attached. That is
# readiness: the "" service and the Generation service.
LIVENESS_SERVICE = "liveness"


@dataclass(frozen=True)
class GrpcServerConfig:
    """Where and how a gRPC server listens: the engine process's own (--frontends 0) or each
    front-end's."""
    host: str = "127.0.0.1"
    port: int = 50051  # 0: a free one
    max_concurrent_rpcs: int | None = None  # gRPC's own bound on RPCs in progress
    api_key_file: pathlib.Path | None = None
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    tls_client_ca: pathlib.Path | None = None  # set: clients must present a certificate it signed

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")


def set_health(servicer: health.HealthServicer, serving: bool, live: bool) -> None:
    status = lambda ok: health_pb2.HealthCheckResponse.SERVING if ok else \
        health_pb2.HealthCheckResponse.NOT_SERVING  # noqa: E731
    for service in ("", SERVICE.full_name):
        servicer.set(service, status(serving))
    servicer.set(LIVENESS_SERVICE, status(live))


async def start_server(add_handlers: Callable[[grpc.aio.Server], None],
                       health_servicer: health.HealthServicer, config: GrpcServerConfig
                       ) -> tuple[grpc.aio.Server, int]:
    """A started server with the Generation handlers `add_handlers` puts on it, health and
    reflection; returns it and the port it bound (port 0: a free one)."""
    interceptors = []
    if config.api_key_file is not None:
        interceptors.append(ApiKeyInterceptor(read_api_keys(config.api_key_file)))
    interceptors.append(MalformedRequestInterceptor(SERVICE.full_name))
    server = grpc.aio.server(interceptors=interceptors,
                             maximum_concurrent_rpcs=config.max_concurrent_rpcs)
    add_handlers(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    credentials = _credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    port = server.add_secure_port(address, credentials) if credentials else \
        server.add_insecure_port(address)
    await server.start()
    return server, port


def _credentials(cert: pathlib.Path | None, key: pathlib.Path | None,
                 client_ca: pathlib.Path | None) -> grpc.ServerCredentials | None:
    """TLS with this certificate and key (None without a certificate); with `client_ca`,
    clients must present a certificate it signed."""
    if cert is None:
        return None
    ca = client_ca.read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)
