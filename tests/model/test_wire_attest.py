"""model/wire.py: sample attestation (``encode_samples(..., key)``, ``entry_attested``) and
``redact_url``, the one way a URL gets into a log line."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest

from oomcast.model.control import node_key, node_keys, sign_command
from oomcast.model.schema import Sample
from oomcast.model.wire import decode_samples, encode_samples, entry_attested, redact_url

MASTER = "the-master-secret"
KEYS = node_keys(MASTER)
GIB = 1 << 30


def payloads(used: int = 40 * GIB) -> list[dict[str, Any]]:
    s = Sample(ts=1e9, node="n1", device="gpu0", kind="gpu", total_bytes=80 * GIB, used_bytes=used)
    return [s.to_dict()]


def as_redis_returns(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_signed_entry_is_attested_for_its_own_node() -> None:
    fields = encode_samples("n1", payloads(), key=node_key(MASTER, "n1"))
    assert fields["sig"].startswith("sha256=")
    assert entry_attested(fields, KEYS)
    assert entry_attested(as_redis_returns(fields), KEYS)  # bytes, as redis-py returns them
    assert [d.sample.device for d in decode_samples(fields)] == ["gpu0"]  # type: ignore[union-attr]
    # the signature covers exactly the node and the samples bytes, with a context prefix
    node, samples = b"n1", fields["samples"].encode()
    msg = b"oomcast-samples-v1\n" + len(node).to_bytes(4, "big") + node + samples
    mac = hmac.new(node_key(MASTER, "n1").encode(), msg, hashlib.sha256).hexdigest()
    assert fields["sig"] == "sha256=" + mac


def test_unsigned_entry_is_not_attested_and_unchanged() -> None:
    fields = encode_samples("n1", payloads())
    assert "sig" not in fields and set(fields) == {"v", "node", "n", "samples"}
    assert not entry_attested(fields, KEYS)


def test_forged_and_tampered_entries_are_not_attested() -> None:
    good = encode_samples("n1", payloads(), key=node_key(MASTER, "n1"))
    # the samples changed after signing (a forger raising the use)
    tampered = {**good, "samples": json.dumps(payloads(79 * GIB), separators=(",", ":"))}
    assert not entry_attested(tampered, KEYS)
    # node n2's key (stolen from n2) cannot vouch for n1's samples
    by_n2 = encode_samples("n1", payloads(), key=node_key(MASTER, "n2"))
    assert not entry_attested(by_n2, KEYS)
    # nor can n1's signed entry be relabelled as n2's
    assert not entry_attested({**good, "node": "n2"}, KEYS)
    # a signature made without the master secret
    assert not entry_attested(encode_samples("n1", payloads(), key="guessed"), KEYS)
    for missing in ("sig", "node", "samples"):
        assert not entry_attested({k: v for k, v in good.items() if k != missing}, KEYS)
    assert not entry_attested({**good, "sig": "sha256=00"}, KEYS)
    assert not entry_attested({**good, "node": ""}, KEYS)
    assert not entry_attested({**as_redis_returns(good), b"node": b"\xff"}, KEYS)


def test_a_node_without_a_key_is_never_attested() -> None:
    fields = encode_samples("n1", payloads(), key=node_key(MASTER, "n1"))
    assert not entry_attested(fields, lambda node: None)
    assert not entry_attested(fields, lambda node: "")
    asked: list[str] = []
    entry_attested(fields, lambda node: asked.append(node) or None)  # type: ignore[func-returns-value]
    assert asked == ["n1"]  # looked up by the entry's own node field


def test_a_command_signature_does_not_pass_for_a_sample_signature() -> None:
    # the same key signs commands and attests samples: the two must never be confused
    key = node_key(MASTER, "n1")
    samples = json.dumps(payloads(), separators=(",", ":"))
    cmd_sig = sign_command({"samples": samples}, key)["sig"]
    plain = hmac.new(key.encode(), samples.encode(), hashlib.sha256).hexdigest()
    for sig in (cmd_sig, "sha256=" + plain):
        assert not entry_attested({"node": "n1", "samples": samples, "sig": sig}, KEYS)


def test_encode_samples_refuses_an_empty_key() -> None:
    with pytest.raises(ValueError):
        encode_samples("n1", payloads(), key="")


# --- redact_url ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://agent:hunter2@redis:6379/0", "redis://agent:***@redis:6379/0"),
        (
            "rediss://default:hunter2@redis.example:6380/1",
            "rediss://default:***@redis.example:6380/1",
        ),
        ("unix://:hunter2@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("redis://:hunter2@[::1]:6379", "redis://:***@[::1]:6379"),
        ("https://hunter2@hooks.example/alerts", "https://***@hooks.example/alerts"),
        ("http://u:hunter2@h:8080/p?x=1", "http://u:***@h:8080/p?x=1"),
        ("https://h/hook?token=hunter2&team=ml", "https://h/hook?token=***&team=ml"),
        ("redis://h:6379/0?password=hunter2", "redis://h:6379/0?password=***"),
        ("redis://:p@ss:hunter2@h/0", "redis://:***@h/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("http://127.0.0.1:9/alerts?x=1", "http://127.0.0.1:9/alerts?x=1"),
    ],
)
def test_redact_url_masks_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


def test_redact_url_of_an_unparsable_url_still_hides_the_password() -> None:
    assert "hunter2" not in redact_url("redis://:hunter2@[::1/0")


def test_a_signed_event_is_attested_for_the_node_it_names_only() -> None:
    from oomcast.model.schema import Event
    from oomcast.model.wire import decode_event, encode_event, event_attested

    oom = Event(ts=1e9, node="n1", device="gpu0", event="oom", job="j")
    fields = encode_event(oom, node_key(MASTER, "n1"))
    assert event_attested(fields, "n1", KEYS)
    assert event_attested(as_redis_returns(fields), "n1", KEYS)
    assert decode_event(fields) == oom  # the signature changes nothing a reader sees
    # the MAC covers exactly the event field's bytes, with a prefix of its own
    mac = hmac.new(
        node_key(MASTER, "n1").encode(),
        b"oomcast-event-v1\n" + fields["event"].encode(),
        hashlib.sha256,
    ).hexdigest()
    assert fields["sig"] == "sha256=" + mac
    assert not event_attested(fields, "n2", KEYS)  # not under another node's key
    other = encode_event(
        Event(ts=1e9, node="n2", device="gpu0", event="oom"), node_key(MASTER, "n1")
    )
    assert not event_attested(other, "n2", KEYS)  # n1's key signing n2's event
    assert not event_attested(encode_event(oom), "n1", KEYS)  # unsigned
    tampered = {**fields, "event": fields["event"].replace("gpu0", "gpu1")}
    assert not event_attested(tampered, "n1", KEYS)
    assert not event_attested(fields, "n1", lambda node: None)  # a node without a key
    # a sample entry's signature never passes for an event's, nor the other way round
    samples = encode_samples("n1", payloads(), key=node_key(MASTER, "n1"))
    assert not event_attested({**fields, "sig": samples["sig"]}, "n1", KEYS)
    assert not entry_attested({**samples, "sig": fields["sig"]}, KEYS)
