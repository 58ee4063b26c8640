"""``python -m qjax.cli``: the ``qjax`` command."""

import sys

from qjax.cli import main

sys.exit(main())
