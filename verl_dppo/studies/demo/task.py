"""The demo's verifiable task: the sum of four digits, answered as two digits and an end token.

Prompt  `<bos> d1 d2 d3 d4 =`   (6 tokens)
Answer  `t u <eos>`              (3 tokens: tens digit, units digit, end), reward 1 for an exact match, else 0.

The vocabulary has 64 ids of which 14 carry meaning (10 digits, `=`, `<bos>`, `<eos>`, `<pad>`): the other 50
are tokens the warm-up teaches the model to avoid, so the sampled tokens span probabilities from ~1e-4 to ~1,
which is what makes the ratio-vs-divergence contrast of the paper's Sec. 4.2 visible.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB_SIZE = 64
EQUALS, BOS, EOS, PAD = 10, 11, 12, 13
N_DIGITS = 4
PROMPT_LEN = N_DIGITS + 2
RESPONSE_LEN = 3
DATA_SOURCE = "digit_sum"
"""The name verl would log validation under: val-core/<data_source>/acc/mean@1."""


def all_problems() -> np.ndarray:
    """Every problem, as an int array [10**N_DIGITS, N_DIGITS] of digits."""
    grid = np.indices((10,) * N_DIGITS).reshape(N_DIGITS, -1).T
    return np.ascontiguousarray(grid, dtype=np.int64)


def encode_prompts(digits: np.ndarray) -> torch.Tensor:
    """[n, N_DIGITS] digits -> [n, PROMPT_LEN] token ids."""
    n = digits.shape[0]
    prompts = np.empty((n, PROMPT_LEN), dtype=np.int64)
    prompts[:, 0] = BOS
    prompts[:, 1 : 1 + N_DIGITS] = digits
    prompts[:, -1] = EQUALS
    return torch.from_numpy(prompts)


def answers(digits: np.ndarray) -> torch.Tensor:
    """[n, N_DIGITS] digits -> the correct [n, RESPONSE_LEN] response ids."""
    total = digits.sum(axis=1)
    out = np.stack([total // 10, total % 10, np.full_like(total, EOS)], axis=1)
    return torch.from_numpy(out.astype(np.int64))


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """1 up to and including the first <eos> (or the whole response when there is none), then 0."""
    is_eos = responses == EOS
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    return (~after_eos).long()


def rewards(responses: torch.Tensor, digits: np.ndarray) -> torch.Tensor:
    """Exact-match reward per response: [n] float, 1.0 or 0.0."""
    return (responses == answers(digits)).all(dim=1).float()
