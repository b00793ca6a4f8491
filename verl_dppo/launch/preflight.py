"""What a launch needs beyond a valid config, checked before anything slow starts (a dry run reports it).

The run's files (data parquet with the columns verl reads, a model folder with its config.json) and the place it
starts from (the rollout engine importable, GPUs visible for a local Ray instance, a Ray cluster that answers with
enough GPUs). Each problem is one sentence naming the setting to change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["check_launch_site", "check_paths", "check_writable"]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(item) for item in value]


def check_writable(config: Any) -> list[str]:
    """The folders a run writes (checkpoints; with cpu_tiny, its model and data): each must be creatable. A folder
    that does not exist yet is tried in its nearest existing parent (a temporary folder, removed at once). The
    problem names DPPO_ROOT when the folder lies under it."""
    import tempfile

    root = str(config.dppo.get("root", "")) if config.get("dppo") is not None else ""
    folders = [str(config.trainer.default_local_dir)]
    if config.get("dppo") is not None and config.dppo.get("tiny_model") is not None:
        folders += [str(config.dppo.model_dir), str(config.dppo.data_dir)]
    problems = []
    for folder in folders:
        parent = Path(folder)
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        try:
            if not parent.is_dir():
                raise NotADirectoryError(f"{parent} is not a folder")
            probe = tempfile.mkdtemp(prefix=".verl-dppo-probe-", dir=parent)
            os.rmdir(probe)
        except OSError as error:
            where = f"DPPO_ROOT={root}: " if root and folder.startswith(root) else ""
            problems.append(
                f"{where}cannot create {folder} ({error.strerror or error}): set DPPO_ROOT to a writable folder"
                if where
                else f"cannot create {folder} ({error.strerror or error})"
            )
            break
    return problems


def check_paths(config: Any) -> list[str]:
    """Problems with the run's local files (data and model), each saying how to fix it; [] when all is usable:
    the data files exist and are parquet with the columns verl reads, the model folder holds a config.json."""
    problems = []
    data = config.data
    columns = [data.get("prompt_key", "prompt"), data.get("reward_fn_key", "data_source"), "reward_model"]
    for key in ("train_files", "val_files"):
        for path in _as_list(data.get(key)):
            file = Path(os.path.expanduser(path))
            if not file.exists():
                problems.append(f"data.{key}: {path} does not exist. {_missing_data_hint(path, key, config)}")
                continue
            problem = _parquet_problem(file, columns)
            if problem:
                problems.append(f"data.{key}: {path} {problem}")
    model_path = str(config.actor_rollout_ref.model.path)
    model_dir = Path(os.path.expanduser(model_path))
    if model_path.startswith(("/", "~", ".")):
        download = (
            f"Download it with `hf download {config.dppo.get('model_id') or '<hub id>'} --local-dir "
            f"{model_path}`, or set actor_rollout_ref.model.path (or DPPO_ROOT; now {config.dppo.root})."
        )
        if not model_dir.exists():
            problems.append(f"actor_rollout_ref.model.path: {model_path} does not exist. {download}")
        elif not (model_dir / "config.json").is_file():
            problems.append(
                f"actor_rollout_ref.model.path: {model_path} holds no config.json (an unfinished download, or the "
                f"wrong folder). {download}"
            )
        else:
            problems += _model_problems(config, model_dir)
    return problems


def _model_problems(config: Any, model_dir: Path) -> list[str]:
    """What the model's own config rules out for this run: a Top-K mode or troll fused with the LM head under FSDP2
    needs the head tied to the embedding (else the engine refuses it at the first step, after Ray and the model
    have started)."""
    from verl_dppo.plugin.topk_mode import is_topk_mode, untied_head_fsdp2_problem

    arr = config.actor_rollout_ref
    mode = arr.actor.policy_loss.get("loss_mode")
    if not (is_topk_mode(mode) and arr.model.get("use_fused_kernels", False) and arr.actor.get("strategy") == "fsdp2"):
        return []
    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(
            str(model_dir), trust_remote_code=bool(arr.model.get("trust_remote_code", False))
        )
    except Exception:  # a config transformers cannot read here: the engine's own check stays
        return []
    if getattr(model_config, "tie_word_embeddings", True):
        return []
    return [f"{untied_head_fsdp2_problem(mode)} (the model at {model_dir} has tie_word_embeddings=false)"]


def _missing_data_hint(path: str, key: str, config: Any) -> str:
    """How to get a missing data file: `verl-dppo data` writes DIR/NAME.parquet, so a file named after one of its
    data sets is one command; any other name is the user's own data, to convert or to point at."""
    from verl_dppo.datasets import DATASETS

    file = Path(path)
    root = str(config.dppo.root)
    under_root = f" (or set DPPO_ROOT; now {root})" if os.path.abspath(path).startswith(root.rstrip("/") + "/") else ""
    if file.suffix == ".parquet" and file.stem in DATASETS:
        return (
            f"Write it with `verl-dppo data {file.stem} --out {file.parent}`, or point data.{key} at your "
            f"copy{under_root}."
        )
    return (
        f"Point data.{key} at a parquet file in verl's RL-dataset schema{under_root}; `verl-dppo data NAME "
        f"--from-file FILE --out DIR` converts a .parquet / .json / .jsonl of yours to DIR/NAME.parquet (NAME: the data set whose "
        f"verifier scores it: {', '.join(sorted(DATASETS))})."
    )


def _parquet_problem(file: Path, columns: Sequence[str]) -> Optional[str]:
    """None when `file` is a parquet file with `columns` (what verl's RLHFDataset and reward manager read)."""
    import pyarrow.parquet as pq

    if file.is_dir():
        return "is a folder; name the .parquet file"
    try:
        names = set(pq.read_schema(file).names)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        return f"is not readable as parquet ({' '.join(str(error).split())[:200]}); write it with `verl-dppo data`"
    missing = [column for column in columns if column not in names]
    if missing:
        return (
            f"lacks the column(s) verl reads: {', '.join(missing)} (has {', '.join(sorted(names))}); "
            "convert it with `verl-dppo data NAME --from-file` or set data.prompt_key / data.reward_fn_key"
        )
    return None


def check_launch_site(config: Any, ray_address: Optional[str], ray_timeout_s: float = 60.0) -> list[str]:
    """Where the run would start: the rollout engine importable, enough GPUs here (local Ray) or in the cluster
    (RAY_ADDRESS, asked within `ray_timeout_s`). Problems, each saying what to change; [] when it can start."""
    import importlib.util

    from verl_dppo.rehearsal.setups.cpu_tiny import is_cpu_run
    from verl_dppo.plugin.run_config import async_trainer_mode

    if is_cpu_run(config):  # trainer.device=cpu: the CPU platform's own checks replace the GPU ones
        return _cpu_site(config, ray_address, ray_timeout_s)
    problems = []
    trainer = config.trainer
    wanted = int(trainer.nnodes) * int(trainer.n_gpus_per_node)
    # separate_async: the rollout pool's GPUs come on top of the trainer's.
    rollout = config.actor_rollout_ref.rollout
    pool = (int(rollout.get("nnodes", 0) or 0), int(rollout.get("n_gpus_per_node", 0) or 0))
    if async_trainer_mode(config) != "separate_async":
        pool = (0, 0)
    pool_text = (
        (f" + actor_rollout_ref.rollout.nnodes x n_gpus_per_node = {pool[0] * pool[1]} for the separate rollout")
        if pool[0]
        else ""
    )
    wanted += pool[0] * pool[1]
    engine = str(config.actor_rollout_ref.rollout.get("name", ""))
    if engine in ("vllm", "sglang") and importlib.util.find_spec(engine) is None:
        problems.append(
            f"actor_rollout_ref.rollout.name={engine}: {engine} is not installed here (pip install verl[{engine}] "
            "on every node, or choose the other engine)"
        )
    if not ray_address:
        if int(trainer.nnodes) > 1 or pool[0] > 1:
            key = "trainer.nnodes" if int(trainer.nnodes) > 1 else "actor_rollout_ref.rollout.nnodes"
            problems.append(
                f"{key}={trainer.nnodes if key == 'trainer.nnodes' else pool[0]} needs a Ray cluster: start one "
                f"(`ray start --head` / `ray start --address=...` on each node) and set RAY_ADDRESS, or set {key}=1"
            )
        if str(trainer.get("device", "cuda")) == "cuda":
            visible = _visible_gpus()
            if visible < int(trainer.n_gpus_per_node) + pool[1]:
                problems.append(
                    f"trainer.n_gpus_per_node={trainer.n_gpus_per_node}{pool_text}, but {visible} GPU(s) are visible "
                    "here (local Ray): set trainer.n_gpus_per_node, or RAY_ADDRESS to a cluster"
                )
        return problems
    from verl_dppo.launch.ray_probe import RayUnreachable, check_address, run_probe

    try:
        check_address(ray_address, "RAY_ADDRESS")
        resources = run_probe("resources", ray_address, ray_timeout_s)
    except RayUnreachable as error:
        return problems + [str(error)]
    if resources.get("GPU", 0) < wanted:
        problems.append(
            f"trainer.nnodes x trainer.n_gpus_per_node{pool_text} = {wanted} GPU(s), but the Ray cluster at {ray_address} has "
            f"{resources.get('GPU', 0):g} ({resources.get('nodes', '?')} node(s)): lower them or add nodes"
        )
    return problems


def _cpu_site(config: Any, ray_address: Optional[str], ray_timeout_s: float) -> list[str]:
    from verl_dppo.rehearsal.setups.cpu_tiny import cpu_problems

    if not ray_address:
        return cpu_problems(config, None)
    from verl_dppo.launch.ray_probe import RayUnreachable, check_address, run_probe

    try:
        check_address(ray_address, "RAY_ADDRESS")
        resources = run_probe("resources", ray_address, ray_timeout_s)
    except RayUnreachable as error:
        return [str(error)]
    return cpu_problems(config, ray_address, resources.get("CPU", 0))


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no CUDA build, no driver: none visible
        return 0
