"""``python -m bench.routing``: item 16 alone (the package's docstring says what it runs)."""

import sys

from bench.routing import main

sys.exit(main())
