"""Issue 74: `ipo` (prime-rl's default loss), one module and one recipe, through verl's real `ppo_loss` against the
float64 reference of its definition (tests/reference.py `ipo_reference`), on LLM-like rows (a peaked token at
1 - 1e-9, log-probs down to -100, bf16), and in the places a user meets it: `check`'s update rule, the demo's and
`study`'s --methods, the figures' colours."""

import math

import pytest

from helpers import actor_config
from reference import ipo_reference
from test_losses import LENS, random_case, rows, run_ppo_loss


def llm_case(seed: int):
    """random_case's rows with the places real models live: a peaked token (mu = 1 - 1e-9) that pi lowers to 0.5,
    one raised from 0.05 to 0.5 under a negative and a positive advantage, and log-probs of -100."""
    pi, mu, old, adv = random_case(seed, drift=0.8)
    mu[0, 1], pi[0, 1], adv[0, 1] = math.log1p(-1e-9), math.log(0.5), 1.0  # A > 0, pi fell by 0.5: dropped
    mu[0, 2], pi[0, 2], adv[0, 2] = math.log(0.05), math.log(0.5), -1.0  # A < 0, pi rose by 0.45: dropped
    mu[2, 0], pi[2, 0], adv[2, 0] = math.log(0.05), math.log(0.5), 1.0  # A > 0, pi rose by 0.45: dropped
    mu[2, 1], pi[2, 1], adv[2, 1] = -100.0, -99.0, 1.0  # rare token, ratio e: kept (|pi - mu| ~ 1e-43)
    old[0, 1:3], old[2, 0:2] = mu[0, 1:3], mu[2, 0:2]
    return pi, mu, old, adv


@pytest.mark.parametrize("tau", [0.0, 0.1])
@pytest.mark.parametrize("agg", ["token-mean", "token-sum"])
@pytest.mark.parametrize("with_rollout,anchor", [(True, "rollout"), (False, "rollout"), (True, "recompute")])
def test_matches_the_float64_reference_through_verl_ppo_loss(tau, agg, with_rollout, anchor):
    pi, mu, old, adv = llm_case(seed=5)
    config = actor_config(
        "ipo", loss_agg_mode=agg, delta_low=0.3, delta_high=0.3, ratio_cap=10000.0, ipo_tau=tau, anchor=anchor
    )
    loss, grads, metrics = run_ppo_loss(config, pi, old, adv, rollout=mu if with_rollout else None)
    mu_ref = mu if with_rollout else old
    anchor_ref = old if anchor == "recompute" else mu_ref
    ref_loss, ref_grads = ipo_reference(
        rows(adv), rows(pi), rows(mu_ref), rows(anchor_ref), LENS, agg, 0.3, 0.3, 10000.0, tau
    )
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    for got_row, ref_row in zip(grads, ref_grads):
        assert got_row == pytest.approx(ref_row, rel=1e-4, abs=1e-6)
    assert metrics["actor/pg_clipfrac"].exact() > 0


def test_the_mask_ignores_the_advantages_sign_where_dppo_does_not():
    """The three planted tokens: IPO drops each; DPPO-Binary-TV at the same threshold lets the two through whose update
    would bring pi back towards mu (A > 0 where pi fell, A < 0 where it rose), and blocks the third."""
    pi, mu, old, adv = llm_case(seed=5)
    ipo = actor_config("ipo", loss_agg_mode="token-sum", delta_low=0.3, delta_high=0.3, ratio_cap=10000.0)
    dppo = actor_config("dppo_binary_tv", loss_agg_mode="token-sum", delta_low=0.3, delta_high=0.3, ratio_cap=10000.0)
    (_, ipo_grads, _), (_, dppo_grads, _) = (run_ppo_loss(c, pi, old, adv, rollout=mu) for c in (ipo, dppo))
    assert [ipo_grads[0][1], ipo_grads[0][2], ipo_grads[2][0]] == [0.0, 0.0, 0.0]
    assert dppo_grads[0][1] != 0.0 and dppo_grads[0][2] != 0.0 and dppo_grads[2][0] == 0.0
    assert ipo_grads[2][1] == pytest.approx(-math.e, rel=1e-5)  # the rare token at -100: kept, weight e


def test_bf16_inputs_drop_nothing_on_policy_and_log_the_penalty_term():
    pi, mu, old, adv = random_case(seed=7, drift=0.0)
    config = actor_config("ipo", delta_low=0.3, delta_high=0.3, ratio_cap=10000.0, ipo_tau=0.5)
    _, _, metrics = run_ppo_loss(config, pi.bfloat16(), old.bfloat16(), adv.bfloat16(), rollout=mu.bfloat16())
    assert metrics["actor/pg_clipfrac"].exact() == 0.0
    assert metrics["actor/dppo/ipo_log_ratio_sq_mean"].exact() == pytest.approx(0.0, abs=1e-12)
    pi, mu, old, adv = random_case(seed=7)
    *_, metrics = run_ppo_loss(config, pi, old, adv, rollout=mu)
    expected = sum((p - m) ** 2 for rp, rm in zip(rows(pi), rows(mu)) for p, m in zip(rp, rm)) / sum(LENS)
    assert metrics["actor/dppo/ipo_log_ratio_sq_mean"].exact() == pytest.approx(expected, rel=1e-5)


def test_bad_settings_are_refused_with_the_key():
    pi, mu, old, adv = random_case(seed=1)
    with pytest.raises(ValueError, match="relax_below"):
        run_ppo_loss(actor_config("ipo", delta_low=0.3, delta_high=0.3, relax_below=0.2), pi, old, adv, rollout=mu)
    with pytest.raises(ValueError, match="ipo_tau"):
        run_ppo_loss(actor_config("ipo", delta_low=0.3, delta_high=0.3, ipo_tau=-1.0), pi, old, adv, rollout=mu)
    assert actor_config("ipo", ipo_tau="0.25").policy_loss.ipo_tau == 0.25  # Hydra's unconverted string


def test_the_recipe_reaches_check_the_demo_study_and_the_figures():
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.plugin.update_rule import update_rule
    from verl_dppo.studies.colors import method_colors, method_of
    from verl_dppo.studies.demo.methods import runnable_methods
    from verl_dppo.studies.plot import Run
    from verl_dppo.studies.study import _methods

    config = compose_recipe("cpu_tiny", "ipo")
    rule = update_rule(config)
    assert rule.startswith(
        "trains ipo: delta 0.3/0.3, ratio cap 10000 (inherited from clip_ratio_c), no log-ratio "
        "penalty, anchored on the rollout's log-probs"
    ), rule
    tau = update_rule(compose_recipe("cpu_tiny", "ipo", ["actor_rollout_ref.actor.policy_loss.ipo_tau=0.1"]))
    assert "penalty tau 0.1 x (log pi/mu)^2" in tau
    assert _methods("dppo_binary_tv,ipo", []) == ["dppo_binary_tv", "ipo"]  # study --methods
    (row,) = runnable_methods(["ipo"])
    assert (row.loss_mode, row.policy_loss["delta_low"], row.needs_rollout_topk) == ("ipo", 0.3, False)
    assert method_of("cpu_tiny-ipo-sync") == "ipo" and method_colors()["ipo"] not in (
        color for name, color in method_colors().items() if name != "ipo"
    )
    assert Run(path="ipo.jsonl", label="ipo", loss_mode="ipo").family == "dppo"
