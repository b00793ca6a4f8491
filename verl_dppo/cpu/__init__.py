"""The CPU rehearsal: what exists so that verl's whole trainer runs on this machine's CPUs, and nothing a GPU
cluster's run uses (the plugin's entry registers these hooks in every process; off the CPU platform, and for
engines a run does not name, each is a pass-through that imports nothing heavy).

- `platform`: the plugin's CPU platform for verl (`VERL_PLATFORM=cpu`): gloo, no pinning, one CPU per worker.
- `hf_rollout`: the `hf` rollout, a transformers stand-in for vLLM behind verl's server interface (verl's agent
  loop, weight sync, LoRA and MoE weights as vLLM takes them).
- `store_engine`: the `ray_store` checkpoint engine (weights through Ray's object store, for CPU workers).
- `megatron_shim` (with `megatron_device`, torch's CUDA surface on a CPU): what megatron-core 0.16.1 and mbridge 0.15.1
  need to train on a CPU (`model_engine=megatron`).

The CPU-only patches of verl (`patches/cpu_distributed.py`, `cpu_resources.py`, `vllm_cpu.py`) sit with the other
patches, one module per verl module; they act on the CPU platform only.
"""
