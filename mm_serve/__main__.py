"""``python -m mm_serve``: the same command line as the ``mm-serve`` console script."""

from __future__ import annotations

import sys

from mm_serve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
