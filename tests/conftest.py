"""Session-wide test settings.

The CPU tests run tiny tensors: one intra-op thread is faster than two (and far faster than two that
fight other jobs on a shared 2-core machine). Set before any test module imports torch; subprocesses
the tests start (CLI, server) inherit it. A value the caller sets wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 - after the thread setting above


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's `--dist loadgroup` (the README's test command) each file is one group: its tests run
    in one worker, in order, as in a serial run (a module's fixtures are shared, e.g. a server whose counters a
    later test reads); a file marked with a group of its own (the Ray files: "ray") joins that group instead."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _structlog_left_as_found():
    """structlog.testing.capture_logs (and a restored configuration) leave structlog marked as configured, after
    which ourobatch's logger (ourobatch/log.py) sends events to structlog instead of the standard library's logger,
    where caplog reads them: a later test in the same worker would see none. Undone after each test that did it."""
    import structlog

    was = structlog.is_configured()
    yield
    if not was and structlog.is_configured():
        structlog.reset_defaults()
