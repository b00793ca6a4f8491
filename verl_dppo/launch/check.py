"""`verl-dppo check`: the plugin's launch checks on a plain `python -m verl.trainer.main_ppo ...` command line.

`verl-dppo run` composes a paper setup; a user with a GRPO command of their own wants to know, before a cluster
job, what the plugin would say about that command as it is. `check` reads the launch line as it is typed
(`python3 -m verl.trainer.main_ppo`, behind `uv run ...`, `torchrun ...`, `ray job submit ... --` or `VAR=value`
words, or `.../main_ppo.py`; only main_ppo: another entry point, or a module verl does not have, is one line, exit 2).
It composes verl's own config (`ppo_trainer`, or the command's `--config-path`, relative to verl's `trainer/` folder
as Hydra reads it, and `--config-name`; the command's `hydra.searchpath`) with the command's overrides, as `main_ppo`
does, and runs on it everything `run --dry-run` checks: each override's key and type (the type verl's config classes
declare, else verl's value's), verl's own `validate_config` and config classes, the plugin's run-level checks (anchor
and bypass mode, asynchronous trainers, Ulysses attention), the Top-K settings, the thresholds a DPPO mode would
inherit from the ratio clip, what cancels or drops part of the update (distillation without task rewards; a
`rollout_rs` that bypass mode skips), and whether the data files and the models its checks read exist here. Nothing
is launched and nothing is downloaded. Every problem it can find is named in one run: each override's key (a
misspelled one with the existing keys it is nearest to) and type are checked before Hydra composes (Hydra stops at
the first), the config is composed with the overrides that passed, and the plugin's checks, the files and verl's own
validation follow (after `validate_config`'s first complaint, its parts that stand alone run again one by one); each
problem is one line. A command with no problem ends with one line of the update rule it trains
(`verl_dppo.plugin.update_rule`: loss mode, thresholds, ratio cap, anchor, bypass mode, K, then what else shapes the
update where it differs from the paper's recipe: KL loss, aggregation, advantages, entropy bonus, distillation), as
the worker resolves it. Warnings name what costs without stopping the launch: no bypass mode (verl recomputes the old
log-probs every step), a threshold set outside the paper's range; a DPPO threshold inherited from the ratio clip
outside that range (GSPO's 0.0003) is a problem.

Exit codes: 0 nothing found; 2 the command is wrong, on any machine; 3 the command is right but cannot
start here (a data file, a local model, a critic's model not in the Hugging Face cache, a config package on the
search path: missing on this machine); 4 the rehearsal did not train. What a launch from this machine lacks that a
cluster has (the GPUs the command asks, a hub model not in the Hugging Face cache) is one line and no exit code:
`check` runs before a cluster job. Other libraries' output while the command is read (VeOmni's, transformers',
vLLM's notices) is kept out of view; `--library-output` prints it after check's own lines.

    verl-dppo check python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo ... \\
        actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv
    verl-dppo check algorithm.adv_estimator=grpo ...        # the overrides alone
    verl-dppo check --rehearse python3 -m verl.trainer.main_ppo ...   # then 2 steps of its update rule on cpu_tiny

`--rehearse` then trains the command's update rule (its policy loss and thresholds, the actor's loss settings, the
rollout's sampling and log-probs, the advantage estimator) for `--steps` steps on cpu_tiny's model and data, on this
CPU, through `verl-dppo run cpu_tiny`, in the command's shape where the CPU runs it (`verl_dppo.launch.rehearse`: a
MoE and its router replay, vLLM's CPU build, the Megatron engine, LoRA, the trainer mode, bf16, the KL loss); one
line says what was rehearsed and what was left out (the model, data, lengths, batch, GPUs, parallelism, an engine
or rollout the CPU lacks). Its log: `cpu_tiny-rehearsal+<loss mode>-<trainer mode>[-vllm][-megatron][-moe4]`; the
`run` command line, thousands of characters, in its run record. A wrong command is not rehearsed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from verl_dppo.errors import EXIT_USAGE
from verl_dppo.launch.launch_line import Launch, config_folder, missing_search_paths, parse_launch
from verl_dppo.launch.findings.overrides import empty_values, group_choices, override_problems

__all__ = [
    "add_command",
    "split_command",
    "compose_main_ppo",
    "override_problems",
    "check_command",
    "Verdict",
    "EXIT_FINE",
    "EXIT_WRONG",
    "EXIT_NOT_HERE",
    "EXIT_REHEARSAL",
]


def split_command(argv: Sequence[str]) -> tuple[list[str], Optional[str], str]:
    """(overrides, --config-path, --config-name) of a main_ppo command line (`launch_line.parse_launch`: the launcher
    words such as `uv run ... python3 -m verl.trainer.main_ppo` skipped, a shell's trailing `$@` or backslash too)."""
    launch = parse_launch(argv)
    return launch.overrides, launch.config_path, launch.config_name


def compose_main_ppo(
    overrides: Sequence[str], config_path: Optional[str] = None, config_name: str = "ppo_trainer"
) -> tuple[Any, Any]:
    """(verl's config with the overrides, verl's config without them), composed as main_ppo composes them."""
    launch = Launch(overrides=list(overrides), config_path=config_path, config_name=config_name)
    return tuple(_compose([list(overrides), []], launch))


def _compose(override_lists: Sequence[Sequence[str]], launch: Launch) -> list:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from verl_dppo.launch.compose import RecipeError, stdout_to_stderr

    folder = config_folder(launch)
    if not folder.is_dir():
        given = f"--config-path={launch.config_path}" if launch.config_path is not None else "main_ppo's config"
        raise RecipeError(
            f"{given}: no config folder {folder} (Hydra reads a relative --config-path from the folder "
            "of the file that declares @hydra.main: verl/trainer/ for main_ppo, not the working folder)"
        )
    extra = [f"file://{Path(folder).resolve()}" for folder in launch.config_dirs]
    try:
        with stdout_to_stderr(), _quiet(), initialize_config_dir(config_dir=str(folder), version_base=None):
            return [
                compose(launch.config_name, overrides=_with_config_dirs(list(overrides), extra))
                for overrides in override_lists
            ]
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise RecipeError(" ".join(str(error).split())) from None


def _with_config_dirs(overrides: list[str], folders: list[str]) -> list[str]:
    """`--config-dir` folders as Hydra adds them: on the search path, beside the command's own `hydra.searchpath`."""
    if not folders:
        return overrides
    for index, override in enumerate(overrides):
        if override.startswith("hydra.searchpath=[") and override.endswith("]"):
            inner = override[len("hydra.searchpath=[") : -1]
            overrides[index] = f"hydra.searchpath=[{','.join([*folders, *([inner] if inner else [])])}]"
            return overrides
    return [*overrides, f"hydra.searchpath=[{','.join(folders)}]"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hydra's warning for a search path that is not here: `missing_search_paths` says it once, as "not here"."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not available")
        yield


EXIT_FINE, EXIT_WRONG, EXIT_NOT_HERE, EXIT_REHEARSAL = 0, EXIT_USAGE, 3, 4
"""`check`'s exit codes, one question each: 0 nothing found; 2 the command is wrong (a problem it would have on any
machine; a line that is no command too); 3 the command is right but cannot start here (a data file or a local model
that is not on this machine); 4 `--rehearse` only: the rehearsal did not train. A wrong command is not rehearsed."""


@dataclass
class Verdict:
    """What `check` found in a main_ppo command line, each finding one line."""

    problems: list[str] = field(default_factory=list)
    """What is wrong with the command itself, on any machine: it would stop the launch, or train what no paper run
    did (a DPPO threshold inherited from the ratio clip outside the paper's range) (exit 2)."""
    not_here: list[str] = field(default_factory=list)
    """What the command needs that is not on this machine (exit 3 where nothing is wrong)."""
    warnings: list[str] = field(default_factory=list)
    config: Optional[Any] = None
    """verl's config with the command's overrides (those that passed), None where it does not compose."""
    rule: Optional[str] = None
    """The update rule in effect (`update_rule`), where the command has no problem."""
    arm: Optional[str] = None
    """The MoE arm the command launches (`verl_dppo.plugin.moe.arm`), where the model routes or a replay is set."""
    machine: Optional[str] = None
    """What a launch from this machine lacks that a cluster has (`findings.command.machine_line`): no exit code."""
    unchecked: Optional[str] = None
    """Why the rest of the command could not be checked here (a config package on its search path, or its absolute
    --config-path, is not on this machine)."""

    @property
    def exit_code(self) -> int:
        return EXIT_WRONG if self.problems else EXIT_NOT_HERE if self.not_here else EXIT_FINE


def check_command(argv: Sequence[str]) -> Verdict:
    """Every problem this check can find in a main_ppo command line, each one line (see the module's docstring), and
    the update rule the command trains where it has none."""
    from verl_dppo.launch.findings.command import modelscope_missing, modelscope_off

    with modelscope_off():  # before anything imports verl (it stops on a modelscope the launch asks and lacks)
        from verl_dppo.launch.compose import RecipeError, check_supported, recipe_problems
        from verl_dppo.launch.commands import threshold_findings
        from verl_dppo.launch.findings.command import command_findings, hub_offline, machine_line, unreadable_models
    from verl_dppo.plugin.moe.arm import moe_arm
    from verl_dppo.plugin.run_config import recompute_pass_warning
    from verl_dppo.plugin.update_rule import update_rule

    launch = parse_launch(argv)
    overrides = launch.overrides
    searched = missing_search_paths(overrides, config_folder(launch) / f"{launch.config_name}.yaml")
    verdict = Verdict(not_here=[*searched, *filter(None, [modelscope_missing(launch.launcher)])])
    if searched:  # the configs that path adds are not here: what they define cannot be checked
        verdict.unchecked = "the configs on that search path define what the command sets"
        return verdict
    if launch.config_path is not None and Path(launch.config_path).is_absolute() and not config_folder(launch).is_dir():
        # a folder of the user's machine (`$(pwd)/examples/...` in verl's multi-turn scripts): not here, not wrong
        verdict.not_here.append(
            f"--config-path={launch.config_path}: no such folder here, so its config "
            f"{launch.config_name!r} cannot be read"
        )
        verdict.unchecked = "that folder holds the command's primary config"
        return verdict
    try:  # the keys each override may set: verl's config with the command's group choices (model_engine=megatron)
        (baseline,) = _compose([group_choices(overrides)], launch)
    except RecipeError as error:  # a choice that does not compose: composing the command names it below
        try:
            (baseline,) = _compose([[]], launch)
        except RecipeError:
            verdict.problems.append(str(error))
            return verdict
    problems, usable = override_problems(baseline, overrides, source="verl's")
    verdict.problems += problems
    try:
        (verdict.config,) = _compose([usable], launch)
    except RecipeError as error:
        verdict.problems.append(str(error))
        return verdict
    config = verdict.config
    with hub_offline():  # nothing is downloaded, and no request waits on retries
        unreadable, skip_critic = unreadable_models(config)
        found, packages = recipe_problems(
            config, plain=True, skip_critic=skip_critic, empty=empty_values(baseline, usable)
        )
    verdict.problems += found
    verdict.not_here += [*unreadable, *packages]
    try:
        verdict.problems += list(check_supported(config))
    except RecipeError as error:
        verdict.problems.append(str(error))
    verdict.not_here += _missing_files(config)
    more_problems, more_warnings = command_findings(config)
    verdict.problems += more_problems
    verdict.arm = moe_arm(config)
    try:
        inherited, verdict.warnings = threshold_findings(config)
        verdict.problems += [inherited] if inherited else []
        verdict.warnings += [warning for warning in [recompute_pass_warning(config)] if warning]
        verdict.warnings += more_warnings
        if not verdict.problems:
            verdict.rule = update_rule(config)
            verdict.machine = machine_line(config)
    except ValueError as error:  # options the loss would refuse at its first call
        verdict.problems.append(f"actor_rollout_ref.actor.policy_loss: {' '.join(str(error).split())}")
    return verdict


def _missing_files(config: Any) -> list[str]:
    problems = []
    for key in ("train_files", "val_files"):
        value = config.data.get(key)
        for path in [value] if isinstance(value, str) else list(value or []):
            if "://" not in str(path) and not Path(str(path)).expanduser().exists():
                problems.append(f"data.{key}: {path} does not exist here")
    model = str(config.actor_rollout_ref.model.path)
    if model.startswith(("/", ".", "~")) and not (Path(model).expanduser() / "config.json").is_file():
        problems.append(f"actor_rollout_ref.model.path: {model} holds no config.json here")
    return problems


def cmd_check(args: argparse.Namespace) -> int:
    from verl_dppo.launch.findings.command import modelscope_off, others_output

    with others_output() as others:
        verdict = check_command(args.command_line)
    for warning in verdict.warnings:
        print(f"verl-dppo: warning: {warning}", file=sys.stderr)
    for problem in verdict.problems:
        print(f"verl-dppo: problem: {problem}", file=sys.stderr)
    for missing in verdict.not_here:
        print(f"verl-dppo: not here: {missing}", file=sys.stderr)
    if verdict.machine:
        print(f"verl-dppo: check: {verdict.machine}", file=sys.stderr)
    if verdict.rule:
        print(f"verl-dppo: check: {verdict.rule}", file=sys.stderr)
    if verdict.arm:
        print(f"verl-dppo: check: {verdict.arm}", file=sys.stderr)
    print(f"verl-dppo: check: {_verdict_line(verdict)}", file=sys.stderr)
    if args.library_output and others:
        print(f"verl-dppo: check: what other libraries printed meanwhile ({len(others)} line(s)):", file=sys.stderr)
        print("\n".join(others), file=sys.stderr)
    if not args.rehearse or verdict.config is None:
        return verdict.exit_code
    if verdict.problems:
        print("verl-dppo: check: not rehearsed: the command's problems above come first", file=sys.stderr)
        return verdict.exit_code
    from verl_dppo.launch.commands import run_command_line
    from verl_dppo.launch.rehearse import rehearsal_overrides, rehearsal_shape

    shape = rehearsal_shape(verdict.config)
    mode = str(verdict.config.actor_rollout_ref.actor.policy_loss.loss_mode)
    run = [
        "run",
        "cpu_tiny",
        "--method",
        "grpo_clip_higher",
        *(["--trainer-mode", shape.trainer_mode] if shape.trainer_mode else []),
        *rehearsal_overrides(verdict.config),
        *shape.overrides,
        f"trainer.total_training_steps={args.steps}",
        f"dppo.run_label=rehearsal+{mode}",
        "trainer.resume_mode=disable",
    ]
    # The `verl-dppo run` line is thousands of characters: the run record keeps it (its "command").
    rehearsed, left_out = shape.lines(mode, args.steps)
    print(f"verl-dppo: check: {rehearsed}", file=sys.stderr)
    print(f"verl-dppo: check: {left_out}; the full `verl-dppo run` command goes to the run record", file=sys.stderr)
    with modelscope_off():  # cpu_tiny's model is local: the rehearsal's workers need no ModelScope hub
        code = run_command_line(run)
    if code != 0:
        print(f"verl-dppo: check: the rehearsal of {mode} did not train (exit {code} above)", file=sys.stderr)
        return EXIT_REHEARSAL
    return verdict.exit_code


def _verdict_line(verdict: Verdict) -> str:
    if verdict.problems:
        where = f"; {len(verdict.not_here)} more only here" if verdict.not_here else ""
        return (
            f"the command is wrong: {len(verdict.problems)} problem(s) above, on any machine{where} (exit {EXIT_WRONG})"
        )
    if verdict.unchecked:
        return (
            f"cannot be checked further here: {verdict.unchecked}, and {len(verdict.not_here)} thing(s) above "
            f"are not on this machine (exit {EXIT_NOT_HERE})"
        )
    if verdict.not_here:
        return (
            f"the command passed verl's checks and the plugin's, but cannot start here: {len(verdict.not_here)} "
            f"thing(s) above that it needs are not on this machine (exit {EXIT_NOT_HERE})"
        )
    return "the command passed verl's checks and the plugin's; nothing found that would stop the launch from here"


def add_command(commands: Any) -> None:
    parser = commands.add_parser(
        "check",
        help="the plugin's launch checks on a plain `python -m verl.trainer.main_ppo ...` command line",
        description=__doc__.split("\n\n")[1],
        epilog=__doc__.split("\n\n")[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="then train the command's update rule (its loss, advantages, rollout sampling) on "
        "cpu_tiny's model and data on this CPU, through verl's trainer, in the command's shape "
        "where the CPU runs it (a MoE and its router replay, vLLM, Megatron, LoRA, the trainer "
        "mode, bf16); two lines say what is kept and what is left out",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps of the rehearsal (default 2)")
    parser.add_argument(
        "--library-output",
        action="store_true",
        help="after check's own lines, what other libraries (verl, VeOmni, transformers, vLLM) printed "
        "while the command was read; kept out otherwise",
    )
    parser.add_argument(
        "command_line",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the main_ppo command line, or its overrides alone",
    )
    parser.set_defaults(handler=cmd_check)
