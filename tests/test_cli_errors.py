"""Every command's bad inputs (issue 12): one line on stderr naming what to change, exit 2, never a traceback, and
before any slow work (no warm-up, no download, no Ray start). `run --dry-run` refuses what the launch refuses.

Most cases call `verl_dppo.cli.main` in-process (what the `verl-dppo` script calls); the few that concern the
process itself (a closed pipe, the installed script, an environment variable) run it through `subprocess`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_dppo.cli import main

BIN = os.path.dirname(sys.executable)


def assert_one_line_error(capsys, argv, *fragments, code=2):
    started = time.perf_counter()
    assert main(argv) == code, argv
    err = capsys.readouterr().err
    # verl's "[validate_config] All configuration checks passed" is not printed: it read as the verdict on a run
    # that the next line refused
    lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and "error:" in lines[0], (argv, err)
    for fragment in fragments:
        assert fragment in lines[0], (argv, fragment, lines[0])
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------- demo
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--out", "/proc/verl-dppo-x"], ["--out /proc/verl-dppo-x", "cannot create"]),
        (["--out", "{file}"], ["is a file, not a folder"]),
        (["--mini-batches", "0"], ["--mini-batches 0", "choose one of 1, 2, 4, 8"]),
        # the message names the real flag (there is no --prompts-per-step)
        (["--mini-batches", "3"], ["--mini-batches 3", "choose one of 1, 2, 4, 8"]),
        (["--lr", "-1"], ["--lr must be a positive number"]),
        (["--lr", "nan"], ["--lr must be a positive number"]),
        (["--seed", "-1"], ["--seed must be >= 0"]),
        (["--steps", "0"], ["--steps must be >= 1"]),
        (["--workers", "0"], ["--workers must be >= 1"]),
    ],
)
def test_demo_bad_flags_are_one_line_before_the_warm_up(tmp_path, capsys, argv, fragments):
    existing = tmp_path / "a_file"
    existing.write_text("x")
    argv = [part.format(file=existing) for part in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    seconds = assert_one_line_error(capsys, ["demo", *argv], *fragments)
    assert seconds < 5  # refused before the warm-up (about 20 s), which would also have written warmup.pt
    assert not (tmp_path / "out" / "warmup.pt").exists()


def test_demo_help_lists_every_method(capsys):
    from verl_dppo.studies.demo.methods import METHODS

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for method in METHODS:
        assert method.name in text


# ---------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize(
    "name, content, fragments",
    [
        ("bad.jsonl", '{"problem": "1+1", "answer": "2"}\n{bad\n', ["bad.jsonl: line 2: not valid JSON"]),
        ("string.json", '"hello"', ["expected a JSON list of rows", "found str"]),
        ("numbers.json", "[1, 2]", ["row 0 is a int"]),
        ("broken.parquet", "not parquet", ["not a readable parquet file"]),
        ("rows.csv", "a,b", ["expected a .parquet, .json or .jsonl file"]),
    ],
)
def test_data_unreadable_input_files(tmp_path, capsys, name, content, fragments):
    source = tmp_path / name
    source.write_text(content)
    assert_one_line_error(
        capsys, ["data", "aime24", "--from-file", str(source), "--out", str(tmp_path / "o")], *fragments
    )


def test_data_unwritable_out_is_refused_before_reading(tmp_path, capsys):
    source = tmp_path / "good.jsonl"
    source.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert_one_line_error(
        capsys, ["data", "aime24", "--from-file", str(source), "--out", "/proc/verl-dppo-x"], "--out /proc/verl-dppo-x"
    )
    assert_one_line_error(
        capsys, ["data", "aime24", "--from-file", str(source), "--out", str(source)], "is a file, not a folder"
    )


# ---------------------------------------------------------------------------------------------------- plot
@pytest.mark.parametrize("content", ["hello world\n", "step,reward\n1,0.5\n"])
def test_plot_on_plain_text_says_not_a_verl_log(tmp_path, capsys, content):
    log = tmp_path / "notes.txt"
    log.write_text(content)
    assert_one_line_error(capsys, ["plot", str(log), "-o", str(tmp_path / "f.png")], "not a verl log")


# --------------------------------------------------------------------------------------------------- doctor
def test_doctor_with_a_silent_ray_address_answers_at_once(capsys):
    # Nothing listens on port 9: ray.init would retry for minutes; the doctor checks the address first.
    seconds = assert_one_line_error(
        capsys, ["doctor", "--ray-address", "127.0.0.1:9"], "--ray-address=127.0.0.1:9", "ray start --head"
    )
    assert seconds < 10


def test_ray_probe_is_killed_at_its_deadline():
    from verl_dppo.launch.ray_probe import RayUnreachable, run_probe

    started = time.perf_counter()
    with pytest.raises(RayUnreachable, match="did not answer within 0.5 s"):
        run_probe("worker", None, timeout_s=0.5)
    assert time.perf_counter() - started < 10


PLUGIN_MODES = (
    "dppo_binary_kl",
    "dppo_binary_tv",
    "dppo_topk_kl",
    "dppo_topk_tv",
    "grpo_clip",
    "ipo",
    "pg_is",
    "troll",
)


@pytest.mark.parametrize(
    "engines, flags, code, verdict",
    [
        ({"vllm": "0.11.0", "sglang": None}, [], 0, "READY: verl-dppo loads"),
        ({"vllm": None, "sglang": "0.5.0"}, [], 0, "READY: verl-dppo loads"),
        ({"vllm": None, "sglang": None}, [], 1, "NOT READY."),
        ({"vllm": None, "sglang": None}, ["--plugin-only"], 0, "OK (--plugin-only)"),
    ],
)
def test_doctor_ready_means_the_plugin_loads_and_a_rollout_engine_is_there(
    capsys, monkeypatch, engines, flags, code, verdict
):
    """Issue 18.9: README's "exit code 0 = ready" = every mode of the plugin (troll included) in verl's registry,
    the hook installed, and vLLM or SGLang importable; without an engine, a named problem (exit 1), or a named
    warning under --plugin-only (a machine that will not train: CI, this suite)."""
    from verl_dppo.launch import doctor

    monkeypatch.setattr(doctor, "engines_here", lambda: engines)
    assert main(["doctor", "--no-ray", *flags]) == code
    out = capsys.readouterr().out
    assert f"this process: modes {', '.join(PLUGIN_MODES)}; anchoring hook installed" in out
    assert verdict in out
    no_engine = "no rollout engine: neither vLLM nor SGLang is importable here"
    assert (no_engine in out) == (not any(engines.values()))
    if not any(engines.values()):
        assert (f"WARNING: {no_engine}" in out) == bool(flags)
        assert ("  - " + no_engine in out) == (not flags)
    assert ("only SGLang is installed" in out) == (engines["sglang"] is not None and engines["vllm"] is None)


def test_doctor_expects_the_plugins_own_modes_and_names_a_missing_one(capsys, monkeypatch):
    """The expected modes are the plugin's table (LOSS_MODES), the listed ones verl's registry: a mode missing from
    the registry (here troll, which the hand list of six never checked) is named and the exit code is 1."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_dppo.launch import doctor

    monkeypatch.setattr(doctor, "engines_here", lambda: {"vllm": "0.11.0", "sglang": None})
    monkeypatch.delitem(POLICY_LOSS_REGISTRY, "troll")
    assert main(["doctor", "--no-ray"]) == 1
    out = capsys.readouterr().out
    assert "this process: loss modes not registered: troll" in out and "Fix: install verl-dppo" in out


# -------------------------------------------------------------------------------------------------- recipes
def test_recipes_into_a_closed_pipe_exits_quietly():
    # `verl-dppo recipes -v | head -1`: the reader closes the pipe after one line.
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    writer = subprocess.run(
        [os.path.join(BIN, "verl-dppo"), "recipes", "-v"],
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    reader.stdin.close()
    reader.wait(timeout=30)
    assert writer.returncode == 0 and writer.stderr == "", writer.stderr


def test_recipes_summaries_are_whole_sentences(capsys):
    assert main(["recipes", "-v"]) == 0
    out = capsys.readouterr().out
    summaries = [line.strip() for line in out.splitlines() if line.startswith("   ") and line.strip()]
    assert summaries and all(line.endswith(".") for line in summaries), summaries


# ------------------------------------------------------------------------------------------------------ run
@pytest.fixture
def root(tmp_path, monkeypatch):
    """A DPPO_ROOT whose model folder and data files the pre-flight checks accept."""
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = tmp_path / "models" / "Qwen3-8B-Base"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "1+1"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0},
    }
    for name in ("dapo-math", "aime24", "aime25"):
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / "data" / f"{name}.parquet")
    return tmp_path


DRY = ["run", "dense_8b", "--method", "dppo_binary_tv", "--dry-run"]


@pytest.mark.parametrize(
    "override, fragments",
    [
        # the launch runs verl's v1 trainer only: a dry run refuses the legacy one too
        ("trainer.use_v1=False", ["trainer.use_v1=False", "remove trainer.use_v1=False"]),
        ("data.train_batch_size=abc", ["data.train_batch_size=abc: expected an integer"]),
        ("actor_rollout_ref.actor.optim.lr=fast", ["optim.lr=fast: expected a number"]),
        ("trainer.val_before_train=maybe", ["expected a boolean"]),
        ("optim.lr=1e-6", ["did you mean actor_rollout_ref.actor.optim.lr"]),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binray_tv", ["Did you mean 'dppo_binary_tv'"]),
        # DPPOLossConfig's own check is reported as the plugin's, not as verl's validate_config
        (
            "actor_rollout_ref.actor.policy_loss.anchor=both",
            ["verl-dppo rejects actor_rollout_ref.actor.policy_loss", "anchor must be one of"],
        ),
    ],
)
def test_dry_run_refuses_what_the_launch_refuses(root, capsys, override, fragments):
    assert_one_line_error(capsys, [*DRY, override], *fragments)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--trainer-mode", "async"], ["unknown trainer mode 'async'", "separate_async"]),
        (["trainer.v1.trainer_mode=separate_async"], ["choose the trainer with --trainer-mode separate_async"]),
        (
            ["--trainer-mode", "separate_async", "data.train_batch_size=100"],
            ["parameter_sync_step", "not a whole number", "ppo_mini_batch_size=32"],
        ),
        (
            ["--trainer-mode", "separate_async", "actor_rollout_ref.rollout.calculate_log_probs=False"],
            ["calculate_log_probs=True"],
        ),
    ],
)
def test_trainer_mode_switch_bad_input_is_one_line(root, capsys, extra, fragments):
    assert_one_line_error(capsys, [*DRY, *extra], *fragments)
    assert capsys.readouterr().out == ""


def test_separate_async_launch_counts_the_rollout_pool_gpus(root, capsys):
    assert main([*DRY[:-1], "--trainer-mode", "separate_async", "trainer.n_gpus_per_node=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import torch

    if torch.cuda.device_count() < 2:  # 1 for the trainer + the rollout pool's 1 (rollout.n_gpus_per_node follows)
        assert "trainer.n_gpus_per_node=1 + actor_rollout_ref.rollout.nnodes x n_gpus_per_node = 1" in err


@pytest.mark.parametrize(
    "override, resolved",
    [
        # a recipe's integer where verl's config dataclass declares a float takes a fraction (issue 34.4)
        ("actor_rollout_ref.actor.entropy_coeff=0.01", "entropy_coeff: 0.01"),
        ("actor_rollout_ref.actor.clip_ratio_c=3.0", "clip_ratio_c: 3.0"),
        ("actor_rollout_ref.rollout.over_sample_rate=0.1", "over_sample_rate: 0.1"),
    ],
)
def test_a_number_verl_declares_float_takes_a_fraction(root, capsys, override, resolved):
    assert main([*DRY, override]) == 0
    assert resolved in capsys.readouterr().out


def test_ulysses_sequence_parallelism_without_flash_attention_is_refused(root, capsys):
    """Issue 34: verl 0.9.1's Ulysses SP exchanges the slices around flash-attention only; with sdpa (the CPU's) each
    rank would attend within its own slice. Refused, naming both settings; with flash-attention (the recipes') it runs."""
    sp2 = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
    assert_one_line_error(
        capsys,
        [*DRY, sp2, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"],
        "ulysses_sequence_parallel_size=2",
        "attn_implementation=sdpa",
        "flash-attention",
    )
    assert main([*DRY, sp2]) == 0


FROM_GRPO = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv",
    "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig",
    "+actor_rollout_ref.actor.policy_loss.delta_low=0.15",
    "+actor_rollout_ref.actor.policy_loss.delta_high=0.15",
    "+actor_rollout_ref.actor.policy_loss.ratio_cap=10000",
    "algorithm.rollout_correction.bypass_mode=True",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
]
"""The README's "From GRPO" overrides (issue 32.3), bypass mode included (issue 43.2)."""


def test_a_grpo_command_switched_by_loss_mode_alone_is_warned_and_the_readme_switch_is_not(root, capsys):
    grpo = ["run", "dense_8b", "--method", "grpo_clip_higher", "--dry-run"]
    assert main([*grpo, FROM_GRPO[0]]) == 0
    err = capsys.readouterr().err
    assert "clip_ratio_low=0.2 clip_ratio_high=0.28" in err and "inherited from verl's ratio clip" in err, err
    assert main([*grpo, *FROM_GRPO]) == 0
    captured = capsys.readouterr()
    assert "inherited" not in captured.err
    assert (
        "delta_low: 0.15" in captured.out and "delta_high: 0.15" in captured.out and "ratio_cap: 10000" in captured.out
    )


def test_an_integer_verl_declares_int_refuses_a_fraction(root, capsys):
    assert_one_line_error(
        capsys,
        [*DRY, "actor_rollout_ref.actor.ppo_epochs=1.5"],
        "ppo_epochs=1.5: expected an integer like the recipe's value 1",
    )


def test_plus_prefixed_overrides_are_accepted_as_in_main_ppo(root, capsys):
    assert main([*DRY, "+actor_rollout_ref.actor.policy_loss.delta_low=0.1"]) == 0
    assert "delta_low: 0.1" in capsys.readouterr().out


def test_launch_pre_flight_checks_the_model_folder_and_the_data_files(root, capsys):
    (root / "models" / "Qwen3-8B-Base" / "config.json").unlink()
    (root / "data" / "aime24.parquet").write_text("not parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "1+1"}]), root / "data" / "aime25.parquet")
    # A dry run warns (and prints the YAML); the launch refuses, before any Ray start.
    assert main(DRY) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("actor_rollout_ref:") or "actor_rollout_ref:" in captured.out
    for fragment in (
        "holds no config.json",
        "hf download Qwen/Qwen3-8B-Base",
        "aime24.parquet is not readable as parquet",
        "aime25.parquet lacks the column(s) verl reads: prompt, data_source, reward_model",
        "at launch from here",
    ):
        assert fragment in captured.err, fragment
    assert main(DRY[:-1]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the run cannot start" in err and "holds no config.json" in err
    assert "[validate_config]" not in err


def test_launch_pre_flight_checks_gpus_engine_and_nodes_here(root, capsys):
    import importlib.util

    assert main([*DRY[:-1], "trainer.nnodes=2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "trainer.nnodes=2 needs a Ray cluster" in err
    import torch

    if torch.cuda.device_count() < 8:
        assert "trainer.n_gpus_per_node=8, but" in err
    if importlib.util.find_spec("vllm") is None:
        assert "vllm is not installed here" in err


def test_run_with_no_ray_cluster_is_one_line_not_a_ray_traceback(root):
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9", DPPO_ROOT=str(root))
    result = subprocess.run(
        [os.path.join(BIN, "verl-dppo"), *DRY[:-1]], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "RAY_ADDRESS=127.0.0.1:9: no Ray cluster answers there" in result.stderr
    assert result.stdout == ""


def test_top_level_guard_turns_user_errors_into_one_line(capsys, monkeypatch):
    from verl_dppo.launch import commands as launch

    def broken(args):
        raise PermissionError(13, "Permission denied", "/root/dppo/data")

    monkeypatch.setattr(launch, "cmd_recipes", broken)  # main() builds its parser afresh: it picks this up
    assert_one_line_error(capsys, ["recipes"], "/root/dppo/data: Permission denied")


def test_guard_reports_a_ray_connection_error_in_one_line(capsys, monkeypatch):
    from verl_dppo.launch import commands as launch

    def no_cluster(args):
        raise ConnectionError("Could not find any running Ray instance.\nPlease specify the one to connect to")

    monkeypatch.setattr(launch, "cmd_recipes", no_cluster)
    assert_one_line_error(capsys, ["recipes"], "Could not find any running Ray instance", "ray start --head")


def test_verls_own_import_refusing_this_machine_is_one_line_and_ours_stays_a_traceback(capsys, monkeypatch):
    """verl 0.9.1's `import verl` raises ImportError where VERL_USE_MODELSCOPE=True and modelscope is missing (one of
    verl's example scripts sets it): every command then stopped with a traceback. Raised by verl's own __init__ it is
    one line; an ImportError of verl-dppo's own code is a bug and keeps its traceback."""
    from verl_dppo.launch import commands as launch

    def verl_refuses(args):
        exec(
            compile(
                "raise ImportError('You are using the modelscope hub, please install modelscope')",
                str(Path("site-packages") / "verl" / "__init__.py"),
                "exec",
            )
        )

    monkeypatch.setattr(launch, "cmd_recipes", verl_refuses)
    assert_one_line_error(capsys, ["recipes"], "verl does not import here: You are using the modelscope hub")

    def ours(args):
        raise ImportError("cannot import name 'gone' from 'verl_dppo.plugin'")

    monkeypatch.setattr(launch, "cmd_recipes", ours)
    with pytest.raises(ImportError, match="gone"):
        main(["recipes"])


@pytest.mark.parametrize("steps", ["-5", "0"])
def test_a_run_of_no_step_is_refused_at_once(tmp_path, capsys, monkeypatch, steps):
    """Issue 24.5: `trainer.total_training_steps<=0` started Ray, trained nothing, exited 0 and left an empty log and a
    run record. Refused in one line, before Ray and before anything is written."""
    from verl_dppo.launch import commands as launch

    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    monkeypatch.setattr(launch, "_launch", lambda *a: pytest.fail("launched"))
    assert_one_line_error(
        capsys,
        ["run", "cpu_tiny", "--method", "dppo_binary_tv", f"trainer.total_training_steps={steps}"],
        f"trainer.total_training_steps={steps}: a run trains at least one step",
    )
    assert list(tmp_path.iterdir()) == []  # no model, data, record or log written


@pytest.mark.parametrize(
    "flag, values", [("--method", ("dppo_binary_tv", "pg_is")), ("--trainer-mode", ("sync", "separate_async"))]
)
def test_an_option_given_twice_is_refused(capsys, flag, values):
    """Issue 24.5: the last `--method` won silently."""
    argv = ["run", "cpu_tiny", "--method", "dppo_binary_tv", "--dry-run"]
    argv += [flag, values[1]] if flag == "--method" else [flag, values[0], flag, values[1]]
    seconds = assert_one_line_error(capsys, argv, f"{flag} given twice ({values[0]} and {values[1]})")
    assert seconds < 1


def test_doctor_names_what_verls_trainer_imports_and_is_missing(capsys, monkeypatch):
    """Issue 24.4: `pip install verl==0.9.1 && pip install .` lacked TransferQueue, so `verl-dppo run` failed in a Ray
    worker after 41 s. The plugin requires what verl's trainer imports; doctor names what is missing (exit 1)."""
    import importlib.util
    import re
    from importlib.metadata import requires

    from verl_dppo.launch import doctor
    from verl_dppo.launch.install_probe import TRAINER_MODULES

    required = {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].lower() for r in requires("verl-dppo") if "extra ==" not in r}
    assert {p.lower() for p in TRAINER_MODULES.values()} <= required
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transfer_queue" else real(name, *a)
    )
    monkeypatch.setattr(doctor, "engines_here", lambda: {"vllm": "0.11.0", "sglang": None})
    assert main(["doctor", "--no-ray"]) == 1
    out = capsys.readouterr().out
    assert "  - verl's trainer imports TransferQueue, not installed here" in out and "NOT READY." in out


def test_a_tv_threshold_above_one_is_warned_in_one_line(root, capsys):
    """Issue 24 (smaller): TV <= 1, so delta_high=5 for a TV mode is no trust region at all; said in one line at
    launch (and by the loss in the worker, `tv_threshold_warning`). 1.0 (Sec. 5.3's minimal mask) and KL modes
    are silent."""
    from verl_dppo.plugin.paper_settings import tv_threshold_warning

    assert main([*DRY, "actor_rollout_ref.actor.policy_loss.delta_high=5"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "exceeds 1" in line]
    assert lines == [
        "verl-dppo: warning: dppo_binary_tv: delta_high=5 exceeds 1, the largest total variation: that "
        "side masks nothing (no trust region; 1.0 says so on purpose). TV thresholds are fractions such "
        "as 0.15, not KL values or percentages"
    ]
    assert main([*DRY[:3], "minimal_mask_0.5", "--dry-run"]) == 0
    assert "exceeds 1" not in capsys.readouterr().err
    assert tv_threshold_warning("dppo_binary_kl", 5.0, 5.0) is None
    assert "delta_low=2" in tv_threshold_warning("dppo_topk_tv", 2.0, 0.2)


def test_doctor_says_what_this_environment_can_train(capsys, monkeypatch):
    """Issue 25 (and 27.5): doctor names CPU training with the hf rollout, vLLM's CPU build as the vllm rollout where
    installed (what is missing where not), and GPU engines; --plugin-only no longer says "no training" where cpu_tiny
    trains."""
    from verl_dppo.launch import doctor
    from verl_dppo.rehearsal.setups import vllm_cpu

    assert main(["doctor", "--no-ray", "--plugin-only"]) == 0
    out = capsys.readouterr().out
    assert "CPU, hf rollout (cpu_tiny): yes" in out and "no training from this environment" not in out
    if vllm_cpu.cpu_build_version() and not vllm_cpu.needs_alias():
        assert "CPU, vllm rollout: yes: vllm-cpu 0.27.1" in out
    from verl_dppo.rehearsal import isa  # issue 40.1: the branch this CPU's kernels take, by name

    assert f"    CPU branch: {isa.level()}, as this CPU is; vLLM-CPU loads _C" in out, out
    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: None)
    monkeypatch.setattr(doctor, "engines_here", lambda: {"vllm": None, "sglang": None})
    assert main(["doctor", "--no-ray", "--plugin-only"]) == 0
    out = capsys.readouterr().out
    assert "CPU, vllm rollout: no: vLLM's CPU build (vllm-cpu) is not installed" in out
    assert "GPU: no: no GPU build of vLLM or SGLang here" in out


def test_the_readme_from_grpo_switch_is_the_one_tested():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme[readme.index("## From GRPO") : readme.index("## Loss modes")]
    lines = [line.strip().rstrip("\\").strip() for line in block.splitlines()]
    for line in FROM_GRPO:
        assert line in lines, line


@pytest.mark.parametrize(
    "argv, fragments",
    [
        # verl's own loss mode given as a method: the plugin's method of the same rule (issue 32.5)
        (
            ["run", "cpu_tiny", "--method", "dppo_tv", "--dry-run"],
            ["Did you mean 'dppo_binary_tv'", "verl's loss mode"],
        ),
        # a typo in a DPPOLossConfig key: the field it is close to
        (
            [
                "run",
                "cpu_tiny",
                "--method",
                "dppo_binary_tv",
                "+actor_rollout_ref.actor.policy_loss.delta_hi=0.1",
                "--dry-run",
            ],
            ["'delta_hi'", "Did you mean actor_rollout_ref.actor.policy_loss.delta_high?"],
        ),
        # a plugin key under verl's PolicyLossConfig: the _target_ switch
        (
            [
                "run",
                "cpu_tiny",
                "--method",
                "dppo_binary_tv",
                "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig",
                "--dry-run",
            ],
            ["PolicyLossConfig", "_target_=verl_dppo.DPPOLossConfig"],
        ),
    ],
)
def test_near_misses_name_the_fix(tmp_path, monkeypatch, capsys, argv, fragments):
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    assert_one_line_error(capsys, argv, *fragments)


def test_a_misspelled_existing_key_is_answered_with_the_key_not_with_hydras_append(tmp_path, monkeypatch, capsys):
    """Issue 43.5: `run` passed on Hydra's "To append to your config use +KEY" for a misspelled key of verl's, telling
    the user to add the typo; it answers with the nearest existing key alone, as `check` does."""
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    argv = [
        "run",
        "cpu_tiny",
        "--method",
        "dppo_binary_tv",
        "actor_rollout_ref.rollout.calculate_log_prob=True",
        "--dry-run",
    ]
    assert_one_line_error(
        capsys,
        argv,
        "actor_rollout_ref.rollout.calculate_log_prob=True: verl's config has no key "
        "actor_rollout_ref.rollout.calculate_log_prob; did you mean "
        "actor_rollout_ref.rollout.calculate_log_probs?",
    )
    assert main(argv) == 2 and "append" not in capsys.readouterr().err
    # a key that a group choice brings (the README's Megatron line): looked up after the choice, and near-missed there
    from verl_dppo.launch.compose import RecipeError, compose_recipe

    with pytest.raises(RecipeError, match="did you mean actor_rollout_ref.actor.megatron.tensor_model_parallel_size"):
        compose_recipe(
            "cpu_tiny",
            "troll",
            ["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_paralel_size=2"],
        )


def test_an_unwritable_dppo_root_is_named_by_the_dry_run_and_the_launch(monkeypatch, capsys):
    """DPPO_ROOT=/proc/nope: the dry run warns, the launch refuses before building anything, naming DPPO_ROOT."""
    monkeypatch.setenv("DPPO_ROOT", "/proc/nope")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["run", "cpu_tiny", "--method", "dppo_binary_tv", "--dry-run"]) == 0
    assert "DPPO_ROOT=/proc/nope: cannot create /proc/nope/checkpoints" in capsys.readouterr().err
    assert_one_line_error(
        capsys,
        ["run", "cpu_tiny", "--method", "dppo_binary_tv"],
        "DPPO_ROOT=/proc/nope",
        "set DPPO_ROOT to a writable folder",
    )


def test_a_method_run_with_another_loss_mode_is_named_after_both(root, capsys):
    """Issue 32.5: `--method grpo_clip_higher ...loss_mode=dppo_binary_tv` trains DPPO: its experiment (checkpoints,
    log) and the console say so, not grpo_clip_higher alone; a name the user gives is kept."""
    switch = "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv"
    assert main(["run", "dense_8b", "--method", "grpo_clip_higher", switch, "--dry-run"]) == 0
    assert "experiment_name: dense_8b-grpo_clip_higher+dppo_binary_tv\n" in capsys.readouterr().out
    assert (
        main(["run", "dense_8b", "--method", "grpo_clip_higher", switch, "trainer.experiment_name=mine", "--dry-run"])
        == 0
    )
    assert "experiment_name: mine\n" in capsys.readouterr().out
    assert main(["run", "dense_8b", "--method", "dppo_binary_tv", "--dry-run"]) == 0
    assert "experiment_name: dense_8b-dppo_binary_tv\n" in capsys.readouterr().out
