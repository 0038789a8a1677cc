"""The ``oomcast`` command: the parser and ``main``. Each subcommand lives in a module of
its own and imports what it needs when it runs, so the collector image (no fastapi) and the
service image (no torch) both run this entry point:

- ``serve``: ``serve``, ``demo``, ``bench``
- ``collect``: ``collect`` (the node agent), ``control-key`` (a node's key)
- ``training``: ``dump``, ``simulate``, ``evaluate``, ``train``, ``export``, ``card``
- ``preflight``: ``preflight`` (will a job fit a GPU; imports torch only when it runs)
- ``check``: ``check`` (settings, rules, model and Redis, before a deploy)
- ``explain``: ``explain`` (a diagnosis bundle or a PyTorch memory snapshot)
- ``top``, ``report``: a running service's fleet, and its scorecard (over its REST API)

No module here imports the service, the training code, preflight or the harnesses at import
time: each command imports what it runs, so the collector's image (no ``service/``) runs
``collect`` and ``control-key``.

Flag defaults that come from ``OOMCAST_*`` variables are read once, here, through
``service/settings.py`` (``CommandEnv``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from oomcast.cli import check as cli_check
from oomcast.cli import collect as cli_collect
from oomcast.cli import explain as cli_explain
from oomcast.cli import preflight as cli_preflight
from oomcast.cli import report as cli_report
from oomcast.cli import serve as cli_service
from oomcast.cli import top as cli_top
from oomcast.cli import training as cli_training
from oomcast.cli.common import PROG, UsageError, missing_extra, package_version
from oomcast.cli.env import CommandEnv

__all__ = ["UsageError", "build_parser", "main"]


def _command_env() -> CommandEnv:
    try:
        return CommandEnv()
    except ValidationError as exc:
        problems = [
            f"OOMCAST_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        ]
        raise UsageError("; ".join(problems)) from None


def build_parser(env: CommandEnv | None = None) -> argparse.ArgumentParser:
    env = env if env is not None else _command_env()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Forecast GPU and container OOMs before they happen, and act on them."
        " Each command has its own --help.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    p.add_argument(
        "--log-level",
        default=env.log_level,
        choices=["debug", "info", "warning", "error"],
        help=f"how much the command logs (default: {env.log_level}; OOMCAST_LOG_LEVEL sets it)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    cli_service.add_parsers(sub, env)
    cli_collect.add_parser(sub, env)
    cli_collect.add_control_key_parser(sub, env)
    cli_training.add_parsers(sub)
    cli_preflight.add_parser(sub)
    cli_service.add_bench_parser(sub)
    cli_check.add_parser(sub)
    cli_explain.add_parser(sub)
    cli_top.add_parser(sub, env)
    cli_report.add_parser(sub, env)
    _explain_every_command(sub)
    return p


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS, [], "")
            and "%(default)" not in text
            and "default" not in text.lower()
        ):
            text += " (default: %(default)s)"
        return text


def _explain_every_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Every command's --help has a description (its one-line help when none was written)
    and shows its options' defaults."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        parser.formatter_class = _DefaultsFormatter
        if parser.description is None:
            text = helps.get(name) or name
            parser.description = text[0].upper() + text[1:] + "."
        for child in parser._actions:
            if isinstance(child, argparse._SubParsersAction):
                _explain_every_command(child)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        env = _command_env()
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser(env).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    func: Callable[[argparse.Namespace], int] = args.func
    from oomcast.model.trace import TraceError

    try:
        return func(args)
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc.name or "", args.command)
        if extra is None:
            raise
        print(
            f"{PROG} {args.command}: error: this command needs {exc.name}, which is not"
            f" installed: pip install 'oomcast[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (TraceError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
