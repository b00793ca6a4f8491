"""`verl-dppo recipes | run | data`: list the paper's recipes, launch one on Ray, prepare its data.

    verl-dppo recipes
    verl-dppo run SETUP --method METHOD [--trainer-mode MODE] [--dry-run] [hydra overrides ...]
    verl-dppo data NAME --out DIR [--hub-id ID | --from-file PATH]

`run` composes the recipe on verl's own ppo_trainer.yaml (verl_dppo.launch.compose), validates it with verl's
`validate_config` and dataclass conversions, and calls what `python -m verl.trainer.main_ppo` calls:
`run_ppo(config, TaskRunnerV1)` (Ray: RAY_ADDRESS names an existing cluster, else a local one starts).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from verl_dppo.errors import EXIT_USAGE, UsageError


class IntermixedParser(argparse.ArgumentParser):
    """Lets options and Hydra overrides mix in any order (`run S a=1 --dry-run b=2`): plain argparse would stop
    filling the overrides list at the first option after it."""

    _inside = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


class _Once(argparse.Action):
    """An option given at most once: `--method a --method b` is refused (argparse would keep the last silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            raise UsageError(
                f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): give it once"
            )
        setattr(namespace, self.dest, values)


def _print_error(message: str) -> int:
    print(f"verl-dppo: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cmd_recipes(args: argparse.Namespace) -> int:
    from verl_dppo.launch.compose import RecipeError, list_recipes

    try:
        recipes = list_recipes()
    except RecipeError as error:
        return _print_error(str(error))
    for group, title in (("setup", "Setups"), ("method", "Methods")):
        print(f"{title} ({'verl-dppo run SETUP' if group == 'setup' else '--method METHOD'}):")
        width = max(len(info.name) for info in recipes[group])
        for info in recipes[group]:
            print(f"  {info.name:<{width}}  {info.figure}")
            if args.verbose and info.summary:
                print(f"  {'':<{width}}  {info.summary}")
        print()
    print("Trainer modes (--trainer-mode MODE, verl's v1 trainers; default sync):")
    width = max(len(info.name) for info in recipes["trainer_mode"])
    for info in recipes["trainer_mode"]:
        print(f"  {info.name:<{width}}  {info.summary}" if args.verbose else f"  {info.name}")
    print()
    print("Any setup runs with any method. Paths come from DPPO_ROOT (default ~/dppo); see recipes/README.md.")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from verl_dppo.launch.compose import (
        check_launch_site,
        check_length,
        check_paths,
        check_writable,
        check_supported,
        compose_recipe,
        resolved_yaml,
        stdout_to_stderr,
        validate_recipe,
    )
    from verl_dppo.rehearsal.setups.cpu_tiny import (
        build_assets,
        builds_assets,
        check_engine,
        select_platform,
        size_local_ray,
    )
    from verl_dppo.launch.run_logs import pin_file_logger

    # RAY_ADDRESS=local (or unset) starts a local instance, as in ray.init.
    ray_address = os.environ.get("RAY_ADDRESS") or None
    if ray_address == "local":
        ray_address = None
    try:
        if ray_address and not args.dry_run:  # a silent address is refused at once, before composing anything
            from verl_dppo.launch.ray_probe import check_address

            check_address(ray_address, "RAY_ADDRESS")
        with stdout_to_stderr():
            config = compose_recipe(args.setup, args.method, args.overrides, args.config_dir, args.trainer_mode)
            check_length(config)  # before anything slow: a run of no step is refused at once
            select_platform(config)  # trainer.device=cpu: the CPU platform in the run's Ray processes
            check_engine(config)
            if not ray_address:
                size_local_ray(config)
            validate_recipe(config)
        pin_file_logger(config)  # the JSONL log under $DPPO_ROOT/logs, not in a Ray actor's working directory
        site = check_launch_site(config, ray_address)
        unwritable = check_writable(config)
        # cpu_tiny builds its model and data at launch, once (not in a dry run, nor for a run that cannot start)
        tiny_pending = builds_assets(config) and (args.dry_run or bool(site) or bool(unwritable))
        built = build_assets(config) if builds_assets(config) and not tiny_pending else []
        problems = check_supported(config) + unwritable + ([] if tiny_pending else check_paths(config))
    except UsageError as error:
        return _print_error(str(error))
    from verl_dppo.launch.run_record import clash_warning

    clash = clash_warning(config)  # same experiment name, another method: verl would resume it / overwrite its log
    if clash:
        print(f"verl-dppo: warning: {clash}", file=sys.stderr)
    for warning in _threshold_warnings(config):
        print(f"verl-dppo: warning: {warning}", file=sys.stderr)

    if args.dry_run:
        # A dry run needs no GPU and no engine: what would stop the launch is reported, the YAML still printed.
        for problem in problems:
            print(f"verl-dppo: warning: {problem}", file=sys.stderr)
        for problem in site:
            print(f"verl-dppo: warning: at launch from here: {problem}", file=sys.stderr)
        if tiny_pending:
            print(
                f"verl-dppo: note: the launch builds the model at {config.actor_rollout_ref.model.path} and the data "
                f"{config.data.train_files} unless already there",
                file=sys.stderr,
            )
        sys.stdout.write(resolved_yaml(config))
        sys.stdout.flush()
        stops = len(problems) + len(site)
        print(
            "verl-dppo: dry run: the config passed verl's checks (validate_config, the workers' config classes); "
            + (
                f"{stops} problem(s) above would stop the launch from here"
                if stops
                else "nothing found that would stop the launch from here"
            ),
            file=sys.stderr,
        )
        return 0
    problems += site
    for line in built:
        print(f"verl-dppo: {line}", file=sys.stderr)
    if len(problems) == 1:
        return _print_error(f"the run cannot start: {problems[0]}")
    if problems:
        return _print_error("the run cannot start:\n  - " + "\n  - ".join(problems))
    return _launch(config, ray_address, _command_line(args))


def _threshold_warnings(config) -> list[str]:
    """The loss's own warnings (a TV threshold above 1; thresholds inherited from verl's ratio clip, or set outside
    the paper's range), said before the launch with the values the actor will use."""
    problem, warnings = threshold_findings(config)
    return [problem, *warnings] if problem else warnings


def threshold_findings(config) -> tuple[Optional[str], list[str]]:
    """(the thresholds a DPPO mode inherits from verl's ratio clip outside every value the paper and the recipes use,
    or None; the warnings on the thresholds in effect), from the values the actor will use. `verl-dppo check` counts
    the first as a problem."""
    from verl_dppo.plugin.options import resolve_options
    from verl_dppo.plugin.paper_settings import (
        inherited_out_of_range_problem,
        inherited_thresholds_warning,
        tv_threshold_warning,
        unusual_thresholds_warning,
    )
    from verl_dppo.plugin.modes import mode_named

    actor = config.actor_rollout_ref.actor
    mode = str(actor.policy_loss.loss_mode)
    registered = mode_named(mode)
    options = resolve_options(actor, registered.uses_divergence_thresholds if registered is not None else True)
    problem = inherited_out_of_range_problem(mode, options)
    found = [
        tv_threshold_warning(mode, options.delta_low, options.delta_high),
        None if problem else inherited_thresholds_warning(mode, options),  # the problem names the same fix
        unusual_thresholds_warning(mode, options),
    ]
    return problem, [warning for warning in found if warning]


def _command_line(args: argparse.Namespace) -> str:
    """The `verl-dppo run` command line as given, for the run record (a rehearsal's is long: its console says less)."""
    import shlex

    words = ["verl-dppo", "run", args.setup, "--method", args.method]
    words += ["--trainer-mode", args.trainer_mode] if args.trainer_mode else []
    for folder in args.config_dir:
        words += ["--config-dir", folder]
    return shlex.join([*words, *args.overrides])


def _launch(config, ray_address, command=None) -> int:
    from omegaconf import OmegaConf

    from verl_dppo.rehearsal.setups.cpu_tiny import select_platform

    select_platform(config, here=True)  # before verl's first get_platform(): main_ppo's import calls it
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    from verl_dppo.launch.run_record import write_records

    # Resolve on the driver: ${oc.env:DPPO_ROOT} and the paths checked above are the ones every Ray node uses.
    OmegaConf.resolve(config)
    auto_set_device(config)
    from verl_dppo.launch.console import quiet_launch, summary_line

    # What the next launch under this experiment name compares itself with; verl's config dump into a file.
    for problem in write_records(config, command) + quiet_launch(config):
        print(f"verl-dppo: warning: {problem}", file=sys.stderr)
    print(
        f"verl-dppo: launching {config.dppo.setup} + {config.dppo.get('run_label', config.dppo.method)} ({config.trainer.nnodes} node(s) x "
        f"{config.trainer.n_gpus_per_node} GPU(s)) on "
        + (f"the Ray cluster at RAY_ADDRESS={ray_address}" if ray_address else "a new local Ray instance"),
        file=sys.stderr,
    )
    from verl_dppo.rehearsal.setups.cpu_tiny import is_cpu_run

    if not ray_address or is_cpu_run(config):
        from verl_dppo.launch import ray_reaper

        # The local Ray instance ends with this process, even a SIGKILLed one; the shared-memory segments a CPU run's
        # vLLM leaves on this node are unlinked after it (on a cluster of the user's: the segments only).
        ray_reaper.start(kill=not ray_address, run_id=ray_reaper.mark_run(config))
    try:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    except ConnectionError as error:  # the cluster went away between the check and ray.init
        lines = str(error).strip().splitlines() or [type(error).__name__]
        return _print_error(f"Ray: {lines[0]} (RAY_ADDRESS={ray_address or 'unset'}; check `ray status`)")
    import ray

    # The workers' last lines reach this console through Ray's log monitor, a moment after the run returns: let them
    # arrive, then disconnect, so that the summary is the last line.
    time.sleep(1.0)
    ray.shutdown()
    print(summary_line(config), file=sys.stderr)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from verl_dppo.datasets import DataError, prepare

    try:
        path, rows = prepare(args.name, args.out, hub_id=args.hub_id, from_file=args.from_file, split=args.split)
    except DataError as error:
        return _print_error(str(error))
    print(f"wrote {rows} rows to {path}")
    return 0


def run_command_line(argv: list[str]) -> int:
    """`verl-dppo run ...` from inside another command (`check --rehearse`): this module's commands parsed and run
    with the command line's own error handling (`verl_dppo.errors.run_handler`), without importing the command line
    itself (the layer above)."""
    from verl_dppo.errors import report, run_handler

    parser = argparse.ArgumentParser(prog="verl-dppo")
    add_command(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    try:
        args = parser.parse_args(argv)
    except UsageError as error:
        return report(str(error))
    return run_handler(args)


def add_command(commands) -> None:
    from verl_dppo.datasets import DATASETS

    recipes = commands.add_parser(
        "recipes", help="list the paper's setups and methods, with the figure each reproduces"
    )
    recipes.add_argument("-v", "--verbose", action="store_true", help="also print each recipe's one-line summary")
    recipes.set_defaults(handler=cmd_recipes)

    run = commands.add_parser(
        "run",
        help="compose a recipe on verl's config, validate it, and launch verl.trainer.main_ppo on Ray",
        description="Compose SETUP + METHOD on verl's ppo_trainer.yaml, apply the Hydra overrides, validate with "
        "verl's own checks, then launch verl.trainer.main_ppo on Ray (RAY_ADDRESS names an existing cluster).",
    )
    run.__class__ = IntermixedParser
    run.add_argument("setup", help="a setup from `verl-dppo recipes` (model, data, lengths, parallelism)")
    run.add_argument(
        "--method", required=True, action=_Once, help="a method from `verl-dppo recipes` (loss mode and options)"
    )
    run.add_argument(
        "--trainer-mode",
        default=None,
        action=_Once,
        metavar="MODE",
        help="verl's v1 trainer: sync (default), colocate_async (rollouts a batch ahead, on the same GPUs) or "
        "separate_async (rollout on GPUs of its own, partial rollouts, samples up to "
        "trainer.v1.sampler.max_off_policy_threshold versions old); recipes/trainer_mode/MODE.yaml",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="do everything but the launch: print the fully resolved config as YAML on stdout (no GPU needed)",
    )
    run.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="your own setups and methods: DIR/setup/NAME.yaml, DIR/method/NAME.yaml, composed like the shipped ones "
        "(a setup may start from one: `defaults: [sanity_1p5b]`); repeatable",
    )
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.nnodes=4 data.train_batch_size=128")
    run.set_defaults(handler=cmd_run)

    data = commands.add_parser(
        "data",
        help="download a data set and write it as parquet in verl's RL-dataset schema",
        description="Write DIR/NAME.parquet in the schema of verl's RLHFDataset and reward functions. "
        + "; ".join(f"{name}: {spec.description}" for name, spec in DATASETS.items()),
    )
    data.add_argument("name", choices=sorted(DATASETS), help="which data set")
    data.add_argument("--out", required=True, help="output folder (the recipes read $DPPO_ROOT/data)")
    data.add_argument("--hub-id", default=None, help="Hugging Face dataset id to read instead of the default")
    data.add_argument("--split", default=None, help="dataset split (default: the data set's usual split)")
    data.add_argument(
        "--from-file", default=None, help="convert a local parquet/json/jsonl copy instead of downloading"
    )
    data.set_defaults(handler=cmd_data)
