"""``python -m oomcast.cli``: the ``oomcast`` command."""

import sys

from oomcast.cli.main import main

sys.exit(main())
