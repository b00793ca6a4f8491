import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: trains verl's real worker in subprocesses (tests/e2e; deselect with -m 'not e2e')"
    )


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def real_model_checkpoint(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint, built once per session from the set-up's package
    (`verl_dppo.cli.real_model`); the tests that use it skip where the package is absent."""
    from verl_dppo.cli import real_model

    problems = real_model.real_model_problems()
    if problems:
        pytest.skip(problems[0])
    path, _ = real_model.build_real_model(tmp_path_factory.mktemp("real_model") / real_model.NAME)
    return path
