"""The full-loop tests' reward (loaded by verl through `reward.custom_reward_function.path`).

cpu_tiny's own reward, verl's GSM8K verifier, gives a random-init model 0 on every sample: GRPO's advantages are then
all 0 and an update moves the weights by weight decay alone, too little for a broken weight push or resume to show.
This one gives each response the share of its words that start with a letter a-m: deterministic, different between
the samples of a prompt, so every step has nonzero advantages and moves the policy.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = [w for w in solution_str.split() if w[:1].isalpha()]
    if not words:
        return 0.0
    return sum(w[0].lower() <= "m" for w in words) / len(words)
