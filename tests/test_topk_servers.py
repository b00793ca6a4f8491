"""The rollout servers' Top-K patches inside verl 0.9.1's real server code: `vLLMHttpServer.generate` and
`SGLangHttpServer.generate` run unmodified, in a subprocess per server against a stand-in engine (tests/probes/),
patched by the plugin's import hook: each server's cases in one process (`--cases`: verl imported once, not once per
case), a fresh server and engine per case."""

import json
import os
import subprocess
import sys

import pytest

PROBES = os.path.join(os.path.dirname(__file__), "probes")

VLLM_CASES = {"topk": ["3"], "topk-stop": ["3", "####"], "bypass": ["0"], "no-logprobs": ["0", "", "0"]}
"""Name -> the probe's arguments: K [STOP [LOGPROBS]] (tests/probes/vllm_server.py)."""
ORIGINAL = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
SGLANG_CASES = {
    "topk": ["3"],
    "no-topk": ["0"],
    "decode": ["3", "decode"],
    "prefill": ["3", "prefill"],
    "original-at-0.7": {"args": ["3"], "env": {**ORIGINAL, "PROBE_TEMPERATURE": "0.7"}},
    "original-at-1": {"args": ["3"], "env": {**ORIGINAL, "PROBE_TEMPERATURE": "1.0"}},
}
"""Name -> K [ROLE], with the case's own environment where it has one (tests/probes/sglang_server.py)."""


class Cases(dict):
    """Name -> what the server returned; a case that raised fails where a test reads it, unless read by `error`."""

    def __getitem__(self, name: str) -> dict:
        out = super().__getitem__(name)
        assert "error" not in out, f"case {name} raised: {out['error']}"
        return out

    def error(self, name: str) -> str:
        out = super().__getitem__(name)
        assert "error" in out, f"case {name} did not raise: {out}"
        return out["error"]


def probe(script: str, cases: dict) -> Cases:
    """Every case of one probe in one process (stubs.run_cases)."""
    result = subprocess.run(
        [sys.executable, os.path.join(PROBES, script), "--cases", json.dumps(list(cases.values()))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return Cases(zip(cases, json.loads(result.stdout.strip().splitlines()[-1]), strict=True))


@pytest.fixture(scope="module")
def vllm() -> Cases:
    return probe("vllm_server.py", VLLM_CASES)


@pytest.fixture(scope="module")
def sglang() -> Cases:
    return probe("sglang_server.py", SGLANG_CASES)


def test_vllm_server_requests_k_and_returns_the_top_k_of_every_token(vllm):
    out = vllm["topk"]
    assert out["patched"] and out["engine_logprobs"] == 3  # verl forces logprobs=0; the patch asks for K
    assert out["token_ids"] == [9, 20, 11]
    assert out["log_probs"] == [-1.5, -3.0, -0.5]  # verl's own sampled-token log-probs are unchanged
    # Rank order; the sampled token 20 (outside the top-3) is not in its row; 9 and 11 (inside) are.
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    assert out["topk_logprobs"] == [[-0.5, -1.5, -2.5]] * 3


def test_vllm_topk_requests_skip_detokenising(vllm):
    """verl reads token ids only: a Top-K request asks vLLM not to decode its K + 1 ids per position (bench/
    bench_vllm_detokenize.py measures it); with stop strings, which need the text, vLLM's default stays."""
    assert vllm["topk"]["detokenize"] is False
    with_stop = vllm["topk-stop"]
    assert with_stop["detokenize"] is None and with_stop["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]


def test_vllm_server_without_top_k_keeps_verls_request_in_the_flat_layout(vllm):
    """Issue 53.6: verl's own request in bypass mode (`logprobs=0`, every binary mode) asks vLLM for its flat layout
    too (bench/bench_rollout_logprobs.py: it costs the rollout less), and verl's unmodified reading of it
    (`logprobs[token_ids[i]].logprob`) returns the sampled tokens' log-probs the dict layout gives. Nothing else of
    the request changes: no K, vLLM's detokenising kept."""
    out = vllm["bypass"]
    assert out["engine_logprobs"] == 0 and out["topk_ids"] is None and out["detokenize"] is None
    assert out["flat_logprobs"] is True and out["layout"] == "FlatLogprobs"
    assert out["log_probs"] == [-1.5, -3.0, -0.5]
    assert vllm["topk"]["layout"] == "FlatLogprobs"  # the Top-K request, as before


def test_vllm_server_without_log_probs_is_untouched(vllm):
    out = vllm["no-logprobs"]  # calculate_log_probs=False: verl sends logprobs=None
    assert out["engine_logprobs"] is None and out["flat_logprobs"] is None and out["log_probs"] is None
    assert out["detokenize"] is None and out["topk_ids"] is None


def test_which_vllm_requests_get_the_flat_layout():
    """The rule of the module's `SamplingParams` stand-in, request by request, on a vLLM with and without the
    `flat_logprobs` field."""
    import types

    from verl_dppo.patches._server_common import REQUEST_K
    from verl_dppo.patches.vllm_async_server import patch_vllm_server

    def module_with(fields):
        class SamplingParams:
            __struct_fields__ = fields

            def __init__(self, **kwargs):
                self.kwargs = kwargs

        class vLLMHttpServer:  # noqa: N801
            async def generate(self, *args, **kwargs):
                return None

        module = types.SimpleNamespace(SamplingParams=SamplingParams, vLLMHttpServer=vLLMHttpServer)
        patch_vllm_server(module)
        return module

    module = module_with(("max_tokens", "logprobs", "prompt_logprobs", "flat_logprobs", "detokenize", "stop"))

    def flat(k=None, **kwargs):
        token = REQUEST_K.set(k)
        try:
            return module.SamplingParams(max_tokens=4, **kwargs).kwargs.get("flat_logprobs")
        finally:
            REQUEST_K.reset(token)

    assert flat(logprobs=0) is True  # verl's bypass request
    assert flat(k=20, logprobs=0) is True  # the plugin's Top-K request
    assert flat(logprobs=None) is None  # no log-probs asked: untouched
    assert flat(logprobs=None, prompt_logprobs=0, detokenize=False) is None  # verl's teacher: prompt log-probs only
    assert flat(logprobs=0, prompt_logprobs=0) is None  # verl slices prompt log-probs: kept as dicts
    assert flat(logprobs=0, flat_logprobs=False) is False  # a request's own choice is kept
    older = module_with(("max_tokens", "logprobs", "prompt_logprobs", "detokenize", "stop"))
    assert "flat_logprobs" not in older.SamplingParams(max_tokens=4, logprobs=0).kwargs  # a vLLM without the field


def test_sglang_server_requests_k_and_returns_the_top_k_of_every_token(sglang):
    out = sglang["topk"]
    assert out["patched"] and out["top_logprobs_num"] == 3
    assert out["token_ids"] == [9, 20, 11] and out["log_probs"] == [-1.5, -3.0, -0.5]
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    assert out["topk_logprobs"] == [[-0.5, -1.5, -2.5]] * 3


def test_sglang_server_is_untouched_without_top_k(sglang):
    out = sglang["no-topk"]
    assert out["top_logprobs_num"] is None and out["topk_ids"] is None


def test_sglang_decode_leg_of_pd_disaggregation_returns_rows(sglang):
    """Prefill/decode disaggregation: verl calls the decode server with a bootstrap room too (async_sglang_server.py
    :572,582); its reply is the one the agent loop gets, so it must carry the rows. The prefill leg asks for none."""
    out = sglang["decode"]
    assert out["top_logprobs_num"] == 3
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    prefill = sglang["prefill"]
    assert prefill["top_logprobs_num"] is None and prefill["topk_ids"] is None


def test_sglang_original_logprob_at_another_temperature_is_refused(sglang):
    """SGLANG_RETURN_ORIGINAL_LOGPROB: log-probs before temperature, not mu's when the rollout samples at T != 1."""
    error = sglang.error("original-at-0.7")
    assert error.startswith("RolloutTopKError: ") and "SGLANG_RETURN_ORIGINAL_LOGPROB" in error, error
    assert "temperature 0.7" in error
    # at temperature 1 the two are the same distribution: allowed
    out = sglang["original-at-1"]
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]


def test_the_vllm_serve_arguments_print_on_one_line_in_a_verl_dppo_run(monkeypatch, capsys):
    """Issue 32.5: verl's vLLM server pretty-prints the `vllm serve` arguments one per line (about 40 lines); in a
    `verl-dppo run` launch (its config file named in the run's environment) they are one line; elsewhere verl's."""
    import types

    from verl_dppo.patches.main_ppo import CONFIG_FILE_VARIABLE
    from verl_dppo.patches.vllm_async_server import _one_line_server_args

    printed = []
    module = types.SimpleNamespace(pprint=lambda obj, *a, **k: printed.append(obj))
    _one_line_server_args(module)
    monkeypatch.delenv(CONFIG_FILE_VARIABLE, raising=False)
    module.pprint(["serve", "/model", "--dtype", "float32"])
    assert printed == [["serve", "/model", "--dtype", "float32"]] and capsys.readouterr().out == ""
    monkeypatch.setenv(CONFIG_FILE_VARIABLE, "/run/config.yaml")
    module.pprint(["serve", "/model", "--dtype", "float32"])
    module.pprint({"other": 1})
    assert capsys.readouterr().out == "verl-dppo: vLLM server: vllm serve /model --dtype float32\n"
    assert printed[-1] == {"other": 1}


def test_each_vllm_server_names_its_version_and_model_runner_once(monkeypatch, capsys):
    """Issue 53.4: vLLM 0.24.0 (verl's pin) runs dense Qwen3/Llama/Mistral on its Model Runner V2 by default, which
    no CPU test runs: each server's replica rank 0 says, once its engine is up, which vLLM and runner it has, and
    the switch back where that is V2 or unknown. verl's `run_server` is stood in for by one that sets `engine`."""
    import asyncio
    import types

    import vllm

    from verl_dppo.patches.vllm_async_server import _logging_engine
    from verl_dppo.patches._import_hook import patch_once

    class Config:
        def __init__(self, v2):
            self.v2, self.model_config = v2, types.SimpleNamespace(architectures=["Qwen3ForCausalLM"])

        @property
        def use_v2_model_runner(self):
            if self.v2 is None:
                raise AttributeError("use_v2_model_runner")
            return self.v2

    class vLLMHttpServer:  # noqa: N801
        node_rank = 0

        def __init__(self, v2):
            self.v2 = v2

        async def run_server(self, args):
            self.engine = types.SimpleNamespace(vllm_config=Config(self.v2))
            return args

    assert patch_once(vLLMHttpServer, "run_server", _logging_engine)
    assert not patch_once(vLLMHttpServer, "run_server", _logging_engine)  # once, however often patched
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    lines = {}
    for v2 in (True, False, None):
        assert asyncio.run(vLLMHttpServer(v2).run_server("args")) == "args"
        (lines[v2],) = capsys.readouterr().out.splitlines()
    head = f"verl-dppo: vLLM server: vLLM {vllm.__version__}, model runner"
    assert lines[False] == (f"{head} V1 (VLLM_USE_V2_MODEL_RUNNER unset: vLLM's default for Qwen3ForCausalLM)")
    assert lines[True].startswith(f"{head} V2 (") and lines[True].endswith(
        "VLLM_USE_V2_MODEL_RUNNER=0 keeps that runner"
    )
    assert "model runner not reported by this vLLM" in lines[None] and "VLLM_USE_V2_MODEL_RUNNER=0" in lines[None]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    asyncio.run(vLLMHttpServer(False).run_server("args"))
    assert "(VLLM_USE_V2_MODEL_RUNNER=0 for Qwen3ForCausalLM)" in capsys.readouterr().out
    server = vLLMHttpServer(True)
    server.node_rank = 1  # another node of a multi-node replica: rank 0 says it
    asyncio.run(server.run_server("args"))
    assert capsys.readouterr().out == ""
