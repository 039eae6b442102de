"""`python -m aiflame` runs the CLI."""

import sys

from aiflame.cli.main import main

sys.exit(main())
