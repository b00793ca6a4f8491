"""How a run on CPUs is set up before anything starts: the launcher (`verl_dppo.launch`) calls these when a recipe
runs on the CPU platform (`cpu_tiny`, `smollm2`, any setup with `VERL_PLATFORM=cpu`).

- `cpu_tiny`: the platform switch, the checks of a CPU run, the tiny Qwen3 and its GSM8K-shaped data (built once).
- `cpu_tiny_warmup`: the warm start that gives cpu_tiny's model peaked, context-dependent rows.
- `cpu_engines`: which engines a CPU run can take, and their settings; `vllm_cpu` (vLLM's CPU build) and
  `megatron_cpu` (megatron-core on the CPU shim) each hold one engine's.
- `real_model`: the `smollm2` setup's real LLM (SmolLM2-135M-Instruct from its registry package) and its sums, and
  the `verl-dppo real-model` command that builds them.
- `builds`: a folder built once and renamed into place.
"""
