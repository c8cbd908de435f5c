# syntax=docker/dockerfile:1
# The data plane on NVIDIA GPUs: a CUDA base image and torch's CUDA build from PyPI (it brings
# its own CUDA libraries; the base provides the driver hooks, and a CUDA 13 base matches the
# CUDA 13 build of torch 2.13). Build from the repository root:
#
#   docker build -f docker/dataplane.Dockerfile -t splitserve-dataplane:0.1.0 .
#
# --build-arg EXTRAS=dataplane,fa4 adds FlashAttention-4, which --attention-backend auto then
# picks on Hopper GPUs (triton_fa4: README).
#
# No model weights are downloaded at build time: checkpoints are mounted at run time.
FROM nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:f8ef28f579ea42a44b415d2c5d46f788e6a9b395c6c83f2929416e1fc192c143 AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small launcher with the C compiler against Python's headers at run time, so
# gcc and python3-dev stay in the runtime image. Ubuntu's package versions follow the pinned base.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

FROM runtime AS build
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=dataplane
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "torch==${TORCH_VERSION}"
COPY . /src
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "/src[${EXTRAS}]" \
        dumb-init==1.2.5.post1

FROM runtime
RUN useradd --no-log-init --uid 10001 --user-group --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin splitserve \
 && mkdir -p /models /var/cache/splitserve && chown 10001:10001 /models /var/cache/splitserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
ENTRYPOINT ["dumb-init", "--"]
CMD ["splitserve", "dataplane", "--help"]
