# syntax=docker/dockerfile:1
# Two slim images from one file:
#   docker build --target service   -t oomcast-service .
#   docker build --target collector -t oomcast-collector .
# The service image has no torch; the collector image has neither fastapi nor onnxruntime.

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model ./model
COPY collectors ./collectors
COPY service ./service
COPY training ./training

FROM base AS service
RUN pip install ".[service,onnx]" && rm -rf /src \
    && useradd --system --uid 10001 --no-create-home oomcast
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/livez')"
ENTRYPOINT ["oomcast"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS collector
# The agent reads NVML and other processes' cgroups; it runs as root inside its pod, with the
# host paths it needs mounted read-only (see deploy/ once it exists).
RUN pip install ".[collector]" && rm -rf /src
ENTRYPOINT ["oomcast"]
CMD ["collect", "--source", "sim"]
