"""The Redis ACLs of docs/security.md, run as written against a real (private) Redis: each
role can do its work and nothing it should not. The agent's role is exercised by the real
node agent and control listener, logged in as that role's user."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_until

from oomcast.collectors.actiontypes import ActionResult
from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.control import ControlListener
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.sim import SimGPU, SimSource
from oomcast.model.control import new_command, node_key, sign_command
from oomcast.model.jobcontrol import jobctl_key
from oomcast.model.wire import Keys, decode_event

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
MARKER = "<!-- acl-commands:"
KEYS = Keys()  # the prefix the document's commands use
MASTER = "acl-test-master"


def doc_commands() -> list[list[str]]:
    """Every command of the block after the marker, as argv without ``redis-cli`` and its
    connection options (backslash continuations joined, comments dropped)."""
    text = DOC.read_text()
    after = text[text.index(MARKER) :]
    block = re.search(r"```sh\n(.*?)```", after, re.S)
    assert block is not None, "no ```sh block after the ACL marker in docs/security.md"
    joined = block.group(1).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "redis-cli", line
        words = words[1:]
        while words[0].startswith("--"):  # --user NAME --pass PASSWORD
            words = words[2:]
        out.append(words)
    return out


def password(user: str) -> str:
    for argv in doc_commands():
        if argv[:3] == ["ACL", "SETUSER", user]:
            return next(w[1:] for w in argv if w.startswith(">"))
    raise AssertionError(f"docs/security.md creates no user {user}")


@pytest.fixture
def acl_redis(private_redis: Any) -> Iterator[Any]:
    admin = redis.Redis.from_url(private_redis.url)
    for argv in doc_commands():
        assert admin.execute_command(*argv) in (b"OK", "OK"), argv
    yield private_redis


def login(server: Any, user: str, **kw: Any) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=server.port, username=user, password=password(user), **kw
    )


def denied(call: Any) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_the_document_has_every_role() -> None:
    users = {argv[2] for argv in doc_commands() if argv[:2] == ["ACL", "SETUSER"]}
    assert {
        "oomcast-admin",
        "oomcast-agent-node-a",
        "oomcast-hook",
        "oomcast-service",
        "oomcast-dashboard",
        "default",
    } <= users


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_default_user_is_off(acl_redis: Any) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=acl_redis.port).ping()


def test_agent_publishes_and_reads_its_own_control_stream_only(acl_redis: Any) -> None:
    agent_client = login(acl_redis, "oomcast-agent-node-a", socket_timeout=2)
    admin = login(acl_redis, "oomcast-admin")
    key = node_key(MASTER, "node-a")

    # the real agent publishes its (attested) samples as this user
    sim = SimSource([SimGPU("node-a", "gpu0", "plateau")])
    agent = NodeAgent([sim], StreamPublisher(agent_client), KEYS, node="node-a", node_key=key)
    agent.tick()
    assert agent.publisher.stats.samples_sent == 1 and agent.publisher.stats.publish_errors == 0
    assert admin.xlen(KEYS.samples_for("node-a")) == 1

    # the real control listener reads its stream and reports on the events stream
    ran: list[str] = []

    def shed(cmd: Any, candidates: Any) -> ActionResult:
        ran.append(cmd.id)
        return ActionResult("dry_run", "would shed nobody")

    listener = ControlListener(
        agent_client, KEYS, "node-a", key, {"shed": shed}, lambda c: [], block_ms=100
    )
    listener.start()
    try:
        cmd = new_command(node="node-a", action="shed", device="gpu0", dry_run=True)
        service = login(acl_redis, "oomcast-service")
        service.xadd(KEYS.control("node-a"), sign_command(cmd, key))  # type: ignore[arg-type]
        assert wait_until(lambda: admin.xlen(KEYS.events) >= 1, 10)
        (_, fields), *_ = admin.xrange(KEYS.events)
        assert decode_event(fields).event == "action_result" and ran == [cmd["id"]]
    finally:
        assert listener.stop(10)

    # it may not write another node's control stream, read it, nor read the alerts
    other = KEYS.control("node-b")
    assert denied(lambda: agent_client.xadd(other, {"cmd": "x", "sig": "y"}))
    assert denied(lambda: agent_client.xadd(KEYS.control("node-a"), {"cmd": "x"}))
    assert denied(lambda: agent_client.xread({other: "0-0"}))
    assert denied(lambda: agent_client.xrevrange(KEYS.alerts, count=1))
    assert denied(lambda: agent_client.xadd(KEYS.alerts, {"a": "b"}))
    # nor read other nodes' samples back, nor touch the service's keys
    assert denied(lambda: agent_client.xrange(KEYS.samples_for("node-a")))
    assert denied(lambda: agent_client.hset("oomcast:outbox:{o}:webhook:items", "x", "y"))
    assert denied(lambda: agent_client.flushall())
    assert denied(lambda: agent_client.config_set("maxmemory", 1))
    # it may ask a job to checkpoint (the checkpoint action)
    assert agent_client.xadd(jobctl_key(KEYS.prefix, "train-1"), {"x": "1"})


def test_service_role_does_its_work_and_no_more(acl_redis: Any) -> None:
    svc = login(acl_redis, "oomcast-service")
    samples = KEYS.samples(0)
    svc.xgroup_create(samples, "oomcast-service", id="0", mkstream=True)
    svc.xadd(samples, {"v": "1"})
    resp = svc.xreadgroup("oomcast-service", "c1", {samples: ">"}, count=10)
    ((_, [(entry_id, _)]),) = resp  # type: ignore[misc]
    svc.xautoclaim(samples, "oomcast-service", "c2", 0, "0-0", count=10)
    assert svc.xack(samples, "oomcast-service", entry_id) == 1
    for stream in (KEYS.alerts, KEYS.deadletter, KEYS.control("node-a"), KEYS.events):
        svc.xadd(stream, {"x": "1"}, maxlen=1000, approximate=True)
    assert svc.xrevrange(KEYS.alerts, count=1)
    # outbox, state, leases: hashes, sorted sets, strings with expiry, scripts
    svc.hset("oomcast:outbox:{o}:webhook:items", "d1", "{}")
    assert svc.hget("oomcast:outbox:{o}:webhook:items", "d1") == b"{}"
    svc.zadd("oomcast:outbox:{o}:webhook:due", {"d1": 1.0})
    assert svc.set("oomcast:lease:{0}", "me", nx=True, px=5000)
    assert svc.pexpire("oomcast:lease:{0}", 5000)
    script = (
        "local t = redis.call('TIME'); redis.call('HSET', KEYS[1], 'at', t[1]);"
        " redis.call('ZADD', KEYS[2], 1, 'x'); return redis.call('INCR', KEYS[3])"
    )
    keys = ["oomcast:snapshot:{0}", "oomcast:outbox:{o}:x", "oomcast:outbox:{o}:seq"]
    assert svc.eval(script, 3, *keys) == 1
    assert svc.register_script(script)(keys=keys) == 2  # EVALSHA, SCRIPT LOAD
    assert list(svc.scan_iter(match="oomcast:samples:*")) == [samples.encode()]
    # but nothing outside its prefix, and no server administration
    assert denied(lambda: svc.set("other-app:key", "x"))
    assert denied(lambda: svc.flushall())
    assert denied(lambda: svc.config_set("maxmemory", 1))
    assert denied(lambda: svc.execute_command("ACL", "LIST"))
    assert denied(lambda: svc.eval("return redis.call('SET', KEYS[1], 1)", 1, "other-app:x"))


def test_hook_and_dashboard_roles(acl_redis: Any) -> None:
    hook = login(acl_redis, "oomcast-hook")
    assert hook.xadd(KEYS.samples(1), {"v": "1"}) and hook.xadd(KEYS.events, {"v": "1"})
    job = jobctl_key(KEYS.prefix, "train-1")
    login(acl_redis, "oomcast-agent-node-a").xadd(job, {"x": "1"})
    assert hook.xread({job: "0-0"}, count=1)
    assert denied(lambda: hook.xadd(KEYS.control("node-a"), {"cmd": "x"}))
    assert denied(lambda: hook.xadd(job, {"x": "forged ack"}))
    assert denied(lambda: hook.xrevrange(KEYS.alerts, count=1))

    dash = login(acl_redis, "oomcast-dashboard")
    login(acl_redis, "oomcast-service").xadd(KEYS.alerts, {"a": "1"})
    assert dash.xrevrange(KEYS.alerts, count=1) and dash.xlen(KEYS.events) >= 1
    assert dash.xrange(KEYS.samples(1), count=1)
    assert denied(lambda: dash.xadd(KEYS.alerts, {"a": "forged"}))
    assert denied(lambda: dash.xrange(KEYS.control("node-a")))
    assert denied(lambda: dash.hgetall("oomcast:outbox:{o}:webhook:items"))
