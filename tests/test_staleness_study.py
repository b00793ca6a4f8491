"""Issue 14.6: `verl-dppo staleness` at tiny size. The rollout engine really samples with the weights of L steps ago,
the plugin's own lag metric logs min(L, s - 1) at every step, lag 0 leaves the demo's RL loop as it was, the command
writes its logs, table, summary and figures, and bad flags are one line and exit 2 before the warm-up."""

import functools
import json
import math

import pytest
import torch

import verl  # noqa: F401  (loads the plugin)
from verl_dppo.cli import main
from verl_dppo.studies.demo import rl, staleness
from verl_dppo.studies.demo.methods import runnable_methods
from verl_dppo.studies.demo.policy import RolloutEngine, build_policy
from verl_dppo.studies.demo.settings import DemoSettings
from verl_dppo.studies.demo.warmup import warm_start

TINY = dict(steps=2, prompts_per_step=4, samples_per_prompt=4, mini_batches=2, micro_batch_size=4, val_every=1)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def warm():
    torch.set_num_threads(1)
    return warm_start(seed=0, target_accuracy=0.3, n_train=32, n_val=32, n_candidates=160, probe_samples=8)


def rows(path):
    return [json.loads(line)["data"] for line in path.read_text().splitlines()]


def without(row, *prefixes):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", *prefixes))}


@pytest.mark.parametrize("lag", [2, 0])
def test_the_rollout_samples_with_the_weights_of_lag_steps_ago(warm, tmp_path, monkeypatch, lag):
    # Record, at each rollout, the learner's weights (version s - 1) and what the engine sampled; then replay every
    # rollout on a fresh engine synced from version max(0, s - 1 - lag): the same log-probs, bit for bit.
    learners, rollouts = [], []

    def recording_policy(*args, **kwargs):
        learners.append(build_policy(*args, **kwargs))
        return learners[-1]

    class RecordingEngine(RolloutEngine):
        def generate_with_topk(self, prompts, temperature, generator, k):
            if temperature == 0:  # validation (greedy), not a rollout
                return super().generate_with_topk(prompts, temperature, generator, k)
            state = {n: v.detach().clone() for n, v in learners[0].state_dict().items()}
            seed_state = generator.get_state()
            out = super().generate_with_topk(prompts, temperature, generator, k)
            rollouts.append((state, prompts, seed_state, out[1]))
            return out

    monkeypatch.setattr(rl, "build_policy", recording_policy)
    monkeypatch.setattr(rl, "RolloutEngine", RecordingEngine)
    (method,) = runnable_methods(["pg_is"])
    settings = DemoSettings(**{**TINY, "steps": 5, "val_every": 100}, rollout_lag=lag, bypass=True, version_fields=True)
    rl.train_method(method, settings, warm, str(tmp_path))
    assert len(rollouts) == 5
    versions = [state for state, *_ in rollouts]  # versions[v] = the learner after v RL steps
    assert not torch.equal(versions[0]["lm_head.weight"], versions[4]["lm_head.weight"])  # the learner moved
    for step, (_, prompts, seed_state, mu) in enumerate(rollouts, start=1):
        policy = build_policy(0)
        policy.load_state_dict(versions[max(0, step - 1 - lag)])
        generator = torch.Generator()
        generator.set_state(seed_state)
        _, replayed = RolloutEngine(policy).generate(prompts, settings.temperature, generator)
        assert torch.equal(replayed, mu), f"step {step}: mu is not version {max(0, step - 1 - lag)}"
        if lag and step > 2:  # and not the learner's current weights
            current = build_policy(0)
            current.load_state_dict(versions[step - 1])
            generator.set_state(seed_state)
            assert not torch.equal(RolloutEngine(current).generate(prompts, 1.0, generator)[1], mu)


def test_sync_state_equals_sync(warm):
    policy = build_policy(0)
    policy.load_state_dict(warm.policy_state)
    for precision in ("bf16-emulated", "fp32"):
        engine, fresh = RolloutEngine(build_policy(1), precision), RolloutEngine(policy, precision)
        engine.sync_state(policy.state_dict())
        for a, b in zip(engine.model.parameters(), fresh.model.parameters()):
            assert torch.equal(a, b)


def test_lag_zero_leaves_the_demo_loop_unchanged(warm, tmp_path):
    # Lag 0 and bypass off: the same rows as the plain demo; the version fields only add the plugin's lag metrics.
    # With anchor=rollout the loss never reads old_log_probs, so bypass mode changes nothing for it either.
    (method,) = runnable_methods(["dppo_binary_tv"])
    runs = {"plain": {}, "versions": dict(version_fields=True), "bypass": dict(version_fields=True, bypass=True)}
    logged = {}
    for name, extra in runs.items():
        rl.train_method(method, DemoSettings(**TINY, **extra), warm, str(tmp_path), run_name=name)
        logged[name] = rows(tmp_path / f"{name}.jsonl")
    assert not any(k.startswith("actor/dppo/lag_") for row in logged["plain"] for k in row)
    assert [row.get("actor/dppo/lag_mean") for row in logged["versions"]] == [None, 0.0, 0.0]
    plain = [without(row) for row in logged["plain"]]
    assert [without(row, "actor/dppo/lag_") for row in logged["versions"]] == plain
    assert [without(row, "actor/dppo/lag_") for row in logged["bypass"]] == plain


def test_the_decoupled_row_anchors_on_the_recompute(warm, tmp_path):
    # Stale rollouts: anchored on mu the trust region sees D(mu_stale, pi); anchored on the recompute, D(pi_old, pi).
    settings = DemoSettings(**{**TINY, "steps": 4}, rollout_lag=2, bypass=True, version_fields=True)
    masked = {}
    for name in ("dppo_binary_tv", "dppo_binary_tv_recompute"):
        (method,) = runnable_methods([name])
        result = rl.train_method(method, settings, warm, str(tmp_path))
        masked[name] = result["masked_frac"]
        assert rows(tmp_path / f"{name}.jsonl")[-1]["actor/dppo/lag_mean"] == 2.0
    assert masked["dppo_binary_tv"] != masked["dppo_binary_tv_recompute"]


def test_staleness_command_end_to_end(tmp_path, capsys, monkeypatch):
    from verl_dppo.studies.demo import warmup

    tiny = DemoSettings(**TINY, warmup_target=0.3, n_train=32, n_val=32)
    monkeypatch.setattr(staleness, "base_settings", lambda: tiny)
    monkeypatch.setattr(warmup, "warm_start", functools.partial(warmup.warm_start, n_candidates=160, probe_samples=8))
    out = tmp_path / "study"
    # One worker process: one import of verl instead of two (the demo's test runs the two-process pool).
    argv = [
        "staleness",
        "--out",
        str(out),
        "--steps",
        "4",
        "--mini-batches",
        "2",
        "--lags",
        "0,3",
        "--methods",
        "pg_is,dppo_binary_tv_recompute",
        "--workers",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| method | lag 0 | lag 3 |" in printed and "| dppo_binary_tv_recompute |" in printed
    assert "bypass mode on" in printed
    for lag in (0, 3):
        for method in ("pg_is", "dppo_binary_tv_recompute"):
            logged = rows(out / f"{method}_lag{lag}.jsonl")
            # The plugin's own lag metric, from the versions on each micro-batch: min(L, s - 1) at step s.
            assert [row.get("actor/dppo/lag_mean") for row in logged[1:]] == [min(lag, s - 1) for s in range(1, 5)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lags"] == [0, 3] and summary["settings"]["bypass"] is True
    runs = {(m["method"], m["lag"]): m for m in summary["methods"]}
    assert set(runs) == {(m, lag) for m in ("pg_is", "dppo_binary_tv_recompute") for lag in (0, 3)}
    assert runs["pg_is", 3]["logged_lag_mean"] == pytest.approx((0 + 1 + 2 + 3) / 4)
    assert all(math.isfinite(m["final_reward"]) for m in summary["methods"])
    for name in ("reward_vs_lag.png", "masked_vs_lag.png", "collapse_vs_lag.png", "staleness.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE, name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lags", ""], "--lags '': name at least one lag"),
        (["--lags=0,-1"], "--lags: -1 is negative"),
        (["--lags", "0,1.5"], "--lags: '1.5' is not a whole number"),
        (["--lags", "2,2"], "--lags: 2 is named twice"),
        (["--methods", "ppo_typo"], "unknown demo method(s) ['ppo_typo']"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--mini-batches", "5"], "--mini-batches 5: each rollout batch"),
    ],
)
def test_staleness_bad_flags_are_one_line(tmp_path, capsys, argv, message):
    assert main(["staleness", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-dppo: error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o" / "warmup.pt").exists()  # refused before the warm-up
