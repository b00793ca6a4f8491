"""Every knob of the demo: one typed field each, the default being what `verl-dppo demo` runs; and the checks of the
flags that set them (`check_settings`, `parse_seeds`), before anything slow starts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class DemoSettings:
    seed: int = 0
    """One seed for everything: model init, warm-up, prompt order, rollout sampling (identical across methods)."""

    steps: int = 200
    """RL steps per method (one rollout batch + `mini_batches` optimizer updates each)."""

    prompts_per_step: int = 32
    """Prompts per rollout batch (verl: data.train_batch_size)."""

    samples_per_prompt: int = 8
    """Responses per prompt, the GRPO group size (verl: actor_rollout_ref.rollout.n)."""

    mini_batches: int = 8
    """Optimizer updates per rollout batch (verl: train_batch_size / ppo_mini_batch_size). With more than one,
    pi drifts away from mu within a step: the off-policy drift that a trust region must contain."""

    micro_batch_size: int = 32
    """Sequences per ppo_loss call (verl: ppo_micro_batch_size_per_gpu); gradients accumulate over a mini-batch."""

    lr: float = 5e-4
    """AdamW learning rate of the RL phase (fp32 learner). Demo-notes: PG-IS collapses at 5e-4 with 8 updates."""

    grad_clip: float = 1.0
    """Gradient-norm clip (verl: actor.grad_clip)."""

    temperature: float = 1.0
    """Rollout sampling temperature (verl: rollout.temperature)."""

    rollout_precision: str = "bf16-emulated"
    """The rollout copy's arithmetic: "bf16-emulated" (default, fast on CPU), "bf16" (true bf16, slow on CPU),
    "fp32" (no training-inference mismatch)."""

    val_every: int = 25
    """Greedy validation on held-out problems every N steps (val-core/digit_sum/acc/mean@1)."""

    hidden_size: int = 64
    num_layers: int = 2

    warmup_target: float = 0.5
    """Stop the supervised warm-up once sampled accuracy on a probe set reaches this."""

    warmup_max_steps: int = 600
    n_train: int = 256
    """Size of the sanity set (problems solved 20-80% of the time after warm-up)."""

    n_val: int = 256

    workers: int = 2
    """Methods trained at once, one process and one thread each."""

    rollout_lag: int = 0
    """Versions the rollout engine lags behind the learner (`verl-dppo staleness`): at RL step s it samples with the
    weights after max(0, s - 1 - rollout_lag) steps, so every sample is min(rollout_lag, s - 1) versions stale."""

    version_fields: bool = False
    """Attach the trainer's version and each sample's rollout version to every micro-batch (as verl's async trainer
    does), so the plugin logs its lag metrics (actor/dppo/lag_*). The staleness study turns it on at every lag."""

    bypass: bool = False
    """old_log_probs := the rollout's log-probs (verl's algorithm.rollout_correction.bypass_mode=True, how the async
    recipes run); False: the learner's recompute. A method with policy_loss anchor="recompute" keeps the recompute."""

    methods: list[str] = field(default_factory=list)
    """Methods to run (names from verl_dppo.studies.demo.methods.METHODS); empty = every runnable one."""

    def to_dict(self) -> dict:
        return asdict(self)


def check_settings(settings: DemoSettings) -> None:
    """Every flag checked before the warm-up: a bad value is one line naming the flag, not a traceback later."""
    from verl_dppo.errors import UsageError

    if settings.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {settings.steps}")
    if settings.seed < 0:
        raise UsageError(f"--seed must be >= 0 (torch and numpy take unsigned seeds), got {settings.seed}")
    if not (math.isfinite(settings.lr) and settings.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {settings.lr:g}")
    if settings.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {settings.workers}")
    prompts, samples, micro = settings.prompts_per_step, settings.samples_per_prompt, settings.micro_batch_size

    def fits(updates: int) -> bool:  # equal mini-batches of prompts, each a whole number of micro-batches
        return updates >= 1 and prompts % updates == 0 and (prompts // updates * samples) % micro == 0

    if not fits(settings.mini_batches):
        choices = [str(d) for d in range(1, prompts + 1) if fits(d)]
        raise UsageError(
            f"--mini-batches {settings.mini_batches}: each rollout batch ({prompts} prompts x {samples} samples) "
            f"is split into that many equal updates of whole {micro}-sequence micro-batches; choose one of "
            f"{', '.join(choices)}"
        )


def parse_seeds(text: str) -> list[int]:
    """`--seeds 0,1,2`: distinct whole numbers in the order given; UsageError otherwise."""
    from verl_dppo.errors import UsageError

    seeds = []
    for item in (item.strip() for item in text.split(",")):
        if not item:
            continue
        try:
            seed = int(item)
        except ValueError:
            raise UsageError(f"--seeds: {item!r} is not a whole number") from None
        if seed in seeds:
            raise UsageError(f"--seeds: {seed} is named twice")
        seeds.append(seed)
    if not seeds:
        raise UsageError(f"--seeds {text!r}: name at least one seed, e.g. --seeds 0,1,2")
    return seeds
