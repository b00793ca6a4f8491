"""The policy pi (a tiny fp32 causal LM) and its rollout copy mu (bf16, as an inference engine serves it).

The learner is fp32. The rollout engine holds a bf16 copy of the same weights, so mu != pi even with identical
parameters: the paper's training-inference mismatch, produced here by real arithmetic rather than injected noise.
A CPU without a bf16 matrix unit runs true bf16 matmuls several times slower than fp32 (docs/demo.md), so by
default the copy *emulates*
bf16: weights rounded to bf16 and every module's output (each activation) rounded to bf16, with fp32
accumulation inside the matmuls, which is what a GPU's bf16 tensor cores do. `rollout_precision="bf16"` runs
true bf16 arithmetic instead, `"fp32"` removes the mismatch altogether.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from verl_dppo.studies.demo.task import EOS, PAD, RESPONSE_LEN, VOCAB_SIZE

ROLLOUT_PRECISIONS = ("bf16-emulated", "bf16", "fp32")


def build_policy(seed: int, hidden_size: int = 64, num_layers: int = 2) -> nn.Module:
    """A randomly initialised Qwen3-style causal LM (no download), fp32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=EOS,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def _round_to_bf16(module, inputs, output):
    # Forward hook: the activation leaves the module in bf16, as it would on a bf16 inference engine.
    if isinstance(output, torch.Tensor):
        return output.to(torch.bfloat16).to(output.dtype)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0].to(torch.bfloat16).to(output[0].dtype), *output[1:])
    return output


class RolloutEngine:
    """The inference side: a copy of the policy at `precision`, re-synced from the learner before each rollout."""

    def __init__(self, policy: nn.Module, precision: str = "bf16-emulated"):
        if precision not in ROLLOUT_PRECISIONS:
            raise ValueError(f"rollout precision must be one of {ROLLOUT_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.model = copy.deepcopy(policy).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        if precision == "bf16":
            self.model.to(torch.bfloat16)
        elif precision == "bf16-emulated":
            for module in self.model.modules():
                module.register_forward_hook(_round_to_bf16)
        self.sync(policy)

    def sync(self, policy: nn.Module) -> None:
        """Load the learner's weights (the weight sync of an RL step), rounded to the engine's precision."""
        self._load(zip(self.model.parameters(), policy.parameters()))

    def sync_state(self, state: dict) -> None:
        """`sync` from a learner's state_dict: an older version of the weights (a stale rollout engine)."""
        self._load((target, state[name]) for name, target in self.model.named_parameters())

    @torch.no_grad()
    def _load(self, pairs) -> None:
        for target, source in pairs:
            if self.precision == "bf16-emulated":
                target.copy_(source.detach().to(torch.bfloat16).float())
            else:
                target.copy_(source.detach())

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits.float()

    @torch.no_grad()
    def generate(
        self, prompts: torch.Tensor, temperature: float = 1.0, generator: Optional[torch.Generator] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample RESPONSE_LEN tokens per prompt. Returns (responses, rollout_log_probs), both [n, RESPONSE_LEN].

        rollout_log_probs is mu(a_t | s_t) of the sampled token under the engine's own (bf16) logits at
        `temperature`; greedy decoding when temperature == 0. Positions after <eos> hold PAD with log-prob 0.
        """
        responses, log_probs, _, _ = self.generate_with_topk(prompts, temperature, generator, k=0)
        return responses, log_probs

    @torch.no_grad()
    def generate_with_topk(
        self, prompts: torch.Tensor, temperature: float, generator: Optional[torch.Generator], k: int
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """`generate`, plus mu's top-k token ids and log-probs at each response position ([n, RESPONSE_LEN, k],
        rank order; zeros after <eos>), as vLLM reports them with `logprobs=k`. k = 0: no top-k (None, None)."""
        sequences = prompts
        tokens, log_probs, topk_ids, topk_log_probs = [], [], [], []
        finished = torch.zeros(prompts.shape[0], dtype=torch.bool)
        for _ in range(RESPONSE_LEN):
            logits = self.logits(sequences)[:, -1]
            if temperature > 0:
                step_log_probs = torch.log_softmax(logits / temperature, dim=-1)
                token = torch.multinomial(step_log_probs.exp(), 1, generator=generator).squeeze(1)
            else:
                step_log_probs = torch.log_softmax(logits, dim=-1)
                token = logits.argmax(dim=-1)
            token_log_prob = step_log_probs.gather(1, token[:, None]).squeeze(1)
            token = torch.where(finished, torch.full_like(token, PAD), token)
            token_log_prob = torch.where(finished, torch.zeros_like(token_log_prob), token_log_prob)
            tokens.append(token)
            log_probs.append(token_log_prob)
            if k > 0:
                top = step_log_probs.topk(k, dim=-1)
                topk_ids.append(top.indices.masked_fill(finished[:, None], 0))
                topk_log_probs.append(top.values.masked_fill(finished[:, None], 0.0))
            finished |= token == EOS
            sequences = torch.cat([sequences, token[:, None]], dim=1)
        if k == 0:
            return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1), None, None
        return (
            torch.stack(tokens, dim=1),
            torch.stack(log_probs, dim=1),
            torch.stack(topk_ids, dim=1),
            torch.stack(topk_log_probs, dim=1),
        )


def sequence_log_probs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob (and entropy) of each next token, as the learner's forward pass sees it.

    Returns [n, seq_len] tensors where column i is about token i+1 (the last column is 0): the layout of verl's
    engine output before `no_padding_2_padding` shifts it onto the response.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    return log_probs_from_logits(logits, input_ids, with_entropy)


def log_probs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`sequence_log_probs` from logits already computed ([n, seq_len, V], fp32)."""
    log_softmax = torch.log_softmax(logits[:, :-1], dim=-1)
    next_token_log_probs = log_softmax.gather(2, input_ids[:, 1:, None]).squeeze(2)
    pad = torch.zeros_like(next_token_log_probs[:, :1])
    log_probs = torch.cat([next_token_log_probs, pad], dim=1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            token_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        entropy = torch.cat([token_entropy, pad], dim=1)
    return log_probs, entropy
