"""The plugin's Megatron CPU shim (verl_dppo/rehearsal/megatron_shim.py) and the CPU settings of model_engine=megatron.

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

from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems
from verl_dppo.rehearsal import megatron_shim

needs_megatron = pytest.mark.skipif(
    bool(megatron_cpu_problems(None)), reason="megatron-core 0.16.1 / mbridge 0.15.1 are not installed: `make venv`"
)

EQUALITY = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import verl  # the plugin: its import hook installs the shim when megatron.core is imported
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    kind, rank, world, path, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.manual_seed(0)

    def r3_replay(model, ids, mask):
        # R3 as verl's engine runs it on a BSHD batch: the rollout's routes (here: drawn, unlike the router's own
        # choice) and verl's replay mask through verl's set_router_replay_data (the shim's r3_bshd piece in place),
        # then the forward; returns the replayed rows on which the router used the drawn experts, and all of them.
        import verl.workers.engine.megatron.transformer_impl as engine
        from megatron.core.transformer.moe.router import TopKRouter
        from verl.utils.megatron.router_replay_patch import RouterReplayAction
        from verl.utils.megatron.router_replay_utils import build_r3_replay_mask, set_model_router_replay_action
        lengths = mask.sum(-1).tolist()
        nested = lambda parts: torch.nested.as_nested_tensor(parts, layout=torch.jagged)
        draw = torch.Generator().manual_seed(2)
        routes = [torch.stack([torch.stack([torch.randperm(4, generator=draw)[:2] for _ in range(2)])
                               for _ in range(n)]) for n in lengths]  # [tokens, layers, k] per sequence
        response_mask = torch.zeros(len(lengths), 8, dtype=torch.bool)
        response_mask[0, :8], response_mask[1, :5] = True, True
        replay = build_r3_replay_mask(nested([ids[b, :n] for b, n in enumerate(lengths)]), response_mask)
        set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
        engine.set_router_replay_data(nested(routes), None, model.config, 0, replay_mask=replay, model=model)
        used = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: used.append(out[1]))
                 for m in model.modules() if isinstance(m, TopKRouter)]
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None].expand(len(lengths), -1),
                  attention_mask=mask)
        for hook in hooks:
            hook.remove()
        same = total = 0
        for layer, routing_map in enumerate(used):  # [S * B, experts], S-major
            for b, n in enumerate(lengths):
                rows = replay.unbind()[b]
                for t in range(n):
                    if rows[t]:
                        chosen = routing_map[t * len(lengths) + b].nonzero().flatten().tolist()
                        same += chosen == sorted(routes[b][t, layer].tolist())
                        total += 1
        return same, total

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    if rank == 0:
        if kind.startswith("moe"):  # the MoE recipes' Qwen3-MoE in miniature: 4 experts, 2 routed per token
            Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                               norm_topk_prob=True, router_aux_loss_coef=0.0)).save_pretrained(path)
        else:
            Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(path)
    import megatron.core
    from verl_dppo.rehearsal import megatron_shim
    megatron_shim.install()  # what verl's MegatronEngine.__init__ does first on the CPU platform (install_on_engine)
    print("PIECES", ",".join(megatron_shim.installed_pieces()))
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    dist.barrier()  # rank 0 has written the checkpoint
    from megatron.core import parallel_state as mpu, tensor_parallel
    mpu.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    from mbridge import AutoBridge
    from verl.utils.megatron_utils import get_hf_rope_theta
    bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    bridge.hf_config.rope_theta = get_hf_rope_theta(bridge.hf_config)  # as verl's engine supplies it
    if kind.startswith("moe"):  # what verl-dppo's CPU settings give a MoE model (verl_dppo/rehearsal/setups/megatron_cpu.py)
        bridge.set_extra_args(moe_grouped_gemm=False, persist_layer_norm=False, bias_activation_fusion=False,
                              bias_dropout_fusion=False, moe_token_dispatcher_type="alltoall")
    if kind == "moe_r3":  # what verl's MegatronEngine does with router_replay.mode=R3
        from verl.utils.megatron.router_replay_patch import apply_router_replay_patch
        apply_router_replay_patch()
        bridge.config.moe_enable_routing_replay = True
    model = bridge.get_model(fp16=False, bf16=False, wrap_with_ddp=False)
    bridge.load_weights(model, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False  # a padded row: verl's BSHD batches end rows with padding
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        out = model[0](input_ids=ids, position_ids=torch.arange(20)[None].expand(2, -1), attention_mask=mask)
    print("DIFF", float((out - ref)[mask].abs().max()), float(ref[mask].abs().max()))
    if kind == "moe_r3":
        # the padded batch, then one without padding (as many rows as packed: in another order all the same)
        print("R3", *r3_replay(model[0], ids, mask), *r3_replay(model[0], ids, torch.ones_like(mask)))
    if kind == "dense":
        exported = dict(bridge.export_weights(model))
        state = hf.state_dict()
        print("EXPORT", max(float((exported[k] - state[k]).abs().max()) for k in exported), len(exported), len(state))
    else:
        local = sum(1 for name, _ in model[0].named_parameters() if ".mlp.experts.linear_fc1.weight" in name)
        print("EXPERTS", local)  # per rank: 2 layers x 4 experts / EP
""")


def _equality(kind: str, world: int, tmp_path) -> list[dict]:
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    args = [str(tmp_path / "model"), str(tmp_path / "init")]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", EQUALITY, kind, str(rank), str(world), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    found = []
    for process in ranks:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        found.append(
            {
                line.split()[0]: line.split()[1:]
                for line in stdout.splitlines()
                if line.split()[:1] and line.split()[0] in ("PIECES", "DIFF", "EXPORT", "EXPERTS", "R3")
            }
        )
    return found


def _same_logits(lines: dict) -> None:
    assert lines["PIECES"][0].split(",") == [name for name, _ in megatron_shim.PIECES]
    diff, scale = map(float, lines["DIFF"])
    assert diff < 1e-4 * max(scale, 1.0), (diff, scale)  # fp32, two implementations of the same layers


@needs_megatron
def test_megatron_forward_equals_transformers_on_the_same_weights(tmp_path):
    """A dense Qwen3: the local spec, the [B, S] mask, mbridge's names for the local norms; the export back is the
    checkpoint bit for bit (what the weight sync pushes)."""
    (lines,) = _equality("dense", 1, tmp_path)
    _same_logits(lines)
    worst, exported, held = lines["EXPORT"]
    assert float(worst) == 0.0 and exported == held, lines["EXPORT"]


@needs_megatron
def test_a_qwen3_moe_with_two_expert_parallel_ranks_equals_transformers(tmp_path):
    """A Qwen3-MoE at EP=2 (two processes, gloo all-to-all): each rank holds half the experts under the names
    mbridge maps, and both ranks' logits equal transformers' forward on the same weights."""
    for lines in _equality("moe", 2, tmp_path):
        _same_logits(lines)
        assert lines["EXPERTS"] == ["4"], lines


@needs_megatron
def test_r3_replays_the_rollout_routes_on_the_rows_a_bshd_batch_routes(tmp_path):
    """R3 on the CPU's unpacked batches (the shim's r3_bshd piece): routes unlike the router's own choice, handed to
    verl's set_router_replay_data in verl's packed layout with verl's R3 replay mask, are the experts every
    replayed row of a padded [B, S] batch is routed to, in both MoE layers. Without the piece verl stops at its
    alignment check; with the rows laid out batch-major instead, about 1 row in 4 matched. A batch without padding
    has as many rows as verl packs, in another order: it is laid out too."""
    (lines,) = _equality("moe_r3", 1, tmp_path)
    _same_logits(lines)
    same, total, same_unpadded, total_unpadded = map(int, lines["R3"])
    assert total == 2 * (19 + 12) and same == total, lines["R3"]  # each sequence's last row routes natively
    assert total_unpadded == 2 * (19 + 19) and same_unpadded == total_unpadded, lines["R3"]


def test_bshd_rows_lays_packed_rows_out_s_major_with_zeros_at_padding():
    from verl_dppo.rehearsal.megatron_r3 import bshd_rows

    rows = torch.tensor([[1], [2], [3], [4], [5]])  # a sequence of 3 tokens, then one of 2
    assert bshd_rows(rows, [3, 2], 4).flatten().tolist() == [1, 4, 2, 5, 3, 0, 0, 0]
    with pytest.raises(megatron_shim.MegatronShimError, match="5 route rows"):
        bshd_rows(rows, [3, 3], 4)


@needs_megatron
@pytest.mark.parametrize("platform", ["cpu", None])
def test_the_shim_stays_out_of_a_process_that_builds_no_megatron_engine(platform):
    """verl imports megatron-core (and its engine module) in every process that imports its engines: an FSDP run's
    processes on the CPU platform, and any process off it, keep torch and megatron-core as they are. Off the CPU
    platform, building the engine installs nothing either."""
    code = (
        "import verl, torch\nimport verl.workers.engine\nimport verl.workers.engine.megatron.transformer_impl as m\n"
        "from verl_dppo.rehearsal import megatron_shim\n"
        "print(megatron_shim.installed_pieces(), type(torch.Tensor.cuda).__name__)\n"
        "try:\n    m.MegatronEngine.__init__(object.__new__(m.MegatronEngine))\nexcept TypeError:\n    pass\n"
        "print(megatron_shim.installed_pieces())"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first.split() == ["[]", "method_descriptor"], out.stdout  # torch's own Tensor.cuda: nothing installed
    built = [name for name, _ in megatron_shim.PIECES] if platform == "cpu" else []
    assert second == str(built), out.stdout  # the engine's __init__ installs it first, on the CPU platform only


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
    from verl_dppo.launch.compose import compose_recipe

    from verl_dppo.rehearsal.setups.cpu_engines import engine_settings

    config = compose_recipe("cpu_tiny", "dppo_binary_tv", overrides=["model_engine=megatron"])
    engine_settings(config)
    actor = config.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and "fsdp_config" not in actor
    assert "lr_scheduler_type" not in actor.optim
    assert actor.megatron.vanilla_mbridge and actor.megatron.dtype == "float32"
    assert actor.megatron.override_transformer_config.attention_backend == "local"
    assert not config.actor_rollout_ref.model.use_remove_padding
    assert config.actor_rollout_ref.ref.megatron.dtype == "float32"
    assert config.dppo.rollout_suffix == "-megatron"  # never resumes an FSDP run's checkpoint
    moe = compose_recipe(
        "cpu_tiny",
        "dppo_binary_tv",
        overrides=["model_engine=megatron", "dppo.tiny_model.num_experts=4", "actor_rollout_ref.rollout.name=vllm"],
    )
    engine_settings(moe)
    engine_settings(moe)  # once per launch stage: the name is computed, not appended
    assert moe.dppo.rollout_suffix == "-vllm-megatron-moe4"
    assert moe.actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type == "alltoall"


def test_megatron_on_cpu_without_the_packages_is_one_line_naming_the_pins(monkeypatch):
    from verl_dppo.rehearsal.setups import megatron_cpu

    monkeypatch.setattr(
        megatron_cpu, "megatron_support", lambda: {"megatron-core": "not installed", "mbridge": "not installed"}
    )
    problems = megatron_cpu.megatron_cpu_problems(None)
    assert len(problems) == 1 and "megatron-core==0.16.1 mbridge==0.15.1" in problems[0] and "make venv" in problems[0]
