"""The verl adapter layer: loss registration, DPPOLossConfig, the rollout-anchoring hook, plugin loading."""
