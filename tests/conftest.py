import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: trains verl's real worker in subprocesses (tests/e2e; deselect with -m 'not e2e')"
    )
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s two workers on two cores: one thread each
        import torch

        torch.set_num_threads(1)


import pytest  # noqa: E402


def pytest_sessionfinish(session):
    """On an xdist worker (`make test` runs the unit tests on two): hand the CPU branches its vLLM-CPU tests ran on
    to the controller (`workeroutput`)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["dppo_cpu_branches"] = list(getattr(session.config, "_dppo_cpu_branches", []))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to a pytest without pytest-xdist
def pytest_testnodedown(node, error):
    """On the xdist controller: what each worker's vLLM-CPU tests ran on, for the summary line below."""
    branches = getattr(node, "workeroutput", {}).get("dppo_cpu_branches", [])
    node.config._dppo_cpu_branches = getattr(node.config, "_dppo_cpu_branches", []) + list(branches)


@pytest.fixture(autouse=True, scope="module")
def _environment_per_test_file():
    """Each test file leaves the process's environment and torch's thread count as it found them. `make test` gives
    the unit tests' files to two workers in an order that varies from run to run (pytest-xdist), so what one file
    sets in `os.environ` (a platform, a log path, vLLM's settings) must not reach the next one on its worker."""
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
    torch.set_num_threads(threads)  # several files take one thread for their tiny models


@pytest.fixture(scope="session")
def real_model_checkpoint(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint, built once per session from the set-up's package
    (`verl_dppo.rehearsal.setups.real_model`); the tests that use it skip where the package is absent."""
    from verl_dppo.rehearsal.setups import real_model

    problems = real_model.real_model_problems()
    if problems:
        pytest.skip(problems[0])
    path, _ = real_model.build_real_model(tmp_path_factory.mktemp("real_model") / real_model.NAME)
    return path


def pytest_terminal_summary(terminalreporter, config):
    """One line for the CPU branch this machine's libraries take (and the forced ones the vLLM-CPU tests ran on):
    the kernels differ by CPU (verl_dppo/rehearsal/isa.py), so a result says which it holds for."""
    try:
        from verl_dppo.rehearsal.isa import describe
    except Exception:  # noqa: BLE001  (the suite's summary must not fail on it)
        return
    terminalreporter.write_line(describe())
    for line in dict.fromkeys(getattr(config, "_dppo_cpu_branches", [])):
        terminalreporter.write_line(f"  tests/test_vllm_cpu_moe.py ran on: {line}")
