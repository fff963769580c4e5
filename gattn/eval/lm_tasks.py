"""The paper's benchmarks as lm-eval tasks that read local files (no network): each task is
lm-eval's own definition (prompt, choices, metrics, few-shot split), `include:`d, with its dataset
pointed at JSON-lines files under a data folder.

    write(data_dir, folder) -> task YAMLs in `folder`, for lm-eval's --include_path

Tasks (and the files each reads under DATA_DIR; a split file holds one record per line in the
Hugging Face dataset's own schema, as `datasets`' `to_json` writes it, docs/evaluation.md):

    local_hellaswag            hellaswag/{train,validation}.jsonl               (Rowan/hellaswag)
    local_arc_easy             arc_easy/{train,validation,test}.jsonl           (allenai/ai2_arc ARC-Easy)
    local_arc_challenge        arc_challenge/{train,validation,test}.jsonl      (allenai/ai2_arc ARC-Challenge)
    local_gsm8k                gsm8k/{train,test}.jsonl                         (openai/gsm8k main)
    local_mmlu  (57 subjects)  mmlu/SUBJECT/{test,dev}.jsonl                    (cais/mmlu SUBJECT)
    local_ceval (52 subjects)  ceval/SUBJECT/{val,dev}.jsonl                    (ceval/ceval-exam SUBJECT)
    local_cmmlu (67 subjects)  cmmlu/SUBJECT/{test,dev}.jsonl                   (haonan-li/cmmlu SUBJECT)
    local_humaneval            humaneval/test.jsonl                             (openai/openai_humaneval)
    paper_table4               the group of the paper's Table 4 columns: hellaswag, mmlu, gsm8k, ceval

local_humaneval executes the model's code: its pass@1 (gattn/eval/code_eval.py) runs each
completion with the task's tests in a subprocess with a timeout, and only when the command is given
--allow-code-execution (lm-eval's own code_eval metric downloads its code from the Hub).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

import lm_eval
import yaml

from gattn.config import ConfigError

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"
PREFIX = "local_"
TABLE4 = "paper_table4"
SINGLE = {  # task: (lm-eval's YAML, the folder under DATA_DIR)
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag"),
    "arc_easy": ("arc/arc_easy.yaml", "arc_easy"),
    "arc_challenge": ("arc/arc_challenge.yaml", "arc_challenge"),
    "gsm8k": ("gsm8k/gsm8k.yaml", "gsm8k"),
}
GROUPS = ("mmlu", "ceval", "cmmlu")
HUMANEVAL = f"{PREFIX}humaneval"
CODE_EVAL = Path(__file__).with_name("code_eval.py")


def subjects(group: str) -> dict[str, Path]:
    """{subject: the lm-eval YAML its local task includes} of an MMLU-style group."""
    if group == "mmlu":
        return {p.stem.removeprefix("mmlu_"): p for p in sorted((LM_EVAL_TASKS / "mmlu" / "default").glob("mmlu_*.yaml"))}
    if group == "ceval":
        return {p.stem.removeprefix("ceval-valid_"): p for p in sorted((LM_EVAL_TASKS / "ceval").glob("ceval-valid_*.yaml"))}
    return {s: LM_EVAL_TASKS / "cmmlu" / "_default_template_yaml" for s in _cmmlu_subjects()}


@functools.lru_cache(maxsize=1)
def _cmmlu_subjects() -> dict[str, str]:
    """{English name: Chinese name} of CMMLU's subjects, from lm-eval's own generator script."""
    spec = importlib.util.spec_from_file_location("cmmlu_configs", LM_EVAL_TASKS / "cmmlu" / "_generate_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.SUBJECTS)


@functools.lru_cache(maxsize=None)
def _splits(path: Path) -> tuple[str, ...]:
    """The dataset splits an lm-eval task YAML (with its includes) reads (read once per file: a
    command builds the task list more than once)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # noqa: PLC0415

    cfg = load_yaml(path, resolve_func=False)
    return tuple(sorted({cfg[k] for k in ("training_split", "validation_split", "test_split", "fewshot_split")
                         if cfg.get(k)}))


def _task(name: str, include: Path, folder: Path, extra: dict | None = None) -> dict:
    files = {split: str(folder / f"{split}.jsonl") for split in _splits(include)}
    return {"include": str(include), "task": name, "tag": [], "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": files}, **(extra or {})}


def tasks(data_dir: str | Path) -> dict[str, dict]:
    """{file name: YAML content} of every local task and group, reading from `data_dir`."""
    data = Path(data_dir).absolute()
    out = {f"{PREFIX}{t}.yaml": _task(f"{PREFIX}{t}", LM_EVAL_TASKS / yml, data / sub) for t, (yml, sub) in SINGLE.items()}
    for group in GROUPS:
        names = []
        for subject, include in subjects(group).items():
            extra = {"description": _cmmlu_description(subject)} if group == "cmmlu" else {}
            names.append(f"{PREFIX}{group}_{subject}")
            out[f"{names[-1]}.yaml"] = _task(names[-1], include, data / group / subject, extra)
        out[f"{PREFIX}{group}.yaml"] = {"group": f"{PREFIX}{group}", "task": names, "aggregate_metric_list": [
            {"metric": "acc", "aggregation": "mean", "weight_by_size": True}], "metadata": {"version": 1}}
    # lm-eval's humaneval.yaml, written out: including it would import its utils.py, which downloads
    # the code_eval metric at import.
    out[f"{HUMANEVAL}.yaml"] = {
        "task": HUMANEVAL, "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(data / "humaneval" / "test.jsonl")}},
        "unsafe_code": True, "output_type": "generate_until", "test_split": "test",
        "doc_to_text": "{{prompt}}", "doc_to_target": "{{test}}\ncheck({{entry_point}})",
        "metric_list": [{"metric": "!function code_eval.pass_at_k", "aggregation": "mean",
                         "higher_is_better": True, "k": [1]}],
        "generation_kwargs": {"until": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"], "max_gen_toks": 1024,
                              "do_sample": False},
        "repeats": 1, "num_fewshot": 0,
        "filter_list": [{"name": "create_test", "filter": [
            {"function": "custom", "filter_fn": "!function code_eval.build_predictions"}]}],
        "metadata": {"version": 1.0}}
    out[f"{TABLE4}.yaml"] = {"group": TABLE4, "task": [f"{PREFIX}hellaswag", f"{PREFIX}mmlu", f"{PREFIX}gsm8k",
                                                       f"{PREFIX}ceval"], "metadata": {"version": 1}}
    return out


def _cmmlu_description(subject: str) -> str:  # (lm-eval's, as its generator script writes it)
    return f"以下是关于{_cmmlu_subjects()[subject]}的单项选择题，请直接给出正确答案的选项。\n\n"


class _Dumper(yaml.SafeDumper):
    pass


def _function_tag(dumper, value: str):  # "!function module.name" strings as lm-eval's tag
    if value.startswith("!function "):
        return dumper.represent_scalar("!function", value.removeprefix("!function "))
    return dumper.represent_str(value)


_Dumper.add_representer(str, _function_tag)


def write(data_dir: str | Path, folder: str | Path) -> Path:
    """Writes the local tasks' YAMLs (and the code_eval module local_humaneval uses) to `folder`."""
    data = Path(data_dir)
    if not data.is_dir():
        raise ConfigError("--data-dir", str(data_dir), "an existing folder of benchmark files (docs/evaluation.md)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in tasks(data).items():
        (folder / name).write_text(yaml.dump(content, Dumper=_Dumper, allow_unicode=True, sort_keys=False))
    shutil.copy(CODE_EVAL, folder / "code_eval.py")
    return folder


def check_files(task_names: list[str], data_dir: str | Path) -> None:
    """Every file the named local tasks or groups read exists, else one line naming the first missing."""
    every = {c.get("group") or c["task"]: c for c in tasks(data_dir).values()}

    def leaves(name: str) -> list[str]:  # a group's tasks, as its YAML lists them
        entry = every.get(name)
        if entry is None:
            return []
        return [t for member in entry["task"] for t in leaves(member)] if "group" in entry else [name]

    for name in task_names:
        for task in leaves(name):
            for path in every[task]["dataset_kwargs"]["data_files"].values():
                if not Path(path).is_file():
                    raise ConfigError("--data-dir", str(data_dir), f"a folder with {path} in it (task {task} reads "
                                      "that file; docs/evaluation.md says how to fetch each benchmark)")
