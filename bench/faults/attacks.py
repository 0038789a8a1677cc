"""Scenarios where someone who can write to Redis or reach the API tries to make oomcast do
harm: forged node commands, forged samples, and a huge unauthenticated request body.

The node here is an ``oomcast collect`` agent watching a memory cgroup laid out as files (a
cgroup tree in a temporary directory: the agent reads it as it reads /sys/fs/cgroup), which
holds two real processes: a protected job (priority 10) and a victim (priority 0). A shed
command that got through would end the victim; the bench checks that it is still alive,
and, with one command it signs properly (the control), that a shed *can* end it, so that a
victim left alive means something.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import subprocess
import time
from typing import Any, cast
from urllib.parse import urlparse

from oomcast.bench.faults import ledger
from oomcast.bench.faults.stage import (
    SIM_ARGS,
    SIM_INTERVAL,
    Bench,
    Scenario,
    batch_ids,
    http_batch,
)
from oomcast.bench.procs import Service, read_status, wait_until
from oomcast.model.control import new_command, node_key, sign_command
from oomcast.model.text import as_str
from oomcast.model.wire import answer, encode_samples

GIB = 1 << 30
MIB = 1 << 20
NODE = "bf-node-1"
DEVICE = "cgroup:/job"
LIMIT = 4 * GIB
USED = int(1.6 * GIB)  # 40 % of the limit: nothing to act on
BODY_BYTES = 116 * 1000 * 1000  # the 116 MB body of the issue
SETTLE_S = 2.0  # the system runs on this long after an attack, before the end is counted
CHUNK = 64 * 1024  # sent at a time, looking for an answer in between


class Node:
    """The cgroup tree and the two processes in it."""

    def __init__(self, b: Bench, sc: Scenario) -> None:
        self.root = b.root / f"cgroup-{sc.name}"
        job = self.root / "job"
        job.mkdir(parents=True)
        (self.root / "cgroup.controllers").write_text("memory\n")
        self.protected = self._process(b, f"{sc.name}-protected", "protected", 10)
        self.victim = self._process(b, f"{sc.name}-victim", "victim", 0)
        files = {
            "memory.max": LIMIT,
            "memory.current": USED,
            "memory.peak": USED,
            "memory.stat": f"anon {USED}\nfile 4096\nkernel 8192\nsock 0",
            "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0",
            "cgroup.procs": f"{self.protected.pid}\n{self.victim.pid}",
        }
        for name, value in files.items():
            (job / name).write_text(f"{value}\n")

    @staticmethod
    def _process(b: Bench, log: str, job: str, priority: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OOMCAST_JOB": job, "OOMCAST_PRIORITY": str(priority)}
        return b.procs.spawn(["sleep", "3600"], env, f"{log}.log")

    def agent_args(self) -> list[str]:
        return [
            "--source",
            "cgroup",
            "--cgroup-root",
            str(self.root),
            "--cgroup-interval",
            "0.2",
            "--shed-uids",
            str(os.getuid()),
            "--shed-grace",
            "0.5",
        ]

    def victim_alive(self) -> bool:
        return self.victim.poll() is None

    def set_used(self, frac: float) -> None:
        """The cgroup's use, as the agent reads it next: ``frac`` of the limit."""
        used = int(frac * LIMIT)
        job = self.root / "job"
        for name in ("memory.current", "memory.peak"):
            (job / name).write_text(f"{used}\n")
        (job / "memory.stat").write_text(f"anon {used}\nfile 4096\nkernel 8192\nsock 0\n")


def _shed_command(used: int = USED) -> dict[str, Any]:
    """A live shed of the victim. With the default claim the node's own reading confirms
    it: only the signature stands between it and the victim."""
    return new_command(
        node=NODE,
        action="shed",
        device=DEVICE,
        job="protected",
        params={"need_bytes": 1},
        reason="fault bench",
        forecast={"risk": {"5": 1.0}, "used_bytes": used, "total_bytes": LIMIT},
    )


def _forged_commands(b: Bench) -> list[tuple[str, dict[str, str]]]:
    """Signed with a wrong key, with another node's key, unsigned; and one properly signed
    whose claim (99 % used) the node's own reading (40 %) refutes: a service fooled by
    forged data, or a stolen master key, still needs the node to see the danger."""
    wrong = sign_command(_shed_command(), secrets.token_hex(32))
    other = sign_command(_shed_command(), node_key(b.master_secret, "bf-other-node"))
    unsigned = {"cmd": sign_command(_shed_command(), secrets.token_hex(32))["cmd"]}
    false_claim = sign_command(
        _shed_command(used=int(0.99 * LIMIT)), node_key(b.master_secret, NODE)
    )
    return [
        ("wrong_key", wrong),
        ("other_nodes_key", other),
        ("unsigned", unsigned),
        ("false_claim", false_claim),
    ]


def started(b: Bench, sc: Scenario, used_frac: float | None = None) -> tuple[Node, Service]:
    """The cgroup node (at ``used_frac`` of its limit, else 40 %), a service and the node's
    agent, once the service has forecast the domain."""
    node = Node(b, sc)
    if used_frac is not None:
        node.set_used(used_frac)
    svc = sc.service()
    sc.agent(NODE, node.agent_args())
    if not wait_until(lambda: (sc.newest_forecast(svc, NODE) or 0) > 0, 30):
        sc.problems.append("the cgroup domain was never forecast")
    return node, svc


def forged_command(b: Bench, sc: Scenario) -> dict[str, Any]:
    """Live shed commands XADDed straight to the node's control stream, signed with a wrong
    key, with another node's key, and unsigned; then one signed properly (the control)."""
    node, svc = started(b, sc)
    stream = sc.keys.control(NODE)
    sent = {}
    for kind, fields in _forged_commands(b):
        sc.client.xadd(stream, cast(Any, fields))
        sent[kind] = json.loads(fields["cmd"])["id"]
    fault_end = time.time()
    ids = set(sent.values())

    def refused(evs: list[dict[str, Any]]) -> bool:
        seen = {e.get("id") for e in evs if e.get("event") == "command_refused"}
        return ids <= seen

    if not sc.wait_events(refused, 15):
        sc.problems.append("the agent did not report refusing every forged command")
    sc.victims_killed = 0 if node.victim_alive() else 1
    sc.figures["forged_commands"] = sorted(sent)

    def on_record() -> int:
        return sum(
            1
            for r in ledger.audit_records(sc.client, sc.keys)
            if r.get("record") == "event"
            and r.get("event") == "command_refused"
            and r.get("command_id") in ids
        )

    if not wait_until(lambda: on_record() >= len(ids), 15, 0.2):
        sc.problems.append("not every refusal reached the audit stream (GET /v1/alerts)")
    sc.figures["refusals_on_record"] = on_record()
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    # the control: the same command, signed with the node's key, must end the victim
    control_shed(b, sc, node, USED, "a refused command")
    time.sleep(SETTLE_S)
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out


def control_shed(b: Bench, sc: Scenario, node: Node, used: int, stopped: str) -> None:
    """The control of the node scenarios: a live shed claiming ``used`` bytes, signed with
    the node's key, must end the victim, so that a victim left alive means the attack
    (``stopped``) was stopped, not that a shed would have done nothing."""
    control = _shed_command(used)
    stream = sc.keys.control(NODE)
    sc.client.xadd(stream, cast(Any, sign_command(control, node_key(b.master_secret, NODE))))
    sc.allowed_commands.add(control["id"])
    taken = wait_until(lambda: not node.victim_alive(), 15)
    sc.figures["control_victim_ended"] = taken
    if not taken:
        sc.problems.append(
            "the control (a properly signed shed) did not end the victim: the bench cannot"
            f" tell {stopped} from one that would have done nothing"
        )


def _forged_entry(
    node: str, device: str, ts: float, frac: float, sig: str | None
) -> dict[str, str]:
    total = LIMIT if device == DEVICE else 80 * GIB
    sample = {
        "ts": ts,
        "node": node,
        "device": device,
        "kind": "host" if device.startswith("cgroup:") else "gpu",
        "total_bytes": total,
        "used_bytes": int(frac * total),
    }
    fields = encode_samples(node, [sample])
    if sig is not None:
        fields["sig"] = sig
    return fields


def _other_nodes_entry(b: Bench) -> dict[str, str]:
    """An entry properly signed by another node (a compromised one) that carries a sample of
    this node's domain: a node vouches for its own domains only."""
    other = "bf-other-node"
    inner = _forged_entry(NODE, DEVICE, time.time() + 0.35, 0.99, None)
    return encode_samples(other, json.loads(inner["samples"]), node_key(b.master_secret, other))


def forged_sample(b: Bench, sc: Scenario) -> dict[str, Any]:
    """Unsigned samples claiming 99 % for the signed cgroup domain (under a live shed rule),
    one with a bogus signature, and samples stamped ts=1e300, one for the signed domain and
    one for a domain whose samples come over HTTP, unsigned, whose later samples must still
    be forecast."""
    node, svc = started(b, sc)
    http_node = "bf-http"
    with b.http() as http:

        def post(n: int) -> set[ledger.SampleId]:
            batch = http_batch(http_node, n, time.time())
            r = http.post(f"{svc.base}/v1/samples", json={"samples": batch})
            if r.status_code != 202:
                sc.problems.append(f"POST /v1/samples answered {r.status_code}: {r.text[:200]}")
                return set()
            return batch_ids(batch)

        legit = post(20)
        time.sleep(0.3)
        forged = [
            *(_forged_entry(NODE, DEVICE, time.time() + i * 0.05, 0.99, None) for i in range(5)),
            _forged_entry(NODE, DEVICE, time.time() + 0.3, 0.99, "sha256=" + "0" * 64),
            _other_nodes_entry(b),
            _forged_entry(NODE, DEVICE, 1e300, 0.99, None),
            _forged_entry(http_node, "gpu0", 1e300, 0.99, None),
        ]
        for fields in forged:
            eid = answer(sc.client.xadd(sc.keys.samples_for(fields["node"]), cast(Any, fields)))
            sc.forged_entries.add(as_str(eid))
            for sample in json.loads(fields["samples"]):
                sc.forged_samples.add((sample["node"], sample["device"], float(sample["ts"])))
        fault_end = time.time()
        time.sleep(0.3)
        legit |= post(20)  # after the 1e300 sample: these must still be forecast
    sc.producers.append(ledger.Producer(f"http:{http_node}", http_node, len(legit), legit))
    recovery = sc.recovered_after(svc, [NODE, http_node], fault_end)
    time.sleep(2.0)  # a shed decided on forged data would have reached the node by now
    sc.victims_killed = 0 if node.victim_alive() else 1
    records = ledger.audit_records(sc.client, sc.keys)
    sc.figures["shed_commands_sent"] = sum(
        1
        for r in records
        if "record" not in r
        and isinstance(r.get("dispatched"), dict)
        and isinstance(r["dispatched"].get("shed"), dict)
    )
    out = sc.conclude()
    out["recovery_s"] = recovery
    if out.get("forged_samples_not_refused"):
        sc.problems.append(f"{out['forged_samples_not_refused']} forged samples were not refused")
    return out


def stream_post(base: str, path: str, headers: dict[str, str], chunked: bool) -> dict[str, Any]:
    """POST a BODY_BYTES body, streamed CHUNK bytes at a time, stopping as soon as the service
    answers or closes; what it answered and how much of the body it let in."""
    url = urlparse(base)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=10)
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {BODY_BYTES}")
    sent, answer, t0 = 0, b"", time.monotonic()
    piece = b"0" * CHUNK
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        while sent < BODY_BYTES:
            if select.select([sock], [], [], 0)[0]:
                break  # the service answered (or closed) before the body was done
            n = min(CHUNK, BODY_BYTES - sent)
            data = piece[:n]
            sock.sendall(b"%x\r\n%s\r\n" % (n, data) if chunked else data)
            sent += n
        if chunked and sent >= BODY_BYTES:
            sock.sendall(b"0\r\n\r\n")
        answer = sock.recv(65536)
    except OSError as exc:  # reset: the service closed on a body it would not read
        answer = _late_answer(sock) or f"closed: {exc.strerror or exc}".encode()
    finally:
        sock.close()
    line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[0].startswith("HTTP/") else None
    return {
        "status": status,
        "answer": line[:120],
        "body_mb_sent": round(sent / 1e6, 1),
        "seconds": round(time.monotonic() - t0, 2),
    }


def _late_answer(sock: socket.socket) -> bytes:
    """What the service answered before it closed, if it is still in the socket's buffer."""
    try:
        sock.settimeout(1.0)
        return sock.recv(65536)
    except OSError:
        return b""


def oversized_body(b: Bench, sc: Scenario) -> dict[str, Any]:
    """A 116 MB POST /v1/samples without a token (declared length), and one with the token
    but chunked (no length): refused early, never buffered; ingest goes on."""
    svc = sc.service()
    sc.agent(NODE, (*SIM_ARGS, *SIM_INTERVAL))
    wait_until(lambda: (sc.newest_forecast(svc, NODE) or 0) > 0, 30)
    before = read_status(svc.pid)
    posts = {
        "unauthenticated": stream_post(svc.base, "/v1/samples", {}, chunked=False),
        "authenticated_chunked": stream_post(
            svc.base, "/v1/samples", {"Authorization": f"Bearer {b.api_token}"}, chunked=True
        ),
    }
    fault_end = time.time()
    after = read_status(svc.pid)
    sc.figures["posts"] = posts
    for name, want in (("unauthenticated", 401), ("authenticated_chunked", 413)):
        if posts[name]["status"] != want:
            sc.problems.append(f"the {name} 116 MB POST got {posts[name]['answer']!r}, not {want}")
    rss0, rss1 = before.get("VmRSS", 0), after.get("VmRSS", 0)
    peak = after.get("VmHWM", 0) - max(before.get("VmHWM", 0), rss0)
    sc.figures["service_rss_before_mib"] = round(rss0 / MIB, 1)
    sc.figures["service_rss_after_mib"] = round(rss1 / MIB, 1)
    sc.figures["service_peak_rss_growth_mib"] = round(max(0, peak) / MIB, 1)
    if max(rss1 - rss0, peak) > 64 * MIB:
        sc.problems.append(f"the service grew by {max(rss1 - rss0, peak) / MIB:.0f} MiB")
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    time.sleep(SETTLE_S)
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out
