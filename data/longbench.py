"""LongBench (Bai et al., 2023): the English tasks of the published data, their generation budgets and metrics.

The data is the dataset ``THUDM/LongBench`` on the Hugging Face Hub: ``data.zip`` holds one JSONL file per task,
each line ``{"input", "context", "answers": [...], "length", "dataset", "language", "all_classes", "_id"}``.
:func:`load_tasks` reads it from a local path (the zip, or a folder of ``<task>.jsonl``) or, when the Hub
answers, downloads the zip into the Hugging Face cache; offline and without a path it says in one line what to
pass. No other hub access, no code from the dataset runs.

Prompts put the task's instruction around the context and the question (the table is
``configs/suites/longbench.yaml``: the wording is ours, the budgets and the metrics are LongBench's). A prompt
longer than the evaluation's length keeps its first and last halves, as LongBench truncates. Scores, each the best over a sample's reference answers, in [0, 1]:

* ``qa_f1``: token F1 after normalising case, punctuation, articles and spaces (SQuAD's normalisation);
* ``rouge_l``: F1 of the longest common subsequence of the whitespace tokens;
* ``classification``: 1 / (number of class names named) when the right one is among them (a name that is only
  part of the right one does not count);
* ``retrieval`` and ``count``: the share of the numbers in the answer equal to the reference's number;
* ``code_sim``: the similarity ratio (``difflib``) of the first code line of the answer to the reference.

For ``trec``, ``triviaqa`` and ``samsum`` (few-shot tasks whose models go on with the next example) only the
first line of the answer is scored, as LongBench does.
"""

from __future__ import annotations

import difflib
import io
import json
import re
import string
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_DATASET = "THUDM/LongBench"
HUB_FILE = "data.zip"


@dataclass(frozen=True)
class Task:
    metric: str
    max_new_tokens: int
    instruction: str  # {context} and {input} are filled in


def _load_tasks() -> dict[str, Task]:
    """The task table shipped in ``configs/suites/longbench.yaml`` (metric, budget, instruction of each task)."""
    import importlib.resources

    import yaml

    doc = yaml.safe_load((importlib.resources.files("rolecall.configs") / "suites" / "longbench.yaml").read_text())
    return {name: Task(t["metric"], int(t["max_new_tokens"]), t["instruction"]) for name, t in doc["tasks"].items()}


TASKS: dict[str, Task] = _load_tasks()
FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum")


class DataNotFound(ValueError):
    """LongBench's data is neither given nor reachable; the message says what to pass."""


def check_tasks(tasks) -> tuple[str, ...]:
    from rolecall.data import check_names

    return check_names("LongBench task", tasks, TASKS)


def _hub_zip() -> Path:
    from rolecall.core.models import _hub_reachable, _offline

    hint = (f"on a machine with access, fetch {HUB_FILE} of the dataset {HUB_DATASET} from the Hugging Face Hub and "
            f"pass --data PATH (the zip, or the folder of <task>.jsonl files it holds)")
    if _offline() or not _hub_reachable():
        raise DataNotFound(f"--suite longbench: no --data given and the Hugging Face Hub cannot be reached; {hint}")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(HUB_DATASET, HUB_FILE, repo_type="dataset"))
    except Exception as e:  # noqa: BLE001 (any failure of the download is the same one-line advice)
        raise DataNotFound(f"--suite longbench: downloading {HUB_DATASET}/{HUB_FILE} failed ({type(e).__name__}); "
                           f"{hint}") from None


def _read_lines(path: Path, task: str) -> list[str]:
    """The JSONL lines of ``task`` in a folder or a zip (any folder inside the zip)."""
    if path.is_dir():
        file = path / f"{task}.jsonl"
        if not file.is_file():
            raise DataNotFound(f"--data {path}: no {task}.jsonl there; pass the folder that holds LongBench's "
                               "<task>.jsonl files, or its data.zip")
        return file.read_text(encoding="utf-8").splitlines()
    if not zipfile.is_zipfile(path):
        raise DataNotFound(f"--data {path}: neither a folder nor a zip file; pass LongBench's data.zip or the folder "
                           "of its <task>.jsonl files")
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if Path(n).name == f"{task}.jsonl"]
        if not names:
            raise DataNotFound(f"--data {path}: the zip holds no {task}.jsonl; pass LongBench's data.zip")
        return io.TextIOWrapper(z.open(names[0]), encoding="utf-8").read().splitlines()


def load_tasks(tasks, data: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` samples of each task (all without a limit), in the file's order; each
    ``{"task", "context", "input", "answers", "all_classes"}``."""
    tasks = check_tasks(tasks)
    path = _hub_zip() if data is None else Path(data).expanduser()
    if not path.exists():
        raise DataNotFound(f"--data {data}: no such file or folder; pass LongBench's data.zip or the folder of its "
                           "<task>.jsonl files")
    samples = []
    for task in tasks:
        rows = [line for line in _read_lines(path, task) if line.strip()][:limit]
        for i, line in enumerate(rows):
            try:
                row = json.loads(line)
                answers = [str(a) for a in row["answers"]]
                sample = {"task": task, "context": str(row["context"]), "input": str(row.get("input") or ""),
                          "answers": answers, "all_classes": list(row.get("all_classes") or [])}
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path} {task}.jsonl line {i + 1}: not a LongBench record (a JSON object with "
                                 "'context' and an 'answers' list)") from None
            samples.append(sample)
    return samples


def prompt_ids(tokenizer, sample: dict[str, Any], length: int) -> list[int]:
    """The task's prompt for ``sample`` as token ids, at most ``length``: a longer one keeps its first and last
    halves."""
    text = TASKS[sample["task"]].instruction.format(context=sample["context"], input=sample["input"])
    ids = tokenizer(text)["input_ids"]
    if len(ids) <= length:
        return ids
    head = length // 2
    return ids[:head] + ids[len(ids) - (length - head):]


# -- scores ---------------------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def qa_f1(prediction: str, reference: str) -> float:
    got, want = normalize(prediction).split(), normalize(reference).split()
    same = sum((Counter(got) & Counter(want)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(got), same / len(want)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (one row of the table at a time)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        row = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            row[j] = previous[j - 1] + 1 if x == y else max(previous[j], row[j - 1])
        previous = row
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    got, want = prediction.lower().split(), reference.lower().split()
    common = _lcs(got, want) if got and want else 0
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def classification(prediction: str, reference: str, classes: list[str]) -> float:
    named = [c for c in classes if c in prediction]
    named = [c for c in named if not (c in reference and c != reference)]
    return 1.0 / len(named) if reference in named else 0.0


def _number_share(prediction: str, number: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == number for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str) -> float:
    found = re.findall(r"Paragraph (\d+)", reference)
    return _number_share(prediction, found[0]) if found else 0.0


def count(prediction: str, reference: str) -> float:
    return _number_share(prediction, str(reference).strip())


def code_sim(prediction: str, reference: str) -> float:
    lines = [line for line in prediction.lstrip("\n").split("\n") if not line.lstrip().startswith(("`", "#", "//"))]
    first = lines[0] if lines else ""
    return difflib.SequenceMatcher(None, first, reference).ratio()


def score(task: str, prediction: str, answers: list[str], classes: list[str] | None = None) -> float:
    """The task's metric, the best over ``answers``."""
    if task in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = TASKS[task].metric
    if metric == "classification":
        return max(classification(prediction, a, classes or []) for a in answers)
    fn = {"qa_f1": qa_f1, "rouge_l": rouge_l, "retrieval": retrieval, "count": count, "code_sim": code_sim}[metric]
    return max(fn(prediction, a) for a in answers)
