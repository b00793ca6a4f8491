"""The full-loop tests' reward (loaded by verl through `reward.custom_reward_function.path`).

cpu_tiny's own reward, verl's GSM8K verifier, gives a random-init model 0 on every sample: GRPO's advantages are then
all 0 and an update moves the weights by weight decay alone, too little for a broken weight push or resume to show.
This one gives each response the mean of a fixed pseudo-random number per character (its code point hashed, so
every character has its own value): deterministic, and apart for any two responses that differ in a character, so
every step whose prompts draw two different texts has nonzero advantages and moves the policy.

(Until 2026-11-27 it was the share of words starting with a-m: cpu_tiny's warm-started model, peaked, writes samples
that differ in a number only ("20 stamps" / "21 stamps"), which that share scores alike, and on the warm-up built
on the code paths every CPU takes alike every group of the two-rank bf16 runs tied at both steps.)
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if not solution_str:
        return 0.0
    return sum(((ord(c) * 2654435761) % 4294967296) / 4294967296 for c in solution_str) / len(solution_str)
