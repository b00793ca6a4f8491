"""The plugin's Megatron CPU shim (verl_dppo/cpu/megatron_shim.py) and the CPU settings of model_engine=megatron.

Megatron's forward, built by mbridge from a transformers checkpoint and run with the shim on the CPU platform, equals
transformers' forward on the same weights (padded BSHD batch, the valid tokens); the shim stays out of a process
that is not on the CPU platform; a megatron-core or mbridge it was not read against is refused naming the module and
the pin; the settings a CPU run gets, and the refusal where the packages are missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_dppo.cli.megatron_cpu import megatron_cpu_problems, megatron_cpu_settings
from verl_dppo.cpu import megatron_shim

needs_megatron = pytest.mark.skipif(bool(megatron_cpu_problems(None)),
                                    reason="megatron-core 0.16.1 / mbridge 0.15.1 are not installed: `make venv`")

EQUALITY = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import verl  # the plugin: its import hook installs the shim when megatron.core is imported
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    path = sys.argv[1]
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)).save_pretrained(path)
    import megatron.core
    from verl_dppo.cpu import megatron_shim
    print("PIECES", ",".join(megatron_shim.installed_pieces()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu, tensor_parallel
    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    from mbridge import AutoBridge
    from verl.utils.megatron_utils import get_hf_rope_theta
    bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    bridge.hf_config.rope_theta = get_hf_rope_theta(bridge.hf_config)  # as verl's engine supplies it
    model = bridge.get_model(fp16=False, bf16=False, wrap_with_ddp=False)
    bridge.load_weights(model, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, 256, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False  # a padded row: verl's BSHD batches end rows with padding
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        out = model[0](input_ids=ids, position_ids=torch.arange(20)[None].expand(2, -1), attention_mask=mask)
    print("DIFF", float((out - ref)[mask].abs().max()), float(ref[mask].abs().max()))
    exported = dict(bridge.export_weights(model))
    state = hf.state_dict()
    print("EXPORT", max(float((exported[k] - state[k]).abs().max()) for k in exported), len(exported), len(state))
""")


@needs_megatron
def test_megatron_forward_equals_transformers_on_the_same_weights(tmp_path):
    env = dict(os.environ, VERL_PLATFORM="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", EQUALITY, str(tmp_path / "model")], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line[:4] in ("PIEC", "DIFF", "EXPO")}
    assert lines["PIECES"][0].split(",") == [name for name, _ in megatron_shim.PIECES]
    diff, scale = map(float, lines["DIFF"])
    assert diff < 1e-4 * max(scale, 1.0), (diff, scale)  # fp32, two implementations of the same layers
    worst, exported, held = lines["EXPORT"]
    assert float(worst) == 0.0 and exported == held, lines["EXPORT"]  # the export back is the checkpoint, bit for bit


@needs_megatron
def test_the_shim_stays_out_of_a_process_off_the_cpu_platform():
    code = ("import verl, megatron.core, torch\nfrom verl_dppo.cpu import megatron_shim\n"
            "print(megatron_shim.installed_pieces(), type(torch.Tensor.cuda).__name__)")
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["[]", "method_descriptor"], out.stdout  # torch's own Tensor.cuda


def test_a_version_the_shim_was_not_read_against_is_refused(monkeypatch):
    monkeypatch.setattr(megatron_shim, "_version", lambda name: "0.17.0" if name == "megatron-core" else "0.15.1")
    with pytest.raises(megatron_shim.MegatronShimError, match=r"megatron_shim.py.*megatron-core 0.16.1.*0.17.0"):
        megatron_shim.check_versions()


def test_the_bshd_mask_masks_later_and_padding_keys():
    valid = torch.tensor([[True, True, True], [True, True, False]])
    mask = megatron_shim.bshd_attention_mask(valid, 3, 3)
    assert mask.shape == (2, 1, 3, 3)
    causal = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    assert torch.equal(mask[0, 0], causal)
    assert torch.equal(mask[1, 0], causal | torch.tensor([False, False, True]))


def test_a_cpu_run_on_megatron_gets_the_settings_it_needs():
    from verl_dppo.cli.compose import compose_recipe

    config = compose_recipe("cpu_tiny", "dppo_binary_tv", overrides=["model_engine=megatron"])
    megatron_cpu_settings(config)
    actor = config.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and "fsdp_config" not in actor
    assert "lr_scheduler_type" not in actor.optim
    assert actor.megatron.vanilla_mbridge and actor.megatron.dtype == "float32"
    assert actor.megatron.override_transformer_config.attention_backend == "local"
    assert not config.actor_rollout_ref.model.use_remove_padding
    assert config.actor_rollout_ref.ref.megatron.dtype == "float32"
    assert config.dppo.rollout_suffix == "-megatron"


def test_megatron_on_cpu_without_the_packages_is_one_line_naming_the_pins(monkeypatch):
    from verl_dppo.cli import megatron_cpu

    monkeypatch.setattr(megatron_cpu, "megatron_support",
                        lambda: {"megatron-core": "not installed", "mbridge": "not installed"})
    problems = megatron_cpu.megatron_cpu_problems(None)
    assert len(problems) == 1 and "megatron-core==0.16.1 mbridge==0.15.1" in problems[0] and "make venv" in problems[0]
