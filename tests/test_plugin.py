"""Loading: `import verl` alone registers the modes (when verl imports its registry) and installs the hook (when verl
imports its losses module), in a fresh process and in a Ray worker; load failures are loud; `verl-dppo doctor`
reports and exits accordingly."""

import os
import subprocess
import sys

import pytest

MODES = ("dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is", "ipo", "dppo_topk_tv", "dppo_topk_kl", "troll")
BIN = os.path.dirname(sys.executable)


def python(code: str, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_verl_alone_registers_modes_and_installs_hook():
    result = python(
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "import verl.workers.utils.losses as losses\n"
        f"assert all(m in POLICY_LOSS_REGISTRY for m in {MODES!r}), list(POLICY_LOSS_REGISTRY)\n"
        "assert getattr(losses.ppo_loss, '__verl_dppo_wrapped__', False)\n"
        "print('loaded-by', sorted(m for m in sys.modules if m.startswith('verl_dppo')))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "verl_dppo.plugin.entry" in result.stdout


def test_processes_that_never_train_do_not_import_verls_trainer_modules():
    """The modes are registered when verl imports its registry, not at `import verl`: a process that only routes
    rollouts (verl's load balancer) imports no trainer module; the registry, once imported, holds every mode; and a
    process that imports the plugin's losses module first (it imports verl itself) ends with them registered too."""
    result = python(
        "import sys, verl.workers.rollout.router\n"
        "assert 'verl.trainer.ppo.core_algos' not in sys.modules\n"
        "assert 'verl.workers.utils.losses' not in sys.modules\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        f"assert all(m in POLICY_LOSS_REGISTRY for m in {MODES!r}), list(POLICY_LOSS_REGISTRY)\n"
    )
    assert result.returncode == 0, result.stderr
    result = python(
        "import verl_dppo.plugin.losses\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        f"assert all(getattr(POLICY_LOSS_REGISTRY.get(m), '__verl_dppo__', False) for m in {MODES!r})\n"
    )
    assert result.returncode == 0 and "failed" not in result.stderr, result.stderr


def test_by_name_importers_of_ppo_loss_get_the_wrapper():
    # engine_workers builds partial(ppo_loss, ...) from its own by-name import; distillation wraps ppo_loss too.
    result = python(
        "import verl\n"
        "import verl.workers.engine_workers as ew, verl.trainer.distillation.losses as dl\n"
        "import verl.workers.utils.losses as losses\n"
        "assert ew.ppo_loss is losses.ppo_loss is dl.ppo_loss\n"
        "assert getattr(ew.ppo_loss, '__verl_dppo_wrapped__', False)\n"
    )
    assert result.returncode == 0, result.stderr


def test_plugins_disabled_means_not_registered():
    result = python(
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "assert 'dppo_binary_tv' not in POLICY_LOSS_REGISTRY\n",
        {"VERL_USE_EXTERNAL_PLUGINS": "none"},
    )
    assert result.returncode == 0, result.stderr


def test_untested_verl_version_is_refused_loudly():
    # Pretend verl 0.8.0 is installed: the plugin must refuse, at ERROR, naming the supported range.
    patch = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda name: '0.8.0' if name == 'verl' else real(name)\n"
    )
    result = python(
        patch + "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "assert 'dppo_binary_tv' not in POLICY_LOSS_REGISTRY\n"
    )
    assert result.returncode == 0, result.stderr
    assert "ERROR" in result.stderr and "verl-dppo failed to load" in result.stderr
    assert "verl==0.9.1" in result.stderr and "found verl 0.8.0" in result.stderr

    allowed = python(
        patch + "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "assert 'dppo_binary_tv' in POLICY_LOSS_REGISTRY\n",
        {"VERL_DPPO_ALLOW_UNTESTED_VERL": "1"},
    )
    assert allowed.returncode == 0, allowed.stderr


def test_values_in_effect_are_logged_once_per_process():
    result = python(
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch\nfrom helpers import actor_config\n"
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
        "config = actor_config('dppo_binary_tv')\n"
        "for _ in range(3):\n"
        "    get_policy_loss_fn('dppo_binary_tv')(torch.zeros(1, 2) - 1, torch.zeros(1, 2) - 1, torch.ones(1, 2),"
        " torch.ones(1, 2, dtype=torch.bool), 'token-mean', config)\n"
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "dppo_binary_tv in effect" in line]
    assert len(lines) == 1
    assert "delta_low=0.2 delta_high=0.2 ratio_cap=3" in lines[0] and "from verl's clip_ratio_low=0.2" in lines[0]


@pytest.mark.parametrize(
    "loss_mode, topk",
    [("dppo_binary_tv", None), ("grpo_clip", None), ("pg_is", None), ("dppo_topk_tv", 20), ("dppo_topk_kl", 7)],
)
def test_the_in_effect_line_shows_k_only_for_a_mode_that_reads_it(loss_mode, topk):
    """Issue 43.4: the recipes set `topk: 20` for every mode, and a binary mode's "in effect" line printed topk=20
    (which it never reads); a Top-K mode's shows its K, the default resolved."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import actor_config

    from verl_dppo.plugin.losses import LOSS_MODES

    (mode,) = [mode for mode in LOSS_MODES if mode.name == loss_mode]
    _, _, described = mode.family.options(mode, actor_config(loss_mode, topk=20 if topk is None else topk))
    assert ("topk=" in described) == (topk is not None), described
    assert topk is None or f"topk={topk}" in described.split(), described
    if topk == 20:  # unset: the mode's default
        _, _, described = mode.family.options(mode, actor_config(loss_mode))
        assert "topk=20" in described.split(), described


@pytest.mark.parametrize("root", ["verl's", "vLLM server's", "unconfigured"])
def test_a_warning_reaches_stderr_once_whatever_the_root_logger_is(root):
    """verl's vLLM server process imports vLLM's OpenAI server, whose dependency model_hosting_container_standards
    sets the root logger and its handler to ERROR: the plugin's warnings there (a weight push cutting a request) were
    dropped. They print once under each root set-up: verl's (WARNING, what verl's workers have), the vLLM server's
    (ERROR; with vLLM's CPU build installed, the real import), and none at all."""
    set_up = {
        "verl's": "import verl\n",
        "vLLM server's": (
            "import verl, importlib.util, logging\n"
            "if importlib.util.find_spec('model_hosting_container_standards'):\n"
            "    import model_hosting_container_standards.logging_config\n"
            "else:  # what its configure_root_logger does\n"
            "    logging.getLogger().setLevel(logging.ERROR)\n"
            "    [h.setLevel(logging.ERROR) for h in logging.getLogger().handlers]\n"
            "assert logging.getLogger().getEffectiveLevel() == logging.ERROR\n"
        ),
        "unconfigured": "import logging\nassert not logging.getLogger().handlers\n",
    }[root]
    result = python(
        set_up + "from verl_dppo.plugin.log_once import warn_once\n"
        "warn_once('k', 'verl-dppo: a warning %d', 1)\nwarn_once('k', 'verl-dppo: a warning %d', 2)\n"
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "verl-dppo: a warning" in line]
    assert len(lines) == 1 and lines[0].endswith("verl-dppo: a warning 1"), result.stderr


def test_doctor_in_process_and_in_a_ray_worker():
    # --plugin-only: this CPU suite has no vLLM / SGLang, whose absence is otherwise a problem (exit 1).
    result = subprocess.run(
        [os.path.join(BIN, "verl-dppo"), "doctor", "--plugin-only"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    listed = ", ".join(sorted(MODES))
    assert f"ray worker: modes {listed}; anchoring hook installed" in result.stdout
    assert f"this process: modes {listed}; anchoring hook installed" in result.stdout


def test_doctor_exits_non_zero_when_the_plugin_does_not_load():
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")
    result = subprocess.run(
        [os.path.join(BIN, "verl-dppo"), "doctor", "--no-ray"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 1
    assert "loss modes not registered: dppo_binary_tv" in result.stdout
    assert "anchoring hook around verl's ppo_loss is not installed" in result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"]])
def test_cli_help(argv):
    result = subprocess.run([os.path.join(BIN, "verl-dppo"), *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: verl-dppo" in result.stdout


def test_each_loss_family_is_one_module_and_the_shared_loss_never_asks_which():
    """Issue 26: the registered modes are the `FAMILY.modes` of the `verl_dppo/plugin/*_mode.py` modules, each mode
    served by its family's object; the function verl calls for every mode names none of them."""
    import importlib
    import inspect
    from pathlib import Path

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import verl_dppo.plugin
    from verl_dppo.plugin import losses

    files = sorted(Path(verl_dppo.plugin.__file__).parent.glob("*_mode.py"))
    assert {f.stem for f in files} == {"binary_mode", "ipo_mode", "topk_mode", "troll_mode"}
    families = [importlib.import_module(f"verl_dppo.plugin.{f.stem}").FAMILY for f in files]
    assert [m.name for m in losses.LOSS_MODES] == [m.name for f in families for m in f.modes]
    assert all(m.family is f for f in families for m in f.modes)
    assert {m.name for m in losses.LOSS_MODES} <= set(POLICY_LOSS_REGISTRY)
    source = inspect.getsource(losses.dppo_policy_loss)
    for word in ("topk", "troll", "binary", "grpo", "pg_is", "ipo", "mode.name =="):
        assert word not in source, word
    assert len(source.splitlines()) <= 80  # ruff-formatted (one argument a line where a call does not fit)
