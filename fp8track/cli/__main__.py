"""``python -m fp8track.cli``: the ``fp8track`` command."""

import sys

from fp8track.cli import main

sys.exit(main())
