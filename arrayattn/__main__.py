"""``python -m arrayattn``: the command line (:mod:`arrayattn.cli`)."""
import sys

from .cli import main

sys.exit(main())
