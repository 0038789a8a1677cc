"""model/control.py: signing and verifying control commands, the nonce cache."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest

from oomcast.model.control import (
    MAX_VALIDITY_S,
    Command,
    CommandRejected,
    NonceCache,
    new_command,
    sign_command,
    unverified_id,
    verify_command,
)

SECRET = "s3cret-of-the-cluster"
NODE = "node-7"
NOW = 1_700_000_000.0


def command(**overrides: Any) -> dict[str, Any]:
    cmd = new_command(
        node=NODE,
        action="checkpoint",
        device="gpu0",
        job="bert-ft-42",
        params={"need_bytes": 1 << 30},
        reason="risk 0.93 at 60 s",
        forecast={"risk": {"60": 0.93}, "time_to_oom_s": 75.0, "model_version": "v3"},
        now=NOW,
    )
    cmd.update(overrides)
    return cmd


def verify(fields: dict[Any, Any], nonces: NonceCache | None = None, **kw: Any) -> Command:
    kw.setdefault("now", NOW + 1)
    kw.setdefault("node", NODE)
    return verify_command(
        fields, SECRET, nonces=nonces if nonces is not None else NonceCache(), **kw
    )


def signed_raw(raw: str, secret: str = SECRET) -> dict[str, str]:
    """Fields with a valid signature over arbitrary bytes (as a buggy signer would make)."""
    sig = hmac.new(secret.encode(), raw.encode(), hashlib.sha256).hexdigest()
    return {"cmd": raw, "sig": f"sha256={sig}"}


def reason_of(fields: dict[Any, Any], nonces: NonceCache | None = None, **kw: Any) -> str:
    with pytest.raises(CommandRejected) as info:
        verify(fields, nonces, **kw)
    return info.value.reason


# --- signing -------------------------------------------------------------------------------


def test_new_command_fills_id_nonce_and_window() -> None:
    cmd = command()
    assert cmd["issued_at"] == NOW
    assert cmd["expires_at"] == NOW + 30
    assert len(cmd["nonce"]) == 32 and int(cmd["nonce"], 16) >= 0
    assert cmd["id"] and cmd["id"] != command()["id"]
    assert cmd["nonce"] != command()["nonce"]
    assert cmd["dry_run"] is False


def test_sign_is_canonical_json_with_hmac_of_those_bytes() -> None:
    cmd = command()
    fields = sign_command(cmd, SECRET)
    assert set(fields) == {"cmd", "sig"}
    assert fields["cmd"] == json.dumps(cmd, sort_keys=True, separators=(",", ":"))
    assert " " not in fields["cmd"].replace("risk 0.93 at 60 s", "")
    expected = hmac.new(SECRET.encode(), fields["cmd"].encode(), hashlib.sha256).hexdigest()
    assert fields["sig"] == f"sha256={expected}"
    # the same command signs the same way whatever the key order it was built in
    assert sign_command(dict(reversed(list(cmd.items()))), SECRET) == fields


def test_roundtrip() -> None:
    cmd = command(action="shed", params={"need_bytes": 123, "allow_partial": True}, dry_run=True)
    got = verify(sign_command(cmd, SECRET))
    assert got.to_dict() == cmd
    assert got.action == "shed" and got.dry_run is True and got.params["need_bytes"] == 123
    assert got.forecast["risk"] == {"60": 0.93}


def test_roundtrip_with_bytes_fields_as_redis_returns_them() -> None:
    fields = {k.encode(): v.encode() for k, v in sign_command(command(job=None), SECRET).items()}
    got = verify(fields)
    assert got.job is None and got.device == "gpu0"


def test_sign_refuses_empty_secret_and_nan() -> None:
    with pytest.raises(ValueError):
        sign_command(command(), "")
    with pytest.raises(ValueError):
        sign_command(command(forecast={"risk": float("nan")}), SECRET)
    with pytest.raises(ValueError):
        verify_command(sign_command(command(), SECRET), "", now=NOW, node=NODE, nonces=NonceCache())


def test_new_command_validates() -> None:
    with pytest.raises(ValueError):
        new_command(node=NODE, action="reboot", device="gpu0")
    with pytest.raises(ValueError):
        new_command(node=NODE, action="shed", device="gpu0", ttl_s=MAX_VALIDITY_S + 1)
    with pytest.raises(ValueError):
        new_command(node=NODE, action="shed", device="gpu0", ttl_s=0)


# --- rejections --------------------------------------------------------------------------


def test_missing_sig_is_unsigned() -> None:
    fields = sign_command(command(), SECRET)
    del fields["sig"]
    assert reason_of(fields) == "unsigned"


def test_forged_with_another_secret() -> None:
    assert reason_of(sign_command(command(), "not-the-secret")) == "bad_signature"


@pytest.mark.parametrize(
    "sig",
    ["", "sha256=", "sha256=zz", "md5=abc", "SHA256=00", "sha256=" + "0" * 64, "sha256=é"],
)
def test_garbage_signatures(sig: str) -> None:
    fields = sign_command(command(), SECRET)
    fields["sig"] = sig
    assert reason_of(fields) == "bad_signature"


def test_tampered_cmd_bytes() -> None:
    fields = sign_command(command(action="shed", params={"need_bytes": 1}), SECRET)
    fields["cmd"] = fields["cmd"].replace('"need_bytes":1', '"need_bytes":9')
    assert reason_of(fields) == "bad_signature"
    # even whitespace: the signature covers the bytes, not the parsed object
    fields = sign_command(command(), SECRET)
    fields["cmd"] = fields["cmd"].replace(",", ", ", 1)
    assert reason_of(fields) == "bad_signature"


def test_signature_is_checked_before_parsing() -> None:
    # not JSON, and unsigned/badly signed: never parsed, so not "malformed"
    assert reason_of({"cmd": "{not json", "sig": "sha256=00"}) == "bad_signature"
    assert reason_of({"cmd": "{not json"}) == "unsigned"


def test_missing_cmd_is_malformed() -> None:
    assert reason_of({"sig": "sha256=00"}) == "malformed"


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        "[1,2]",
        "null",
        '{"a":NaN}',
        "\xff",
    ],
)
def test_signed_garbage_is_malformed(raw: str) -> None:
    assert reason_of(signed_raw(raw)) == "malformed"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("action", "reboot"),
        ("action", None),
        ("id", ""),
        ("id", 7),
        ("node", None),
        ("device", ""),
        ("job", 5),
        ("job", ""),
        ("params", []),
        ("forecast", "high"),
        ("dry_run", "yes"),
        ("dry_run", 0),
        ("issued_at", True),
        ("issued_at", "now"),
        ("expires_at", -1),
        ("nonce", "abc"),
        ("nonce", "z" * 32),
        ("reason", None),
    ],
)
def test_wrongly_typed_fields_are_malformed(key: str, value: Any) -> None:
    cmd = command(**{key: value})
    with pytest.raises(CommandRejected) as info:
        verify(signed_raw(json.dumps(cmd, sort_keys=True, separators=(",", ":"))))
    assert info.value.reason == "malformed"
    assert key in info.value.message


@pytest.mark.parametrize("key", ["id", "node", "action", "params", "nonce", "issued_at"])
def test_missing_fields_are_malformed(key: str) -> None:
    cmd = command()
    del cmd[key]
    assert reason_of(sign_command(cmd, SECRET)) == "malformed"


def test_expires_before_issued_is_malformed() -> None:
    assert reason_of(sign_command(command(expires_at=NOW - 1), SECRET), now=NOW - 2) == (
        "malformed"
    )


def test_wrong_node() -> None:
    fields = sign_command(command(node="node-8"), SECRET)
    with pytest.raises(CommandRejected) as info:
        verify(fields)
    assert info.value.reason == "wrong_node"
    assert info.value.command_id == json.loads(fields["cmd"])["id"]


def test_expired() -> None:
    fields = sign_command(command(), SECRET)
    verify(fields, now=NOW + 30)  # at expires_at: still valid
    assert reason_of(fields, now=NOW + 30.01) == "expired"


def test_not_yet_valid_beyond_the_skew() -> None:
    fields = sign_command(command(), SECRET)
    verify(fields, now=NOW - 29)  # the agent's clock 29 s behind: fine
    assert reason_of(fields, now=NOW - 31) == "not_yet_valid"
    assert reason_of(sign_command(command(), SECRET), now=NOW - 5, max_skew_s=1) == (
        "not_yet_valid"
    )


def test_too_long() -> None:
    fields = sign_command(command(expires_at=NOW + MAX_VALIDITY_S), SECRET)
    verify(fields)
    fields = sign_command(command(expires_at=NOW + MAX_VALIDITY_S + 1), SECRET)
    assert reason_of(fields) == "too_long"


def test_replayed() -> None:
    nonces = NonceCache()
    fields = sign_command(command(), SECRET)
    verify(fields, nonces)
    with pytest.raises(CommandRejected) as info:
        verify(fields, nonces)
    assert info.value.reason == "replayed"
    assert info.value.command is not None and info.value.command.nonce in nonces
    # the same nonce in another (validly signed) command is a replay too
    other = command(id="other", nonce=json.loads(fields["cmd"])["nonce"])
    assert reason_of(sign_command(other, SECRET), nonces) == "replayed"


def test_nonce_recorded_only_when_accepted() -> None:
    nonces = NonceCache()
    fields = sign_command(command(), SECRET)
    assert reason_of(fields, nonces, now=NOW - 60) == "not_yet_valid"
    assert reason_of(fields, nonces, node="node-8") == "wrong_node"
    assert len(nonces) == 0
    verify(fields, nonces)  # the rejections did not use up its nonce
    assert len(nonces) == 1


def test_rejection_carries_the_command_only_when_authenticated() -> None:
    with pytest.raises(CommandRejected) as info:
        verify(sign_command(command(), "forged"))
    assert info.value.command is None and info.value.command_id is None
    assert info.value.authenticated is False
    with pytest.raises(CommandRejected) as info:
        verify(sign_command(command(), SECRET), now=NOW + 100)
    assert info.value.command is not None and info.value.command.device == "gpu0"
    assert info.value.authenticated is True
    with pytest.raises(CommandRejected) as info:
        verify(signed_raw('{"id":"x"}'))
    assert info.value.authenticated is True and info.value.command_id == "x"


def test_unverified_id() -> None:
    cmd = command()
    assert unverified_id(sign_command(cmd, "forged")) == cmd["id"]
    assert unverified_id({b"cmd": json.dumps({"id": "abc"}).encode()}) == "abc"
    for fields in ({}, {"cmd": "{"}, {"cmd": "[]"}, {"cmd": '{"id":5}'}, {"cmd": '{"id":""}'}):
        assert unverified_id(fields) is None
    assert unverified_id({"cmd": json.dumps({"id": "y" * 1000})}) == "y" * 200


# --- the nonce cache -----------------------------------------------------------------------


def test_nonce_cache_forgets_at_expiry() -> None:
    cache = NonceCache(grace_s=0)
    cache.add("a" * 32, expires_at=100.0, now=50.0)
    with pytest.raises(CommandRejected) as info:
        cache.add("a" * 32, expires_at=100.0, now=99.0)
    assert info.value.reason == "replayed"
    cache.add("b" * 32, expires_at=200.0, now=101.0)  # the insert evicts the expired one
    assert "a" * 32 not in cache and len(cache) == 1


def test_nonce_cache_grace_outlives_expiry() -> None:
    cache = NonceCache(grace_s=60)
    cache.add("a" * 32, expires_at=100.0, now=50.0)
    with pytest.raises(CommandRejected):
        cache.add("a" * 32, expires_at=100.0, now=150.0)
    cache.add("b" * 32, expires_at=300.0, now=161.0)
    assert "a" * 32 not in cache


def test_nonce_cache_cap_refuses_instead_of_forgetting() -> None:
    cache = NonceCache(cap=3, grace_s=0)
    for i in range(3):
        cache.add(f"{i:032x}", expires_at=100.0 + i, now=10.0)
    with pytest.raises(CommandRejected) as info:
        cache.add("f" * 32, expires_at=200.0, now=20.0)
    assert info.value.reason == "busy"
    assert len(cache) == 3 and all(f"{i:032x}" in cache for i in range(3))
    # once one expires there is room again
    cache.add("f" * 32, expires_at=200.0, now=100.5)
    assert len(cache) == 3 and f"{0:032x}" not in cache


def test_verify_refuses_when_nonce_cache_full() -> None:
    nonces = NonceCache(cap=1)
    verify(sign_command(command(), SECRET), nonces)
    assert reason_of(sign_command(command(), SECRET), nonces) == "busy"


def test_nonce_cache_stays_bounded_under_churn() -> None:
    cache = NonceCache(cap=100, grace_s=0)
    for i in range(10_000):
        cache.add(f"{i:032x}", expires_at=i + 30.0, now=float(i))
    assert len(cache) <= 31
    assert len(cache._heap) <= 31
