"""``python -m oomcast.cli``: the ``oomcast`` command."""

import sys

from oomcast.cli.entry import main

sys.exit(main())
