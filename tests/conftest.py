"""Session-wide test settings.

The CPU tests run tiny tensors: one intra-op thread is faster than two (and far faster than two that
fight other jobs on a shared 2-core machine). Set before any test module imports torch; subprocesses
the tests start (CLI, server) inherit it. A value the caller sets wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
