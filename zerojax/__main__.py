"""``python -m zerojax``: the ``zerojax`` command without an installed script."""

import sys

from zerojax.tools.cli import main

sys.exit(main())
