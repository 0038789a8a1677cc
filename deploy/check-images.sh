#!/usr/bin/env bash
# Build both images and show what each holds, then run them together for a minute's smoke:
# the collector simulates two GPUs into Redis, the service forecasts them.
#
#   deploy/check-images.sh                        # base python:3.11-slim from Docker Hub
#   PYTHON_IMAGE=my/python:3.11 deploy/check-images.sh   # any Python 3.11 base you have
#
# Needs a Docker daemon and a Redis on 127.0.0.1:6379 (the containers use the host network,
# so nothing else is published). Leaves the images tagged oomcast-{service,collector}:check,
# and the smoke's node (image-check-PID) in that Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE="${PYTHON_IMAGE:-python:3.11-slim}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
NODE="image-check-$$"
for target in service collector; do
    docker build -q --network=host --build-arg "PYTHON_IMAGE=$BASE" --target "$target" \
        -t "oomcast-$target:check" . >/dev/null
    echo "== oomcast-$target:check ($(docker image inspect -f '{{.Size}}' "oomcast-$target:check" \
        | awk '{printf "%.0f MB", $1/1e6}'), base $BASE)"
    docker run --rm --entrypoint sh "oomcast-$target:check" -c '
        site=$(python -c "import oomcast.cli, os; print(os.path.dirname(os.path.dirname(os.path.dirname(oomcast.cli.__file__))))")
        echo "  /opt/oomcast: $(du -sh /opt/oomcast | cut -f1)"
        echo "  oomcast/: $(ls "$site/oomcast" | grep -v __pycache__ | tr "\n" " ")"
        echo "  site-packages: $(ls "$site" | grep -v -e dist-info -e __pycache__ | tr "\n" " ")"
        for m in torch fastapi onnxruntime pynvml; do
            python -c "import $m" 2>/dev/null && echo "  imports $m" || echo "  no $m"
        done
        echo "  user: $(id -un)"'
done

cleanup() { docker rm -f "$NODE-svc" "$NODE-col" >/dev/null 2>&1 || true; }
trap cleanup EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
docker run -d --name "$NODE-svc" --network host -e "OOMCAST_REDIS_URL=$REDIS_URL" \
    oomcast-service:check serve --host 127.0.0.1 --port "$PORT" >/dev/null
docker run -d --name "$NODE-col" --network host oomcast-collector:check \
    collect --source sim --node "$NODE" --gpus 2 --interval 0.5 --redis-url "$REDIS_URL" >/dev/null
for _ in $(seq 60); do
    out=$(curl -sf "http://127.0.0.1:$PORT/v1/devices?node=$NODE" || true)
    if [[ "$out" == *"\"risk\""* && "$out" == *"$NODE"* ]]; then
        echo "== smoke: the service forecasts the collector's devices"
        python3 -c 'import json,sys; d=json.loads(sys.argv[1]); [print("  ", x["node"], x["device"], "used", x["used_frac"], "risk@120s", x["risk"]["120"], x["model_version"]) for x in d["devices"]]' "$out"
        exit 0
    fi
    sleep 1
done
echo "smoke failed: no forecast for node $NODE within 60 s" >&2
docker logs "$NODE-svc" 2>&1 | tail -20 >&2
docker logs "$NODE-col" 2>&1 | tail -20 >&2
exit 1
