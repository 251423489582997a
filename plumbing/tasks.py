"""Tasks: the registry of what a run trains and is evaluated on, and loading a task's questions.

TASKS holds one entry per task, or per family of tasks (a name pattern): its loader, its splits, its prompt format
(and the strings that end a response in it) and its answer kind (numeric or expression, how grading reads the
references). Loading (load_task, load_examples), every script's early check (task_problems) and grading by task name
(grade, check_references) all read the entry; no other module lists task names, so adding a task is one entry in
TASKS, e.g. for a Hugging Face dataset with "problem" and "answer" columns:

    "arithmetic": Task(hub("someone/arithmetic"), "expression"),

It lives in plumbing, not in eval.py: the four scripts and eval.py read it, it builds on plumbing's grading, files and
chat templates, and a plumbing module may read it too (plumbing never imports eval.py, an entry point). grading.py's
sandboxed workers never import it: the answer kind is looked up here, in the training process, and handed to
grading.grade as a value.

  TASKS         name or pattern -> Task(load, answer_kind, splits, prompt, eval_task, ...), found by find(name)
  load_task     a task's split as Examples: question, reference answer, and (given a tokenizer) the prompt and its ids
  load_examples a training run's questions: the training split and the held-out questions
  task_problems whether a task name (and split) can be loaded, checked without loading it
  grade         grading.grade with the task's answer kind: 1.0 for each response whose final answer is the reference
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import tqdm
from transformers import PreTrainedTokenizerBase

from plumbing import UsageError, chat_templates, distributed, files, grading, shown
from plumbing.grading import AnswerKind
from plumbing.settings import HELDOUT_SEED

# ----------------------------------------------------------------------------------------------
# Prompt formats

RHO_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
RHO_STOP = "\n\n\nProblem:"  # the SFT model may start a new problem instead of emitting EOS
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def uses_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptFormat:
    """How a question becomes a prompt, and what ends a response in it besides EOS. A model with a chat template gets
    the question and `instruction` as its user turn (the template's end of turn ends the response); any other model
    gets `plain` with the question filled in, and `plain_stops` end its response."""

    plain: str
    plain_stops: tuple[str, ...]
    instruction: str

    def prompts(self, questions: list[str], tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
        """Each question's prompt. A chat template is the model directory's code: all the questions go to one bounded
        worker process (plumbing/chat_templates.py), so that a template that loops, balloons or raises is one error
        line naming the model, not a hung or crashed run."""
        if not uses_chat_template(tokenizer):
            return [self.plain.format(question=question) for question in questions]
        return chat_templates.render_user_prompts(
            tokenizer, [f"{question}\n{self.instruction}" for question in questions]
        )

    def stops(self, tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
        """Strings that end a response besides EOS (the plain format's next-problem marker)."""
        return [] if uses_chat_template(tokenizer) else list(self.plain_stops)


# Every task's format: the Rho SFT models' (the paper's GSM8K and MATH policies), or a boxed answer for a chat model.
MATH_PROMPT = PromptFormat(plain=RHO_PROMPT, plain_stops=(RHO_STOP,), instruction=BOXED_INSTRUCTION)


def encode_prompt(prompt: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # A chat template already writes its BOS as text; a plain prompt needs the tokenizer's BOS.
    return tokenizer(prompt, add_special_tokens=not uses_chat_template(tokenizer))["input_ids"]


# ----------------------------------------------------------------------------------------------
# Loaders: a task's rows {"question", "answer": the reference} of one split, in the task's order


@dataclass(frozen=True)
class Request:
    """What a loader is asked for; a Hub task reads only `split`."""

    name: str  # the task as given: a family's member in full ("rg:chain_sum:max_digits=1", "data/train.jsonl")
    split: str  # the source's split (Task.splits maps train and test to it)
    size: int  # how many training items a generated task draws
    seed: int  # a generated task's training draws
    heldout_seed: int  # a generated task's test draws


def hub_rows(dataset_id: str, config: str | None, split: str) -> list[dict]:
    """A Hugging Face dataset's split as rows (downloaded once into the datasets cache)."""
    try:
        import datasets

        return list(datasets.load_dataset(dataset_id, config, split=split))
    except Exception as error:  # datasets raises many types for "offline", "no such split", ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot load {dataset_id} split {split!r} ({reason}). Offline, use --task rg:chain_sum "
            "or a local GSM8K-format .jsonl file."
        ) from None


def hub(
    dataset_id: str,
    config: str | None = None,
    question: str = "problem",
    answer: str = "answer",
    reference: Callable[[object], str] = str,
) -> Callable[[Request], list[dict]]:
    """The loader of a Hugging Face dataset (`config`: its subset): of each row of the split asked for, the
    `question` column as the question and reference(row[answer]) as the reference."""

    def load(request: Request) -> list[dict]:
        return [
            {"question": row[question], "answer": reference(row[answer])}
            for row in hub_rows(dataset_id, config, request.split)
        ]

    return load


def gsm8k_answer(solution: str) -> str:
    """Reference from a GSM8K solution: the text after "####", calculator annotations and commas removed.

    >>> gsm8k_answer("3 + 4 = <<3+4=7>>7 apples\\n#### 1,007")
    '1007'
    """
    answer = solution.split("####")[-1] if "####" in solution else solution
    return re.sub(r"<<[^>]*>>", "", answer).replace(",", "").strip()


def last_boxed(solution: str) -> str:
    """Content of the last \\boxed{...} in a MATH solution (braces balanced).

    >>> last_boxed("so \\\\boxed{1} and \\\\boxed{\\\\frac{1}{2}} done")
    '\\\\frac{1}{2}'
    """
    start = solution.rfind("\\boxed")
    if start < 0:
        return ""
    i = solution.find("{", start)
    depth = 0
    out = []
    for ch in solution[i:] if i >= 0 else "":
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            break
        out.append(ch)
    return "".join(out[1:])


MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def math_rows(request: Request) -> list[dict]:
    """MATH (Hendrycks et al.), its seven subjects, with MATH500's problems removed (they are its test set)."""
    math500 = {row["problem"] for row in hub_rows("HuggingFaceH4/MATH-500", None, "test")}
    return [
        {"question": row["problem"], "answer": last_boxed(row["solution"])}
        for subject in MATH_SUBJECTS
        for row in hub_rows("EleutherAI/hendrycks_math", subject, request.split)
        if row["problem"] not in math500
    ]


RG_TEST_SIZE = 200  # reasoning-gym test draws (fewer after deduplication)


def parse_rg_name(name: str) -> tuple[str, dict]:
    """ "rg:chain_sum:min_terms=2,max_digits=1" -> ("chain_sum", {"min_terms": 2, "max_digits": 1})."""
    dataset, _, options = name[len("rg:") :].partition(":")
    config = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(
                f"bad reasoning-gym option {item!r} in {name!r}: write key=value, e.g. rg:chain_sum:max_digits=1"
            )
        try:
            config[key.strip()] = json.loads(value.strip().lower() if value.strip() in ("True", "False") else value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return dataset, config


def rg_rows(request: Request) -> list[dict]:
    """reasoning-gym items. The test split is the same RG_TEST_SIZE draws for every run (`heldout_seed`, not the
    run's seed: neighbouring seeds give shifted copies of the same items), and train (drawn with `seed`) drops every
    test question, so small task spaces (e.g. 1-digit sums) keep disjoint splits."""
    import reasoning_gym

    dataset, config = parse_rg_name(request.name)

    def generate(seed: int, size: int) -> list[dict]:
        try:
            return list(reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config))
        except Exception as error:
            raise UsageError(f"reasoning-gym cannot build {dataset!r} with {config}: {error}") from None

    test = generate(request.heldout_seed, RG_TEST_SIZE)
    if request.split == "test":
        return test
    held_out = {row["question"] for row in test}
    return [row for row in generate(request.seed, request.size) if row["question"] not in held_out]


def rg_problems(name: str, flag: str) -> list[str]:
    """Whether reasoning-gym has the dataset an rg:<dataset>[:key=value,...] name asks for, and its options parse."""
    try:
        dataset, _ = parse_rg_name(name)
    except UsageError as error:
        return [f"{flag}: {error}"]
    from reasoning_gym.factory import DATASETS

    if dataset in DATASETS:
        return []
    close = sorted(d for d in DATASETS if d[:3] == dataset[:3])[:5]
    return [
        f"{flag} {name}: reasoning-gym has no dataset {dataset!r}"
        + (f" (similar: {', '.join(close)})" if close else " (e.g. rg:chain_sum, rg:gsm_symbolic)")
    ]


def file_rows(request: Request) -> Iterable[dict]:
    """A GSM8K-format .jsonl file's rows (both splits), read one line at a time; the reference is gsm8k_answer's."""
    return ({**row, "answer": gsm8k_answer(row["answer"])} for row in files.read_task_rows(request.name))


def file_problems(name: str, flag: str) -> list[str]:
    """Whether a task file can be read, checked without reading it."""
    if Path(name).is_dir():
        return [f"{flag} {name}: a directory, not a task file"]
    if files.special_file_problem(name):  # a run reads its task more than once, and again on --resume
        return [f"{flag} {files.special_file_problem(name)}"]
    if not Path(name).is_file():
        return [f"{flag} {name}: the file does not exist"]
    if not os.access(name, os.R_OK):
        return [f"{flag} {name}: the file cannot be read (permission denied)"]
    return []


# ----------------------------------------------------------------------------------------------
# The registry

SPLITS = ("train", "test")  # every task has both; one whose source has a single split reads it for both


@dataclass(frozen=True)
class Task:
    """One task, or one family of tasks (a name pattern of TASKS)."""

    load: Callable[[Request], Iterable[dict]]
    """the rows {"question", "answer": the reference} of one split, in the task's order"""
    answer_kind: AnswerKind
    """numeric: references are numbers (scientific notation read as its value); expression: LaTeX, compared as math"""
    splits: dict[str, str] = field(default_factory=lambda: {"train": "train", "test": "test"})
    """train and test -> the source's split each is read from"""
    prompt: PromptFormat = MATH_PROMPT
    """the prompt format, and the strings that end a response in it"""
    eval_task: str | None = None
    """the held-out task of a run that trains on this one (None: this task's test split)"""
    problems: Callable[[str, str], list[str]] = lambda name, flag: []
    """(name, flag) -> what would stop a family's member from loading, found without loading it"""
    shown_as: str | None = None
    """how task_problems' list of the tasks names a family (None: by its name)"""
    user_file: bool = False
    """the user's own file: a reference that does not parse stops the load at its row (a public dataset's row is
    skipped with a warning); it has no held-out split of its own"""


TASKS: dict[str, Task] = {
    "gsm8k": Task(hub("openai/gsm8k", "main", question="question", reference=gsm8k_answer), "numeric"),
    "math": Task(math_rows, "expression", eval_task="math500"),
    "math500": Task(hub("HuggingFaceH4/MATH-500"), "expression", splits={"train": "test", "test": "test"}),
    "aime24": Task(hub("HuggingFaceH4/aime_2024"), "expression", splits={"train": "train", "test": "train"}),
    "rg:*": Task(rg_rows, "numeric", problems=rg_problems, shown_as="rg:<reasoning-gym dataset>"),
    "*.jsonl": Task(file_rows, "numeric", problems=file_problems, shown_as="a .jsonl file", user_file=True),
}


def find(name: str) -> Task | None:
    """The entry of a task name: its own, else the first family whose pattern matches it (None: an unknown task)."""
    if name in TASKS:
        return TASKS[name]
    return next((task for pattern, task in TASKS.items() if fnmatch.fnmatchcase(name, pattern)), None)


def known_tasks() -> str:
    """The tasks there are, as a message lists them: "gsm8k, ..., rg:<reasoning-gym dataset> or a .jsonl file"."""
    names = [task.shown_as or name for name, task in TASKS.items()]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def task_problems(name: str, split: str | None = None, flag: str = "--task") -> list[str]:
    """Whether a task name (and split) can be loaded, checked without loading it: the early check of every script."""
    problems = []
    if split is not None and split not in SPLITS:
        problems.append(f"--split {split!r} is not a split: use train or test")
    task = find(name)
    if task is None:
        return problems + [f"{flag}: unknown task {name!r}: use {known_tasks()}"]
    return problems + task.problems(name, flag)


def task_of(name: str) -> Task:
    """The entry of a task name; an unknown name is a UsageError listing the tasks there are."""
    task = find(name)
    if task is None:
        raise UsageError(task_problems(name)[0])
    return task


def answer_kind(name: str) -> AnswerKind:
    return task_of(name).answer_kind


def default_eval_task(task: str) -> str:
    """The held-out task of a training task: its entry's eval_task (MATH is evaluated on MATH500, the paper's
    protocol), else the task's own test split."""
    entry = find(task)
    if entry is None or entry.eval_task is None:
        return task
    return entry.eval_task


# ----------------------------------------------------------------------------------------------
# Grading by task name: the answer kind is looked up here, in the parent; the grading workers get it as a value


def grade(responses: list[str], references: list[str], task: str, **options) -> list[float]:
    """1.0 for each response whose final answer equals its reference, else 0.0: grading.grade (the reward, its
    options: timeout, workers, grace) with the task's answer kind."""
    return grading.grade(responses, references, answer_kind(task), **options)


def check_references(references: list[str], task: str) -> list[bool]:
    """For each reference, whether it parses (to a number, for a numeric task); one grading-pool round trip."""
    return grading.check_references(references, answer_kind(task))


def check_reference(reference: str, task: str) -> bool:
    """True if the reference parses (to a number, for a numeric task)."""
    return check_references([reference], task)[0]


# ----------------------------------------------------------------------------------------------
# Loading


@dataclass
class Example:
    question: str
    answer: str  # the reference answer, graded against by `grade`
    prompt: str = ""  # the question in the model's prompt format
    prompt_ids: list[int] = field(default_factory=list)


def add_prompts(examples: list[Example], prompt: PromptFormat, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    """Fill in each example's prompt (in `prompt`'s format) and prompt_ids; a chat template, if any, is rendered once
    for them all."""
    for example, text in zip(examples, prompt.prompts([e.question for e in examples], tokenizer)):
        example.prompt = text
        example.prompt_ids = encode_prompt(text, tokenizer)
    return examples


def stop_strings(task: str, tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
    """Strings that end a response to the task's prompts besides EOS."""
    return task_of(task).prompt.stops(tokenizer)


def check_prompt_room(examples: list[Example], context: int, what: str, drop: bool) -> list[Example]:
    """Prompts that leave room for a response within `context` tokens.

    None leaves room: one clear error. Some do not: a warning with the count; they are dropped (drop=True,
    training) or kept and score 0 as unfinished (drop=False, evaluation keeps its denominator).
    """
    full = [e for e in examples if len(e.prompt_ids) >= context]
    if full and len(full) == len(examples):
        lengths = sorted(len(e.prompt_ids) for e in examples)
        raise UsageError(
            f"--context {context} leaves no room for a response after any prompt of {what} (prompts are "
            f"{lengths[0]}-{lengths[-1]} tokens): raise --context"
        )
    if full:
        action = "dropped" if drop else "kept; they score 0 as unfinished"
        warnings.warn(
            f"{len(full)} of {len(examples)} prompts of {what} leave no room for a response within --context "
            f"{context} ({action})"
        )
    return [e for e in examples if len(e.prompt_ids) < context] if drop else examples


# References are checked CHECKED_AT_ONCE to a grading-pool round trip, a progress bar moving after each; the bar shows
# once the check has taken PROGRESS_DELAY seconds (a 200,000-row file takes minutes on a CPU), so a short one prints
# nothing.
CHECKED_AT_ONCE = 10_000
PROGRESS_DELAY = 2.0


def _checked_examples(rows: Iterable[dict], name: str, task: Task, split: str, limit: int | None) -> list[Example]:
    """The first `limit` (None: all) rows whose question is new and whose reference parses, as Examples, in the task's
    order. Rows are read, and their references checked (one grading-pool round trip per batch), only until `limit`
    examples are found: `--limit 2` of a million-row file reads a few rows. The examples are those of checking every
    row first and keeping the first `limit`; what is left unread is not checked (a bad row after them is not
    reported, and a public dataset's skipped count covers the rows read)."""
    rows = iter(rows)
    examples = []
    skipped = []
    seen = set()
    try:
        while limit is None or len(examples) < limit:
            batch = []  # (position among the unique rows, row)
            for row in rows:
                if row["question"] not in seen:  # duplicates would weigh some questions twice
                    seen.add(row["question"])
                    batch.append((len(seen), row))
                    if limit is not None and len(batch) == limit - len(examples):
                        break
            if not batch:
                break
            references = [str(row["answer"]) for _, row in batch]
            parses = []
            with tqdm.tqdm(
                total=len(references),
                desc=f"checking the answers of {shown(name)}",
                unit=" rows",
                delay=PROGRESS_DELAY,
                disable=distributed.rank() > 0,
            ) as progress:
                for start in range(0, len(references), CHECKED_AT_ONCE):
                    parses += check_references(references[start : start + CHECKED_AT_ONCE], name)
                    progress.update(len(parses) - progress.n)
            examples += [
                Example(question=row["question"], answer=str(row["answer"]))
                for (_, row), ok in zip(batch, parses)
                if ok
            ]
            skipped += [(position, row) for (position, row), ok in zip(batch, parses) if not ok]
            if skipped and task.user_file:  # the user's own file: stop and say which row to fix
                _, row = skipped[0]
                raise UsageError(
                    f"{name} row {row['line']} has a missing or unparseable reference answer {row['answer']!r}; "
                    "fix or remove it"
                )
    finally:
        if hasattr(rows, "close"):  # a file's reader: closed now, which issues its warning of dropped rows
            rows.close()
    if skipped:  # a public dataset: a few answers math-verify cannot parse are skipped, not fatal
        position, row = skipped[0]
        warnings.warn(
            f"{name} {split}: skipped {len(skipped)} rows whose reference does not parse "
            f"(first: row {position}, {row['answer']!r})"
        )
    return examples


def load_task(
    name: str,
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    heldout_seed: int = HELDOUT_SEED,
) -> list[Example]:
    """Examples of a task: question, reference answer and, given a tokenizer, the prompt in the model's format.

    name: a task of TASKS (find): a name, an rg:<dataset>[:key=value,...] or a path.jsonl
    split: "train" or "test" (a task with one split reads it for both; reasoning-gym test items are drawn with
    `heldout_seed`, whatever `seed` draws the training items).
    limit: the first `limit` examples; a file is read, and references are checked, no further than they need.
    """
    task = task_of(name)
    if split not in task.splits:
        raise UsageError(f"--split {split!r} is not a split: use train or test")
    request = Request(name, task.splits[split], max(limit or 0, 10_000), seed, heldout_seed)
    examples = _checked_examples(task.load(request), name, task, split, limit)
    if not examples:
        raise UsageError(f"task {name!r} split {split!r} has no examples")
    return add_prompts(examples, task.prompt, tokenizer) if tokenizer is not None else examples


def load_examples(
    task: str,
    eval_task: str,
    context: int,
    eval_limit: int | None,
    seed: int,
    tokenizer,
    heldout_seed: int = HELDOUT_SEED,
) -> tuple[list[Example], list[Example]]:
    """A training run's questions: the training split of `task` (prompts without room for a response within
    `context` dropped) and the held-out questions of `eval_task` (kept, scoring 0 as unfinished)."""
    train_examples = load_task(task, "train", seed=seed, heldout_seed=heldout_seed)
    held_out = load_task(eval_task, "test", limit=eval_limit, seed=seed, heldout_seed=heldout_seed)
    if tokenizer is not None:
        train_prompt = task_of(task).prompt
        held_out_prompt = task_of(eval_task).prompt
        if train_prompt == held_out_prompt:  # one rendering of the chat template for both
            add_prompts(train_examples + held_out, train_prompt, tokenizer)
        else:
            add_prompts(train_examples, train_prompt, tokenizer)
            add_prompts(held_out, held_out_prompt, tokenizer)
    if eval_task == task and task_of(task).user_file:  # a file has no test split: say that "held-out" is not
        warnings.warn(
            f"--eval-task is the training file {task} itself: the accuracy reported is on training questions, "
            "not held-out ones; give --eval-task a separate file for a held-out figure",
            stacklevel=2,
        )
    return (
        check_prompt_room(train_examples, context, f"--task {task}", drop=True),
        check_prompt_room(held_out, context, f"--eval-task {eval_task}", drop=False),
    )
