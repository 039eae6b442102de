"""`python -m aiflame` runs the CLI."""

import sys

from aiflame.agent.cli import main

sys.exit(main())
