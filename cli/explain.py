"""``oomcast explain FILE``: a diagnosis bundle (written by the in-job hook when an alert
fires) or a PyTorch memory-snapshot pickle, read out as fragmentation, the largest free
block against the failing request, the top live allocations by site, and the remedies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from oomcast.cli.common import UsageError


def cmd_explain(args: argparse.Namespace) -> int:
    from oomcast.collectors.diagnosis import DiagnosisError, analyse, explain_text, read_file

    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    for flag in ("request_bytes", "capacity_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: must be a positive byte count")
    try:
        snap, bundle = read_file(path)
    except DiagnosisError as exc:
        raise UsageError(str(exc)) from None
    d = analyse(
        snap, bundle=bundle, failing_request=args.request_bytes, capacity_bytes=args.capacity_bytes
    )
    print(json.dumps(d.to_json()) if args.json else explain_text(d))
    return 0


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "explain",
        help="read a diagnosis bundle or a PyTorch memory snapshot: why the OOM, what fixes it",
        description="Read a diagnosis bundle (the in-job hook writes one when an alert fires)"
        " or a pickle from torch.cuda.memory._dump_snapshot(), and print the fragmentation,"
        " the largest free block against the failing request, the top live allocations by"
        " site and the remedies that follow. The pickle is read as plain data only.",
    )
    e.add_argument("file", help="bundle (.json.gz) or snapshot pickle")
    e.add_argument(
        "--request-bytes", type=int, help="the request that failed, if the file lacks it"
    )
    e.add_argument("--capacity-bytes", type=int, help="the GPU's memory, if the file lacks it")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_explain)
