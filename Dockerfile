# syntax=docker/dockerfile:1
# Two targets:
#   demo:   gpuwarden on its bundled SGLang stand-in (no GPU needed)
#     docker build --target demo -t gpuwarden:demo .
#     docker run --rm -p 8600:8600 -v gpuwarden-demo:/data gpuwarden:demo
#   sglang: gpuwarden inside an SGLang image, supervising real SGLang
#     docker build --target sglang -t gpuwarden:sglang .
#     docker run --gpus all --ipc=host --shm-size 32g -p 8600:8600 \
#       -v /etc/gpuwarden:/etc/gpuwarden:ro -v /models:/models:ro -v gpuwarden-state:/var/lib/gpuwarden \
#       -v gpuwarden-cache:/var/cache/gpuwarden gpuwarden:sglang
#     (the cache volume keeps SGLang's JIT and compile caches across containers)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# An SGLang image whose python3 is 3.11 or newer (the build checks it).
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.5-cu129

FROM ${PYTHON_IMAGE} AS demo
# tini reaps and forwards signals as PID 1; the distribution's current build is wanted, so no
# version pin (the base image tag pins the distribution release).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 gpuwarden \
    && useradd --system --create-home --uid 10001 --gid 10001 --home-dir /home/gpuwarden gpuwarden \
    && mkdir -p /data && chown 10001:10001 /data
WORKDIR /opt/gpuwarden
COPY pyproject.toml README.md ./
COPY daemon daemon
COPY api api
COPY standin standin
# The project itself with its charts extra (matplotlib, for a sweep's chart): no pin applies.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[charts]' && gpuwarden --help > /dev/null
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8600
# Healthy while the server is ready (/readyz answers 503 otherwise, and urlopen raises).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8600/readyz', timeout=2)"]
ENTRYPOINT ["tini", "--", "gpuwarden"]
CMD ["demo", "--dir", "/data", "--listen", "0.0.0.0:8600"]

FROM ${BASE_IMAGE} AS sglang
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Same reasoning as above for the unpinned tini.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -c 'import sys; assert sys.version_info >= (3, 11), "gpuwarden needs Python 3.11+, this image has " + sys.version'
WORKDIR /opt/gpuwarden
COPY pyproject.toml README.md ./
COPY daemon daemon
COPY api api
COPY standin standin
# Installed with the image's own python3, beside SGLang, so preflight can build SGLang's parser.
# The project itself with its charts extra (matplotlib, for a sweep's chart): no pin applies.
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir '.[charts]' && gpuwarden --help > /dev/null
ENV GPUWARDEN_STATE_DIR=/var/lib/gpuwarden \
    GPUWARDEN_LOG_DIR=/var/log/gpuwarden \
    GPUWARDEN_COMPILE_CACHE__DIR=/var/cache/gpuwarden/compile \
    GPUWARDEN_LISTEN=0.0.0.0:8600
EXPOSE 8600
# Healthy while SGLang is ready (/readyz); a real model loads for minutes, hence the start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8600/readyz', timeout=2)"]
ENTRYPOINT ["tini", "--", "gpuwarden"]
CMD ["serve", "--settings", "/etc/gpuwarden/settings.yaml"]
