"""``python -m kvcompress`` = the ``kvcompress`` command."""

import sys

from .cli import main

sys.exit(main())
