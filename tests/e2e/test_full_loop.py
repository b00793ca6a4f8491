"""verl's whole training loop on CPU, through `python -m verl.trainer.main_ppo` itself (issue 19, part 4).

Each run is verl's own entry point on a config composed from this project's recipes (`cpu_tiny` x the method, as
`verl-dppo run cpu_tiny --method M` composes it, its model and data built by `verl_dppo.rehearsal.setups.cpu_tiny`), with the
plugin loaded in every Ray process through its entry point, the CPU platform chosen by `VERL_PLATFORM=cpu` in the
run's Ray runtime env, and the plugin's `hf` rollout generating. The restart of the killed run is launched as a user
would, through the `verl-dppo run` console script (its own composition, checks and Ray launch): its step 3 must equal
the uninterrupted run's, composed here. Every stage is verl's: the agent loop, verl's GSM8K
reward, GRPO advantages, `update_actor` with the plugin's loss, the weight sync, checkpoints, the JSONL log.

The runs go in the e2e tiers' pool of lanes (tests/e2e/conftest.py, `run_pool` here), each lane's runs one after
another on a local Ray cluster of its own (started and stopped here); the tests read what a user reads: the exit
code, the JSONL log, the workers' log lines, the checkpoint folder.
"""

from __future__ import annotations

import copy
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import driver  # noqa: E402  (method_for_mode, plugin_loss_modes: read from the recipes and verl's registry)

pytestmark = pytest.mark.e2e

MODES = driver.plugin_loss_modes()
TOPK = ("dppo_topk_tv", "dppo_topk_kl")
ROWS_MODE = "dppo_topk_kl"
"""Its run keeps cpu_tiny's own model (warm-started: next-token distributions that depend on the context, so a row
that is not its token's shows); the other runs use a random-init model of the same shape, whose samples differ
within a group (nonzero advantages: every step moves the policy, which the weight-push and resume checks need)."""
RANDOM_MODEL = ("+dppo.tiny_model.warmup.max_steps=0", "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-random")
# The Top-K rows' run: two mini-batches a step, both on the policy that sampled (lr 0: no update moves pi between
# them, whatever order verl's trainer receives the samples in), so the rows' correctness alone decides its masks. With
# an update, the second mini-batch meets the first one's, and its mask may act (the CI of 7be08c3: 0.0667 at step 2).
ROWS = ("actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=0.0")
FUSED_MODE = "dppo_topk_tv"
"""Its run trains with verl's fused kernels (use_fused_kernels=True, torch backend): the Top-K statistics come from
the plugin's pass fused with the LM head (issue 20), and its weight-sync check then holds the fused log-probs to the
rollout's."""
FUSED_TROLL = "sync-troll-fused"
"""troll with use_fused_kernels, a run of its own beside the unfused troll run: its loss reaches the fused pass only
through TROLL's terms, never through the model's output (issue 24.1: FSDP2 had freed the tied LM head)."""
FUSED = (
    "actor_rollout_ref.model.use_fused_kernels=True",
    "dppo.tiny_model.tie_word_embeddings=true",
    "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-random-tied",
)
"""FSDP2 (the CPU's engine) reads an untied LM head's weight still sharded in the fused forward (refused, by verl's
kernel too): the fused run's random-init model ties its head to the embedding, as Qwen3 up to 4B does."""
TWO_RANKS = ("trainer.n_gpus_per_node=2",)
LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=all-linear",
)
MOE = (
    "dppo.tiny_model.num_experts=4",
    "+dppo.tiny_model.warmup.max_steps=0",
    "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-moe-random",
)
R3_HF = (
    "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
)
"""R3 on verl's FSDP engine, the routes recorded by the plugin's hf rollout (issue 52)."""
PADDED = (
    "data.train_batch_size=3",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
)
"""A batch verl's v1 trainer pads (issue 72.1): 3 prompts x 2 samples, mini-batches of 2 x 2, so 6 samples padded
to 8 with two of verl's synthetic samples (routes all zeros, no response token), one sample a micro-batch: those two
are micro-batches of their own, which the replay must count, not refuse."""
PADDED_MODE = "ipo"
"""Its run is the `hf` rollout's padded R3 launch: the random-init Qwen3-MoE (MOE), its routes recorded by the hf
rollout and replayed (R3_HF), on a batch verl pads (PADDED). The vLLM tier's R3 run pads likewise: verl's padding is
then run through on both rollouts (a launch of its own would add two minutes)."""
RESUME_SHAPE = (*TWO_RANKS, *MOE, *R3_HF)
"""The killed run and its restart (and so the weight-sync check of RESUME_METHOD, on the restart): a cluster run's
shape (issue 34), two ranks, a Qwen3-MoE of 4 experts (random init) whose routes the hf rollout records and the
trainer replays (R3, issue 52)."""
LORA_MODE = "grpo_clip"
"""Its run trains a LoRA adapter (rank 8, all-linear) on the hf rollout, launched through the CLI (issue 34.3)."""
SYNC_BOUND = 1e-5
"""fp32 on both sides, one update per step on the policy that sampled: mu and pi agree to float rounding (about
1e-10 on the random-init models, 1e-6 on the warm-started one: issue 24.7); a weight that missed the push moves
them 1e-3 or more apart."""
STEPS = 2
VALIDATION_FILE = "${dppo.tiny_data.dir}/validation.parquet"
"""cpu_tiny's problems with other prompts (validation_file): the resume runs validate on them."""
RESUME_METHOD = "dppo_binary_tv"
RESUMED = "resume-restarted"
"""RESUME_METHOD's sync-trainer run: the restart of the killed run, which logs every step of a whole run (1-2 kept
from the killed run, 3-4 its own) and is checked as a mode's own run is (a run of its own would add 2-3 minutes)."""
DEFAULT_METHODS = ("dppo_binary_tv", "troll")
"""Run with cpu_tiny's own settings, on cpu_tiny's warm-started model (the pool builds it once, as the lanes start)."""
TRAINED_ELSEWHERE = {
    "dppo_binary_kl": ("test_cluster_shapes", "shape-2r-bf16-binary_kl"),
    "pg_is": ("test_megatron_loop", "megatron-moe-ep2"),
}
"""Modes whose main_ppo run is another tier's launch in the pool (its module, the run): no run of their own here (a
launch: 2-4 minutes on a slow 2-core machine); test_every_loss_mode_trains_through_main_ppo checks that run."""
TRAINED_BY_DEFAULT_RUN = ("troll",)
"""Modes whose sync-trainer checks read their `default-` run (no `sync-` run of their own; TROLL's fused run is
another); RESUME_METHOD's read the restart (RESUMED)."""
PARALLEL = int(os.environ.get("DPPO_FULL_LOOP_PARALLEL", "2"))
"""Lanes of runs side by side, each on a local Ray cluster of its own, its runs one after another: verl's
TransferQueue names its controller actor globally (namespace "transfer_queue"), so two main_ppo jobs at once on one
cluster would share it."""
RUN_TIMEOUT_S = 600
WORKER_DEATH_TIMEOUT_S = 180
"""After its training worker is killed, the driver has this long to fail on its own (a hang is a failure)."""
CLUSTER_CPUS = 32
"""Logical CPUs of the shared cluster: every run takes one per worker process (the CPU platform's Ray resource)."""

NOT_COMPARED = (
    "timing_s/",
    "timing_per_token_ms/",
    "perf/",
    "actor/perf/",
    "global_seqlen/",
    "actor/lr",
    "training/time",
    "training/off_policy/wait",
)
"""Clocks, throughput and memory counters differ between runs by nature."""


# ----------------------------------------------------------------------------------------------------- the cluster


class Cluster:
    """A local Ray instance owned by a holder process of ours; the runs join it with RAY_ADDRESS."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        # Ray's socket paths (<temp>/session_<date>_<pid>/sockets/plasma_store) must stay under AF_UNIX's 107 bytes:
        # pytest's tmp_path (/tmp/pytest-of-<user>/pytest-<n>/...) is too long once n has two digits.
        self.ray_dir = tempfile.mkdtemp(prefix="dppo-ray-", dir="/tmp")
        code = (
            "import ray, sys; ray.init(num_cpus=%d, include_dashboard=False, _temp_dir=%r); "
            "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()" % (CLUSTER_CPUS, self.ray_dir)
        )
        # No idle worker processes prestarted for each job that connects (Ray's default: two per driver, each
        # importing Ray for nothing: every actor of a run gets a process of its own).
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=str(root),
            env=self.env(RAY_prestart_worker_first_driver="0"),
        )
        self.address = self.process.stdout.readline().strip()
        if not self.address:
            raise RuntimeError("the local Ray cluster did not start")

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        """The cluster's and its drivers' environment: Ray's token authentication off (a private local cluster whose
        token the drivers would otherwise have to find in ~/.ray), no VERL_* of this process (each run sets its own
        in its Ray runtime env, as `verl-dppo run` does)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "RANK", "WORLD_SIZE", "MASTER_"))}
        env.update(RAY_AUTH_MODE="disabled", **extra)
        return env

    def stop(self) -> None:
        self.process.stdin.close()  # the holder returns from stdin.read(): ray.shutdown at exit stops the cluster
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.ray_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------- the runs


@dataclass
class Run:
    name: str
    method: str
    trainer_mode: Optional[str] = None
    steps: int = STEPS
    overrides: tuple[str, ...] = ()
    kill_after_step: Optional[int] = None
    """SIGKILL the run's training worker (verl's WorkerDict actor: the FSDP actor) once this step is logged and
    checkpointed (or `kill_checkpoint` is), as a node lost mid-run would; the driver must then fail on its own."""
    kill_checkpoint: Optional[int] = None
    """The checkpoint the kill waits for, if not kill_after_step's own: a step before it, so that the killed run has
    logged steps past its last checkpoint, which the restart logs again."""
    kill_launcher_when: Optional[Callable] = None
    """kill_launcher_when(run, process), polled while the launch runs: once True, SIGKILL the launched process itself
    (`verl-dppo run`), as a user's closed terminal or OOM kill would (`killed_pid` its pid)."""
    killed_pid: Optional[int] = None
    exited_on_its_own: bool = True
    folder_of: Optional[str] = None  # another run whose folder (checkpoints, JSONL log) this one continues
    after: Optional[Callable] = None
    """after(run, cluster), called in the run's lane once the run has ended (its lane's Ray cluster still up)."""
    defaults: bool = False
    """cpu_tiny's own settings, as a user's `verl-dppo run cpu_tiny --method M` trains: only the run's folders set
    (checkpoints, JSONL log). The other runs set the suite's reward, lr and model, and one update per step."""
    warm_model: bool = False
    """cpu_tiny's warm-started model (peaked rows, as a real model's) instead of the suite's random-init one."""
    via_cli: bool = False
    """Launched as a user launches it, `verl-dppo run cpu_tiny --method M OVERRIDES` (the console script: its own
    composition, checks, asset build and Ray launch), instead of main_ppo on a YAML composed here."""
    command: list = field(default_factory=list)
    """Set here for a launch that is not cpu_tiny's (`compose` then leaves it as it is)."""
    environment: dict = field(default_factory=dict)
    """Variables the launch's environment adds (the harness drops the caller's VERL_* ones)."""
    own_ray: bool = False
    """Launched without RAY_ADDRESS: `verl-dppo run` starts a Ray instance of its own, as on a machine without a
    cluster (its lane's cluster idles meanwhile)."""
    timeout_s: float = 0.0
    """How long the launch may take (0: RUN_TIMEOUT_S)."""
    cost: float = 1.0
    """Its length in launches of a one-rank sync run, before what its settings add (`chain_cost`)."""
    first: bool = False
    """Its chain goes before every chain without such a run, whatever the costs (`run_pool`)."""
    notes: dict = field(default_factory=dict)
    """What the run's hooks (kill_launcher_when, after) record for its tests."""
    rc: Optional[int] = None
    seconds: float = 0.0
    log: str = ""
    records: list = field(default_factory=list)
    folder: Optional[Path] = None

    def metrics(self, step: int) -> dict:
        return next(r["data"] for r in self.records if r["step"] == step and not validation_only(r))

    def values(self, key: str) -> list[float]:
        return [r["data"][key] for r in sorted(self.records, key=lambda r: r["step"]) if not validation_only(r)]


_COMPOSED: dict = {}


def compose(run: Run, root: Path) -> Path:
    """The run's config as `verl-dppo run cpu_tiny --method M` composes it, written where main_ppo reads it."""
    from omegaconf import OmegaConf, open_dict

    from verl_dppo.launch.compose import compose_recipe, resolved_yaml, validate_recipe
    from verl_dppo.rehearsal.setups.cpu_tiny import build_assets, select_platform

    run.folder = root / (run.folder_of or run.name)
    run.folder.mkdir(parents=True, exist_ok=True)
    if run.command:
        return run.folder
    checkpoints = run.folder / "checkpoints"
    # Hydra composes each (method, trainer mode) once (some 30 YAML files: seconds on a small CPU); the overrides
    # are parsed by Hydra's own parser and set on a copy (driver.apply_overrides), as Hydra would set them.
    key = (run.method, run.trainer_mode)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose_recipe("cpu_tiny", run.method, trainer_mode=run.trainer_mode)
    overrides = (
        [f"trainer.default_local_dir={checkpoints}"]
        if run.defaults
        else [
            f"trainer.total_training_steps={run.steps}",
            f"trainer.default_local_dir={checkpoints}",
            "trainer.resume_mode=auto",
            # One update per step on the policy that sampled (cpu_tiny's own: 4 epochs of 4 mini-batches): the weight
            # sync is then what actor/dppo/mismatch_tv_mean measures, and a missed push or a wrong resume shows in it.
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_epochs=1",
            # A reward that varies between samples (full_loop_reward.py): every step moves the policy, at a rate (lr)
            # that a missed weight push or a wrong resume cannot hide in.
            f"reward.custom_reward_function.path={HERE / 'full_loop_reward.py'}",
            "reward.custom_reward_function.name=compute_score",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            # fp32 on both sides: the weight-sync check measures the sync, not bf16 rounding.
            "actor_rollout_ref.rollout.dtype=float32",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            *(() if run.name == f"sync-{ROWS_MODE}" or run.warm_model else RANDOM_MODEL),
            *run.overrides,
        ]
    )
    if run.via_cli:  # the same overrides, with the two runtime-env settings set below as overrides too
        run.command = [
            str(Path(sys.executable).parent / "verl-dppo"),
            "run",
            "cpu_tiny",
            "--method",
            run.method,
            *([f"--trainer-mode={run.trainer_mode}"] if run.trainer_mode else []),
            *overrides,
            f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_ROOT={run.folder / 'logs'}",
            "+ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='1'",
        ]
        return run.folder
    config = driver.apply_overrides(copy.deepcopy(_COMPOSED[key]), overrides)
    validate_recipe(config)
    select_platform(config)  # VERL_PLATFORM=cpu in the run's runtime env: the cluster's processes do not have it
    with open_dict(config):
        env = config.ray_kwargs.ray_init.runtime_env.env_vars
        env.VERL_FILE_LOGGER_ROOT = str(run.folder / "logs")
        env.OMP_NUM_THREADS = "1"
    build_assets(config)
    OmegaConf.resolve(config)
    if "validation.parquet" in str(config.data.val_files):
        validation_file(str(config.data.train_files), str(config.data.val_files))
    path = run.folder / f"{run.name}.yaml"
    path.write_text(resolved_yaml(config))
    run.command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(path.parent),
        "--config-name",
        path.stem,
        f"hydra.run.dir={run.folder / 'hydra'}",
        "hydra.output_subdir=null",
    ]
    return path


def validation_file(train: str, path: str) -> None:
    """The training problems, each prompt with a sentence added: answers unchanged, no prompt shared."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(train).to_pylist()
    for row in rows:
        row["prompt"] = [
            dict(m, content=m["content"] + " Check your answer.") if m["role"] == "user" else m for m in row["prompt"]
        ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def read_records(run: Run) -> list[dict]:
    records = []
    for path in (run.folder / "logs").rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return records


def past_step(run: Run, step: int, checkpoint: Optional[int] = None) -> bool:
    """The checkpoint of `checkpoint` (default: `step`) is complete and the step's line is in the JSONL log (verl logs
    after saving)."""
    try:
        saved = int((run.folder / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return False
    return saved >= (step if checkpoint is None else checkpoint) and any(
        r.get("step") == step for r in read_records(run)
    )


def worker_pid(log_path: Path) -> int:
    """The pid of one of the run's training workers (the lowest: one rank of several), from Ray's log prefix
    "(WorkerDict pid=N)"."""
    pids = set(re.findall(r"\(WorkerDict pid=(\d+)\)", log_path.read_text(errors="replace")))
    assert pids, f"no WorkerDict process in {log_path}"
    return min(int(pid) for pid in pids)


def execute(run: Run, address: str) -> Run:
    env = Cluster.env(
        RAY_ADDRESS=address,
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        RAY_DEDUP_LOGS="0",
        HYDRA_FULL_ERROR="1",
        DPPO_ROOT=str(run.folder.parent / "dppo_root"),
    )
    if run.own_ray:
        del env["RAY_ADDRESS"]
    env.update(run.environment)
    start = time.perf_counter()
    log_path = run.folder / f"{run.name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(run.folder))
        deadline = start + (run.timeout_s or RUN_TIMEOUT_S)
        while process.poll() is None and time.perf_counter() < deadline:
            if (
                run.kill_after_step
                and run.killed_pid is None
                and past_step(run, run.kill_after_step, run.kill_checkpoint)
            ):
                run.killed_pid = worker_pid(log_path)
                os.kill(run.killed_pid, signal.SIGKILL)  # the worker dies right after step kill_after_step
                deadline = min(deadline, time.perf_counter() + WORKER_DEATH_TIMEOUT_S)
            if run.kill_launcher_when is not None and run.killed_pid is None and run.kill_launcher_when(run, process):
                run.killed_pid = process.pid
                process.kill()
            time.sleep(0.2)
        if process.poll() is None:
            run.exited_on_its_own = False
            process.kill()
        run.rc = process.wait()
    run.seconds = time.perf_counter() - start
    run.log = log_path.read_text(errors="replace")
    run.records = read_records(run)
    return run


def chains() -> list[list[Run]]:
    """The runs, as chains run one after another (a resume after its killed run); chains run side by side."""

    def shape(mode: str) -> tuple[str, ...]:
        return {ROWS_MODE: ROWS, FUSED_MODE: FUSED, LORA_MODE: LORA, PADDED_MODE: (*MOE, *R3_HF, *PADDED)}.get(mode, ())

    modes = [
        [
            Run(
                f"sync-{mode}",
                driver.method_for_mode(mode),
                via_cli=mode == LORA_MODE,
                overrides=(
                    *(() if mode in (ROWS_MODE, PADDED_MODE) else ("actor_rollout_ref.actor.ppo_mini_batch_size=4",)),
                    *shape(mode),
                ),
            )
        ]
        for mode in MODES
        if mode_run(mode) == f"sync-{mode}" and mode not in TRAINED_ELSEWHERE
    ]
    if "troll" in MODES:
        modes.append([Run(FUSED_TROLL, driver.method_for_mode("troll"), overrides=FUSED)])
    # With the recipes' val_before_train (cpu_tiny's is off): the restart logs a validation at the checkpoint's step.
    # Its prompts are not the training prompts (validation_file), as a user's validation set would be; the hf
    # rollout seeds each sample from its identity in the run (validation samples have their own), so the restart's
    # validation at step 2 leaves what step 3 samples as the killed run, uninterrupted until then, sampled it.
    resumed = (
        "trainer.save_freq=2",
        "trainer.val_before_train=True",
        f"data.val_files={VALIDATION_FILE}",
        *RESUME_SHAPE,
    )
    # cpu_tiny as it ships (issue 27.2): the trust region acts within its 4 steps.
    defaults = [[Run(f"default-{method}", method, steps=4, via_cli=True, defaults=True)] for method in DEFAULT_METHODS]
    # Killed once step 3 is logged, a step past its step-2 checkpoint (as a crash mostly falls between checkpoints):
    # its step 3 is the uninterrupted run's, which the restart's must equal, and the line the restart logs again.
    resume = [
        [
            Run("resume-killed", RESUME_METHOD, steps=4, kill_after_step=3, kill_checkpoint=2, overrides=resumed),
            Run(RESUMED, RESUME_METHOD, steps=4, folder_of="resume-killed", via_cli=True, overrides=resumed),
        ]
    ]
    return resume + defaults + modes


def lane_chains(root: Path) -> list[list[Run]]:
    """This tier's launches for the pool of lanes (tests/e2e/conftest.py: `launches`)."""
    return chains()


@pytest.fixture(scope="module")
def runs(launches) -> dict[str, Run]:
    return launches


def chain_cost(chain: list[Run]) -> float:
    """A chain's rough length for the pool's order, in launches of a one-rank sync run (the vLLM and Megatron start-ups,
    two ranks, more steps, the separate_async trainer cost more: 2026-11-28's clean-clone suite, a slow 2-core Intel,
    117-200 s a plain launch, 164-251 s on Megatron, 208-296 s on vLLM)."""
    cost = 0.0
    for run in chain:
        settings = " ".join(run.overrides)
        cost += (
            run.cost
            + 0.5 * ("rollout.name=vllm" in settings)
            + 0.3 * ("model_engine=megatron" in settings)
            + 0.2 * ("n_gpus_per_node=2" in settings)
            + 0.1 * max(0, run.steps - 2)
            + 0.5 * (run.trainer_mode == "separate_async")
        )
    return cost


def only_runs() -> Optional[set[str]]:
    """The runs named in DPPO_FULL_LOOP_ONLY (comma-separated), a developer's subset of the pool; None: every run."""
    only = os.environ.get("DPPO_FULL_LOOP_ONLY")
    return {name.strip() for name in only.split(",") if name.strip()} if only else None


def run_pool(root: Path, chains_: list[list[Run]], prepare: Optional[Callable] = None) -> dict[str, Run]:
    """Every tier's chains (a resume after its killed run) in PARALLEL lanes that pull them from one queue, longest
    first, each lane on a local Ray cluster of its own (started once for every tier), its runs one after another.
    This thread composes the chains as the lanes run the first ones (Hydra's composition is not thread-safe),
    DPPO_ROOT=root/dppo_root for all of them: each model and data set is built once (`prepare()` once the lanes have
    a chain each: the builds that launches through the CLI would otherwise make side by side). Only the runs named
    in DPPO_FULL_LOOP_ONLY (comma-separated), if set; a chain with a `first` run before the others. The times go to
    root/seconds.json."""
    only = only_runs()
    plan = [[run for run in chain if only is None or run.name in only] for chain in chains_]
    plan = sorted(
        (chain for chain in plan if chain),
        key=lambda chain: (any(run.first for run in chain), chain_cost(chain)),
        reverse=True,
    )
    done: dict[str, Run] = {}
    lock = threading.Lock()
    ready: queue.Queue = queue.Queue()
    failed = threading.Event()  # a composition failed: the lanes start nothing more

    def run_lane(index: int) -> None:
        cluster = Cluster(root / f"lane{index}")
        try:
            while (chain := ready.get()) is not None:
                for run in chain if not failed.is_set() else ():
                    execute(run, cluster.address)
                    if run.after is not None:
                        run.after(run, cluster)
                    with lock:
                        done[run.name] = run
                    print(f"lanes: {run.name} rc={run.rc} {run.seconds:.0f} s", file=sys.stderr)
        finally:
            cluster.stop()

    start = time.perf_counter()
    lanes = min(PARALLEL, len(plan))
    with ThreadPoolExecutor(max_workers=max(1, lanes)) as pool:
        futures = [pool.submit(run_lane, index) for index in range(lanes)]
        saved_root = os.environ.get("DPPO_ROOT")
        os.environ["DPPO_ROOT"] = str(root / "dppo_root")
        try:
            for index, chain in enumerate(plan):
                if index == lanes and prepare is not None:
                    prepare()  # the lanes have a chain each (a launch that needs its build first makes it itself)
                for run in chain:
                    compose(run, root)  # resolved: the runs read their paths from the YAML, not from DPPO_ROOT
                ready.put(chain)
        except BaseException:
            failed.set()
            raise
        finally:
            if saved_root is None:
                os.environ.pop("DPPO_ROOT")
            else:
                os.environ["DPPO_ROOT"] = saved_root
            for _ in range(lanes):
                ready.put(None)
        for future in futures:
            future.result()
    total = time.perf_counter() - start
    print(f"lanes: all runs {total:.0f} s", file=sys.stderr)
    (root / "seconds.json").write_text(json.dumps({"all": total, **{n: r.seconds for n, r in done.items()}}, indent=1))
    return done


def _fail(run: Run, what: str) -> str:
    tail = "\n".join(run.log.splitlines()[-40:])
    limit = "" if run.exited_on_its_own else ", killed at its time limit"
    return f"{run.name}: {what} (rc={run.rc}, {run.seconds:.0f} s{limit}); log tail:\n{tail}"


def validation_only(record: dict) -> bool:
    return all(key.startswith("val-") for key in record["data"])


def finished(run: Run, steps: int) -> None:
    assert run.rc == 0, _fail(run, "main_ppo failed")
    training = [r["step"] for r in run.records if not validation_only(r)]
    assert training == list(range(1, steps + 1)), _fail(run, f"JSONL steps {training}")


def replayed_every_route(run: Run, steps: int, router_differs: bool, unrouted_max: float) -> None:
    """R3 (issue 52) at each of `steps` logged steps: the experts the update used were the rollout's on every row with
    a route (`r3_replayed_frac` 1: without the replay there is no such metric), the router alone would have chosen
    otherwise on under a fifth of them (the routes reached their rows: rows out of line differ on most) and, with
    `router_differs`, on some at least (so a replay that did nothing would read below 1); the routes fit the tokens
    (`r3_route_fit` at least 0.8: a replay one token or one layer off reads about 0.14, issue 72.2; the later
    mini-batches' routers have moved, 0.95-0.99 in the warmed-up MoE's runs); rows without a
    route counted apart, above 0 (each sequence's last token) and under `unrouted_max`."""
    replayed = run.values("actor/dppo/r3_replayed_frac")
    differs = run.values("actor/dppo/r3_router_differs_frac")
    fit = run.values("actor/dppo/r3_route_fit")
    unrouted = run.values("actor/dppo/r3_unrouted_frac")
    assert len(replayed) == steps and all(r == 1.0 for r in replayed), _fail(run, f"replayed {replayed}")
    assert len(fit) == steps and all(0.8 <= f <= 1.0 + 1e-9 for f in fit), _fail(run, f"route fit {fit}")
    assert all(0 <= d < 0.2 for d in differs) and (max(differs) > 0 or not router_differs), _fail(
        run, f"router differs {differs}"
    )
    assert all(0 < u < unrouted_max for u in unrouted), _fail(run, f"rows without a route {unrouted}")


# ----------------------------------------------------------------------------------------------------- the tests


def mode_run(mode: str) -> str:
    """The run that trains `mode` with the sync trainer: its own, the `default-` run of a mode that has one (the
    same main_ppo, launched through `verl-dppo run` with cpu_tiny's own settings: a second run would add a minute), or
    for RESUME_METHOD the restart of the killed run (RESUMED)."""
    if mode == RESUME_METHOD:
        return RESUMED
    return f"default-{mode}" if mode in TRAINED_BY_DEFAULT_RUN else f"sync-{mode}"


def trained_through_main_ppo(run: Run, mode: str) -> None:
    """main_ppo exited 0 after the run's steps; every logged number is finite; the mode's own metrics are in the JSONL
    log at every step; the worker announced the mode in effect (the plugin ran in the worker)."""
    finished(run, run.steps)
    for record in run.records:
        bad = {k: v for k, v in record["data"].items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, _fail(run, f"step {record['step']}: non-finite {bad}")
    prefix = "actor/troll/" if mode == "troll" else "actor/dppo/"
    for record in run.records:  # a validation's record (val_before_train) holds its val-* metrics alone
        assert validation_only(record) or any(k.startswith(prefix) for k in record["data"]), _fail(
            run, f"no {prefix}* at step {record['step']}"
        )
    assert f"verl-dppo {mode} in effect" in run.log, _fail(run, "the worker's 'in effect' line is missing")
    # The run's TQ_NUM_THREADS=1 (cpu_tiny): TransferQueue's per-call warning on a machine of fewer than 8 cores.
    assert "should not exceed total physical CPU cores" not in run.log, _fail(run, "TransferQueue's thread warnings")
    assert all(r["data"]["response_length/mean"] > 0 for r in run.records if not validation_only(r))


@pytest.mark.parametrize("mode", MODES)
def test_every_loss_mode_trains_through_main_ppo(runs, mode):
    """Each registered loss mode, sync trainer: `trained_through_main_ppo`, on the mode's run here or, for those of
    TRAINED_ELSEWHERE, on the other tier's run (skipped only where that tier is not in this session's pool)."""
    module, name = TRAINED_ELSEWHERE.get(mode, (None, mode_run(mode)))
    if name not in runs and module is not None and module not in runs.tiers:
        pytest.skip(f"{mode} trains in {module}'s {name}, a tier this session does not run")
    trained_through_main_ppo(runs[name], mode)  # a run missing otherwise: skipped or failed by Launches.__missing__


@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_topk_tv"])
def test_weight_sync_is_exact(runs, mode):
    """One mini-batch per step (cpu_tiny: ppo_mini_batch_size = train_batch_size), fp32 on both sides: the policy the
    actor scores is the one the hf rollout sampled from, so mu and pi agree up to float rounding at every step. A
    weight push that skipped a tensor, or a stale copy, would show a mismatch of the order of the update (1e-3+).
    dppo_binary_tv's run is the resumed one (RESUMED): steps 1-2 before the kill, 3-4 on the weights the restart
    loaded and pushed."""
    run = runs[mode_run(mode)]
    finished(run, run.steps)
    mismatch = run.values("actor/dppo/mismatch_tv_mean")
    assert len(mismatch) >= 2 and max(mismatch) <= SYNC_BOUND, _fail(run, f"mismatch_tv_mean per step {mismatch}")
    # measured, not 0: the two forwards' rounding (README: about 2e-10 on this random-init model; issue 24.7)
    assert min(mismatch) > 0.0, _fail(run, f"mismatch_tv_mean per step {mismatch}")
    assert min(run.values("actor/grad_norm")) > 0, _fail(run, "no update: the check above could not fail")


def test_topk_rows_reach_the_actor(runs):
    """The Top-K rows travel from the hf server through the agent loop (patches/agent_loop: one row per generated
    token, or it raises) to the actor's logits hook, which checks them against the sampled token's log-prob (rows
    and log-prob of one distribution, or it raises) and measures D on mu's top-K. The run's two mini-batches a step
    are both on the sampling policy (ROWS: lr 0), so with the server's rows no token is masked or dropped and the
    mismatch is the two forwards' rounding (about 1e-6, issue 24.7) at every step, in any order of the samples. Rows
    that are not their token's (shifted by one, truncated) fail the actor's check or give a large D on cpu_tiny's
    warm-started model."""
    run = runs[f"sync-{ROWS_MODE}"]
    finished(run, run.steps)
    for key in ("actor/dppo/masked_frac_pos", "actor/dppo/masked_frac_neg", "actor/dppo/dropped_frac"):
        assert max(run.values(key)) == 0.0, _fail(run, f"{key} per step {run.values(key)}")
    mismatch = run.values("actor/dppo/mismatch_tv_mean")
    assert len(mismatch) == run.steps and all(1e-7 < m < 1e-5 for m in mismatch), _fail(
        run, f"mismatch_tv_mean per step {mismatch}"
    )
    assert max(run.values("actor/grad_norm")) > 0, _fail(run, "every advantage 0: the masks could not act")


def test_fused_topk_trains_through_main_ppo(runs):
    """use_fused_kernels=True in main_ppo: the plugin's fused pass ran in the worker (its announcement), the run
    finished with its Top-K metrics (test_every_loss_mode_trains_through_main_ppo) and the fused log-probs equal the
    rollout's to 1e-5 at every step (test_weight_sync_is_exact)."""
    run = runs[f"sync-{FUSED_MODE}"]
    finished(run, run.steps)
    assert "use_fused_kernels: true" in (run.folder / f"{run.name}.yaml").read_text()
    assert f"verl-dppo {FUSED_MODE}: statistics fused with the LM head" in run.log, _fail(run, "no fused pass")


def test_fused_troll_trains_through_main_ppo(runs):
    """troll with use_fused_kernels=True in main_ppo (FSDP2, tied LM head): the fused pass ran, the run finished
    with TROLL's metrics at every step, every number finite, and the policy moved (a gradient reached the head)."""
    run = runs[FUSED_TROLL]
    finished(run, run.steps)
    assert "verl-dppo troll: statistics fused with the LM head" in run.log, _fail(run, "no fused pass")
    for record in run.records:
        assert any(k.startswith("actor/troll/") for k in record["data"]), _fail(run, "no actor/troll/*")
        bad = {k: v for k, v in record["data"].items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, _fail(run, f"step {record['step']}: non-finite {bad}")
    assert min(run.values("actor/grad_norm")) > 0, _fail(run, "no update")


def test_resume_after_sigkill_continues_at_step_3(runs):
    """A run whose training worker (verl's WorkerDict actor) is SIGKILLed once it has logged step 3, a step past its
    step-2 checkpoint, fails loudly on its own: main_ppo exits non-zero within WORKER_DEATH_TIMEOUT_S, Ray's
    actor-death error in its log. Started again (trainer.resume_mode=auto), it continues at step 3; its step-3 metrics
    equal the killed run's, which had run uninterrupted until then. Tolerance 1e-4 relative: the checkpoint restores
    the fp32 weights, optimizer and data order exactly and the hf rollout seeds each request from (seed, weight
    version, prompt), so the same tokens are sampled; what remains is float summation order (batch composition and
    padding in the rollout's forward), 1e-6 or below. The JSONL log holds steps 1-2 of the killed run and 3-4 of the
    restart, once each: the killed run's step 3, logged after the checkpoint, is dropped (patches/file_logger.py).

    The runs' shape (RESUME_SHAPE): two ranks, one rank's worker killed; a Qwen3-MoE of 4 experts, its experts
    exported one by one (verl's unfuse_moe_params) and put back in transformers' fused tensors by the hf rollout,
    which samples from the policy the actor scores to float rounding at every step, an update at each, nothing masked
    on the policy that sampled. Issue 52: at every step before the kill and after the resume, the trainer's routers
    on both ranks took the experts the hf rollout recorded on every row with a route (`r3_replayed_frac` 1: without
    the replay there is no such metric), the router alone would have chosen otherwise on at most a few (the routes
    reached their rows), and the rows without a route (padding, each sequence's last token) are counted apart."""
    killed, restarted = runs["resume-killed"], runs[RESUMED]
    model = killed.folder.parent / "dppo_root" / "models" / "cpu_tiny-moe-random"
    config = json.loads((model / "config.json").read_text())
    assert config["num_local_experts"] == 4 and config["architectures"] == ["Qwen3MoeForCausalLM"], config
    assert killed.killed_pid is not None, _fail(killed, "the worker was never killed")
    assert killed.exited_on_its_own, _fail(
        killed, f"main_ppo hung after its worker died (killed after {WORKER_DEATH_TIMEOUT_S} s)"
    )
    assert killed.rc not in (0, None), _fail(killed, "main_ppo exited 0 after its worker died")
    assert "ActorDiedError" in killed.log or "RayActorError" in killed.log, _fail(killed, "no actor-death error")
    logged = [r["step"] for r in killed.records if not validation_only(r)]
    assert logged == [1, 2, 3], _fail(killed, f"training steps logged by the killed run {logged}")
    # The JSONL file of the killed run and the restart: training steps 1, 2 (before), 3, 4 (after), each once (the
    # killed run's step 3 dropped; issue 24.2: the restart's validation at step 2 had dropped step 2's training
    # record); validations at steps 0 and 2.
    finished(restarted, 4)
    assert [r["step"] for r in restarted.records if validation_only(r)] == [0, 2], _fail(restarted, "validations")
    assert f"verl-dppo: launching cpu_tiny + {RESUME_METHOD}" in restarted.log, _fail(restarted, "not through the CLI")
    assert "Resuming from" in restarted.log and "setting global step to 2" in restarted.log, _fail(
        restarted, "did not resume from the step-2 checkpoint"
    )
    assert not any("Training from scratch" in line for line in restarted.log.splitlines()), _fail(restarted, "scratch")
    ours, theirs = restarted.metrics(3), killed.metrics(3)
    compared = 0
    for key, value in theirs.items():
        if key.startswith(NOT_COMPARED) or not isinstance(value, (int, float)):
            continue
        assert key in ours, f"step 3 of the resumed run lacks {key}"
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{key}: resumed {ours[key]} vs {value}"
        compared += 1
    assert compared > 20
    mismatch = restarted.values("actor/dppo/mismatch_tv_mean")
    assert len(mismatch) == 4 and all(0 < m < SYNC_BOUND for m in mismatch), _fail(
        restarted, f"mismatch_tv_mean {mismatch}"
    )
    assert min(restarted.values("actor/grad_norm")) > 0, _fail(restarted, "no update: the check above can't fail")
    assert max(restarted.values("actor/pg_clipfrac")) == 0.0, _fail(restarted, "masked on the sampling policy")
    for run, steps in ((killed, 3), (restarted, 4)):  # the restart's log keeps the steps before the checkpoint
        replayed_every_route(run, steps, router_differs=False, unrouted_max=0.5)  # fp32: the router agrees


def test_r3_on_the_hf_rollout_counts_verls_padding_samples(runs):
    """R3 on the hf rollout's routes, on a batch verl's v1 trainer pads (PADDED, issue 72.1): two of verl's synthetic
    samples (routes all zeros, no response token), each a micro-batch of its own, are counted and the step goes on;
    every real route is replayed and fits its token (`replayed_every_route`: the padding samples' 128 rows each count
    as rows without a route), and the update moved the policy."""
    run = runs[mode_run(PADDED_MODE)]
    finished(run, run.steps)
    assert "verl's padding samples alone" in run.log, _fail(run, "no micro-batch of padding samples alone")
    replayed_every_route(run, run.steps, router_differs=False, unrouted_max=0.6)  # fp32: the router may agree
    assert min(run.values("actor/grad_norm")) > 0, _fail(run, "no update")


def test_lora_on_the_hf_rollout_samples_from_the_adapted_policy(runs):
    """LoRA (rank 8, all-linear) on the hf rollout, launched through the CLI: verl pushes the base once and the
    adapter at every step; the rollout's log-probs equal the actor's (fp32, one update per step) to float rounding at
    every step, which an adapter not merged (or merged onto the last merge) would break by the update's size."""
    run = runs[f"sync-{LORA_MODE}"]
    finished(run, run.steps)
    assert "verl-dppo: launching cpu_tiny + " in run.log, _fail(run, "not through the CLI")
    assert "hf rollout: LoRA adapter merged into" in run.log, _fail(run, "no adapter sync reached the hf rollout")
    assert any(p.name == "lora_train_meta.json" for p in (run.folder / "checkpoints").rglob("*")), _fail(
        run, "the checkpoint holds no LoRA adapter"
    )
    mismatch = run.values("actor/dppo/mismatch_tv_mean")
    assert all(0 < m < SYNC_BOUND for m in mismatch), _fail(run, f"mismatch_tv_mean {mismatch}")
    # the suite's reward on the random-init model: every step updates the adapter, which the next step samples with
    assert min(run.values("actor/grad_norm")) > 0, _fail(run, "no update: the check above could not fail")


def test_cpu_tiny_as_shipped_shows_the_trust_region_at_work(runs):
    """Issue 27.2: every 4-step cpu_tiny run had its masked fractions and TROLL's projected fraction at 0, and TROLL's
    scores equal to DPPO's: one update per step, on the policy that sampled. cpu_tiny's own settings (4 epochs of 4
    mini-batches, lr 1e-3) give the later updates a policy that has moved: DPPO's mask blocks some of them, TROLL
    projects some tokens, and the two runs' scores part after the first step (the same model samples step 1)."""
    dppo, troll = (runs[f"default-{method}"] for method in DEFAULT_METHODS)
    for run in (dppo, troll):
        finished(run, 4)
        assert "actor_rollout_ref.actor.ppo_epochs" not in " ".join(run.command)  # the shipped settings
    masked = dppo.values("actor/pg_clipfrac")
    assert any(m > 0 for m in masked), _fail(dppo, f"pg_clipfrac per step {masked}")
    blocked = [
        p + n for p, n in zip(dppo.values("actor/dppo/masked_frac_pos"), dppo.values("actor/dppo/masked_frac_neg"))
    ]
    assert any(b > 0 for b in blocked), _fail(dppo, f"masked_frac_pos + masked_frac_neg per step {blocked}")
    projected = troll.values("actor/troll/projected_frac")
    assert any(p > 0 for p in projected), _fail(troll, f"projected_frac per step {projected}")
    assert troll.values("actor/pg_clipfrac") == [0.0] * 4  # TROLL projects, never masks
    scores = [run.values("critic/score/mean") for run in (dppo, troll)]
    assert scores[0][0] == scores[1][0] and scores[0] != scores[1], scores


def test_the_cli_console_ends_with_where_the_run_is_and_leaves_out_the_noise(runs):
    """Issue 27.3: `verl-dppo run` printed about 1,080 lines for a cpu_tiny run (verl's config dump, five "engine is
    not available" warnings from each of three processes, the CPU platform's override notice and NUMA warning in
    each) and ended on a checkpoint save. Its config now goes to a file named in one line, and the last line says
    how many steps were done and where the log, checkpoints, config and run record are, and how to draw the log."""
    import yaml

    restarted = runs[RESUMED]
    finished(restarted, 4)
    lines = [line for line in restarted.log.splitlines() if line.strip()]
    # the run's log is named by setup, method, trainer mode and shape (RESUME_SHAPE's MoE of 4 experts: -moe4)
    log = restarted.folder / "logs" / "verl-dppo" / f"cpu_tiny-{RESUME_METHOD}-sync-moe4.jsonl"
    last = lines[-1]
    assert last.startswith(
        f"verl-dppo: done, 4 of 4 steps of cpu_tiny + {RESUME_METHOD}; log {log}; checkpoints "
        f"{restarted.folder / 'checkpoints'}"
    ), last
    assert f"draw it: verl-dppo plot {log} -o" in last and "run record" in last
    for noise in (
        "engine is not available",
        "Platform override from VERL_PLATFORM",
        "Failed to set NUMA affinity",
        "'actor_rollout_ref':",
        "[validate_config]",
    ):
        assert noise not in restarted.log, noise
    config_file = log.with_suffix(".config.yaml")
    assert f"verl's resolved config is in {config_file}" in restarted.log
    assert yaml.safe_load(config_file.read_text())["trainer"]["total_training_steps"] == 4
    assert len(lines) < 150, len(lines)
