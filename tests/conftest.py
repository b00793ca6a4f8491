import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: trains verl's real worker in subprocesses (tests/e2e; deselect with -m 'not e2e')"
    )
