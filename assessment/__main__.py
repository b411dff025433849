"""``python -m assessment ...`` is ``lab-grade ...``: the console script without
installing it (:func:`assessment.cli.main`). Nothing imports this module back."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
