# syntax=docker/dockerfile:1
# The control plane: gRPC API, tokenizer, scheduler, KV block manager. CPU only and without
# torch (the build fails if a dependency pulls it in). Build from the repository root:
#
#   docker build -f docker/controlplane.Dockerfile -t splitserve-controlplane:0.1.0 .
#
# Base images are pinned by tag and digest; move both together
# (`docker buildx imagetools inspect python:3.12.11-slim-bookworm` prints the digest).
FROM python:3.12.11-slim-bookworm@sha256:519591d6871b7bc437060736b9f7456b8731f1499a57e22e6c285135ae657bf7 AS runtime

FROM runtime AS build
RUN python -m venv /opt/venv
COPY . /src
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check /src dumb-init==1.2.5.post1 \
 && /opt/venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

FROM runtime
RUN useradd --no-log-init --uid 10001 --user-group --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin splitserve \
 && mkdir /models && chown 10001:10001 /models
COPY --from=build /opt/venv /opt/venv
# HOME=/tmp: the root filesystem is read-only in deployments; /tmp is a tmpfs or emptyDir there.
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# 50051: gRPC (clients, probes). 5555: the ZeroMQ link data planes connect to (never publish it).
EXPOSE 50051 5555
# dumb-init is PID 1: it forwards SIGTERM to splitserve's process group and reaps children
# (the gRPC front-ends run in sessions of their own, so only splitserve gets it, drains, then
# stops them).
ENTRYPOINT ["dumb-init", "--"]
CMD ["splitserve", "controlplane", "--help"]
