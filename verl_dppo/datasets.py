"""`verl-dppo data NAME --out DIR`: the paper's data sets as parquet in the schema verl's RL dataset reads.

One row per problem, as `verl.utils.dataset.rl_dataset.RLHFDataset` and verl's reward managers expect:

    data_source    routes the reward to verl's verifier (verl.utils.reward_score.default_compute_score):
                   "math_dapo" (DAPO-Math), "aime24"/"aime25" (both to math_dapo, reported apart),
                   "DigitalLearningGmbH/MATH-lighteval" (the sanity set: verl's MATH verifier, \\boxed{} answers),
                   "openai/gsm8k" (verl's GSM8K verifier: the number after the last "#### ")
    prompt         the chat messages, [{"role": "user", "content": ...}]
    ability        "math"
    reward_model   {"style": "rule", "ground_truth": <final answer>}
    extra_info     {"index": i, "split": ..., "source_id": <hub id or file>}

Rows already in this schema (DAPO-Math-17k, BytedTsinghua-SIA/AIME-2024) keep their prompt; raw problem/answer rows
get the prompt the recipe's model was trained with. Duplicate problems are dropped (DAPO-Math-17k repeats each
problem ~100 times; the AIME copies repeat each problem 32 times: the recipes sample n=32 per problem instead).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from verl_dppo.errors import UsageError, writable_folder

__all__ = ["DATASETS", "DataError", "DatasetSpec", "convert_rows", "prepare"]

# The instruction of DAPO-Math-17k's own prompts: the base models are trained to end with "Answer: ...".
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
# DeepSeek-R1-Distill's recommended instruction: reasoning, then the answer in \boxed{}.
R1_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
# verl's own GSM8K instruction (examples/data_preprocess/gsm8k.py): its verifier reads the number after "#### ".
GSM8K_TEMPLATE = '{problem} Let\'s think step by step and output the final answer after "####".'

_PROBLEM_KEYS = ("problem", "question", "Problem", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "ground_truth", "final_answer", "solution", "Solution")


class DataError(UsageError, RuntimeError):
    """A data set that cannot be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class DatasetSpec:
    hub_id: str
    split: str
    data_source: str
    template: str
    description: str
    keep_source_prompt: bool = True
    """Rows already in verl's schema keep their prompt (and a data_source verl's verifier knows)."""
    hub_config: Optional[str] = None
    """The hub data set's configuration name, where it has several (openai/gsm8k: "main")."""


DATASETS = {
    "dapo-math": DatasetSpec(
        hub_id="BytedTsinghua-SIA/DAPO-Math-17k",
        split="train",
        data_source="math_dapo",
        template=DAPO_TEMPLATE,
        description="DAPO-Math-17k, deduplicated (the paper's ~13k filter is not published: all unique problems kept)",
    ),
    "aime24": DatasetSpec(
        hub_id="BytedTsinghua-SIA/AIME-2024",
        split="train",
        data_source="aime24",
        template=DAPO_TEMPLATE,
        description="AIME 2024, 30 problems",
    ),
    "aime25": DatasetSpec(
        hub_id="yentinglin/aime_2025",
        split="train",
        data_source="aime25",
        template=DAPO_TEMPLATE,
        description="AIME 2025, 30 problems (no canonical hub copy: any with problem/answer columns, --hub-id)",
    ),
    "math-sanity": DatasetSpec(
        hub_id="sail/Sanity-Test-R1D-1.5B",
        split="train",
        data_source="DigitalLearningGmbH/MATH-lighteval",
        template=R1_TEMPLATE,
        description="the sanity test's 1,460 MATH problems (the authors' card)",
    ),
    "gsm8k": DatasetSpec(
        hub_id="openai/gsm8k",
        split="train",
        data_source="openai/gsm8k",
        template=GSM8K_TEMPLATE,
        description="GSM8K grade-school math, rewarded by verl's GSM8K verifier (the cpu_tiny setup writes a small "
        "synthetic copy of this shape)",
        hub_config="main",
    ),
}


def _verl_knows(data_source: str) -> bool:
    """Whether verl's default reward routes this data_source to a verifier (it raises NotImplementedError if not)."""
    from verl.utils.reward_score import default_compute_score

    try:
        default_compute_score(data_source, "", "0")
    except NotImplementedError:
        return False
    except Exception:  # the verifier itself ran: the source is known
        return True
    return True


def _final_answer(text: str) -> str:
    """The final answer from an answer column; a full worked solution gives its last \\boxed{} content."""
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    text = str(text).strip()
    if "####" in text:  # GSM8K's worked solutions end with "#### <number>" (commas dropped, as verl's preprocessing)
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed_only_string(text)
    if boxed is not None:
        try:
            return remove_boxed(boxed).strip()
        except (AssertionError, IndexError):
            pass
    return text


def _first(row: dict, keys: Iterable[str]) -> Optional[Any]:
    for key in keys:
        value = row.get(key)
        if value is not None and not (isinstance(value, str) and not value.strip()):
            return value
    return None


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(message, dict) and "role" in message and "content" in message for message in value)
    )


def convert_rows(rows: Iterable[dict], spec: DatasetSpec, source_id: str) -> list[dict]:
    """Rows of any supported layout -> deduplicated rows in verl's schema. Raises DataError on unusable rows."""
    converted, seen = [], set()
    known_sources: dict[str, bool] = {}
    for number, row in enumerate(rows):
        row = dict(row)
        reward_model = row.get("reward_model")
        if spec.keep_source_prompt and _is_chat(row.get("prompt")) and isinstance(reward_model, dict):
            prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"]]
            answer = reward_model.get("ground_truth")
            source = str(row.get("data_source") or spec.data_source)
            if source not in known_sources:
                known_sources[source] = _verl_knows(source)
            # The AIME sets are reported under their own name; any source verl cannot score is replaced.
            if spec.data_source.startswith("aime") or not known_sources[source]:
                source = spec.data_source
        else:
            problem = _first(row, _PROBLEM_KEYS)
            answer = _first(row, _ANSWER_KEYS)
            if problem is None or answer is None:
                raise DataError(
                    f"{source_id}: row {number} has no problem/answer columns (found {sorted(row)}); expected one of "
                    f"{list(_PROBLEM_KEYS)} and one of {list(_ANSWER_KEYS)}, or verl's prompt/reward_model schema. "
                    "Point --hub-id or --from-file at a copy with those columns."
                )
            prompt = [{"role": "user", "content": spec.template.format(problem=str(problem).strip())}]
            source = spec.data_source
        if answer is None or not str(answer).strip():
            raise DataError(f"{source_id}: row {number} has an empty ground-truth answer")
        answer = _final_answer(answer)
        key = (prompt[-1]["content"], answer)
        if key in seen:
            continue
        seen.add(key)
        converted.append(
            {
                "data_source": source,
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"index": len(converted), "split": spec.split, "source_id": source_id},
            }
        )
    if not converted:
        raise DataError(f"{source_id}: no rows to convert")
    return converted


def _read_local(path: str) -> list[dict]:
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        raise DataError(f"--from-file {path}: no such file")
    if file.suffix not in (".parquet", ".json", ".jsonl"):
        raise DataError(f"--from-file {path}: expected a .parquet, .json or .jsonl file")
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.read_table(file).to_pylist()
            except Exception as error:  # pyarrow's ArrowInvalid and friends: not a parquet file
                raise DataError(f"--from-file {path}: not a readable parquet file ({_first_line(error)})") from None
        elif file.suffix == ".jsonl":
            rows = []
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
                if line.strip():
                    rows.append(_parse_json(line, f"--from-file {path}: line {number}"))
        else:
            data = _parse_json(file.read_text(encoding="utf-8"), f"--from-file {path}")
            rows = data.get("data") if isinstance(data, dict) else data
            if not isinstance(rows, list):
                raise DataError(
                    f'--from-file {path}: expected a JSON list of rows (or {{"data": [rows]}}), found '
                    f"{type(data).__name__}"
                )
    except UnicodeDecodeError:
        raise DataError(f"--from-file {path}: not UTF-8 text; give a .parquet, .json or .jsonl file") from None
    except OSError as error:
        raise DataError(f"--from-file {path}: cannot read it ({error.strerror or error})") from None
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"--from-file {path}: row {number} is a {type(row).__name__}, not an object with problem/answer "
                "(or verl's prompt/reward_model) fields"
            )
    return rows


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _read_hub(hub_id: str, split: str, hub_config: Optional[str] = None) -> list[dict]:
    try:
        import datasets
    except ImportError as error:
        raise DataError("`verl-dppo data` needs Hugging Face `datasets`: pip install datasets") from error
    try:
        dataset = datasets.load_dataset(hub_id, hub_config, split=split)
    except Exception as error:  # network, auth, offline mode, missing repo or split: all end the same way
        raise DataError(
            f"cannot load {hub_id!r} (split {split!r}) from the Hugging Face hub: {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}\n"
            "  Check the network (and HF_ENDPOINT / HF_TOKEN / HF_HUB_OFFLINE), name another copy with --hub-id, "
            "or convert a local copy with --from-file PATH."
        ) from None
    return [dict(row) for row in dataset]


def prepare(
    name: str, out_dir: str, hub_id: Optional[str] = None, from_file: Optional[str] = None, split: Optional[str] = None
) -> tuple[Path, int]:
    """Fetch (or read) data set `name`, convert it, write OUT_DIR/NAME.parquet; returns (path, rows written)."""
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    spec = DATASETS[name]
    split = split or spec.split
    out = Path(writable_folder(out_dir, "--out"))  # before the download: a bad --out costs nothing
    if from_file:
        source_id, rows = from_file, _read_local(from_file)
    else:
        source_id = hub_id or spec.hub_id
        rows = _read_hub(source_id, split, spec.hub_config if hub_id is None else None)
    converted = convert_rows(rows, spec, source_id)

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = out / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(converted), path)
    return path, len(converted)
