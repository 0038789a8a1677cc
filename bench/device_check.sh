#!/usr/bin/env bash
# Every GPU-only check in one call, for the few minutes a machine with a GPU is lent
# (docs/bench.md, "On a GPU"). Run from the repository root there; needs in .whl/ this
# package's wheel, the wheels of what that machine lacks, and redislib/ (a redis-server with
# its libraries). Results go to $OUT (default ./gpu-out): log.txt and results.tgz.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/r"
exec > >(tee "$OUT/log.txt") 2>&1
here=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$here/.whl/redislib" \
    "$here/.whl/redislib/redis-server" > /tmp/redis-server && chmod +x /tmp/redis-server
cd /tmp  # the package comes from the wheel, not from the checkout
# One deadline for the whole run (BUDGET_S, default 540 s: the device's 600 s per command,
# less the install and the tar): each step gets at most its own limit and what is left,
# and a step with under 20 s left is skipped, so the results always come back.
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
step() { echo "=== $1 ($(date +%T), $((DEADLINE - SECONDS)) s left)"; }
limit() {  # limit WANT: seconds this step may run; fails (skip the step) under 20 s
    local left=$((DEADLINE - SECONDS))
    [ "$left" -ge 20 ] || { echo "(skipped: ${left} s left)" >&2; return 1; }
    echo $(( $1 < left ? $1 : left ))
}

step "machine"
nvidia-smi -L
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
python3 -m oomcast.cli.main --version

step "a CUDA context: its size, and the NVML check that must see it"
T=$(limit 60) && timeout $T python3 - <<'EOF'
import json, os, torch
from oomcast.bench.preflight.scripts_gpu import holds_gpu_context
before = holds_gpu_context()
a = torch.randn(1024, 1024, device="cuda")
(a @ a).sum().item()  # cuBLAS loaded, as after any first step
free, total = torch.cuda.mem_get_info()
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
print("CONTEXT " + json.dumps({"before": before, "after": holds_gpu_context(),
      "nvml_process_bytes": mine, "torch_reserved": torch.cuda.memory_reserved(),
      "device_used": total - free, "total": total,
      "fraction_api": hasattr(torch.cuda, "get_per_process_memory_fraction")}))
EOF

step "a real CUDA leak under a memory-fraction cap, hook + NVML agent, dumped and scored"
T=$(limit 300) && timeout $T python3 -m oomcast.bench.gpu_leak --out "$OUT/r/leak" \
    --redis-server /tmp/redis-server --timeout 150 | tail -c 3000

step "preflight of scripts as written: the real runs"
T=$(limit 150) && timeout $T python3 -m oomcast.bench.preflight.scripts_gpu --truth-only --jobs 8 \
    --out "$OUT/r/scripts_truth.json" > /dev/null
step "preflight of scripts as written: the predictions, on this CUDA build"
T=$(limit 120) && timeout $T python3 -m oomcast.bench.preflight.scripts_gpu --join "$OUT/r/scripts_truth.json" \
    --out "$OUT/r/scripts_gpu.json" > /dev/null 2> "$OUT/r/scripts_gpu.err"
python3 - "$OUT/r/scripts_gpu.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    t, p = r.get("truth") or {}, r.get("predicted") or {}
    print(r["case"], t.get("peak_allocated_bytes"), p.get("peak_allocated_bytes"),
          r.get("rel_error_allocated"), p.get("cuda_initialized"), p.get("gpu_context"),
          (t.get("error") or p.get("error") or "")[-300:])
EOF

step "the oomcast preflight command on a plain script, on this CUDA build"
T=$(limit 60) && timeout $T python3 -m oomcast.cli.main preflight --gpu H100-80GB --no-remedies -- \
    python3 /tmp/site/oomcast/bench/preflight/scripts/plain_lm.py --steps 3 | tail -25

step "the allocator simulator against the real allocator, and a real OOM"
T=$(limit 90) && timeout $T python3 -m oomcast.bench.gpu_check --out "$OUT/r/gpu_check.json" | tail -c 2500

step "the preflight zoo against real CUDA runs and real OOMs under a cap"
T=$(limit 150) && timeout $T python3 -m oomcast.bench.preflight.gpu --out "$OUT/r/preflight_gpu.json" 2>&1 | tail -8

step "done"
tar -C "$OUT/r" -czf "$OUT/results.tgz" .
rm -rf "$OUT/r"
