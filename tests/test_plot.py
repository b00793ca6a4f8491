"""`verl-dppo plot` on hand-written verl file-logger logs: the format of verl/utils/tracking.py::FileLogger
(`{"step": s, "data": {...}}` per line), validation metrics every N steps, a run cut off mid-line, bad input."""

import json

import pytest

from verl_dppo.studies import plot
from verl_dppo.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_log(path, steps=20, val_every=5, truncate=False, score=lambda s: s / 20):
    lines = []
    for step in range(1, steps + 1):
        data = {
            "critic/score/mean": score(step),
            "actor/pg_clipfrac": 0.01 * (step % 3),
            "response_length/mean": 100.0 + step,
            "actor/dppo/mismatch_tv_mean": 1e-3,
            "perf/note": "strings are skipped",
        }
        if step % val_every == 0:
            data["val-core/math/acc/mean@1"] = step / 40
        lines.append(json.dumps({"step": step, "data": data}))
    text = "\n".join(lines) + "\n"
    if truncate:
        text += '{"step": 21, "data": {"critic/score/me'
    path.write_text(text)
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    log = write_log(tmp_path / "run.jsonl", truncate=True)
    run = plot.load_run(str(log))
    assert sorted(run.series["critic/score/mean"]) == list(range(1, 21))
    assert any("cut short" in w for w in run.warnings)
    assert main(["plot", str(log), "-o", str(tmp_path / "fig.png")]) == 0
    assert "line 21 is cut short" in capsys.readouterr().err
    assert_png(tmp_path / "fig.png")


def test_sparse_metric_keeps_only_its_logged_steps(tmp_path):
    run = plot.load_run(str(write_log(tmp_path / "run.jsonl", val_every=5)))
    assert run.series["val-core/math/acc/mean@1"] == {5: 0.125, 10: 0.25, 15: 0.375, 20: 0.5}
    assert "perf/note" not in run.series  # non-numeric values are not metrics
    metrics, _ = plot.select_metrics([run], None)
    assert metrics[:2] == ["critic/score/mean", "val-core/math/acc/mean@1"]


def test_overlay_two_runs_with_metric_list_and_wildcard(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", score=lambda s: 0.5)
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    first = write_log(tmp_path / "x" / "run.jsonl")
    second = write_log(tmp_path / "y" / "run.jsonl", score=lambda s: 0.3)
    out = tmp_path / "figs" / "cmp.png"
    assert (
        main(
            [
                "plot",
                str(first),
                str(second),
                str(a),
                "-o",
                str(out),
                "--metrics",
                "critic/score/mean,val-core/*",
                "--smooth",
                "3",
            ]
        )
        == 0
    )
    assert "2 panel(s), 3 run(s)" in capsys.readouterr().out
    assert_png(out)
    assert plot._label_runs([str(first), str(second)]) == ["x/run", "y/run"]


def test_a_resumed_run_keeps_the_latest_value_of_a_step(tmp_path):
    log = tmp_path / "run.jsonl"
    rows = [
        {"step": 1, "data": {"critic/score/mean": 0.1}},
        {"step": 2, "data": {"critic/score/mean": 0.2}},
        {"step": 2, "data": {"critic/score/mean": 0.25}},
    ]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert plot.load_run(str(log)).series["critic/score/mean"] == {1: 0.1, 2: 0.25}


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "the file is empty"),
        ("\n\n", "the file is empty"),
        ('[1, 2]\n{"a": 1}\n', "not a verl log"),
        ('{"step": 1, "data": {"x": "text"}}\n', "no numeric metric"),
        ('{"step": 1, "dat', "no complete verl file-logger row"),
    ],
)
def test_unusable_logs_give_one_line_errors(tmp_path, capsys, content, message):
    log = tmp_path / "run.jsonl"
    log.write_text(content)
    assert main(["plot", str(log), "-o", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "f.png").exists()


def test_cli_error_paths(tmp_path, capsys):
    log = write_log(tmp_path / "run.jsonl")
    (tmp_path / "empty").mkdir()
    cases = [
        (["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "f.png")], "no such file"),
        (["plot", str(tmp_path / "empty"), "-o", str(tmp_path / "f.png")], "a folder without a verl log"),
        (["plot", str(log), "-o", str(tmp_path / "f.txt")], "ending in one of"),
        (
            ["plot", str(log), "-o", str(tmp_path / "f.png"), "--metrics", "critic/score/maen"],
            "did you mean critic/score/mean",
        ),
        (["plot", str(log), "-o", str(tmp_path / "f.png"), "--smooth", "0"], "--smooth must be >= 1"),
        (["plot", str(log), "-o", str(tmp_path / "f.png"), "--labels", "a,b"], "--labels names 2 run(s)"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_partly_missing_metrics_warn_and_draw_the_rest(tmp_path, capsys):
    log = write_log(tmp_path / "run.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.4}}) + "\n")
    out = tmp_path / "f.png"
    metrics = "critic/score/mean,actor/pg_clipfrac,nope"
    assert main(["plot", str(log), str(other), "-o", str(out), "--metrics", metrics]) == 0
    err = capsys.readouterr().err
    assert "'nope'" in err and "actor/pg_clipfrac: not logged by other" in err
    assert_png(out)


def test_no_default_metric_present_names_the_available_ones(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"step": 1, "data": {"my/metric": 1.0}}) + "\n")
    assert main(["plot", str(log), "-o", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err
    assert "choose some with --metrics" in err and "my/metric" in err


def test_run_pins_verl_file_logger_under_dppo_root_and_plot_finds_it_by_name(tmp_path, monkeypatch, capsys):
    """`verl-dppo run` hands VERL_FILE_LOGGER_ROOT=$DPPO_ROOT/logs to Ray through the config verl merges into
    ray.init's runtime_env; verl's own FileLogger, in an actor's unrelated working directory, then writes
    logs/<project>/<experiment>.jsonl, and `plot <experiment>` / `plot --latest` find it there."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl.utils.tracking import FileLogger

    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.launch.run_logs import pin_file_logger

    root = tmp_path / "root"
    monkeypatch.setenv("DPPO_ROOT", str(root))
    for name in ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH"):
        monkeypatch.delenv(name, raising=False)
    config = compose_recipe("dense_8b", "dppo_binary_tv")
    pin_file_logger(config)
    OmegaConf.resolve(config)  # as `run` does on the driver
    ray_init = config.ray_kwargs.ray_init
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.runtime_env)  # verl's run_ppo
    actor_root = runtime_env.env_vars.VERL_FILE_LOGGER_ROOT
    assert actor_root == f"{root}/logs"

    worker_cwd = tmp_path / "ray_worker_cwd"
    worker_cwd.mkdir()
    monkeypatch.chdir(worker_cwd)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", actor_root)
    logger = FileLogger(config.trainer.project_name, config.trainer.experiment_name)
    for step in range(1, 6):
        logger.log({"critic/score/mean": step / 10, "actor/pg_clipfrac": 0.0}, step)
    logger.finish()
    assert (root / "logs" / "verl-dppo" / "dense_8b-dppo_binary_tv.jsonl").is_file()
    assert not list(worker_cwd.iterdir())
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT")

    assert main(["plot", "dense_8b-dppo_binary_tv", "-o", str(tmp_path / "by_name.png")]) == 0
    assert main(["plot", "verl-dppo/dense_8b-dppo_binary_tv", "-o", str(tmp_path / "by_project.png")]) == 0
    capsys.readouterr()
    assert main(["plot", "--latest", "-o", str(tmp_path / "latest.png")]) == 0
    # which run --latest drew (issue 32.5)
    err = capsys.readouterr().err
    assert "verl-dppo plot: --latest draws " in err and "dense_8b-dppo_binary_tv.jsonl" in err, err
    for name in ("by_name", "by_project", "latest"):
        assert_png(tmp_path / f"{name}.png")
    capsys.readouterr()

    assert main(["plot", "dense_8b-dppo_binary_kl", "-o", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err
    assert "no run of that experiment name" in err and "verl-dppo/dense_8b-dppo_binary_tv" in err
    assert main(["plot", "--latest", "--log-root", str(tmp_path / "empty"), "-o", str(tmp_path / "f.png")]) == 2
    assert "no run has logged under" in capsys.readouterr().err
    assert main(["plot", "-o", str(tmp_path / "f.png")]) == 2
    assert "give the runs to draw" in capsys.readouterr().err


def test_the_demos_logs_are_found_as_a_folder_by_latest_and_by_log_root(tmp_path, monkeypatch, capsys):
    """Issue 18.8: after `make demo` (`verl-dppo demo --out out/demo`: one log per method, written by verl's own
    FileLogger through VERL_FILE_LOGGER_PATH as the demo's rl.py does), `plot out/demo` draws every method,
    `plot --latest` finds the demo when nothing newer was logged under the log root, and `--log-root out/demo`
    finds its logs by name and --latest. A `verl-dppo run` log written after the demo is the latest again."""
    import os

    from verl.utils.tracking import FileLogger

    from verl_dppo.cli import build_parser
    from verl_dppo.launch import run_logs

    assert build_parser().parse_args(["demo"]).out == run_logs.DEMO_OUT  # `plot --latest` looks where demo writes
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    demo = tmp_path / "out" / "demo"
    demo.mkdir(parents=True)
    (demo / "summary.json").write_text("{}")
    for index, method in enumerate(("pg_is", "grpo_clip", "dppo_binary_tv")):
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(demo / f"{method}.jsonl"))
        logger = FileLogger("verl-dppo-demo", method)
        for step in range(1, 11):
            logger.log({"critic/score/mean": 0.5 + 0.01 * index * step, "actor/pg_clipfrac": 0.0}, step)
        logger.finish()
        os.utime(demo / f"{method}.jsonl", (1_000 + index, 1_000 + index))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")

    assert main(["plot", "out/demo", "-o", "all.png"]) == 0
    assert "3 run(s)" in capsys.readouterr().out
    assert main(["plot", "--latest", "-o", "latest.png"]) == 0
    captured = capsys.readouterr()
    assert "3 run(s)" in captured.out and "--latest: the demo in out/demo (3 runs; nothing under" in captured.err
    assert main(["plot", "--latest", "--log-root", "out/demo", "-o", "newest.png"]) == 0
    assert "1 run(s)" in capsys.readouterr().out
    assert plot.resolve_runs([], latest=True, log_root="out/demo") == [
        os.path.join("out", "demo", "dppo_binary_tv.jsonl")
    ]
    assert main(["plot", "grpo_clip", "pg_is", "--log-root", "out/demo", "-o", "named.png"]) == 0
    for name in ("all", "latest", "newest", "named"):
        assert_png(tmp_path / f"{name}.png")

    (tmp_path / "root" / "logs" / "verl-dppo").mkdir(parents=True)
    cluster = write_log(tmp_path / "root" / "logs" / "verl-dppo" / "dense_8b-dppo_binary_tv.jsonl")
    os.utime(cluster, (2_000, 2_000))
    assert plot.resolve_runs([], latest=True) == [str(cluster)]
    os.utime(cluster, (500, 500))  # the demo ran after it
    assert len(plot.resolve_runs([], latest=True)) == 3


def test_demo_figures_mark_collapse_say_one_seed_and_keep_the_legend_off_the_bars(tmp_path, monkeypatch):
    """Issue 12: blocked_probs.png's legend sat on the bars at mu < 0.45; reward.png had no collapse line (the
    demo's verdict: a COLLAPSE_WINDOW-step mean below COLLAPSE_FRACTION x the warm-start reward) and did not say
    its held-out panel is one seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_dppo.studies.demo.figures import draw_all
    from verl_dppo.studies.demo.rl import COLLAPSE_FRACTION

    bins = [0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0]
    results = []
    for index, method in enumerate(("pg_is", "grpo_clip", "dppo_binary_tv")):
        write_log(tmp_path / f"{method}.jsonl", score=lambda s, i=index: 0.5 - 0.01 * i * s)
        results.append(
            {
                "method": method,
                "initial_reward": 0.5,
                "collapse_window": 20,
                "prob_bins": bins,
                "blocked_by_prob": [0, 0, 0, 0, 0, 0, 0] if method == "pg_is" else [40, 30, 20, 10, 2, 1, 0],
                "updates_by_prob": [100] * 7,
                "held_out_accuracy": [[0, 0.5], [25, 0.5 + 0.1 * index]],
                "n_held_out": 1200,
            }
        )
    figures = []
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    paths = draw_all(str(tmp_path), results)
    for path in paths:
        assert open(path, "rb").read(8) == PNG_SIGNATURE
    reward, blocked = figures[0], figures[3]

    left, right = reward.axes
    collapse = [line for line in left.get_lines() if line.get_label().startswith("collapse")]
    assert len(collapse) == 1 and set(collapse[0].get_ydata()) == {COLLAPSE_FRACTION * 0.5}
    assert "20-step mean" in collapse[0].get_label()
    assert "seed 0, one run" in right.get_title()
    from matplotlib.colors import to_hex

    from verl_dppo.studies.colors import METHOD_COLORS

    method_lines = {
        line.get_label(): to_hex(line.get_color())
        for line in left.get_lines()
        if line.get_label() in ("pg_is", "grpo_clip", "dppo_binary_tv")
    }
    assert method_lines == {
        "pg_is": METHOD_COLORS["pg_is"],
        "grpo_clip": METHOD_COLORS["grpo_clip_higher"],
        "dppo_binary_tv": METHOD_COLORS["dppo_binary_tv"],
    }  # the colours `plot` gives them

    renderer = blocked.canvas.get_renderer()
    assert all(axis.get_legend() is None for axis in blocked.axes)
    (legend,) = blocked.legends
    assert [text.get_text() for text in legend.get_texts()] == ["grpo_clip (103 tokens)", "dppo_binary_tv (103 tokens)"]
    box = legend.get_window_extent(renderer)
    for axis in blocked.axes:
        assert not box.overlaps(axis.get_window_extent(renderer))
    monkeypatch.undo()
    plt.close("all")


def write_family_log(path, loss_mode, steps=4):
    """A `verl-dppo run` log of `loss_mode` with its run record beside it: a TROLL run logs the DPPO mask's metrics
    too (at 0) and its projection's; a DPPO run the mask's."""
    lines = []
    for step in range(1, steps + 1):
        data = {
            "critic/score/mean": 0.5,
            "actor/pg_clipfrac": 0.0,
            "actor/dppo/mismatch_tv_mean": 1e-3,
            "actor/dppo/masked_frac_pos": 0.0,
            "actor/dppo/masked_frac_neg": 0.0,
            "actor/dppo/bad_update_frac": 0.0,
            "actor/dppo/masked_rollout_prob_mean": 0.0,
        }
        if loss_mode == "troll":
            data.update(
                {
                    "actor/troll/projected_frac": 0.01 * step,
                    "actor/troll/kl_before_mean": 0.02,
                    "actor/troll/kl_after_mean": 0.01,
                    "actor/troll/eta_mean": 0.5,
                }
            )
        elif loss_mode.startswith("dppo_"):
            data["actor/dppo/masked_frac_pos"] = 0.02 * step
        lines.append(json.dumps({"step": step, "data": data}))
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".run.json").write_text(
        json.dumps({"setup": "cpu_tiny", "method": loss_mode, "loss_mode": loss_mode, "trainer_mode": "sync"})
    )
    return path


def drawn_figure(monkeypatch, argv):
    """Run `verl-dppo plot argv` and return the matplotlib figure it drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    assert main(["plot", *argv]) == 0
    monkeypatch.undo()
    (figure,) = figures
    return figure


def panels(figure):
    """{panel title: [(line label, colour, line style), ...]} (the raw-value shadows of --smooth left out)."""
    from matplotlib.colors import to_hex

    return {
        axis.get_title(): [
            (line.get_label(), to_hex(line.get_color()), line.get_linestyle())
            for line in axis.get_lines()
            if not line.get_label().startswith("_")
        ]
        for axis in figure.axes
        if axis.get_title()
    }


def test_panels_follow_the_loss_mode_each_method_in_its_colour_with_integer_steps(tmp_path, monkeypatch):
    """Issue 27.4: `plot` on a TROLL run drew the DPPO mask's panels (flat at 0) and no actor/troll/* panel. The
    default panels follow each run's loss mode (its run record): the projection's for TROLL, the mask's for DPPO,
    each drawn for the runs of its family only; the common ones for every run, later lines dashed so that equal
    values stay visible; one colour per method, the one the demo's figures use; integer ticks on 4 steps."""
    import matplotlib.pyplot as plt

    from verl_dppo.studies.colors import METHOD_COLORS

    troll = write_family_log(tmp_path / "cpu_tiny-troll-sync.jsonl", "troll")
    figure = drawn_figure(monkeypatch, [str(troll), "-o", str(tmp_path / "troll.png")])
    drawn = panels(figure)
    assert {"actor/troll/projected_frac", "actor/troll/kl_after_mean"} <= set(drawn)
    assert not any(title.startswith("actor/dppo/masked") or title == "actor/pg_clipfrac" for title in drawn)
    assert drawn["actor/troll/projected_frac"] == [("cpu_tiny-troll-sync", METHOD_COLORS["troll"], "-")]
    for axis in figure.axes:
        if axis.get_title():
            ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (axis.get_title(), ticks)
    plt.close(figure)

    dppo = write_family_log(tmp_path / "cpu_tiny-dppo_binary_tv-sync.jsonl", "dppo_binary_tv")
    figure = drawn_figure(monkeypatch, [str(dppo), str(troll), "-o", str(tmp_path / "both.png")])
    drawn = panels(figure)
    # the blocked fraction the README quotes, for the DPPO run only (issue 32.5)
    assert [label for label, _, _ in drawn["actor/pg_clipfrac"]] == ["cpu_tiny-dppo_binary_tv-sync"]
    assert [label for label, _, _ in drawn["actor/dppo/masked_frac_pos"]] == ["cpu_tiny-dppo_binary_tv-sync"]
    assert [label for label, _, _ in drawn["actor/troll/projected_frac"]] == ["cpu_tiny-troll-sync"]
    assert drawn["critic/score/mean"] == [
        ("cpu_tiny-dppo_binary_tv-sync", METHOD_COLORS["dppo_binary_tv"], "-"),
        ("cpu_tiny-troll-sync", METHOD_COLORS["troll"], "--"),
    ]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "cpu_tiny-dppo_binary_tv-sync",
        "cpu_tiny-troll-sync",
    ]
    plt.close(figure)


def test_the_r3_metrics_are_drawn_by_default_where_a_log_has_them(tmp_path, monkeypatch):
    """Issue 72.5: a run with rollout router replay gets its R3 panels without --metrics, beside every panel a DPPO
    run draws without R3; a run without them gets none."""
    import matplotlib.pyplot as plt

    plain = write_family_log(tmp_path / "cpu_tiny-dppo_binary_tv-sync.jsonl", "dppo_binary_tv")
    figure = drawn_figure(monkeypatch, [str(plain), "-o", str(tmp_path / "plain.png")])
    without = set(panels(figure))
    plt.close(figure)
    assert not any("/r3_" in title for title in without)
    lines = [json.loads(line) for line in plain.read_text().splitlines()]
    for line in lines:
        line["data"].update({name: 0.5 for name in plot.R3_METRICS})
    plain.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    figure = drawn_figure(monkeypatch, [str(plain), "-o", str(tmp_path / "r3.png")])
    assert set(panels(figure)) == without | set(plot.R3_METRICS)
    plt.close(figure)


def test_demo_and_plot_colour_a_method_alike():
    from verl_dppo.studies.colors import METHOD_COLORS, colors_for

    assert colors_for(
        [
            "dppo_binary_tv",
            "cpu_tiny-dppo_binary_tv-sync",
            "moe_base-troll-separate_async",
            "grpo_clip",
            "x/run",
            "y/run",
        ]
    ) == [
        METHOD_COLORS["dppo_binary_tv"],
        METHOD_COLORS["dppo_binary_tv"],
        METHOD_COLORS["troll"],
        METHOD_COLORS["grpo_clip_higher"],
        "#393b79",
        "#637939",
    ]
    assert len(set(METHOD_COLORS.values())) == len(METHOD_COLORS)
