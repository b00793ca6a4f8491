"""A cluster run's shape, rehearsed on CPU (issue 34): two ranks, bf16, a reference model. Every run is launched as a
user launches it,
`verl-dppo run cpu_tiny --method M ...`, on a local Ray cluster of the test's own (the harness of
test_full_loop: one update per step on the policy that sampled, the suite's reward, fp32 unless a run says bf16).

The runs, in the e2e tiers' pool of lanes (tests/e2e/conftest.py):
- two ranks, bf16 mixed precision and a bf16 rollout, on cpu_tiny's warm-started model (peaked rows, where bf16
  rounds a confident token's log-prob to 0), one run per family: `dppo_binary_kl`, `dppo_topk_tv`, and `troll` with
  `use_kl_loss=True` (the reference model on the CPU platform). Each: a prompt's two samples are distinct draws
  (the rollout dump), some advantage is non-zero, nothing is masked or projected on the policy that sampled (the
  fp32 level), and every ratio metric is exact over the two ranks (a probe in the workers records the per-rank
  parts: tests/e2e/parts_probe).
The other shapes run in test_full_loop, each in a launch that checks more (one launch is 2-4 minutes on a slow
2-core machine): LoRA on the `hf` rollout (`sync-grpo_clip`: base sync, then adapter syncs merged by the server, the
rollout sampling from the policy the actor scores at every step), and a kill and resume at two ranks of a Qwen3-MoE
with R3 (`resume-killed`, `resume-restarted`: its step 3 equal to the killed run's, the experts pushed per
expert into transformers' fused tensors). LoRA on vLLM runs in the vLLM tier (test_vllm_loop's troll run). Ulysses
sequence parallelism is refused on the CPU (verl 0.9.1 exchanges the slices around flash-attention only; with sdpa
each rank attends within its slice, which this tier's first SP=2 runs showed: tests/test_cli_errors.py checks the
refusal).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_full_loop as loop  # noqa: E402  (the cluster, the runs, the JSONL reading: one harness)

pytestmark = pytest.mark.e2e

TWO_RANKS = loop.TWO_RANKS
BF16 = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
    "actor_rollout_ref.rollout.dtype=bfloat16",
)
FAMILIES = {
    "dppo_binary_kl": "shape-2r-bf16-binary_kl",
    "dppo_topk_tv": "shape-2r-bf16-topk_tv",
    "troll": "shape-2r-bf16-troll-kl",
}


def _lanes(root: Path) -> list[list[loop.Run]]:
    def observed(name: str) -> tuple[str, ...]:
        parts, dump = root / name / "parts", root / name / "rollouts"
        parts.mkdir(parents=True, exist_ok=True)
        return (
            f"trainer.rollout_data_dir={dump}",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.DPPO_TEST_PARTS={parts}",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={HERE / 'parts_probe'}",
        )

    families = [
        loop.Run(
            name,
            method,
            via_cli=True,
            warm_model=True,
            overrides=(
                *TWO_RANKS,
                *BF16,
                *observed(name),
                *(("actor_rollout_ref.actor.use_kl_loss=True",) if method == "troll" else ()),
            ),
        )
        for method, name in FAMILIES.items()
    ]
    return [families]


def lane_chains(root: Path) -> list[list[loop.Run]]:
    """This tier's launches for the pool of lanes (tests/e2e/conftest.py)."""
    (families,) = _lanes(root)
    return [[run] for run in families]


@pytest.fixture(scope="module")
def shape_runs(launches) -> dict[str, loop.Run]:
    return launches


def _groups(run: loop.Run) -> dict[int, list[list[str]]]:
    """Per step, the outputs of each prompt's samples (verl's rollout dump, trainer.rollout_data_dir)."""
    found = {}
    for path in sorted((run.folder / "rollouts").glob("*.jsonl")):
        by_prompt = collections.defaultdict(list)
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_prompt[row["input"]].append(row["output"])
        found[int(path.stem)] = list(by_prompt.values())
    return found


def _parts(run: loop.Run) -> list[list[dict]]:
    """The probe's records, one list per worker that aggregated (each rank gathers the metrics of both), one record
    per mini-batch (one per step here) in the order the worker wrote them."""
    files = sorted((run.folder / "parts").glob("*.jsonl"))
    assert files, loop._fail(run, "no worker recorded the parts of its ratio metrics")
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in files]


@pytest.mark.parametrize("method", list(FAMILIES))
def test_two_ranks_bf16_learn_and_mask_nothing_on_policy(shape_runs, method):
    """Two ranks, bf16 both sides, on the policy that sampled: a prompt's samples are distinct draws at every step
    (the two replicas of the hf rollout seed each sample from its identity in the run, issue 34.1), the group's
    advantages are non-zero at some step, and nothing is masked or projected (issue 34.2: bf16 log pi = 0 is within
    its rounding), the mismatch KL at the rounding's size."""
    run = shape_runs[FAMILIES[method]]
    loop.trained_through_main_ppo(run, method)  # and test_full_loop's checks of a mode trained through main_ppo
    groups = _groups(run)
    assert sorted(groups) == list(range(1, run.steps + 1)), loop._fail(run, f"rollout dumps of steps {sorted(groups)}")
    for step, outputs in groups.items():
        assert all(len(group) == 2 for group in outputs), loop._fail(run, f"step {step}: groups {outputs}")
        assert any(len(set(group)) == 2 for group in outputs), loop._fail(
            run, f"step {step}: every prompt's two samples are the same text"
        )
    assert max(run.values("critic/advantages/max")) > 0, loop._fail(run, "every advantage 0")
    assert max(run.values("actor/grad_norm")) > 0, loop._fail(run, "no update")
    assert max(run.values("actor/pg_clipfrac")) == 0.0, loop._fail(run, f"masked {run.values('actor/pg_clipfrac')}")
    if method == "troll":
        projected = run.values("actor/troll/projected_frac")
        assert max(projected) == 0.0, loop._fail(run, f"projected_frac {projected}")
        # the reference is the initial policy: a KL loss after the policy moved (step 1 sees the reference itself)
        kl_loss, grad_norm = run.values("actor/kl_loss"), run.values("actor/grad_norm")
        assert len(kl_loss) == run.steps and grad_norm[0] > 0 and kl_loss[-1] > 0, loop._fail(
            run, f"kl_loss {kl_loss}, grad_norm {grad_norm}"
        )
    else:
        masked = run.values("actor/dppo/masked_frac_pos")
        assert max(masked) == 0.0, loop._fail(run, f"masked_frac_pos {masked}")
    kl = run.values("actor/dppo/mismatch_kl_mean")
    assert max(kl) < 1e-3, loop._fail(run, f"mismatch_kl_mean {kl} on the policy that sampled")


@pytest.mark.parametrize("method", list(FAMILIES))
def test_two_ranks_metrics_are_exact_over_the_ranks(shape_runs, method):
    """Each ratio metric the JSONL log holds is sum(numerators) / sum(denominators) over both ranks' micro-batches
    (recorded in the worker that gathers them), not verl's mean of the per-rank means."""
    run = shape_runs[FAMILIES[method]]
    loop.finished(run, run.steps)
    workers = _parts(run)
    compared = 0
    for records in workers:
        assert len(records) == run.steps, loop._fail(run, f"{len(records)} mini-batch records for {run.steps} steps")
    for step, record in ((step, record) for records in workers for step, record in enumerate(records, start=1)):
        logged = run.metrics(step)
        assert record, loop._fail(run, f"step {step}: no ratio metric reached the aggregation")
        for name, entry in record.items():
            ranks = entry["parts"]
            assert len(ranks) == 2, loop._fail(run, f"{name}: parts of {len(ranks)} ranks")
            numerator = sum(n for rank in ranks for n, _ in rank)
            denominator = sum(d for rank in ranks for _, d in rank)
            exact = numerator / denominator if denominator > 0 else 0.0
            assert entry["written"] == pytest.approx(exact, abs=1e-12), (name, entry)
            if name in logged:
                assert logged[name] == pytest.approx(exact, abs=1e-9), (step, name, logged[name], exact)
                compared += 1
    assert compared >= 2 * run.steps * len(workers), compared
