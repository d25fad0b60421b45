"""``python -m ourobatch.server --model DIR ...``, the same as ``python -m ourobatch serve``."""

import sys

from ourobatch.server.cli import main

sys.exit(main())
