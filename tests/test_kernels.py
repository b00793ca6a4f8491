"""The GPU kernels of `verl_dppo.math.kernels` equal the torch paths they replace (issue 41), run by Triton's
interpreter on this CPU: one child process (tests/probes/kernel_agreement.py) with TRITON_INTERPRET=1 and Triton from
.venv/triton-interpret on its path, so that the suite's own processes never import Triton.

Covered there, each with the kernels' launches counted (a dispatch that fell back to torch fails): the Top-K
statistics on peaked rows (top-1 1 - 1e-9), log-probs down to -100, bf16/fp16/fp32 logits, masked and padded rows,
vocabularies below and above one block and not a multiple of it, a_t inside and outside the top-K, K = 1..20; the
vocabulary-parallel path on two gloo ranks with Megatron's padded vocabulary; TROLL's forward and backward (K = 64,
peaked and flat rows, masks, the in-place gradient, pi's top-K read by the threshold kernels) and its guard against
overwritten logits; TROLL's crowded rows (more logits at the threshold than the candidates' room: read again with
torch's top-k); TROLL's rows with a NaN, +inf or only -inf logits (NaN, as Top-K's D), unfused and fused; Top-K and
TROLL fused with the LM head (bf16 chunks read in place, forward and backward), and the binary modes' log pi(a_t) and entropy fused the same way (issue 54.1); the kernels' edges (a row of -inf, a
row subset, ids outside the vocabulary); each Top-K call's waits for the device, at most one on either path, and
TROLL's, a fixed number per call whatever the chunks (issue 54.2, `reference.host_reads`). A second child compiles every kernel for
an H100 (sm_90) with Triton's own ptxas. On a GPU, bench/gpu_suite.py runs the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

PROBE = Path(__file__).resolve().parent / "probes" / "kernel_agreement.py"
TRITON_SITE = Path(sys.prefix) / "triton-interpret"


def test_the_kernels_equal_the_torch_paths_under_tritons_interpreter():
    assert (TRITON_SITE / "triton").is_dir(), f"{TRITON_SITE} holds no Triton: `make venv` installs it there"
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(TRITON_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    env.pop("VERL_DPPO_KERNELS", None)
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "kernel agreement: all cases agree" in done.stdout, done.stdout


def test_every_kernel_compiles_for_an_h100_without_one():
    """tests/probes/kernel_compile.py: Triton's own ptxas builds each kernel's sm_90 cubin on this CPU (the
    interpreter above runs the kernels' semantics; this catches what only the compiler refuses)."""
    env = dict(
        os.environ,
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join([str(TRITON_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(PROBE.with_name("kernel_compile.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "all kernels compile for sm_90" in done.stdout, done.stdout
    # four kernels, two with and without the entropy, the max-and-sum kernel also with the entropy's sums stored
    assert done.stdout.count("sm_90 cubin of") == 7, done.stdout
    assert "max_and_sum_outside_kernel{'ENTROPY': True, 'SUMS': True}" in done.stdout, done.stdout


def test_the_torch_path_runs_where_triton_does_not_import_and_on_cpu_tensors():
    """The suite's processes have no Triton: `auto` picks torch for CPU tensors, and forcing the kernels says why
    they cannot run instead of failing inside a kernel."""
    import pytest

    from verl_dppo.math import kernels

    assert kernels.backend_for(torch.zeros(1, 4)) == "torch"
    assert kernels.chunk_bytes_for(torch.device("cpu")) == kernels.CPU_CHUNK_BYTES
    os.environ[kernels.KERNELS_ENV] = "triton"
    try:
        if not kernels.triton_importable():
            with pytest.raises(RuntimeError, match="Triton does not import"):
                kernels.backend_for(torch.zeros(1, 4))
        assert kernels.backend_for(torch.zeros(1, 4, dtype=torch.float64)) == "torch"  # kernels are float32
        os.environ[kernels.KERNELS_ENV] = "cuda please"
        with pytest.raises(ValueError, match="use auto, torch or triton"):
            kernels.backend_for(torch.zeros(1, 4))
    finally:
        os.environ.pop(kernels.KERNELS_ENV)


def test_the_gpu_checks_smoke_path_runs_on_the_cpu(tmp_path):
    """bench/gpu_suite.py --device cpu --smoke: the per-token table and TROLL's device agreement at small sizes, the
    JSON and the markdown written (the GPU run is the same code at the issue's sizes, by the `device` tool)."""
    import json

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--smoke",
            "--out",
            str(tmp_path),
            "--parts",
            "per_token,unfused,troll_devices",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert result["complete"] and result["device"] == "CPU"
    rows = result["per_token"]["rows"]
    assert all("seconds" in row for row in rows.values()), rows
    # the device's own time beside the wall time (on the CPU: the ops' own time in one more, profiled call, which
    # on these tiny sizes and a shared CPU may read well above or below the median wall time)
    assert all(0 < row["device_seconds"] < float("inf") for row in rows.values()), rows
    assert "| device ms |" in (tmp_path / "gpu_suite.md").read_text()
    assert rows["topk_divergence, kernels"]["backend"] == "torch"  # no Triton in the suite's processes
    agreement = result["troll_devices"]["permuted_vocabulary_on_device"]
    assert agreement["support_differs_rows"] == 0 and agreement["log_p_max_abs_diff"] <= 1e-5, agreement
    assert "## TROLL on bf16 ties" in (tmp_path / "gpu_suite.md").read_text()
    # issue 53.5: the unfused steps side by side, and the log-probs and entropy verl's functions and the plugin's
    # pass compute on the same logits (float32 here), each against float64
    unfused = result["unfused"]
    assert all(
        row["device_events"] > 0 and "x_unfused_binary_verl" in row
        for name, row in unfused["rows"].items()
        if name != "unfused_binary_verl"
    ), unfused["rows"]
    for pair in ("verl_vs_float64", "plugin_vs_float64", "plugin_vs_verl"):
        assert unfused["agreement"][pair]["log_p_max_abs_diff"] <= 1e-5, unfused["agreement"]
        assert unfused["agreement"][pair]["entropy_max_abs_diff"] <= 1e-5, unfused["agreement"]
    assert "## Unfused steps" in (tmp_path / "gpu_suite.md").read_text()
    # the goals first, those of the parts that ran measured, the others not
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert markdown.index("## Goals on CPU") < markdown.index("## Per-token work"), markdown[:2000]
    measured = {row["measure"] for row in result["goals"] if row["value"] is not None}
    assert measured == {
        "topk_divergence: wall time in reads of the logits",
        "topk_divergence: device share",
        "TROLL fwd + bwd, kernels / torch's cross entropy fwd + bwd",
    }, result["goals"]


def test_the_gpu_goals_read_each_value_from_its_own_row_and_never_hold_unmeasured():
    """bench/gpu_goals.py on a result shaped as gpu_suite.py writes it: each goal reads its own row (the unfused
    worker row of its mode, not the fused one; R3's row against its own baseline), a bound is inclusive, and a goal
    whose part did not run or failed reads "not measured", not "holds"."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_goals import GOALS, goal_rows, goals_markdown

    def worker(mode, fused, seconds, ratio, path="plugin"):
        return dict(mode=mode, fused=fused, logprob_path=path, step_seconds=seconds, time_vs_binary_tv=ratio)

    result = {
        "device": "NVIDIA H200",
        "per_token": {
            "rows": {
                "topk_divergence, kernels": {"x_one_read": 2.0, "device_share": 0.51},
                "fwd+bwd TROLL, kernels": {"x_torch_ce": 3.1},
            }
        },
        "fused": {"error": "RuntimeError: out of memory"},
        "worker": {
            "modes": [
                worker("dppo_binary_tv", False, 0.611, 1.0),
                worker("dppo_topk_tv", False, 0.62, 1.01),
                worker("troll", False, 0.75, 1.22),
                worker("dppo_binary_tv", True, 0.807, 1.0),
                worker("dppo_topk_tv", True, 0.9, 1.5),  # the fused row: not the goal's
                worker("dppo_binary_tv", False, 0.5, 0.8, path="verl"),
            ]
        },
    }
    rows = {row["measure"]: row for row in goal_rows(result)}
    assert len(rows) == len(GOALS)
    topk = rows["worker step, unfused: dppo_topk_tv / dppo_binary_tv"]
    assert (topk["value"], topk["holds"]) == (1.01, True)
    assert rows["worker step, unfused: troll / dppo_binary_tv"]["holds"] is False
    fused = rows["worker step, dppo_binary_tv: fused / unfused"]
    assert abs(fused["value"] - 0.807 / 0.611) < 1e-12 and fused["holds"] is False
    assert rows["topk_divergence: wall time in reads of the logits"]["holds"] is True  # 2.0 <= 2
    assert rows["topk_divergence: device share"]["holds"] is False
    assert rows["TROLL fwd + bwd, kernels / torch's cross entropy fwd + bwd"]["holds"] is False
    for unmeasured in (
        "fused TROLL step / verl's fused step (H = 1,024)",  # the part failed
        "fused TROLL step: device share",
        "worker step, dppo_binary_tv: with R3 / without (Qwen3-MoE layer shape)",  # the part did not run
    ):
        assert rows[unmeasured]["value"] is None and rows[unmeasured]["holds"] is None, rows[unmeasured]
    text = "\n".join(goals_markdown(result, list(rows.values())))
    assert "## Goals on NVIDIA H200: 2 of 6 measured hold (9 goals)" in text, text
    assert text.count("not measured") == 3 and "say nothing about a GPU" not in text
