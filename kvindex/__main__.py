"""``python -m kvindex``: the ``kvindex`` command."""

import sys

from kvindex.cli import main

sys.exit(main())
