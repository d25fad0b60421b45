"""``python -m ourobatch generate --model DIR ...``: see ourobatch.cli."""

import sys

from ourobatch.cli import main

sys.exit(main())
