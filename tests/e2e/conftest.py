"""The launches of the e2e tiers that train through `main_ppo` on local Ray clusters (the full loop, the cluster shapes,
Megatron, vLLM; the real model and the killed launcher on a Ray instance of their own) go in one pool of lanes (issue
53.7): two Ray clusters for all of them instead of two per tier, each model built once, and no lane idle at the end of
each tier while the other finishes its last run (on a slow 2-core machine the four tiers' tails had cost about four
minutes). Each tier's module gives its chains (`lane_chains(root)`, only where it can run: `LANES_AVAILABLE`) and reads
its runs from `launches` by name; the pool holds the tiers that have a test in this pytest session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory) -> Launches:
    import test_full_loop as loop

    tiers = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "lane_chains") and module not in tiers:
            tiers.append(module)
    root = tmp_path_factory.mktemp("lanes")
    tiers = [module for module in tiers if getattr(module, "LANES_AVAILABLE", True)]
    done = Launches(
        loop.run_pool(root, [chain for module in tiers for chain in module.lane_chains(root)], prepare=warm_model)
    )
    done.tiers = {module.__name__ for module in tiers}
    request.config._dppo_pool = done
    return done


def pytest_terminal_summary(terminalreporter, config):
    """The pool's launches, longest first, with their seconds and exit codes (pytest's durations show the pool as one
    fixture's set-up): where the e2e phase's time went, in the CI's log."""
    done = getattr(config, "_dppo_pool", None)
    if not done:
        return
    runs = sorted(done.values(), key=lambda run: -run.seconds)
    launches = f"{len(runs)} launch" + ("es" if len(runs) != 1 else "")
    terminalreporter.write_line(
        f"e2e pool: {launches}, {sum(run.seconds for run in runs):,.0f} s in all (lanes side by side):"
    )
    listed = [f"{run.name} {run.seconds:.0f} s" + (f" (rc {run.rc})" if run.rc else "") for run in runs]
    terminalreporter.write_line("  " + ", ".join(listed))


class Launches(dict):
    """The pool's runs by name; `tiers`: the names of the modules whose chains it ran."""

    tiers: set

    def __missing__(self, name: str):
        """A run left out by DPPO_FULL_LOOP_ONLY (a developer's subset of the pool): its tests skip. Any other missing
        run is a failure (the pool stopped, or a test names a run no tier launches)."""
        from test_full_loop import only_runs

        only = only_runs()
        if only is not None and name not in only:
            pytest.skip(f"{name} is not in DPPO_FULL_LOOP_ONLY")
        raise KeyError(name)


def warm_model() -> None:
    """cpu_tiny's warm-started model and data, built before the lanes start: several launches through the CLI read it,
    and side by side each would build it (about 40 s of a core on a slow machine)."""
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.rehearsal.setups.cpu_tiny import build_assets

    build_assets(compose_recipe("cpu_tiny", "dppo_binary_tv"))
