"""The verl layer: what plugs into verl 0.9.1's public extension points only.

- `entry`: the `verl.plugins` entry point (`import verl` loads it in every process): version check, registration,
  the patches' installation.
- `config`: `DPPOLossConfig`, a subclass of verl's `PolicyLossConfig` (selected with `policy_loss._target_`).
- `losses`: what every loss mode shares, and their registration in verl's `POLICY_LOSS_REGISTRY`; one module per loss
  family says what its modes change (`loss_family`: the interface): `binary_mode` (binary DPPO, GRPO's clip, PG-IS),
  `topk_mode` (Top-K DPPO), `troll_mode` (TROLL).
- `extras`, `metrics`: what the loss reads beyond verl's arguments, and diagnostics that aggregate exactly.
- `run_config`: checks of a whole run's config; `compat`: the supported verl versions.
"""
