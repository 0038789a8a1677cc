"""Harnesses apart from the product: benchmarks, fault scenarios, a local Redis Cluster,
fake NVML, deliberately leaky trainers, the preflight zoo and its accuracy runner. Installed
with the product (`oomcast bench ...`, `oomcast demo`), imported by it only inside those
commands; the images leave it out."""
