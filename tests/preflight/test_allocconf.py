from __future__ import annotations

import pytest

from oomcast.preflight.allocconf import AllocConf, AllocConfError, parse_alloc_conf


def test_torch_style_settings_parse() -> None:
    conf = parse_alloc_conf(
        "expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6"
    )
    assert conf == AllocConf(
        expandable_segments=True, max_split_size_mb=128, garbage_collection_threshold=0.6
    )
    assert conf.ignored() == ["garbage_collection_threshold"]
    assert parse_alloc_conf(conf.to_string()) == conf
    assert parse_alloc_conf(None) == parse_alloc_conf("") == AllocConf()


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("expandable_segment:True", "unknown alloc conf key 'expandable_segment'"),
        ("expandable_segments:yes", "expandable_segments must be True or False, not 'yes'"),
        ("max_split_size_mb:10", "max_split_size_mb must be at least 20"),
        ("max_split_size_mb:big", "max_split_size_mb must be a whole number of MiB, not 'big'"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold must be in"),
        ("expandable_segments", "is not key:value"),
        ("backend:cudaMallocAsync", "backend 'cudaMallocAsync' is not modelled"),
    ],
)
def test_a_bad_setting_is_named(text: str, names: str) -> None:
    with pytest.raises(AllocConfError) as info:
        parse_alloc_conf(text)
    assert names in str(info.value)
