"""What `verl-dppo check` finds in a composed main_ppo config beyond verl's own checks and the plugin's run checks:
settings that cancel or quietly change the plugin's update, and the models its checks cannot read here.

- A distillation run without task rewards (`distillation.enabled=True`, `use_task_rewards=False`): verl 0.9.1's
  actor then trains `distillation_ppo_loss`, which computes the policy loss and multiplies it by zero. A plugin
  loss mode there trains nothing: a problem, not a summary.
- Bypass mode with `rollout_rs`: verl's v1 trainer skips its whole rollout correction in bypass mode, the rejection
  sampling included (the plugin means to drop `rollout_is`: its loss weights by pi/mu itself). A warning.
- The plugin's thresholds set (`delta_*`, `ratio_cap`) under one of verl's own loss modes, which do not read them.
- A path verl opens at launch (the actor's model, the data files) left empty by `key=` (a shell variable the script
  did not set): Hydra and verl's classes take '', the launch fails at the load. A problem.
- The MoE arm (`verl_dppo.plugin.moe.arm`): which arm of the paper's with/without-R3 comparison the command
  launches, named in the summary where the model routes or a router replay is set; R2/R3 on a model whose readable
  config.json names no experts is a problem (on the FSDP engine the plugin's run checks say it).
- `VERL_USE_MODELSCOPE=True` (in this process's environment or the launch line's `VAR=value` words) where the
  `modelscope` package is not installed: verl 0.9.1's `import verl` raises then, before any config is read. "Not
  here" (the cluster may have it); `check` reads the rest of the command with the variable off (`modelscope_off`).
- The critic's model: verl's `validate_config` builds the critic's `HFModelConfig`, which reads the model's
  `config.json` (from the hub for a hub id). `check` downloads nothing (`hub_offline`): a critic model that is
  neither a local folder nor in this machine's Hugging Face cache is "not here", and the critic's own checks are
  skipped, instead of a minute of retries and a problem.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["command_findings", "hub_offline", "modelscope_missing", "modelscope_off", "unreadable_models", "verl_hint"]

_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face hub off for the block (its variables, and huggingface_hub's constant where it is imported
    already); everything as it was after."""
    saved = {name: os.environ.get(name) for name in _OFFLINE}
    constants = sys.modules.get("huggingface_hub.constants")
    saved_constant = getattr(constants, "HF_HUB_OFFLINE", None)
    os.environ.update({name: "1" for name in _OFFLINE})
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if constants is not None:
            constants.HF_HUB_OFFLINE = saved_constant


MODELSCOPE = "VERL_USE_MODELSCOPE"


def _modelscope_on(value: str | None) -> bool:
    return str(value if value is not None else "False").lower() == "true"  # as verl's __init__ reads it


def modelscope_missing(launcher: Sequence[str] = ()) -> str | None:
    """The "not here" line where the launch asks verl for ModelScope's hub (`VERL_USE_MODELSCOPE=True` in this
    process's environment, or among the launch line's `VAR=value` words, which win) and `modelscope` is not
    installed here: verl's `import verl` then raises ImportError, so the launch stops before reading its config."""
    import importlib.util

    value = os.environ.get(MODELSCOPE)
    for word in launcher:
        if word.startswith(f"{MODELSCOPE}="):
            value = word.split("=", 1)[1]
    if not _modelscope_on(value) or importlib.util.find_spec("modelscope") is not None:
        return None
    return (
        f"{MODELSCOPE}={value}: verl then loads models through ModelScope's hub, and the modelscope package is not "
        "installed here (verl's import stops on it: pip install modelscope, or leave the variable out to use "
        "Hugging Face's hub); the rest of the command was read with the variable off"
    )


@contextlib.contextmanager
def modelscope_off() -> Iterator[None]:
    """The block with `VERL_USE_MODELSCOPE` unset where it asks for a modelscope that is not installed, and verl
    imported in it: verl reads the variable at its import, here and in every process started meanwhile (the
    rehearsal's Ray workers), so that `check` reads, and rehearses on cpu_tiny's local model, a command whose only
    trouble here is that; the variable as it was after."""
    value = os.environ.get(MODELSCOPE)
    masked = modelscope_missing() is not None
    if masked:
        del os.environ[MODELSCOPE]
    try:
        if masked and "verl" not in sys.modules:
            import verl  # noqa: F401
        yield
    finally:
        if masked:
            os.environ[MODELSCOPE] = value


def _readable_here(path: str) -> bool:
    """Whether a model's config.json can be read on this machine without a download."""
    local = Path(path).expanduser()
    if local.is_dir():
        return (local / "config.json").is_file()
    if "://" in path or path.startswith(("/", ".", "~")):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(path, "config.json"), str)
    except Exception:  # noqa: BLE001  (not a repository id huggingface_hub accepts)
        return False


def machine_line(config: Any) -> str | None:
    """What a launch from this machine lacks that a cluster has (`check` is run before a cluster job, so this is no
    "not here" finding and changes no exit code): the GPUs asked (`trainer.nnodes` x `n_gpus_per_node`) against
    those visible here, and an actor's hub model not in this machine's Hugging Face cache (the launch downloads it).
    None where a launch from here lacks neither."""
    from verl_dppo.launch.preflight import _visible_gpus

    lacks = []
    trainer = config.trainer
    if str(trainer.get("device", "cuda")) == "cuda":
        nodes, per_node, visible = int(trainer.nnodes), int(trainer.n_gpus_per_node), _visible_gpus()
        if visible < per_node or nodes > 1:
            lacks.append(f"{nodes * per_node} GPU(s) asked ({nodes} node(s) x {per_node}), {visible} visible here")
    model = str(config.actor_rollout_ref.model.get("path", ""))
    if model and not model.startswith(("/", ".", "~")) and not _readable_here(model):
        lacks.append(f"the model {model} is not in this machine's Hugging Face cache (the launch downloads it)")
    if not lacks:
        return None
    return f"launched from this machine: {'; '.join(lacks)}; launch it on the cluster, or rehearse it here (--rehearse)"


def unreadable_models(config: Any) -> tuple[list[str], bool]:
    """("not here" lines for the models verl's checks would read and cannot here, whether to skip the critic's
    checks). The actor's model is read only at launch (its local folder: `check`'s file checks)."""
    import warnings

    from verl.trainer.ppo.utils import need_critic

    with warnings.catch_warnings():  # verl's "Disabled critic" note: verl prints it again at launch
        warnings.simplefilter("ignore")
        critic = need_critic(config)
    if not critic:
        return [], False
    path = str(config.critic.model.path)
    if _readable_here(path):
        return [], False
    return [
        f"critic.model.path: {path} is neither a local folder with a config.json nor in this machine's Hugging "
        "Face cache (check downloads nothing); verl's critic checks read it, so they were not run here"
    ], True


def _registered(mode: str) -> bool:
    """Whether verl's policy-loss registry holds `mode` (an unregistered one is no "verl's own" mode)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return mode in POLICY_LOSS_REGISTRY


@contextlib.contextmanager
def others_output() -> Iterator[list[str]]:
    """Other libraries' output while `check` reads a command (VeOmni's attention notice, transformers' and vLLM's
    import warnings: Python's and C's, on file descriptors 1 and 2) kept out of the user's view: the lines are
    appended to the yielded list when the block ends, for `check --library-output` to print after its own."""
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    lines: list[str] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            lines += sink.read().decode(errors="replace").splitlines()


def complaint_hint(text: str, error: BaseException, config: Any, empty: Sequence[str] = ()) -> str:
    """The fix beside one of verl's complaints (`text`, raised as `error`) about the composed `config`: a config
    class's unknown field (`overrides.field_hint`), one the plugin's switch brings out (`verl_hint`), or, for a
    TypeError whose text names no key, the numbers the command left `empty` (`overrides.empty_values`)."""
    from verl_dppo.launch.findings.overrides import field_hint

    hint = field_hint(text, config) + verl_hint(text, config)
    if empty and isinstance(error, TypeError) and not hint:
        hint = (
            f". The command leaves {', '.join(f'{key}=' for key in empty)} empty (a shell variable left unset?), "
            "where verl may compute with a number: give each a value"
        )
    return hint


def verl_hint(text: str, config: Any = None) -> str:
    """The plugin's fix beside one of verl's complaints that a DPPO switch brings out; R3's key is the one the
    command's engine reads (`actor.strategy`: Megatron's and VeOmni's are verl's, FSDP's the plugin's)."""
    if "router_replay.mode='R2' requires algorithm.rollout_correction.bypass_mode=False" in text:
        from verl_dppo.plugin.moe.arm import ENGINE_REPLAY

        strategy = str(config.actor_rollout_ref.actor.get("strategy", "megatron")) if config is not None else "megatron"
        section = ENGINE_REPLAY.get(strategy, "megatron")
        engine = {"megatron": "verl's Megatron engine", "veomni": "verl's VeOmni engine"}.get(
            section, "the plugin's replay on the FSDP engine"
        )
        key = f"{'+' if section == 'fsdp_config' else ''}actor_rollout_ref.actor.{section}.router_replay.mode=R3"
        return (
            ". With DPPO: keep R2 and leave out bypass_mode=True (the anchor stays the rollout's log-probs; "
            "verl's recompute pass records the routes, at about a quarter of a step), or replay the rollout's "
            f"own routes with R3 ({key} and actor_rollout_ref.rollout.enable_rollout_routing_replay=True, "
            f"{engine}), as the paper's moe_base_r3"
        )
    return ""


LOADED_AT_LAUNCH = {
    "actor_rollout_ref.model.path": "the model (its config, tokenizer and weights)",
    "data.train_files": "the training prompts",
    "data.val_files": "the validation prompts",
}
"""The paths verl opens as it starts: one left empty (`key=`, a shell variable the script did not set) is wrong on
any machine, though Hydra and verl's config classes take '' (verl then fails at the model's or dataset's load, after
the cluster's workers started)."""


def empty_path_problems(config: Any) -> list[str]:
    """A line for each of `LOADED_AT_LAUNCH` that the command leaves empty ('' or a list holding '')."""
    from omegaconf import OmegaConf

    problems = []
    for key, what in LOADED_AT_LAUNCH.items():
        value = OmegaConf.select(config, key, default=None)
        values = [value] if value is None or isinstance(value, str) else list(value)
        if any(str(item).strip() == "" for item in values if item is not None):
            problems.append(
                f"{key} is empty ({key}=: a shell variable the script left unset?): verl reads {what} from it at "
                "launch; give the path (or, for the model, a Hugging Face id)"
            )
    return problems


def command_findings(config: Any) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the settings around the policy loss (see the module's docstring), and of the paths
    verl opens at launch left empty (`empty_path_problems`)."""
    from omegaconf import OmegaConf

    from verl_dppo.plugin.run_config import is_plugin_mode

    def get(key: str) -> Any:
        return OmegaConf.select(config, key, default=None)

    problems, warnings = empty_path_problems(config), []
    mode = str(get("actor_rollout_ref.actor.policy_loss.loss_mode"))
    plugin = is_plugin_mode(config)
    if plugin and get("distillation.enabled") and get("distillation.distillation_loss.use_task_rewards") is False:
        problems.append(
            f"distillation.enabled=True with distillation.distillation_loss.use_task_rewards=False: verl's actor then "
            f"trains distillation_ppo_loss, which multiplies the policy loss ({mode}) by zero, so the update is the "
            "distillation loss alone; set distillation.distillation_loss.use_task_rewards=True to train "
            f"{mode} beside it (weighted by distillation_loss_coef), or leave the loss_mode line out"
        )
    correction = get("algorithm.rollout_correction") or {}
    if correction.get("bypass_mode", False) and correction.get("rollout_rs", None):
        warnings.append(
            f"algorithm.rollout_correction.rollout_rs={correction.get('rollout_rs')}: bypass_mode=True makes verl's "
            "trainer skip its rollout correction, this rejection sampling included; to keep it, leave bypass_mode "
            "out (verl then recomputes the old log-probs every step)"
        )
    from verl_dppo.plugin.run_config import fsdp_router_replay_warning

    warnings += [warning for warning in [fsdp_router_replay_warning(config)] if warning]
    policy_loss = get("actor_rollout_ref.actor.policy_loss") or {}
    unused = [key for key in ("delta_low", "delta_high", "ratio_cap") if policy_loss.get(key, None) is not None]
    if unused and not plugin and _registered(mode):  # an unregistered mode: the registry's problem says so
        warnings.append(
            f"{', '.join(f'policy_loss.{key}' for key in unused)} set, but loss_mode={mode} is verl's own and does not "
            "read them: add actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv (README, From GRPO)"
        )
    return problems, warnings
