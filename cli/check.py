"""``oomcast check``: everything the service would refuse or trip over at start-up, found
before a deploy. Each check prints one line (``ok`` or ``FAIL`` and a sentence); the command
exits 1 when any failed, so it can gate a CI job or an init container."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomcast.cli.common import UsageError


@dataclass
class Verdict:
    name: str
    ok: bool
    says: str
    warn: bool = False  # ok, but the service would run degraded (it warns at start-up too)


def _settings(config: str | None) -> tuple[Any, Verdict]:
    from pydantic import ValidationError

    from oomcast.cli.serve import settings_problems
    from oomcast.service.settings import Settings

    where = f"{config} and the environment" if config else "the environment"
    try:
        settings = Settings(_env_file=config) if config else Settings()  # type: ignore[call-arg]
    except ValidationError as exc:
        return None, Verdict("settings", False, f"{where}: {settings_problems(exc)}")
    return settings, Verdict("settings", True, f"the OOMCAST_* settings of {where} are valid")


def _rules(path: str, source: str) -> tuple[Any, Verdict]:
    from oomcast.service.pipeline.rulefile import RulesError, check_rules_file

    try:
        spec = check_rules_file(path, source)
    except RulesError as exc:
        return None, Verdict("rules", False, str(exc))
    names = ", ".join(r.name for r in spec.rules)
    return spec, Verdict("rules", True, f"{path}: {len(spec.rules)} rules ({names})")


def _actions(settings: Any, spec: Any) -> Verdict:
    """The rules' actions that nothing is configured to carry out: ``serve`` starts and
    records them without acting (and warns); a deploy usually wants to know first."""
    from oomcast.service.pipeline.actions import MISSING_SETTING

    have = {
        "webhook": settings.webhook_url is not None,
        "alertmanager": settings.alertmanager_url is not None,
        "checkpoint": settings.control_secret is not None,
        "shed": settings.control_secret is not None,
    }
    missing = sorted({a for r in spec.rules for a in r.actions if not have[a]})
    if not missing:
        return Verdict("actions", True, "every action the rules name is configured")
    said = "; ".join(f"{a} needs {MISSING_SETTING[a]}" for a in missing)
    return Verdict(
        "actions",
        True,
        f"recorded, not carried out: {said} (serve starts and warns the same)",
        warn=True,
    )


def _model(settings: Any) -> Verdict:
    if settings.forecaster != "model":
        return Verdict("model", True, f"OOMCAST_FORECASTER={settings.forecaster}: no model needed")
    try:
        from oomcast.model.runtime import DEFAULT_MODEL, ModelLoadError, OnnxForecaster
    except ImportError as exc:
        return Verdict("model", False, f"cannot import the runtime ({exc})")
    path = settings.model_path or str(DEFAULT_MODEL)
    try:
        fc = OnnxForecaster(path)
    except ModelLoadError as exc:
        return Verdict("model", False, str(exc))
    return Verdict("model", True, f"{path}: model {fc.version} loads ({fc.provider})")


def _redis(settings: Any) -> Verdict:
    import redis

    from oomcast.model.wire import redact_url

    url = redact_url(settings.redis_url)
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    key = f"{settings.key_prefix}:check"
    try:
        client.ping()
        client.set(key, "1", ex=10)  # the service writes: a read-only replica is not enough
        client.delete(key)
    except redis.RedisError as exc:
        return Verdict("redis", False, f"{url}: {exc}")
    finally:
        client.close()
    return Verdict("redis", True, f"{url} answers and takes writes")


def run_checks(config: str | None, rules: str | None, redis_check: bool) -> list[Verdict]:
    settings, first = _settings(config)
    out = [first]
    spec = None
    if rules is not None:
        spec, verdict = _rules(rules, "--rules")
        out.append(verdict)
    if settings is None:
        return out
    if rules is None:
        spec, verdict = _rules(settings.rules_path(), "OOMCAST_RULES")
        out.append(verdict)
    if spec is not None:
        out.append(_actions(settings, spec))
    checks: list[Callable[[Any], Verdict]] = [_model]
    if redis_check:
        checks.append(_redis)
    out += [check(settings) for check in checks]
    return out


def cmd_check(args: argparse.Namespace) -> int:
    if args.config and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
    verdicts = run_checks(args.config, args.rules, not args.no_redis)
    if args.json:
        print(
            json.dumps({"ok": all(v.ok for v in verdicts), "checks": [vars(v) for v in verdicts]})
        )
    else:
        for v in verdicts:
            print(f"{('WARN' if v.warn else 'ok  ') if v.ok else 'FAIL'} {v.name:9} {v.says}")
    return 0 if all(v.ok for v in verdicts) else 1


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "check",
        help="validate settings, rules, the model and Redis before a deploy",
        description="Check what `oomcast serve` would refuse or trip over: the OOMCAST_*"
        " settings (from the environment, or an env file with --config), the rules file, the"
        " model file, and that Redis answers and takes writes. One line per check; exits 1"
        " when any failed.",
    )
    c.add_argument("--rules", help="check this rules file (default: OOMCAST_RULES's)")
    c.add_argument(
        "--config", metavar="FILE", help="an env file of OOMCAST_*=value lines, as a ConfigMap"
    )
    c.add_argument("--no-redis", action="store_true", help="skip the Redis check (offline)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_check)
