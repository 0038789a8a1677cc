"""The ``oomcast`` console script and ``python -m oomcast.cli``: ``cli.main.main``, or, where
the package was installed without the extra a command needs (the base install is the
in-job hook's: numpy, redis and orjson only), one line that names the extra to install
instead of a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from oomcast.cli.main import main as run
    except ModuleNotFoundError as exc:
        from oomcast.cli.common import PROG, missing_extra

        if missing_extra(exc.name or "") is None:
            raise
        print(
            f"{PROG}: error: the command needs {exc.name}, which the base install leaves out"
            " (it is the in-job hook's). Install it with an extra: pip install"
            " 'oomcast[collector]' (the node agent), 'oomcast[service]' (the service),"
            " 'oomcast[preflight]' (checking a job before launch), 'oomcast[train]' (training,"
            " scoring and refitting models) or 'oomcast[demo]' (the service, the agent and the"
            " demo)",
            file=sys.stderr,
        )
        return 2
    return run()
