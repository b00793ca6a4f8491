"""`verl-dppo plot`: draw verl run logs (trainer.logger=['console','file']) side by side, one panel per metric.

verl's file logger (verl/utils/tracking.py, `FileLogger`) writes one JSON object per line:
`{"step": <int>, "data": {"<metric>": <number>, ...}}`. Validation metrics arrive every `test_freq` steps only,
and a run that is still going (or was killed) may end in a half-written line: both are normal and handled.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from verl_dppo.launch.run_logs import PlotError, read_log

COMMON_METRICS = ("critic/score/mean", "val-core/*", "response_length/mean", "actor/dppo/mismatch_tv_mean")
FAMILY_METRICS = {
    "clip": ("actor/pg_clipfrac",),
    "dppo": (
        "actor/pg_clipfrac",
        "actor/dppo/masked_frac_pos",
        "actor/dppo/masked_frac_neg",
        "actor/dppo/bad_update_frac",
        "actor/dppo/masked_rollout_prob_mean",
        "actor/dppo/rollout_topk_mass_mean",
    ),
    "troll": (
        "actor/troll/projected_frac",
        "actor/troll/kl_before_mean",
        "actor/troll/kl_after_mean",
        "actor/troll/eta_mean",
        "actor/troll/rollout_topk_mass_mean",
    ),
}
"""Panels of a loss family, drawn for its runs only: the blocked fraction `actor/pg_clipfrac` (the ratio clip's, DPPO's
mask) for the clipped and unclipped baselines and DPPO, the mask's own for DPPO, the projection's for TROLL (a TROLL
run logs the mask's metrics too, at 0), each with the mass of the rollout's top-K rows where the run logs it."""
R3_METRICS = (
    "actor/dppo/r3_router_differs_frac",
    "actor/dppo/r3_route_fit",
    "actor/dppo/r3_unrouted_frac",
    "actor/dppo/r3_replayed_frac",
)
"""Rollout router replay's panels, for any run whose log has them (docs/megatron.md says what their values mean):
drawn beside the common ones and not counted against MAX_DEFAULT_PANELS."""
DEFAULT_METRICS = (
    *COMMON_METRICS,
    *R3_METRICS,
    *dict.fromkeys(m for family in FAMILY_METRICS.values() for m in family),
    "training/rollout_probs_diff_mean",
)
"""Drawn when --metrics is not given (those present in at least one run of their family; patterns use shell-style
wildcards)."""
OWNER: dict[str, set] = {}
for _family, _metrics in FAMILY_METRICS.items():
    for _metric in _metrics:
        OWNER.setdefault(_metric, set()).add(_family)

MAX_DEFAULT_PANELS = 12


@dataclass
class Run:
    path: str
    label: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    """metric -> {step: value}; a later row for the same step overrides an earlier one, as in a resumed run."""
    warnings: list[str] = field(default_factory=list)
    loss_mode: Optional[str] = None
    """From the run record `verl-dppo run` writes beside the log, or the demo's row of that name."""

    @property
    def family(self) -> str:
        """troll, dppo or clip (the mode's `LossMode.panels`; clip for verl's own modes); without a known loss mode,
        read from what the run logged."""
        mode = self.loss_mode
        if mode is None:
            return (
                "troll"
                if any(m.startswith("actor/troll/") for m in self.series)
                else "dppo"
                if "actor/dppo/masked_frac_pos" in self.series
                else "clip"
            )
        from verl_dppo.plugin.modes import mode_named

        registered = mode_named(mode)
        return registered.panels if registered is not None else "clip"  # verl's own modes: the ratio clip

    def metrics(self) -> set[str]:
        return set(self.series)

    def n_steps(self) -> int:
        """How many distinct steps logged anything."""
        return len(set().union(*(set(points) for points in self.series.values())))


def load_run(path: str, label: Optional[str] = None) -> Run:
    """Read one verl file-logger JSONL (`verl_dppo.launch.run_logs.read_log`). Raises PlotError for a file that
    cannot be a verl log."""
    series, warnings = read_log(path)
    return Run(
        path=path,
        label=label or os.path.splitext(os.path.basename(path))[0],
        series=series,
        warnings=warnings,
        loss_mode=_loss_mode(path),
    )


def _loss_mode(path: str) -> Optional[str]:
    """The run's loss mode: its run record's (<log>.run.json, written by `verl-dppo run`), else that of the demo's
    row named as the file (out/demo/<method>.jsonl), else None."""
    try:
        with open(os.path.splitext(path)[0] + ".run.json") as handle:
            record = json.load(handle)
        if isinstance(record, dict) and isinstance(record.get("loss_mode"), str):
            return record["loss_mode"]
    except (OSError, ValueError):
        pass
    from verl_dppo.studies.demo.methods import ALIASES, METHODS, STUDY_METHODS, mode_rows

    stem = os.path.splitext(os.path.basename(path))[0]
    stem = ALIASES.get(stem, stem)
    return next((m.loss_mode for m in (*METHODS, *STUDY_METHODS, *mode_rows()) if m.name == stem), None)


def _label_runs(paths: Sequence[str]) -> list[str]:
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    labels = []
    for path, stem in zip(paths, stems):
        if stems.count(stem) > 1:  # same file name in different run folders: name the folder too
            stem = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), stem)
        labels.append(stem)
    return labels


def select_metrics(runs: Sequence[Run], requested: Optional[Sequence[str]]) -> tuple[list[str], list[str]]:
    """Resolve metric names/patterns against the runs: (metrics to draw, warnings). Raises PlotError if none."""
    available = sorted(set().union(*(run.metrics() for run in runs)))
    if not requested:  # a family's panel only where a run of that family logged it
        available = [m for m in available if any(m in run.series for run in drawn_runs(runs, m))]
    patterns = list(requested) if requested else list(DEFAULT_METRICS)
    chosen, warnings, missing = [], [], []
    for pattern in patterns:
        matches = (
            [m for m in available if fnmatch.fnmatchcase(m, pattern)]
            if any(c in pattern for c in "*?[")
            else [pattern]
            if pattern in available
            else []
        )
        if not matches:
            missing.append(pattern)
        chosen.extend(m for m in matches if m not in chosen)
    if requested and missing:
        hints = []
        for name in missing:
            import difflib

            close = difflib.get_close_matches(name, available, n=3, cutoff=0.5)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        message = "metric(s) not found in any run: " + "; ".join(hints)
        if not chosen:
            raise PlotError(message + _available_hint(available))
        warnings.append(message + "; drawing the others")
    if not chosen:
        raise PlotError(
            "none of the default metrics is in these runs; choose some with --metrics" + _available_hint(available)
        )
    limit = MAX_DEFAULT_PANELS + sum(name in R3_METRICS for name in chosen)
    if not requested and len(chosen) > limit:
        warnings.append(f"showing the first {limit} of {len(chosen)} default metrics; use --metrics")
        chosen = chosen[:limit]
    for name in chosen:
        absent = [run.label for run in (runs if requested else drawn_runs(runs, name)) if name not in run.series]
        if absent:
            warnings.append(f"{name}: not logged by {', '.join(absent)}")
    return chosen, warnings


def drawn_runs(runs: Sequence[Run], metric: str) -> list[Run]:
    """The runs a default panel draws: those of the metric's loss family (every run for a common metric)."""
    owners = OWNER.get(metric)
    return [run for run in runs if owners is None or run.family in owners]


def _available_hint(available: Sequence[str]) -> str:
    shown = ", ".join(available[:15]) + (f", ... ({len(available)} in all)" if len(available) > 15 else "")
    return f". Available: {shown}"


def _smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out = []
    for end in range(1, len(values) + 1):  # trailing moving average, ignoring NaN
        finite = [v for v in values[max(0, end - window) : end] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def draw(
    runs: Sequence[Run],
    metrics: Sequence[str],
    output: str,
    smooth: int = 1,
    title: Optional[str] = None,
    dpi: int = 100,
    by_family: bool = False,
) -> None:
    """One panel per metric, one line per run (each method in its colour, `colors.METHOD_COLORS`; later lines
    dashed and thinner, so that equal ones stay visible); a metric logged at a few steps only is drawn with markers.
    by_family: a loss family's panel draws that family's runs only (the default panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from verl_dppo.studies.colors import colors_for, line_style

    columns = min(3, len(metrics))
    rows = math.ceil(len(metrics) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.2 * rows), squeeze=False)
    colors = colors_for([run.label for run in runs])
    for index, metric in enumerate(metrics):
        axis = axes[index // columns][index % columns]
        shown = drawn_runs(runs, metric) if by_family else runs
        for run_index, run in enumerate(runs):
            points = run.series.get(metric)
            if not points or run not in shown:
                continue
            style = line_style(run_index)
            steps = sorted(points)
            values = [points[s] for s in steps]
            # Logged every N steps (validation): markers, and no smoothing across its few points.
            sparse = len(steps) <= max(1, run.n_steps() // 2)
            color = colors[run_index]
            if sparse:
                axis.plot(steps, values, marker="o", color=color, label=run.label, markersize=3.5, **style)
            else:
                if smooth > 1:
                    axis.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
                axis.plot(steps, _smooth(values, smooth), color=color, label=run.label, **style)
        axis.set_title(metric, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers: no tick at 1.5
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    for index in range(len(metrics), rows * columns):
        axes[index // columns][index % columns].axis("off")
    legend: dict[str, Any] = {}  # every run once, in order, whichever panels draw it
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    order = [run.label for run in runs if run.label in legend]
    handles, labels = [legend[label] for label in order], order
    figure.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5) or 1, fontsize=8, frameon=False)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.tight_layout(rect=(0, 0.06 if rows == 1 else 0.035, 1, 1))
    figure.savefig(output, dpi=dpi)
    plt.close(figure)


_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def resolve_runs(
    names: Sequence[str], latest: bool = False, log_root: Optional[str] = None, notes: Optional[list] = None
) -> list[str]:
    """Each argument is a log file, a folder of logs (a demo's --out: every method), or the experiment name of a
    `verl-dppo run` (its log is <log root>/<project>/<experiment>.jsonl, verl_dppo.launch.run_logs); --latest adds
    the newest run there, or the demo just run in ./out/demo when that is newer. What was chosen for the user
    goes to `notes`."""
    from verl_dppo.launch import run_logs

    root = log_root or run_logs.default_log_root()
    paths = []
    for name in names:
        if os.path.isdir(name):
            found = run_logs.logs_in(name)
            if not found:
                raise PlotError(
                    f"{name}: a folder without a verl log (*.jsonl) in it or one level down; give "
                    "log files, a run's folder (e.g. a demo's --out) or experiment names"
                )
            paths.extend(found)
            continue
        if os.path.exists(name):
            paths.append(name)
            continue
        try:
            found = run_logs.find_log(name, root)
        except ValueError as error:
            raise PlotError(str(error)) from None
        if found is None:
            raise PlotError(f"{name}: no such file, and no run of that experiment name ({run_logs.known_runs(root)})")
        paths.append(found)
    if latest:
        found, note = run_logs.latest_run(log_root)
        if not found:
            demo = "" if log_root else f", nor a demo's logs in {run_logs.DEMO_OUT}"
            raise PlotError(f"--latest: {run_logs.known_runs(root)}{demo}")
        if note and notes is not None:
            notes.append(note)
        if notes is not None:
            notes.append(f"verl-dppo plot: --latest draws {', '.join(str(path) for path in found)}")
        paths.extend(found)
    if not paths:
        raise PlotError(
            "give the runs to draw: log files, a folder of logs (out/demo), experiment names of "
            "`verl-dppo run`, or --latest"
        )
    return paths


def run(
    paths: Sequence[str],
    output: str,
    metrics: Optional[str] = None,
    smooth: int = 1,
    labels: Optional[str] = None,
    title: Optional[str] = None,
    err=None,
    out=None,
    latest: bool = False,
    log_root: Optional[str] = None,
) -> int:
    err, out = err or sys.stderr, out or sys.stdout
    try:
        notes: list[str] = []
        paths = resolve_runs(paths, latest, log_root, notes)
        for note in notes:
            print(note, file=err)
        if not output.lower().endswith(_FORMATS):
            raise PlotError(f"-o {output}: give a file name ending in one of {', '.join(_FORMATS)}")
        if smooth < 1:
            raise PlotError(f"--smooth must be >= 1, got {smooth}")
        names = [label.strip() for label in labels.split(",")] if labels else _label_runs(paths)
        if len(names) != len(paths):
            raise PlotError(f"--labels names {len(names)} run(s) but {len(paths)} log file(s) were given")
        runs = [load_run(path, name) for path, name in zip(paths, names)]
        requested = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
        chosen, warnings = select_metrics(runs, requested)
        for warning in [w for r in runs for w in r.warnings] + warnings:
            print(f"warning: {warning}", file=err)
        directory = os.path.dirname(os.path.abspath(output))
        os.makedirs(directory, exist_ok=True)
        draw(runs, chosen, output, smooth=smooth, title=title, by_family=not requested)
    except PlotError as error:
        print(f"verl-dppo plot: error: {error}", file=err)
        return 2
    except OSError as error:
        print(f"verl-dppo plot: error: cannot write {output}: {error.strerror or error}", file=err)
        return 2
    print(f"wrote {output}: {len(chosen)} panel(s), {len(runs)} run(s)", file=out)
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser(
        "plot",
        help="draw verl run logs (trainer.logger=['file'] JSONL) side by side",
        description="Overlay verl file-logger runs, one panel per metric. Default metrics: "
        + ", ".join(DEFAULT_METRICS)
        + " (those present).",
    )
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help='verl file-logger logs ({"step", "data"} rows), a folder of them (a demo\'s: '
        "`plot out/demo` draws every method), or the trainer.experiment_name of a `verl-dppo run` "
        "(e.g. dense_8b-dppo_binary_tv), found under $DPPO_ROOT/logs",
    )
    parser.add_argument(
        "--latest",
        action="store_true",
        help="also draw the newest run logged under $DPPO_ROOT/logs, or the demo in ./out/demo (every "
        "method) when it wrote more recently; with --log-root, the newest log there",
    )
    parser.add_argument(
        "--log-root",
        default=None,
        metavar="DIR",
        help="where to look for experiment names and --latest: a log root (PROJECT/EXPERIMENT.jsonl) "
        "or a folder of logs such as out/demo (default: $VERL_FILE_LOGGER_ROOT, else "
        "$DPPO_ROOT/logs, else ~/dppo/logs)",
    )
    parser.add_argument("-o", "--output", required=True, metavar="FIG.png", help="figure to write (.png/.pdf/.svg)")
    parser.add_argument(
        "--metrics",
        default=None,
        metavar="M1,M2",
        help="comma-separated metric names or wildcards (e.g. 'actor/dppo/*')",
    )
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing moving average over N steps")
    parser.add_argument("--labels", default=None, metavar="A,B", help="legend names, one per run (default: file names)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.set_defaults(
        handler=lambda args: run(
            args.runs,
            args.output,
            args.metrics,
            args.smooth,
            args.labels,
            args.title,
            latest=args.latest,
            log_root=args.log_root,
        )
    )
