# DARTree worker image (verifier or drafter, chosen by the command): torch + transformers.
# CPU (default):  docker build -f deploy/worker.Dockerfile -t dartree-worker .
# CUDA:           docker build -f deploy/worker.Dockerfile -t dartree-worker:cuda \
#                   --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DARTREE_CACHE=/cache DARTREE_METRICS_HOST=0.0.0.0 PATH=/opt/venv/bin:$PATH
# CUDA base images have no python: install one; every image then uses a venv (PEP 668-safe).
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/*; fi && \
    (python3 -m venv /opt/venv || (apt-get update && apt-get install -y --no-install-recommends python3-venv && \
      python3 -m venv /opt/venv))
WORKDIR /app
COPY requirements.txt requirements-data.txt pyproject.toml /app/
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0 && \
    pip install -r requirements.txt && \
    pip install --no-deps -r requirements-data.txt
COPY services /app/services
COPY gateway /app/gateway
# The shipped drafters (the default: models/smollm2-135m-dartree-drafter-v2); the wildcard keeps the build
# working on a checkout without it (the verifier then serves plain decoding).
COPY pyproject.toml model[s] /app/models/
RUN pip install --no-deps -e . && \
    useradd --create-home --uid 1000 dartree && mkdir -p /cache && chown dartree /cache
USER dartree
# verifier: 5555 (ZMQ from the gateway) + 8001 (metrics); drafter: 5556 (ZMQ) + 8002 (metrics)
EXPOSE 5555 5556 8001 8002
CMD ["dartree", "verifier"]
