"""Hydra composition of verl's own ppo_trainer config with each mode and with DPPOLossConfig as _target_, through
verl's validate_config and the dataclass conversion its workers apply."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import PolicyLossConfig

from verl_dppo import DPPOLossConfig

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
BASE = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "trainer.n_gpus_per_node=1",
]
TARGET = "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig"


def compose_actor(overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose("ppo_trainer", overrides=BASE + overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is"])
def test_each_mode_composes_with_verl_plain_policy_loss_config(mode):
    actor = compose_actor([f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
    assert type(actor.policy_loss) is PolicyLossConfig and actor.policy_loss.loss_mode == mode


@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is"])
def test_each_mode_composes_with_dppo_loss_config_target(mode):
    actor = compose_actor(
        [
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
            TARGET,
            "+actor_rollout_ref.actor.policy_loss.delta_low=0.15",
            "+actor_rollout_ref.actor.policy_loss.delta_high=1.0",
            "+actor_rollout_ref.actor.policy_loss.ratio_cap=10000",
            "+actor_rollout_ref.actor.policy_loss.anchor=recompute",
            "+actor_rollout_ref.actor.policy_loss.relax_below=0.1",
            "+actor_rollout_ref.actor.policy_loss.relax_side=both",
            "+actor_rollout_ref.actor.policy_loss.topk=8",
        ]
    )
    loss = actor.policy_loss
    assert isinstance(loss, DPPOLossConfig) and loss.loss_mode == mode
    assert (loss.delta_low, loss.delta_high, loss.ratio_cap) == (0.15, 1.0, 10000)
    assert (loss.anchor, loss.relax_below, loss.relax_side, loss.topk) == ("recompute", 0.1, "both", 8)


def test_defaults_of_dppo_loss_config_and_infinite_cap_from_yaml():
    actor = compose_actor([TARGET, "+actor_rollout_ref.actor.policy_loss.ratio_cap=inf"])
    loss = actor.policy_loss
    assert loss.delta_low is None and loss.delta_high is None and loss.anchor == "rollout"
    assert loss.ratio_cap == float("inf")


def test_bad_value_fails_at_conversion_with_the_key_named():
    with pytest.raises(Exception, match="anchor must be one of"):
        compose_actor([TARGET, "+actor_rollout_ref.actor.policy_loss.anchor=old"])


def test_new_keys_without_target_fail_as_verl_documents():
    # Without the _target_ switch verl's PolicyLossConfig rejects our keys: the README says to set it.
    with pytest.raises(Exception):
        compose_actor(["+actor_rollout_ref.actor.policy_loss.delta_low=0.15"])


def test_dataclass_is_verl_base_config_and_serialises():
    loss = DPPOLossConfig(loss_mode="dppo_binary_kl", delta_low=0.05)
    assert isinstance(loss, PolicyLossConfig)
    assert loss.get("delta_low") == 0.05 and loss["anchor"] == "rollout"
    assert OmegaConf.to_container(OmegaConf.structured(loss))["delta_low"] == 0.05


@pytest.mark.parametrize("text,expected", [("inf", float("inf")), (".inf", float("inf")), ("1e4", 1e4)])
def test_numbers_given_as_strings_are_converted(text, expected):
    assert DPPOLossConfig(ratio_cap=text).ratio_cap == expected
    with pytest.raises(ValueError, match="ratio_cap must be a number"):
        DPPOLossConfig(ratio_cap="big")
