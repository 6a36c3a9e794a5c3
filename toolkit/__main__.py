"""`python -m toolkit ...` runs the `toolkit` command (toolkit/commands/cli.py) where its console script is not on
PATH, as `python -m toolkit.cli` did before the commands moved into toolkit/commands/."""

import sys

from toolkit.commands.cli import main

sys.exit(main())
