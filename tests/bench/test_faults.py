"""``oomcast bench faults``: the scenarios run on real processes and report what they
measured; the ledger counts a loss as a loss."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest
from support import oomcast_cmd

from oomcast.bench.faults import SCENARIOS, parse_only
from oomcast.bench.faults.ledger import Copies, Producer, alert_figures, sample_figures
from oomcast.service.delivery.outbox import delivery_id

A = ("n1", "gpu0", 1.0)
B = ("n1", "gpu0", 2.0)
C = ("n1", "gpu0", 3.0)


def test_a_sample_never_acknowledged_or_missing_from_redis_is_lost() -> None:
    c = Copies()
    c.stored.update([A, B, B])  # B twice: a re-send
    c.acked.update([A, B])
    figures = sample_figures(c, [Producer("agent", "n1", accepted=3)])  # C never got in
    assert figures["samples_processed"] == 2
    assert figures["samples_lost"] == 1
    assert figures["samples_extra_copies"] == 1

    exact = sample_figures(c, [Producer("http", "n1", 2, ids={A, C})])
    assert exact["samples_lost"] == 1  # C, by name, not by subtraction


def test_a_refused_sample_is_dead_lettered_not_processed() -> None:
    c = Copies()
    c.stored.update([A, B])
    c.acked.update([A, B])
    c.refused.update([B])
    c.reasons[B] = {"out_of_order"}
    figures = sample_figures(c, [Producer("agent", "n1", accepted=2)])
    assert (figures["samples_processed"], figures["samples_deadlettered"]) == (1, 1)
    assert figures["samples_deadlettered_by_reason"] == {"out_of_order": 1}
    assert figures["samples_lost"] == 0


def test_alerts_owed_delivered_duplicated_and_lost() -> None:
    def alert(episode: str, sent_at: float) -> dict[str, object]:
        return {
            "status": "firing",
            "episode": episode,
            "sent_at": sent_at,
            "dispatched": {"webhook": "owed"},
        }

    records = [alert("e1", 10.0), alert("e2", 11.0), alert("e3", 12.0)]
    records.append({"record": "delivery", "target": "webhook", "outcome": "delivered"})
    got = Counter({delivery_id(records[0], "webhook"): 2, delivery_id(records[1], "webhook"): 1})
    first_at = {delivery_id(records[0], "webhook"): 10.5, delivery_id(records[1], "webhook"): 14.0}
    figures = alert_figures(records, got, first_at)
    assert figures["alerts_owed"] == 3
    assert figures["alerts_delivered"] == 2
    assert figures["alerts_duplicated"] == 1
    assert figures["alerts_lost"] == 1
    assert figures["deliveries_ended_by_outcome"] == {"delivered": 1}
    assert (figures["alert_delivery_p50_s"], figures["alert_delivery_max_s"]) == (3.0, 3.0)


def test_only_names_scenarios_in_the_bench_order() -> None:
    assert parse_only("oversized_body,forged_command") == ["forged_command", "oversized_body"]
    assert parse_only(None) == list(SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenario nope"):
        parse_only("forged_command,nope")


@pytest.mark.slow
def test_cli_bench_faults_json_forged_command_and_oversized_body() -> None:
    done = subprocess.run(
        oomcast_cmd("bench", "faults", "--only", "forged_command,oversized_body", "--json"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert set(result["scenarios"]) == {"forged_command", "oversized_body"}
    for name, figures in result["scenarios"].items():
        for key in (
            "samples_accepted",
            "samples_lost",
            "alerts_owed",
            "alerts_delivered",
            "alerts_duplicated",
            "actions_wrongly_taken",
            "recovery_s",
            "ok",
            "problems",
        ):
            assert key in figures, (name, key)
        assert figures["actions_wrongly_taken"] == 0, (name, figures["problems"])
        assert figures["samples_accepted"] > 0, name
    forged = result["scenarios"]["forged_command"]
    assert forged["commands_refused_by_reason"] == {
        "bad_signature": 2,
        "unsigned": 1,
        "unconfirmed": 1,
    }
    assert forged["control_victim_ended"] is True  # a shed that got through would be seen
    posts = result["scenarios"]["oversized_body"]["posts"]
    assert posts["unauthenticated"]["status"] == 401
    assert posts["authenticated_chunked"]["status"] == 413
    assert done.returncode == (0 if result["ok"] else 1), done.stderr[-3000:]
    assert result["ok"], json.dumps(result, indent=1)[-3000:]


def test_cli_bench_faults_refuses_an_unknown_scenario() -> None:
    done = subprocess.run(
        oomcast_cmd("bench", "faults", "--only", "nope"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown scenario nope" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_bench_faults_attacks_are_refused_and_their_controls_seen() -> None:
    """The attacks of issue 31 against real processes: a snapshot planted while the
    attacker held the lease, oom events naming another node's domain, items staged in the
    outbox, a flood of new domains, and a webhook receiver that drips its answer and then
    sends 1 GiB error bodies beside Alertmanager. Each is refused or bounded, and each
    control shows the bench would have seen the harm."""
    names = "forged_snapshot,forged_oom,forged_outbox,domain_flood,stalled_receiver"
    done = subprocess.run(
        oomcast_cmd("bench", "faults", "--only", names, "--json"),
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    got = result["scenarios"]
    assert result["ok"], json.dumps(result, indent=1)[-3000:]
    snap = got["forged_snapshot"]
    assert snap["snapshots_refused"] == 2 and snap["sheds_sent"] == 0
    assert snap["samples_dropped_as_late_after_forgeries"] == 0
    assert snap["control_sealed_forgery_restored_and_seen"] is True
    assert snap["control_victim_ended"] is True and snap["victims_killed"] == 0
    oom = got["forged_oom"]
    assert oom["forged_ooms_dead_lettered"] == 4 and oom["forged_ooms_counted"] == 0
    assert oom["alert_still_firing_after_forgeries"] is True
    assert oom["control_signed_oom_ended_the_episode"] is True
    outbox = got["forged_outbox"]
    assert outbox["forged_items_refused"] == 4 and outbox["forged_items_signed_and_sent"] == 0
    assert outbox["control_sealed_item_delivered"] is True and outbox["alerts_delivered"] > 0
    flood = got["domain_flood"]
    assert flood["flood"]["most_held_at_a_refusal"] == flood["flood"]["cap"]
    assert flood["flood"]["refused_domain_cap"] >= flood["flood"]["domains_posted"] - 4000
    rss = flood["service_rss_mb"]  # the bench's own bar, read back: memory came back
    assert rss["after_expiry"] - rss["before"] <= 40 and flood["samples_lost"] == 0
    stalled = got["stalled_receiver"]
    assert stalled["control_stall_held_attempts_to_the_deadline"] is True
    assert stalled["webhook"]["drip_attempt_held_s_max"] < 7.0  # the 5 s deadline, whole
    assert stalled["webhook"]["attempts_of_one_delivery_overlapping"] == 0
    assert stalled["webhook"]["huge_error_attempts"] > 0
    am = stalled["alertmanager"]
    assert am["firings_during_faults"] > 0 and am["pushed"] == am["firings_during_faults"]
    assert am["push_lag_s_max"] <= 2.0 and stalled["alerts_lost"] == 0
    assert done.returncode == 0
