# syntax=docker/dockerfile:1
# Two slim images from one file:
#   docker build --target service   -t oomcast-service:0.1.0   .
#   docker build --target collector -t oomcast-collector:0.1.0 .
# service:   the API and the forecaster (ONNX Runtime, CPU build); no torch.
# collector: the node agent (NVML, memory cgroups, /proc); neither fastapi nor onnxruntime.
#
# Stages: `build` turns the source into one wheel (setuptools and the build isolation stay
# there); `service-env` and `collector-env` install that wheel with their extras into the
# virtual environment /opt/oomcast (created without pip or setuptools); the two final stages
# are fresh base images that receive that folder and nothing else.
# deploy/ holds the Kubernetes manifests and a compose file; docs/deployment.md explains them.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# .dockerignore keeps data/, runs/, .venv/, tests/, caches and the like out of the context;
# setup.py (package discovery) and the source folders must stay in it.
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# Each image keeps the parts of the package it runs and removes the others from the
# installed wheel: the service keeps cli/, model/ and service/; the collector cli/, model/
# and collectors/. Neither carries the harnesses (bench/), training or preflight (torch)
# or the recorded traces. tests/packaging/test_wheel.py runs the collector's commands from
# a wheel stripped the same way.
FROM ${PYTHON_IMAGE} AS service-env
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN python -m venv --without-pip /opt/oomcast \
    && pip --python /opt/oomcast/bin/python install "$(echo /wheels/oomcast-*.whl)[service,onnx]" \
    && cd "$(/opt/oomcast/bin/python -c 'import oomcast.cli, os; print(os.path.dirname(os.path.dirname(oomcast.cli.__file__)))')" \
    && rm -rf bench collectors training preflight

FROM ${PYTHON_IMAGE} AS collector-env
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN python -m venv --without-pip /opt/oomcast \
    && pip --python /opt/oomcast/bin/python install "$(echo /wheels/oomcast-*.whl)[collector]" \
    && cd "$(/opt/oomcast/bin/python -c 'import oomcast.cli, os; print(os.path.dirname(os.path.dirname(oomcast.cli.__file__)))')" \
    && rm -rf bench service training preflight

FROM ${PYTHON_IMAGE} AS service
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/oomcast/bin:$PATH
COPY --from=service-env /opt/oomcast /opt/oomcast
RUN groupadd --system --gid 10001 oomcast \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin oomcast
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/livez')"
ENTRYPOINT ["oomcast"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

FROM ${PYTHON_IMAGE} AS collector
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/oomcast/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=utility
COPY --from=collector-env /opt/oomcast /opt/oomcast
# No USER: as a node agent (DaemonSet, `pid: host`) this image runs as root, for three
# capabilities the manifests add after dropping all others. It maps GPU and cgroup users to
# pods and jobs through other processes' /proc/<pid>/environ, which is mode 0400 and owned by
# each process's user: reading it takes CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE. Signalling a
# job (checkpoint, shed) run by another user takes CAP_KILL. Kubernetes and Docker only give
# added capabilities to uid 0, so the agent stays uid 0 with those three and a read-only root
# filesystem. As a sidecar sharing a pod's process namespace it needs none of them: run it
# as the trainer's uid (see deploy/kubernetes/training-pod-sidecar.yaml).
# NVML: the image carries no NVIDIA driver library. The NVIDIA container runtime mounts
# libnvidia-ml.so.1 and the /dev/nvidia* nodes into the container when NVIDIA_VISIBLE_DEVICES
# is set (the manifests set `all`); `utility` is the only capability NVML queries need.
ENTRYPOINT ["oomcast"]
CMD ["collect", "--source", "nvml,cgroup"]
