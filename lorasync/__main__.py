"""``python -m lorasync`` runs the command line."""

import sys

from lorasync.cli import main

sys.exit(main())
