"""``python -m kvformat.cli``: the same as the ``kvformat`` console script."""

import sys

from . import main

sys.exit(main())
