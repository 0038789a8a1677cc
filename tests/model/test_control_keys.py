"""model/control.py: per-node keys. A key taken from one node signs commands for that node
only; the master secret stays with the service."""

from __future__ import annotations

import pytest

from oomcast.model.control import (
    CommandRejected,
    NonceCache,
    new_command,
    node_key,
    node_keys,
    sign_command,
    verify_command,
)
from oomcast.model.signing import derive_key

MASTER = "master-of-the-cluster"
NOW = 1_700_000_000.0


def test_node_key_is_stable_distinct_and_not_the_master() -> None:
    a = node_key(MASTER, "node-a")
    assert a == node_key(MASTER, "node-a")
    assert len(a) == 64 and set(a) <= set("0123456789abcdef")
    assert a != node_key(MASTER, "node-b") and a != node_key("another-master", "node-a")
    assert MASTER not in a
    assert node_keys(MASTER)("node-a") == a and node_keys(MASTER)("") is None
    # pinned: agents and services of different versions must derive the same keys
    assert node_key("m", "n") == derive_key("m", b"oomcast-node-key-v1\nn")


def test_node_key_refuses_empty_inputs() -> None:
    with pytest.raises(ValueError):
        node_key("", "node-a")
    with pytest.raises(ValueError):
        node_key(MASTER, "")
    with pytest.raises(ValueError):
        node_keys("")
    with pytest.raises(ValueError):
        derive_key(MASTER, b"")


def test_a_stolen_node_key_acts_on_its_own_node_only() -> None:
    stolen = node_key(MASTER, "node-a")
    # node-b's agent holds node-b's key: a command for it signed with node-a's key is forged
    cmd = new_command(node="node-b", action="shed", device="gpu0", now=NOW)
    with pytest.raises(CommandRejected) as err:
        verify_command(
            sign_command(cmd, stolen),
            node_key(MASTER, "node-b"),
            now=NOW,
            node="node-b",
            nonces=NonceCache(),
        )
    assert err.value.reason == "bad_signature"
    # with node-b's key it verifies
    got = verify_command(
        sign_command(cmd, node_key(MASTER, "node-b")),
        node_key(MASTER, "node-b"),
        now=NOW,
        node="node-b",
        nonces=NonceCache(),
    )
    assert got.node == "node-b"
