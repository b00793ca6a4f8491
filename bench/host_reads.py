"""How often one micro-batch's loss reads a value back to the host, by mode: each read is a wait for the device on a GPU.

    .venv/bin/python bench/host_reads.py [--sequences 4,16]

Runs one v1 micro-batch (tests/test_topk_actor.py's: a tiny random Llama, the rollout's top-K under a perturbed mu)
through verl's FSDP engine's `prepare_model_outputs` (the logits hook, for the Top-K modes and troll) and verl's
`ppo_loss` wrapped by the plugin, after one warm-up call, and counts every call of a tensor method that reads the
host (`tolist`, `item`, `__bool__`, `__int__`, `__float__`, `__index__`) in the hook, the loss and its backward: in all,
as a ratio to the first mode's (dppo_binary_tv: verl's own padding of log pi and the entropy is most of it), and
those made from the plugin's code (verl_dppo/, patches/); and the aten ops dispatched in the same call (the
model's forward and backward included: on a GPU a kernel launch each, but for views). Prints one row per mode and
batch size. On the CPU there is no
device to wait for; the counts are what a GPU would wait on. Issue 75: the rows where the host, not the device, bounds
a step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import verl  # noqa: E402,F401  (loads the plugin)
import verl.workers.utils.losses as verl_losses  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from helpers import actor_config  # noqa: E402
from test_topk_actor import K, micro_batch, run_engine, tiny_llama  # noqa: E402

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
OURS = tuple(str(ROOT / part) + "/" for part in ("verl_dppo", "patches"))
COUNTS: collections.Counter = collections.Counter()


def install_counters() -> None:
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            COUNTS["plugin" if caller.startswith(OURS) else "verl and libraries"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


class CountOps(TorchDispatchMode):
    """Every aten op dispatched (a kernel launch each, on a GPU, but for views)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        COUNTS["ops"] += 1
        return func(*args, **(kwargs or {}))


def one_call(net, mode: str, sequences: int) -> tuple[int, int, int]:
    gen = torch.Generator().manual_seed(sequences)
    prompt_lens = torch.randint(1, 6, (sequences,), generator=gen).tolist()
    response_lens = torch.randint(1, 8, (sequences,), generator=gen).tolist()
    data, _ = micro_batch(prompt_lens, response_lens)
    if mode in ("dppo_binary_tv", "dppo_binary_kl", "grpo_clip"):
        tu.assign_non_tensor(data, distillation_use_topk=False)
        config = actor_config(mode)
    else:
        config = actor_config(mode, topk=K)
    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)
    _, output = run_engine(net, data, config)
    loss_fn(model_output=output, data=data)  # the first call's announcements out of the count
    COUNTS.clear()
    with CountOps():
        _, output = run_engine(net, data, config)
        loss, _ = loss_fn(model_output=output, data=data)
        loss.backward()
    return COUNTS["plugin"], COUNTS["verl and libraries"], COUNTS["ops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", default="4,16", help="sequences per micro-batch, comma-separated")
    parser.add_argument("--modes", default="dppo_binary_tv,dppo_topk_tv,troll")
    args = parser.parse_args()
    install_counters()
    net = tiny_llama()
    print(
        f"{'mode':16} {'sequences':>9} {'host reads':>10} {'x binary':>8} {'in plugin code':>14} {'ops':>6} {'x binary':>8}"
    )
    baseline = {}
    for mode in args.modes.split(","):
        for sequences in (int(n) for n in args.sequences.split(",")):
            ours, theirs, ops = one_call(net, mode, sequences)
            base = baseline.setdefault(sequences, (ours + theirs, ops))
            print(
                f"{mode:16} {sequences:9d} {ours + theirs:10d} {(ours + theirs) / base[0]:8.2f} {ours:14d} "
                f"{ops:6d} {ops / base[1]:8.2f}"
            )


if __name__ == "__main__":
    main()
