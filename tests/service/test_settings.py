from __future__ import annotations

import pytest
from pydantic import ValidationError

from oomcast.service.settings import Settings, parse_partition_set


def test_partition_sets() -> None:
    assert parse_partition_set("0-2,5", 8) == [0, 1, 2, 5]
    assert parse_partition_set(" 3 ", 4) == [3]
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        parse_partition_set("2-4", 4)
    with pytest.raises(ValueError, match="not a number"):
        parse_partition_set("a", 4)
    assert Settings(partitions=4).owned_partitions() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"webhook_url": "http://x/h"}, "OOMCAST_WEBHOOK_SECRET"),
        ({"webhook_url": "ftp://x/h", "webhook_secret": "k"}, r"http\(s\) URL"),
        ({"redis_url": "http://localhost"}, "redis://"),
        ({"alert_horizon_s": 50}, "one of"),
        ({"alert_resolve_risk": 0.6}, "flap"),
        ({"alert_resolve_after_s": -5}, "alert_resolve_after_s"),
        ({"partitions": 2, "partitions_owned": "0-2"}, "OOMCAST_PARTITIONS_OWNED"),
    ],
)
def test_unsafe_settings_are_refused_with_the_variable_named(kw: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Settings(**kw)


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMCAST_PARTITIONS", "8")
    monkeypatch.setenv("OOMCAST_API_TOKEN", "t")
    monkeypatch.setenv("OOMCAST_ALERT_RESOLVE_AFTER_S", "12.5")
    s = Settings()
    assert s.partitions == 8
    assert s.alert_resolve_after_s == 12.5
    assert s.api_token is not None and s.api_token.get_secret_value() == "t"
