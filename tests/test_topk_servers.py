"""The rollout servers' Top-K patches inside verl 0.9.1's real server code: `vLLMHttpServer.generate` and
`SGLangHttpServer.generate` run unmodified, each in a subprocess against a stand-in engine (tests/probes/),
patched by the plugin's import hook."""

import json
import os
import subprocess
import sys

import pytest

PROBES = os.path.join(os.path.dirname(__file__), "probes")


def probe(script: str, *args: str, env: dict | None = None, fails: bool = False):
    result = subprocess.run([sys.executable, os.path.join(PROBES, script), *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, **(env or {})})
    if fails:
        assert result.returncode != 0, result.stdout[-2000:]
        return result.stderr
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_vllm_server_requests_k_and_returns_the_top_k_of_every_token():
    out = probe("vllm_server.py", "3")
    assert out["patched"] and out["engine_logprobs"] == 3  # verl forces logprobs=0; the patch asks for K
    assert out["token_ids"] == [9, 20, 11]
    assert out["log_probs"] == [-1.5, -3.0, -0.5]  # verl's own sampled-token log-probs are unchanged
    # Rank order; the sampled token 20 (outside the top-3) is not in its row; 9 and 11 (inside) are.
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    assert out["topk_logprobs"] == [[-0.5, -1.5, -2.5]] * 3


def test_vllm_topk_requests_skip_detokenising():
    """verl reads token ids only: a Top-K request asks vLLM not to decode its K + 1 ids per position (bench/
    bench_vllm_detokenize.py measures it); with stop strings, which need the text, vLLM's default stays."""
    assert probe("vllm_server.py", "3")["detokenize"] is False
    with_stop = probe("vllm_server.py", "3", "####")
    assert with_stop["detokenize"] is None and with_stop["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]


def test_vllm_server_is_untouched_without_top_k():
    out = probe("vllm_server.py", "0")
    assert out["engine_logprobs"] == 0 and out["topk_ids"] is None and out["detokenize"] is None
    assert out["log_probs"] == [-1.5, -3.0, -0.5]


def test_sglang_server_requests_k_and_returns_the_top_k_of_every_token():
    out = probe("sglang_server.py", "3")
    assert out["patched"] and out["top_logprobs_num"] == 3
    assert out["token_ids"] == [9, 20, 11] and out["log_probs"] == [-1.5, -3.0, -0.5]
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    assert out["topk_logprobs"] == [[-0.5, -1.5, -2.5]] * 3


def test_sglang_server_is_untouched_without_top_k():
    out = probe("sglang_server.py", "0")
    assert out["top_logprobs_num"] is None and out["topk_ids"] is None


def test_sglang_decode_leg_of_pd_disaggregation_returns_rows():
    """Prefill/decode disaggregation: verl calls the decode server with a bootstrap room too (async_sglang_server.py
    :572,582); its reply is the one the agent loop gets, so it must carry the rows. The prefill leg asks for none."""
    out = probe("sglang_server.py", "3", "decode")
    assert out["top_logprobs_num"] == 3
    assert out["topk_ids"] == [[5, 9, 2], [3, 4, 8], [11, 12, 13]]
    prefill = probe("sglang_server.py", "3", "prefill")
    assert prefill["top_logprobs_num"] is None and prefill["topk_ids"] is None


def test_sglang_original_logprob_at_another_temperature_is_refused():
    """SGLANG_RETURN_ORIGINAL_LOGPROB: log-probs before temperature, not mu's when the rollout samples at T != 1."""
    stderr = probe("sglang_server.py", "3", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "PROBE_TEMPERATURE": "0.7"},
                   fails=True)
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in stderr and "temperature 0.7" in stderr
    # at temperature 1 the two are the same distribution: allowed
    out = probe("sglang_server.py", "3", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "PROBE_TEMPERATURE": "1.0"})
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
