# DARTree gateway: FastAPI + tokenizer + ZMQ client. No torch (docs/design.md "Layering"; tests/test_layering.py).
# Build from the repository root:  docker build -f deploy/gateway.Dockerfile -t dartree-gateway .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DARTREE_HOST=0.0.0.0 DARTREE_PORT=8000 DARTREE_CACHE=/cache
WORKDIR /app
COPY deploy/requirements-gateway.txt /app/deploy/requirements-gateway.txt
RUN pip install -r deploy/requirements-gateway.txt
# Only torch-free modules are imported by the gateway; the worker packages come along as source
# because services.serve (the flag parser) imports their config dataclasses, which are torch-free.
COPY services /app/services
COPY gateway /app/gateway
RUN python -c "import sys, gateway.app, gateway.server; assert 'torch' not in sys.modules"
RUN useradd --create-home --uid 1000 dartree && mkdir -p /cache && chown dartree /cache
USER dartree
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=2).status == 200 else 1)"
CMD ["python", "-m", "gateway"]
