"""`verl-dppo data`: conversion to verl's RL-dataset schema, on small local fixtures (no network).

Pins down: one row per problem in the schema `verl.utils.dataset.rl_dataset.RLHFDataset` reads; a data_source
that verl's own verifier (`default_compute_score`) scores, so a right answer earns the reward and a wrong one does
not; clear errors for unusable input and an unreachable hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.utils.reward_score import default_compute_score

from verl_dppo.datasets import DAPO_TEMPLATE, DataError, prepare


def _score(row: dict, solution: str) -> float:
    result = default_compute_score(row["data_source"], solution, row["reward_model"]["ground_truth"])
    return float(result["score"] if isinstance(result, dict) else result)


def _read(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture
def dapo_fixture(tmp_path):
    """Rows as in BytedTsinghua-SIA/DAPO-Math-17k: already in verl's schema, each problem repeated."""
    rows = []
    for problem, answer in (("What is 1+1?", "2"), ("What is 6*7?", "42"), ("What is 10-3?", "7")):
        for repeat in range(4):
            rows.append(
                {
                    "data_source": "math_dapo",
                    "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
                    "ability": "MATH",
                    "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                    "extra_info": {"index": f"uuid-{problem}-{repeat}"},
                }
            )
    path = tmp_path / "dapo-src.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_dapo_rows_keep_their_prompt_and_are_deduplicated(dapo_fixture, tmp_path):
    path, count = prepare("dapo-math", tmp_path / "out", from_file=str(dapo_fixture))
    rows = _read(path)
    assert path.name == "dapo-math.parquet" and count == len(rows) == 3
    assert {row["data_source"] for row in rows} == {"math_dapo"}
    assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2]
    assert rows[1]["prompt"] == [{"role": "user", "content": DAPO_TEMPLATE.format(problem="What is 6*7?")}]
    # verl's DAPO verifier (Minerva "Answer:" format): +1 right, -1 wrong.
    assert _score(rows[1], "6*7 = 42.\nAnswer: 42") == 1.0
    assert _score(rows[1], "Answer: 41") == -1.0


def test_raw_aime_rows_get_the_dapo_prompt_and_their_own_data_source(tmp_path):
    src = tmp_path / "aime.jsonl"
    problems = [{"id": i, "problem": f"Find the number {i}.", "answer": str(100 + i)} for i in range(3)]
    src.write_text("\n".join(json.dumps(p) for p in problems * 32), encoding="utf-8")  # 32 copies, as on the hub

    path, count = prepare("aime25", tmp_path / "out", from_file=str(src))
    rows = _read(path)
    assert count == 3  # one row per problem: the recipes sample n=32 per problem
    assert {row["data_source"] for row in rows} == {"aime25"}  # reported apart from aime24 in verl's val metrics
    assert rows[2]["prompt"][0]["content"] == DAPO_TEMPLATE.format(problem="Find the number 2.")
    assert rows[2]["reward_model"]["ground_truth"] == "102"
    assert _score(rows[2], "Reasoning...\nAnswer: 102") == 1.0
    assert _score(rows[2], "Reasoning...\nAnswer: 103") == -1.0


def test_sanity_rows_take_the_boxed_answer_and_verl_math_verifier(tmp_path):
    src = tmp_path / "sanity.parquet"
    rows = [
        {"problem": "Compute 1/2 of 1.", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Compute 3+4.", "solution": "$3+4=\\boxed{7}$"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), src)
    path, _ = prepare("math-sanity", tmp_path / "out", from_file=str(src))
    out = _read(path)
    assert [row["reward_model"]["ground_truth"] for row in out] == ["\\frac{1}{2}", "7"]
    assert {row["data_source"] for row in out} == {"DigitalLearningGmbH/MATH-lighteval"}
    assert "\\boxed{}" in out[0]["prompt"][0]["content"]  # R1-Distill's instruction
    # verl's MATH verifier normalises LaTeX: \frac12 equals \frac{1}{2}.
    assert _score(out[0], "so the answer is \\boxed{\\frac12}") == 1.0
    assert _score(out[0], "so the answer is \\boxed{2}") == 0.0


def _tiny_tokenizer(texts):
    """A word-level tokenizer with a chat template, built locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for text in texts for word in text.split()} | {"user", "assistant", ":"})
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{word: i + 3 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return tokenizer


def test_verl_rl_dataset_reads_the_output(dapo_fixture, tmp_path):
    from omegaconf import OmegaConf

    from verl.utils.dataset.rl_dataset import RLHFDataset

    path, _ = prepare("dapo-math", tmp_path / "out", from_file=str(dapo_fixture))
    rows = _read(path)
    tokenizer = _tiny_tokenizer([row["prompt"][0]["content"] for row in rows])
    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 256,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "truncation": "error",
            "return_raw_chat": True,
        }
    )
    dataset = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=config)
    assert len(dataset) == 3
    item = dataset[1]
    assert item["data_source"] == "math_dapo"
    assert item["reward_model"]["ground_truth"] == "42"
    assert item["raw_prompt"] == rows[1]["prompt"]


def test_rows_without_problem_or_answer_are_refused_with_the_expected_columns(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"text": "no columns we know"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="problem/answer columns.*--from-file"):
        prepare("aime24", tmp_path / "out", from_file=str(src))
    with pytest.raises(DataError, match="no such file"):
        prepare("aime24", tmp_path / "out", from_file=str(tmp_path / "missing.parquet"))


def test_unreachable_hub_is_a_clear_error_not_a_traceback(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    result = subprocess.run(
        [sys.executable, "-m", "verl_dppo.cli", "data", "aime25", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "cannot load 'yentinglin/aime_2025'" in result.stderr
    assert "--from-file" in result.stderr and "--hub-id" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "aime25.parquet").exists()
