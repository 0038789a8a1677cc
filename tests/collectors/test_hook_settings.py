"""collectors/hook_settings.py: the hook's environment, read once, under its arguments."""

from __future__ import annotations

import pytest

from oomcast.collectors.hook_settings import HookSettings, redact_url
from oomcast.model.wire import DEFAULT_REDIS_URL, Keys

ENV = {
    "OOMCAST_JOB": "env-job",
    "OOMCAST_NODE": "env-node",
    "OOMCAST_REDIS_URL": "redis://env:6379/2",
    "OOMCAST_KEY_PREFIX": "envp",
    "OOMCAST_PARTITIONS": "7",
}


def test_the_environment_fills_what_the_arguments_leave_unset() -> None:
    st = HookSettings.from_env(ENV)
    assert (st.job, st.node, st.redis_url) == ("env-job", "env-node", "redis://env:6379/2")
    assert st.keys == Keys("envp", 7)
    assert st.enabled and st.mode == "auto"


def test_arguments_win_over_the_environment() -> None:
    st = HookSettings.from_env(
        {**ENV, "OOMCAST_PARTITIONS": "not a number"},  # overridden, so never parsed
        job="j",
        node="n",
        redis_url="redis://arg:1/0",
        key_prefix="argp",
        partitions=2,
    )
    assert (st.job, st.node, st.redis_url, st.keys) == (
        "j",
        "n",
        "redis://arg:1/0",
        Keys("argp", 2),
    )


def test_defaults_without_environment() -> None:
    st = HookSettings.from_env({})
    assert st.job is None and st.node and st.redis_url == DEFAULT_REDIS_URL
    assert st.keys == Keys()
    with pytest.raises(ValueError, match="OOMCAST_PARTITIONS"):
        HookSettings.from_env({"OOMCAST_PARTITIONS": "x"})


@pytest.mark.parametrize(
    ("value", "mode", "want_mode", "enabled"),
    [
        ("off", "auto", "auto", False),
        ("off", "host", "host", False),
        ("host", "auto", "host", True),
        ("cuda", "host", "host", True),  # the variable only chooses for auto
        ("bogus", "auto", "auto", True),  # logged, ignored
    ],
)
def test_oomcast_hook(value: str, mode: str, want_mode: str, enabled: bool) -> None:
    st = HookSettings.from_env({"OOMCAST_HOOK": value}, mode=mode)
    assert (st.mode, st.enabled) == (want_mode, enabled)
    assert st.off_by == (None if enabled else "OOMCAST_HOOK")
    assert HookSettings.from_env({}, enabled=False).off_by == "enabled=False"


def test_bad_values_are_refused_and_settings_are_frozen() -> None:
    for kwargs in ({"mode": "gpu"}, {"queue_size": 0}, {"min_interval_s": -1.0}):
        with pytest.raises(ValueError):
            HookSettings.from_env({}, **kwargs)  # type: ignore[arg-type]
    st = HookSettings.from_env({})
    with pytest.raises(AttributeError):
        st.node = "other"  # type: ignore[misc]


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert redact_url("redis://h/0") == "redis://h/0"
