"""``python -m kvformat._cli``: the same as the ``kvformat`` console script."""

import sys

from . import main

sys.exit(main())
