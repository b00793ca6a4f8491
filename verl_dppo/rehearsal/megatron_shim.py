"""megatron-core and mbridge on a CPU: what verl 0.9.1's Megatron engine needs to train on the plugin's CPU platform.

Active only on the CPU platform (`VERL_PLATFORM=cpu`) with a torch that has no CUDA, and only in a process that
builds verl's Megatron engine (the rehearsal's entry wraps `MegatronEngine.__init__`: `install_on_engine`). verl imports
megatron-core in every process that imports its engines, wherever it is installed; an FSDP run's processes are left
as they are. Read against **megatron-core
0.16.1** and **mbridge 0.15.1**; `install` raises, naming this module, under any other version, since every piece
below targets their internals by name. Each piece, and why (1, 2, 6 and 7, torch's CUDA surface, live in
`megatron_device`):

1. `cuda`: `torch.cuda` answers as a device that is the CPU. megatron-core calls `torch.cuda.current_device()`
   (rotary embeddings), `synchronize`, `empty_cache`, streams and events, memory counters throughout (~600 uses);
   mbridge moves its model with `model.cuda(...)` (core/util.py:151). No-ops, a "cpu" device, `Tensor.cuda` /
   `Module.cuda` returning the object itself.
2. `rng`: megatron-core's RNG tracker saves and restores CUDA generator states around every dropout region
   (tensor_parallel/random.py `_get_cuda_rng_state` / `_set_cuda_rng_state`, `model_parallel_cuda_manual_seed`):
   the CPU generator's, and `torch.cuda.manual_seed` seeds it (without that the tracker stores unseeded states and
   expert-parallel ranks disagree).
3. `local_spec`: verl (models/mcore/model_initializer.py) and mbridge (core/llm_bridge.py) build the decoder with
   `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`; without TransformerEngine, the local spec
   (torch modules) is used whatever they ask, and a MoE layer's experts are `cpu_grouped_mlp()`: SequentialMLP with
   its weights under TEGroupedMLP's names, the only expert names mbridge maps.
4. `norm_names`: mbridge maps TransformerEngine's fused-norm names (`linear_qkv.layer_norm_weight`); the local
   spec's norms are `input_layernorm` / `pre_mlp_layernorm`, mapped here to transformers' names.
5. `bshd_mask`: verl's unpacked (BSHD) batches carry a [B, S] mask of valid tokens (TransformerEngine's format);
   megatron-core's `DotProductAttention` wants [B, 1, Sq, Sk] with True where masked: causal or key padding.
6. `tensor_type`: megatron-core's optimizer and gradient clipping compare `param.type()` with CUDA type names
   (optimizer/optimizer.py, distrib_optimizer.py, clip_grads.py): to a caller in `megatron.core`, a CPU tensor's
   type reads as the CUDA one.
7. `cuda_factories`: `torch.tensor(..., device="cuda")` and the like in megatron-core's optimizer, gradient
   clipping, schedules, utilities and MoE dispatch: in those modules only, the module's `torch` is a proxy whose
   factories create on the CPU (a process-wide rewrite of torch's factories corrupted transformers' weight loading).
8. `moe`: megatron-core 0.16.1 without TransformerEngine leaves `te_general_gemm` undefined in
   transformer/moe/moe_utils.py (NameError in the router), and the all-to-all's split sizes become numpy only for
   CUDA tensors (`maybe_move_tensor_to_cpu`), which gloo's `all_to_all_single` needs as lists.
9. `resume_optimizer`: resuming megatron-core's distributed optimizer without Apex or TransformerEngine (below).
10. `r3_bshd`: verl lays R3's rollout routes out for packed (THD) batches only; on the CPU's unpacked (BSHD)
   batches the router reads them [S, B], padding included (`verl_dppo.rehearsal.megatron_r3`).

What verl's own config needs (the plugin's cpu_tiny settings, `verl_dppo.rehearsal.setups.cpu_tiny.MEGATRON_CPU_OVERRIDES`):
mbridge (`vanilla_mbridge=True`: Megatron-Bridge needs Python 3.12 or TransformerEngine), float32 (verl's
McoreEngineConfig accepts bf16/fp16 only: `allow_float32` here), BSHD batches, local attention, no sequence
parallelism.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

import torch

from verl_dppo.rehearsal.megatron_device import (
    MegatronShimError,
    piece_cuda,
    piece_cuda_factories,
    piece_rng,
    piece_tensor_type,
    target,
)
from verl_dppo.rehearsal.megatron_r3 import piece_r3_bshd

__all__ = [
    "KNOWN_VERSIONS",
    "MegatronShimError",
    "allow_float32",
    "applies",
    "install",
    "install_on_engine",
    "installed_pieces",
]

KNOWN_VERSIONS = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}
_INSTALLED: list[str] = []


def applies() -> bool:
    """The CPU platform is selected and torch has no CUDA: the shim's condition."""
    return os.environ.get("VERL_PLATFORM") == "cpu" and not torch.cuda.is_available()


def installed_pieces() -> list[str]:
    return list(_INSTALLED)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def check_versions() -> None:
    for distribution, known in KNOWN_VERSIONS.items():
        found = _version(distribution)
        if found != known and not (distribution == "mbridge" and found == "not installed"):
            raise MegatronShimError(
                f"verl-dppo's Megatron CPU shim (verl_dppo/rehearsal/megatron_shim.py) was read against {distribution} "
                f"{known}, and {found} is installed: install {distribution}=={known} (the README's set-up does), or "
                "run Megatron on GPUs"
            )


# ----------------------------------------------------------------------------------------------- 3. local_spec


def _piece_local_spec() -> None:
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    original = target(specs.__name__, "get_gpt_decoder_block_spec")

    @functools.wraps(original)
    def get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs):
        block = original(config, False, *args, **kwargs)
        for layer in block.layer_specs:
            mlp = getattr(layer.submodules, "mlp", None)
            experts = getattr(getattr(mlp, "submodules", None), "experts", None)
            if experts is not None:
                experts.module = cpu_grouped_mlp()
        return block

    _rebind(original, get_gpt_decoder_block_spec)  # verl's model_initializer and mbridge imported it by name


def _rebind(original: Any, replacement: Any) -> None:
    """`replacement` wherever a loaded module holds `original` under the same name (its own module included): the
    shim is installed when the engine is built, after verl and mbridge imported megatron-core's functions by name."""
    name = original.__name__
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)  # not getattr(module, name): lazy modules would import on it
        if isinstance(namespace, dict) and namespace.get(name) is original:
            setattr(module, name, replacement)


@functools.lru_cache(maxsize=1)
def cpu_grouped_mlp() -> type:
    """megatron-core's SequentialMLP (one torch MLP per local expert: what runs without TransformerEngine or
    grouped_gemm) whose expert weights also answer to TEGroupedMLP's names, the only ones mbridge 0.15.1 maps
    (`mlp.experts.linear_fc1.weight{i}`, i the local expert, which mbridge turns into the global index by the EP rank):
    the same Parameter objects (their expert-parallel attributes kept), registered there instead of under
    `local_experts.{i}`; the forward is SequentialMLP's."""
    experts = importlib.import_module("megatron.core.transformer.moe.experts")
    sequential = target(experts.__name__, "SequentialMLP")

    class CpuGroupedMLP(sequential):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            local = list(self._modules.pop("local_experts"))
            self.__dict__["_local_experts"] = local  # not a submodule: the parameters live under TE's names
            self.linear_fc1, self.linear_fc2 = torch.nn.Module(), torch.nn.Module()
            for index, expert in enumerate(local):
                self.linear_fc1.register_parameter(f"weight{index}", expert.linear_fc1.weight)
                self.linear_fc2.register_parameter(f"weight{index}", expert.linear_fc2.weight)
                for name in ("linear_fc1", "linear_fc2"):
                    if getattr(getattr(expert, name), "bias", None) is not None:
                        raise MegatronShimError("verl-dppo's Megatron CPU shim: experts with biases are not mapped")

        @property
        def local_experts(self):
            local = self.__dict__.get("_local_experts")
            return self._modules["local_experts"] if local is None else local

    return CpuGroupedMLP


# ----------------------------------------------------------------------------------------------- 4. norm_names

_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def _piece_norm_names() -> None:
    try:
        bridge = importlib.import_module("mbridge.core.bridge")
    except ImportError:
        return  # no mbridge: verl's Megatron engine cannot load a model anyway (verl says so)
    owner = target(bridge.__name__, "Bridge")
    original = owner._weight_name_mapping_mcore_to_hf

    @functools.wraps(original)
    def mapping(self, mcore_weights_name: str) -> list[str]:
        parts = mcore_weights_name.split(".")
        if parts[:2] == ["decoder", "layers"] and ".".join(parts[3:]) in _NORMS:
            return [f"model.layers.{parts[2]}.{_NORMS['.'.join(parts[3:])]}"]
        return original(self, mcore_weights_name)

    owner._weight_name_mapping_mcore_to_hf = mapping


# ------------------------------------------------------------------------------------------------ 5. bshd_mask


def bshd_attention_mask(mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """verl's [B, S] valid-token mask -> megatron-core's [B, 1, Sq, Sk], True where a query must not attend:
    a later key (causal) or a padding key."""
    causal = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=mask.device), diagonal=1)
    return causal[None, None] | ~mask[:, None, None, :sk].bool()


def _piece_bshd_mask() -> None:
    attention = importlib.import_module("megatron.core.transformer.dot_product_attention")
    owner = target(attention.__name__, "DotProductAttention")
    original = owner.forward

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = bshd_attention_mask(attention_mask, query.shape[0], key.shape[0])  # [S, B, ...]
        return original(self, query, key, value, attention_mask, *args, **kwargs)

    owner.forward = forward


# -------------------------------------------------------------------------------------------------------- 8. moe


def _piece_moe() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = target(moe_utils.__name__, "maybe_move_tensor_to_cpu")

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    _rebind(original, maybe_move_tensor_to_cpu)


# ------------------------------------------------------------------------------------------- 9. resume_optimizer


def _piece_resume_optimizer() -> None:
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    owner = target(distrib.__name__, "DistributedOptimizer")
    original = owner.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, *args, **kwargs):
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and not distrib.HAVE_APEX_OR_TE and not self.optimizer.state:
            # megatron-core's own loading preparation (it fills the states it will load into), done before
            # `state_dict()` reads torch Adam's per-parameter 'step', which a fresh optimizer does not have yet
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    owner.sharded_state_dict = sharded_state_dict
    setter = owner._set_main_param_and_optimizer_states

    @functools.wraps(setter)
    def _set_main_param_and_optimizer_states(self, *args, **kwargs):
        with torch.no_grad():  # in fp32 the main parameters are the model's own, leaves that require grad
            return setter(self, *args, **kwargs)

    owner._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


PIECES = (
    ("cuda", piece_cuda),
    ("rng", piece_rng),
    ("local_spec", _piece_local_spec),
    ("norm_names", _piece_norm_names),
    ("bshd_mask", _piece_bshd_mask),
    ("tensor_type", piece_tensor_type),
    ("cuda_factories", piece_cuda_factories),
    ("moe", _piece_moe),
    ("resume_optimizer", _piece_resume_optimizer),
    ("r3_bshd", piece_r3_bshd),
)


def install(_module: Any = None, force: bool = False) -> list[str]:
    """Install every piece once in this process, where `applies()` (or `force`); returns the pieces installed."""
    if _INSTALLED or not (force or applies()):
        return installed_pieces()
    check_versions()
    for name, piece in PIECES:
        try:
            piece()
        except MegatronShimError:
            raise
        except Exception as error:  # a target moved: say which piece met it
            raise MegatronShimError(f"verl-dppo's Megatron CPU shim, piece {name!r}: {error}") from error
        _INSTALLED.append(name)
    _quiet_rng_notice()
    from verl_dppo.plugin.log_once import warn_once

    warn_once(
        "megatron_shim",
        "verl-dppo: megatron-core %s and mbridge %s on the CPU platform (the plugin's shim: %s)",
        KNOWN_VERSIONS["megatron-core"],
        KNOWN_VERSIONS["mbridge"],
        ", ".join(_INSTALLED),
    )
    return installed_pieces()


def install_on_engine(module: Any) -> None:
    """On the import of verl's Megatron engine module: its engines' `__init__` installs the shim first (where
    `applies()`), before it builds the parallel state, the model and the optimizer."""
    owner = module.MegatronEngine
    original = owner.__init__
    if getattr(original, "_verl_dppo_shim", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        install()
        original(self, *args, **kwargs)

    __init__._verl_dppo_shim = True
    owner.__init__ = __init__


class _RngNotice:
    """megatron-core's RNG tracker warns "CPU RNG state changed within GPU RNG context" at every fork on the CPU, where
    the 'GPU' generator is the CPU one (piece 2): about ten lines per model build, each saying nothing."""

    def filter(self, record) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _quiet_rng_notice() -> None:
    import logging

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_RngNotice())


def allow_float32(engine: Any = None) -> None:
    """On the CPU platform: verl's `McoreEngineConfig.__post_init__` accepts bfloat16 and float16 only
    (workers/config/engine.py:218), and a CPU runs float32: the check sees bf16, the config keeps float32 (verl's
    engine then builds no Float16Module). Installed on the import of verl's config module, wherever it validates (a
    dry run's driver included); float32 passes only where torch has no CUDA."""
    if engine is None:
        engine = importlib.import_module("verl.workers.config.engine")
    owner = engine.McoreEngineConfig
    original = owner.__post_init__
    if getattr(original, "_verl_dppo_float32", False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        asked = self.dtype
        if asked in ("float32", "fp32") and not torch.cuda.is_available():
            object.__setattr__(self, "dtype", "bfloat16")
            try:
                original(self)
            finally:
                object.__setattr__(self, "dtype", asked)
        else:
            original(self)

    __post_init__._verl_dppo_float32 = True
    owner.__post_init__ = __post_init__
