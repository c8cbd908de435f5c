# syntax=docker/dockerfile:1
# The data plane on CPU (the demo, CI-sized models): torch from PyTorch's CPU wheel index, so
# the image carries no CUDA libraries. Also writes the demo model (`splitserve demo-model`).
#
#   docker build -f docker/dataplane-cpu.Dockerfile -t splitserve-dataplane-cpu:0.1.0 .
#
# No model weights are downloaded at build time: checkpoints are mounted at run time.
FROM python:3.12.11-slim-bookworm@sha256:519591d6871b7bc437060736b9f7456b8731f1499a57e22e6c285135ae657bf7 AS runtime

FROM runtime AS build
ARG TORCH_VERSION=2.13.0
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY . /src
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "/src[dataplane]" \
        dumb-init==1.2.5.post1

FROM runtime
RUN useradd --no-log-init --uid 10001 --user-group --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin splitserve \
 && mkdir /models && chown 10001:10001 /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
ENTRYPOINT ["dumb-init", "--"]
CMD ["splitserve", "dataplane", "--help"]
