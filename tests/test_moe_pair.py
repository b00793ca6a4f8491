"""`verl-dppo moe-pair` (issue 72.4): the same warmed-up cpu_tiny MoE through `verl-dppo run`, with R3 and without
(routes returned and compared, not replayed), tabulated per step from verl's own JSONL logs. The launches here are
stand-ins that write what verl's file logger writes (docs/megatron.md has a real pair, by the command it names);
each arm's command is composed for real, through verl's checks (`run --dry-run`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_dppo.cli import main
from verl_dppo.studies import moe_pair


def _fake(calls: list, short: str = ""):
    def launch(arguments, log):
        out = Path(next(a.split("=", 1)[1] for a in arguments if a.startswith("trainer.default_local_dir="))).parent
        name = next(a.split("=", 1)[1] for a in arguments if a.startswith("trainer.experiment_name="))
        calls.append(name)
        r3 = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3" in arguments
        steps = int(next(a.split("=", 1)[1] for a in arguments if a.startswith("trainer.total_training_steps=")))
        path = out.parent / "logs" / "verl-dppo" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            for step in range(1, steps + (0 if name == short else 1)):
                data = {
                    "critic/score/mean": 0.5,
                    "actor/dppo/r3_router_differs_frac": 0.02,
                    "actor/dppo/r3_replayed_frac": 1.0 if r3 else 0.98,
                    "actor/dppo/r3_route_fit": 0.99,
                    "training/rollout_probs_diff_mean": 1e-3 if r3 else 2e-3,
                    "actor/dppo/mismatch_tv_mean": 0.02,
                    "actor/pg_clipfrac": 0.01,
                    "actor/grad_norm": 0.3,
                }
                handle.write(json.dumps({"step": step, "data": data}) + "\n")
        return 0

    return launch


def test_both_arms_run_once_per_seed_and_are_tabulated_side_by_side(tmp_path):
    calls = []
    code, table = moe_pair.run_pair("dppo_binary_tv", "hf", [0], 2, tmp_path, ["x=1"], launch=_fake(calls))
    assert code == 0 and calls == ["moe-pair-hf-r3-seed0", "moe-pair-hf-nor3-seed0"]
    assert table["arms"]["R3"]["experts not the rollout's"] == [0.0, 0.0]
    assert [round(v, 6) for v in table["arms"]["no R3"]["experts not the rollout's"]] == [0.02, 0.02]
    assert table["arms"]["no R3"]["log-prob mismatch TV"] == [2e-3, 2e-3]
    assert json.loads((tmp_path / "pair.json").read_text())["arms"]["R3"]["reward"] == [0.5, 0.5]
    text = moe_pair.pair_table(table)
    assert "| step | R3: reward | no R3: reward |" in text and text.count("\n") == 3
    again = []
    assert moe_pair.run_pair("dppo_binary_tv", "hf", [0], 2, tmp_path, ["x=1"], launch=_fake(again))[0] == 0
    assert again == []  # every step logged under the same arguments: not launched again
    assert (
        moe_pair.run_pair(
            "dppo_binary_tv", "hf", [0], 2, tmp_path, ["x=2"], launch=_fake(again, short="moe-pair-hf-nor3-seed0")
        )[0]
        == 1
    )  # a run short: exit 1
    assert again == ["moe-pair-hf-r3-seed0", "moe-pair-hf-nor3-seed0"]


def test_each_arm_is_a_valid_launch_and_the_without_arm_measures_without_replaying():
    """Both arms pass verl's checks as `verl-dppo run` composes them; the without-R3 arm's routes go to the
    trainer's routers in `measure` mode (counted, not replayed); R2 on FSDP is still refused."""
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.plugin.run_config import fsdp_router_replay_problem

    for arm in moe_pair.ARMS:
        config = compose_recipe("cpu_tiny", "dppo_binary_tv", moe_pair.arm_overrides("vllm", arm))
        assert fsdp_router_replay_problem(config) is None, arm
        mode = config.actor_rollout_ref.actor.fsdp_config.router_replay.mode
        assert mode == {"R3": "R3", "no R3": "measure"}[arm]
    config = compose_recipe(
        "cpu_tiny", "dppo_binary_tv", [*moe_pair.ROUTES, "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2"]
    )
    assert "replays R3 only, or measures" in fsdp_router_replay_problem(config)
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_dppo.cli",
            "run",
            "cpu_tiny",
            "--method",
            "dppo_binary_tv",
            "--dry-run",
            *moe_pair.arm_overrides("hf", "no R3"),
        ],
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0 and "passed verl's checks" in dry.stderr, dry.stderr[-2000:]


def test_bad_options_are_one_line(tmp_path, capsys):
    assert main(["moe-pair", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps 0: give at least 1" in capsys.readouterr().err
    assert main(["moe-pair", "--out", str(tmp_path), "trainer.experiment_name=x"]) == 2
    assert "the study sets trainer.experiment_name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["moe-pair", "--out", str(tmp_path), "--rollout", "sglang"])
