"""The JSON schema of POST /v1/samples says what the service accepts: a client validating
against it (with an ECMA-262 regex engine, as JSON Schema prescribes) and the service agree
on every name, down to which characters count as whitespace."""

from __future__ import annotations

import re

from oomcast.model.schema import SchemaError, parse_sample
from oomcast.service.api.samples_in import _NAME_PATTERN

# ECMA-262's \s: WhiteSpace and LineTerminator. Python's \s and str.isspace() differ from
# it (U+001C-U+001F and U+0085 are whitespace to Python only, U+FEFF to ECMA only).
ECMA_SPACE = "\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
ECMA_NAME = re.compile(_NAME_PATTERN.replace(r"\s", ECMA_SPACE))


def service_takes(name: str) -> bool:
    sample = {"ts": 1.0, "node": name, "device": "gpu0", "kind": "gpu"}
    sample |= {"total_bytes": 10, "used_bytes": 1}
    try:
        parse_sample(sample)
    except SchemaError:
        return False
    return True


def test_a_name_the_schema_allows_is_one_the_service_takes() -> None:
    chars = [chr(c) for c in range(0x3001)] + ["\ufeff"]
    for name in [*chars, *(c + " " for c in chars), *(" " + c for c in chars)]:
        if ECMA_NAME.fullmatch(name):
            assert service_takes(name), f"the schema allows {name!r}; the service refuses it"


def test_the_schema_still_refuses_control_characters_and_blank_names() -> None:
    for name in ["", " ", "\t", "a\nb", "a\x00", "\x7f", "\x85", "\u3000"]:
        assert not ECMA_NAME.fullmatch(name), name
        assert not service_takes(name), name
