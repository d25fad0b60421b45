"""``python -m ourobatch.cli``, the same as ``python -m ourobatch``."""

import sys

from ourobatch.cli import main

sys.exit(main())
