#!/usr/bin/env bash
# Fill .whl/ (ignored) with what bench/device_check.sh needs on a GPU machine that has
# Python 3.12, torch, transformers, Lightning, NVML and onnxruntime but not this package:
# this package's wheel, the wheels of its dependencies that machine lacks, and a
# redis-server with the libraries it links that the machine may not have.
# Run from the repository root; then carry .whl in the device call.
set -eu
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl/redislib
"$PY" -m pip wheel -q --no-deps -w .whl .
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    orjson "redis<8" pydantic-settings hiredis  # with their dependencies, versions that agree
cp "$(command -v redis-server)" .whl/redislib/
for lib in $(ldd "$(command -v redis-server)" | awk '/=>/ {print $3}'); do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*) ;;  # the machine's own
        *) cp -L "$lib" .whl/redislib/ ;;
    esac
done
du -sh .whl
