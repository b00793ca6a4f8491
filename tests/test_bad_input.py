"""Bad input never yields a silent NaN: either a finite loss with the documented meaning or an error naming the
cause. Also the diagnostics under actor/dppo/ on hand-checked tensors."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from helpers import actor_config, v1_micro_batch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.utils.losses import ppo_loss

from verl_dppo import DPPOLossConfig
from verl_dppo.plugin import log_once

lg = math.log


def direct(mode, mu, pi, adv, mask=None, config=None, agg="token-mean"):
    """Call the registered function straight from verl's registry (no hook: old_log_prob is mu)."""
    pi = pi.clone().requires_grad_()
    mask = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask
    config = config or actor_config(mode, delta_low=0.15, delta_high=0.15, ratio_cap=10.0)
    loss, metrics = get_policy_loss_fn(mode)(mu, pi, adv, mask, agg, config)
    loss.backward()
    return loss, metrics, pi.grad


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rollout_log_prob_drops_the_token(bad):
    mu = torch.tensor([[lg(0.5), bad, lg(0.3)]])
    pi = torch.tensor([[lg(0.6), lg(0.2), lg(0.3)]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics, grad = direct("dppo_binary_tv", mu, pi, adv)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 1] == 0.0 and grad[0, 0] != 0.0
    assert metrics["actor/dppo/dropped_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_current_log_prob_is_an_error_naming_the_forward_pass(bad):
    mu = torch.tensor([[lg(0.5), lg(0.5)]])
    pi = torch.tensor([[lg(0.6), bad]])
    with pytest.raises(FloatingPointError, match="current policy's log-probs are NaN/inf at 1 response token"):
        direct("dppo_binary_kl", mu, pi, torch.ones(1, 2))


def test_nonfinite_values_outside_the_response_are_ignored():
    mu = torch.tensor([[lg(0.5), math.nan]])
    pi = torch.tensor([[lg(0.6), -math.inf]])
    mask = torch.tensor([[True, False]])
    loss, metrics, grad = direct("pg_is", mu, pi, torch.tensor([[1.0, math.nan]]), mask=mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert metrics["actor/dppo/dropped_frac"] == 0.0


def test_nan_advantage_is_an_error():
    with pytest.raises(FloatingPointError, match="advantages are NaN/inf"):
        direct("grpo_clip", torch.tensor([[-0.5]]), torch.tensor([[-0.4]]), torch.tensor([[math.nan]]))


def test_mismatched_shapes_name_every_tensor():
    with pytest.raises(ValueError, match=r"old_log_prob=\(1, 3\).*log_prob=\(1, 2\)"):
        direct("dppo_binary_tv", torch.zeros(1, 3) - 1, torch.zeros(1, 2) - 1, torch.ones(1, 2))


def test_mismatched_rollout_log_probs_through_the_hook():
    pi = torch.full((2, 3), -1.0)
    model_output, data, _ = v1_micro_batch(pi, pi, torch.ones(2, 3), [3, 2], rollout_log_prob=pi, nested_fields=False)
    data["rollout_log_probs"] = torch.full((2, 2), -1.0)
    with pytest.raises(ValueError, match="rollout_log_probs=\\(2, 2\\)"):
        ppo_loss(actor_config("dppo_binary_tv"), model_output, data)


def test_all_masked_batch_gives_zero_loss_and_zero_gradient():
    mu = torch.tensor([[lg(0.99), lg(0.9)]])
    pi = torch.tensor([[lg(0.5), lg(0.4)]])
    loss, metrics, grad = direct("dppo_binary_tv", mu, pi, torch.tensor([[-1.0, -1.0]]))
    assert loss.item() == 0.0 and (grad == 0).all()
    assert metrics["actor/pg_clipfrac"] == 1.0 and metrics["actor/dppo/masked_frac_neg"] == 1.0


def test_zero_advantages_give_zero_loss():
    loss, metrics, grad = direct("pg_is", torch.tensor([[-0.5, -2.0]]), torch.tensor([[-0.1, -3.0]]), torch.zeros(1, 2))
    assert loss.item() == 0.0 and (grad == 0).all() and metrics["actor/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_empty_responses_give_a_zero_loss_that_still_backpropagates(agg):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics, grad = direct(
        "dppo_binary_kl", torch.full((2, 3), -1.0), torch.full((2, 3), -1.0), torch.ones(2, 3), mask=mask, agg=agg
    )
    assert loss.item() == 0.0 and loss.requires_grad is True and (grad == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("anchor", "old", "anchor must be one of"),
        ("relax_side", "up", "relax_side must be one of"),
        ("delta_low", -0.1, "delta_low must be a finite number >= 0"),
        ("delta_high", math.nan, "delta_high must be a finite number >= 0"),
        ("ratio_cap", 0.0, "ratio_cap must be > 0"),
        ("relax_below", 1.5, "relax_below"),
        ("topk", 0, "topk must be an integer >= 1"),
    ],
)
def test_bad_options_are_rejected_by_the_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        DPPOLossConfig(loss_mode="dppo_binary_tv", **{field: value})


BAD_VALUES = {
    "delta_low": -0.1,
    "delta_high": math.nan,
    "ratio_cap": 0.0,
    "anchor": "old",
    "relax_below": 1.5,
    "relax_side": "up",
    "topk": 0,
    "max_off_policy_threshold": 0,
    "troll_eps": 0.0,
    "troll_alpha": -1.0,
    "troll_support_mass": 1.5,
    "ipo_tau": -1.0,
}


def test_each_option_has_one_rule_that_the_config_and_the_loss_both_apply():
    """Issue 74: an option is checked in one place (`verl_dppo.plugin.options.RULES`): every field DPPOLossConfig adds
    to verl's has its rule, and a bad value is refused with the same words by the dataclass and by what a loss reads
    from a plain DictConfig (resolve_options, TROLL's and IPO's options)."""
    from dataclasses import fields

    from verl.workers.config import PolicyLossConfig

    from verl_dppo.plugin.config import resolve_options
    from verl_dppo.plugin.ipo_mode import ipo_tau
    from verl_dppo.plugin.options import RULES
    from verl_dppo.plugin.troll_mode import troll_options

    added = {f.name for f in fields(DPPOLossConfig)} - {f.name for f in fields(PolicyLossConfig)}
    assert added == set(RULES) == set(BAD_VALUES)
    for name, value in BAD_VALUES.items():
        with pytest.raises(ValueError) as by_config:
            DPPOLossConfig(loss_mode="dppo_binary_tv", **{name: value})
        assert f"policy_loss.{name} must be" in str(by_config.value)
        plain = OmegaConf.create({"policy_loss": {"loss_mode": "troll", name: value}, "clip_ratio": 0.2})
        reader = {
            "troll_eps": troll_options,
            "troll_alpha": troll_options,
            "troll_support_mass": troll_options,
            "ipo_tau": ipo_tau,
        }.get(name, lambda config: resolve_options(config, True))
        with pytest.raises(ValueError) as by_loss:
            reader(plain)
        assert str(by_loss.value) == str(by_config.value), name


@pytest.mark.parametrize(
    "policy_loss,message",
    [
        ({"loss_mode": "dppo_binary_tv", "anchor": "old"}, "anchor must be one of"),
        ({"loss_mode": "grpo_clip", "relax_below": 0.1, "relax_side": "up"}, "relax_side must be one of"),
    ],
)
def test_bad_options_in_a_plain_dictconfig_are_rejected_at_the_loss(policy_loss, message):
    config = OmegaConf.create(
        {"policy_loss": policy_loss, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    )
    with pytest.raises(ValueError, match=message):
        get_policy_loss_fn(policy_loss["loss_mode"])(
            torch.zeros(1, 1) - 1,
            torch.zeros(1, 1) - 1,
            torch.ones(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            "token-mean",
            config,
        )


def test_negative_verl_clip_ratio_fallback_is_rejected():
    config = actor_config("dppo_binary_tv", clip_ratio_low=-0.2)
    with pytest.raises(
        ValueError, match=r"delta_low \(unset: verl.s actor.clip_ratio_low\) must be a finite number >= 0"
    ):
        direct("dppo_binary_tv", torch.zeros(1, 1) - 1, torch.zeros(1, 1) - 1, torch.ones(1, 1), config=config)


def test_recompute_anchor_without_rollout_log_probs_names_the_setting():
    config = actor_config("dppo_binary_kl", anchor="recompute")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.calculate_log_probs=True"):
        direct("dppo_binary_kl", torch.zeros(1, 1) - 1, torch.zeros(1, 1) - 1, torch.ones(1, 1), config=config)


@pytest.mark.parametrize("mode", ["dppo_binary_kl", "dppo_binary_tv", "grpo_clip"])
def test_recompute_anchor_accepts_old_log_probs_equal_to_the_rollouts(mode):
    # Issue 8.4: a short, fully confident response gives recomputed log-probs equal to the rollout's bit for bit
    # (both 0.0). That is valid data, not bypass mode: the loss must not guess the configuration from it.
    pi = torch.tensor([[-0.01, -0.02, 0.0], [-0.5, 0.0, 0.0]])
    mu = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, 0.0]])
    config = actor_config(mode, anchor="recompute", delta_low=0.15, delta_high=0.15, ratio_cap=10.0)
    pi_leaf = pi.clone().requires_grad_()
    model_output, data, values = v1_micro_batch(pi_leaf, mu, adv, [3, 2], rollout_log_prob=mu)
    loss, metrics = ppo_loss(config, model_output, data)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(values.grad).all()
    # The same tokens anchored on the rollout (old == mu here) give the same loss.
    pi_leaf2 = pi.clone().requires_grad_()
    model_output, data, _ = v1_micro_batch(pi_leaf2, mu, adv, [3, 2], rollout_log_prob=mu)
    rollout_loss, _ = ppo_loss(actor_config(mode, delta_low=0.15, delta_high=0.15, ratio_cap=10.0), model_output, data)
    assert loss.item() == pytest.approx(rollout_loss.item())


def _run_config(
    mode="dppo_binary_kl",
    anchor="rollout",
    bypass=True,
    calculate=True,
    logprobs_mode=None,
    temperature=1.0,
    name="vllm",
):
    rollout = {"name": name, "calculate_log_probs": calculate, "temperature": temperature}
    if logprobs_mode is not None:
        rollout["logprobs_mode"] = logprobs_mode
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": mode, "anchor": anchor}}, "rollout": rollout},
            "algorithm": {"rollout_correction": {"bypass_mode": bypass}},
        }
    )


def test_recompute_anchor_in_bypass_mode_is_refused_from_the_configuration():
    # bypass_mode copies rollout_log_probs into old_log_probs: the "recomputed" anchor does not exist. Decided on
    # the driver from the run's config (verl-dppo run, and the plugin's LLMServerManager patch at launch).
    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    with pytest.raises(RunConfigError, match="algorithm.rollout_correction.bypass_mode=False"):
        check_run_config(_run_config(anchor="recompute", bypass=True))
    assert check_run_config(_run_config(anchor="recompute", bypass=False)) == []
    assert check_run_config(_run_config(mode="vanilla", anchor="recompute", bypass=True)) == []  # not ours


def test_raw_logprobs_with_temperature_is_refused():
    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    with pytest.raises(RunConfigError, match="logprobs_mode=processed_logprobs"):
        check_run_config(_run_config(logprobs_mode="raw_logprobs", temperature=0.7))
    assert check_run_config(_run_config(logprobs_mode="raw_logprobs", temperature=1.0)) == []
    assert check_run_config(_run_config(logprobs_mode="processed_logprobs", temperature=0.7)) == []


def test_decoupled_anchor_without_rollout_log_probs_warns_once(caplog):
    from verl_dppo.plugin.run_config import check_run_config

    warnings = check_run_config(_run_config(bypass=False, calculate=False))
    assert len(warnings) == 1 and "actor_rollout_ref.rollout.calculate_log_probs=True" in warnings[0]
    # The worker's side: a batch without rollout_log_probs, through verl's ppo_loss.
    log_once._SEEN.discard("no_rollout_log_probs")
    pi, old = torch.full((2, 3), -1.0), torch.full((2, 3), -1.1)
    with caplog.at_level("WARNING", logger="verl_dppo"):
        for _ in range(3):
            model_output, data, _ = v1_micro_batch(pi, old, torch.ones(2, 3), [3, 2])
            ppo_loss(actor_config("dppo_binary_tv"), model_output, data)
    hits = [r for r in caplog.records if "carries no rollout_log_probs" in r.getMessage()]
    assert len(hits) == 1 and "calculate_log_probs=True" in hits[0].getMessage()


@pytest.mark.parametrize("mode,cap", [("pg_is", math.inf), ("dppo_binary_tv", math.inf), ("grpo_clip", 1e30)])
def test_huge_log_ratio_gives_a_finite_loss_and_gradient(mode, cap):
    # Issue 8.6: log pi - log mu = 100 overflows exp() in float32 (r = inf); with no cap, one zero-advantage token
    # in the micro-batch made the loss NaN (0 x inf). The ratio is bounded by exp(MAX_LOG_RATIO).
    from verl_dppo.plugin.losses import MAX_LOG_RATIO

    mu = torch.tensor([[-100.0, -100.0, -1.0, -0.5]])
    pi = torch.tensor([[-0.001, -0.001, -1.2, -0.5]])
    adv = torch.tensor([[1.0, 0.0, -1.0, 0.0]])
    config = actor_config(mode, delta_low=0.15, delta_high=0.15, ratio_cap=cap)
    loss, metrics, grad = direct(mode, mu, pi, adv, config=config)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    weight = math.exp(MAX_LOG_RATIO)
    if mode == "pg_is":  # nothing masked: token 0's weight is the bound, token 2's the plain ratio
        expected = -(weight * 1.0 * -0.001 + math.exp(-0.2) * -1.0 * -1.2) / 4
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert all(math.isfinite(v) for v in metrics.values())


def test_config_none_is_an_error():
    with pytest.raises(ValueError, match="actor config"):
        get_policy_loss_fn("pg_is")(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            "token-mean",
            None,
        )


def test_diagnostics_on_hand_checked_tokens():
    # Four response tokens, anchor = mu (rollout), delta 0.15:
    #  t0: A>0, 0.10 -> 0.40 (TV .30, up)  blocked      t1: A<0, 0.90 -> 0.30 (TV .60, down, a "bad update") blocked
    #  t2: A>0, 0.50 -> 0.55 (TV .05)      kept          t3: A<0, 0.20 -> 0.25 (moving back up)              kept
    mu = torch.log(torch.tensor([[0.10, 0.90, 0.50, 0.20]]))
    pi = torch.log(torch.tensor([[0.40, 0.30, 0.55, 0.25]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    entropy = torch.tensor([[2.0, 4.0, 1.0, 1.0]])
    pi_leaf = pi.clone().requires_grad_()
    model_output, data, _ = v1_micro_batch(pi_leaf, mu, adv, [4], rollout_log_prob=mu, entropy=entropy)
    _, metrics = ppo_loss(actor_config("dppo_binary_tv", delta_low=0.15, delta_high=0.15), model_output, data)
    value = {k: v.values[0] for k, v in metrics.items()}
    assert value["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert value["actor/dppo/masked_frac_pos"] == pytest.approx(0.5)
    assert value["actor/dppo/masked_frac_neg"] == pytest.approx(0.5)
    assert value["actor/dppo/mismatch_tv_mean"] == pytest.approx((0.30 + 0.60 + 0.05 + 0.05) / 4, rel=1e-5)
    assert value["actor/dppo/mismatch_tv_max"] == pytest.approx(0.60, rel=1e-5)
    assert value["actor/dppo/bad_update_frac"] == pytest.approx(0.25)
    assert value["actor/dppo/masked_rollout_prob_mean"] == pytest.approx((0.10 + 0.90) / 2, rel=1e-5)
    assert value["actor/dppo/masked_entropy_mean"] == pytest.approx(3.0)

    def kl(m, p):
        return m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))

    expected_kl = (kl(0.1, 0.4) + kl(0.9, 0.3) + kl(0.5, 0.55) + kl(0.2, 0.25)) / 4
    assert value["actor/dppo/mismatch_kl_mean"] == pytest.approx(expected_kl, rel=1e-4)
    assert metrics["actor/dppo/mismatch_tv_max"].aggregation.value == "max"


def test_diagnostics_need_two_scalar_host_transfers_per_call(monkeypatch):
    # Reduced on device: one scalar (is every input finite?) and one short list of diagnostics are read back.
    transfers = []
    original_tolist, original_item, original_bool = torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__

    def counting(original):
        def call(self):
            transfers.append(self.numel())
            return original(self)

        return call

    monkeypatch.setattr(torch.Tensor, "tolist", counting(original_tolist))
    monkeypatch.setattr(torch.Tensor, "item", counting(original_item))
    monkeypatch.setattr(torch.Tensor, "__bool__", counting(original_bool))
    mu, pi = torch.full((4, 64), -1.0), torch.full((4, 64), -0.9)
    get_policy_loss_fn("dppo_binary_kl")(
        mu, pi, torch.ones(4, 64), torch.ones(4, 64, dtype=torch.bool), "token-mean", actor_config("dppo_binary_kl")
    )
    assert len(transfers) == 2 and transfers[0] == 1 and transfers[1] <= 20
