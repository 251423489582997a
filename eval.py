"""eval.py — the small evaluation script every algorithm is scored by: tasks, grading (the reward), evaluate().

  tasks     load_task("gsm8k" | "math" | "math500" | "aime24" | "rg:<name>" | "data.jsonl", split) -> [Example]
  grading   grade(responses, references, task) -> [1.0 | 0.0] (plumbing/grading.py: math-verify in sandboxed workers)
  evaluate  evaluate(model, tokenizer, task, ...) -> accuracy, pass@k, majority vote, records; and its CLI

Evaluate a checkpoint (paper protocols):
  python eval.py --model rho-1b-sft-gsm8k --task gsm8k --samples 16 --temperature 0.35 --top-p 0.9
  python eval.py --model runs/<run>/checkpoint --task math500 --max-new-tokens 2048 --temperature 0.6 --top-p 0.95
Offline (no GPU, no internet):
  python eval.py --model smollm2-135m --task rg:chain_sum --limit 50
"""

from __future__ import annotations

import collections
import fractions
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import tqdm
import tyro
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from plumbing import UsageError, chat_templates, distributed, files, ranges, shown
from plumbing.cli import run_cli
from plumbing.engines import HFSampler, backend_problems, make_sampler
from plumbing.grading import check_reference, check_references, grade, grade_failures  # noqa: F401  (eval.grade)
from plumbing.models import load_model
from plumbing.precision import choose_precision
from plumbing.settings import HELDOUT_SEED, directory_problems

# ----------------------------------------------------------------------------------------------
# Tasks

RHO_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
RHO_STOP = "\n\n\nProblem:"  # the SFT model may start a new problem instead of emitting EOS
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
RG_TEST_SIZE = 200  # reasoning-gym test draws (fewer after deduplication)


@dataclass
class Example:
    question: str
    answer: str  # the reference answer, graded against by `grade`
    prompt: str = ""  # the question in the model's prompt format
    prompt_ids: list[int] = field(default_factory=list)


def uses_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(question: str, tokenizer: PreTrainedTokenizerBase | None) -> str:
    """Chat models get the chat template with a boxed-answer instruction; others the Rho SFT format."""
    return format_prompts([question], tokenizer)[0]


def format_prompts(questions: list[str], tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
    """format_prompt of each question. A chat template is the model directory's code: all the questions go to one
    bounded worker process (plumbing/chat_templates.py), so that a template that loops, balloons or raises is one error
    line naming the model, not a hung or crashed run."""
    if not uses_chat_template(tokenizer):
        return [RHO_PROMPT.format(question=question) for question in questions]
    return chat_templates.render_user_prompts(tokenizer, [f"{question}\n{BOXED_INSTRUCTION}" for question in questions])


def add_prompts(examples: list[Example], tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    """Fill in each example's prompt and prompt_ids (the chat template, if any, rendered once for them all)."""
    for example, prompt in zip(examples, format_prompts([e.question for e in examples], tokenizer)):
        example.prompt = prompt
        example.prompt_ids = encode_prompt(prompt, tokenizer)
    return examples


def stop_strings(tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
    """Strings that end a response besides EOS (the Rho format's next-problem marker)."""
    return [] if uses_chat_template(tokenizer) else [RHO_STOP]


def encode_prompt(prompt: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # A chat template already writes its BOS as text; a plain prompt needs the tokenizer's BOS.
    return tokenizer(prompt, add_special_tokens=not uses_chat_template(tokenizer))["input_ids"]


def _hub_rows(dataset_id: str, config: str | None, split: str) -> list[dict]:
    try:
        import datasets

        return list(datasets.load_dataset(dataset_id, config, split=split))
    except Exception as error:  # datasets raises many types for "offline", "no such split", ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot load {dataset_id} split {split!r} ({reason}). Offline, use --task rg:chain_sum "
            "or a local GSM8K-format .jsonl file."
        ) from None


def _gsm8k_answer(solution: str) -> str:
    """Reference from a GSM8K solution: the text after "####", calculator annotations and commas removed."""
    answer = solution.split("####")[-1] if "####" in solution else solution
    return re.sub(r"<<[^>]*>>", "", answer).replace(",", "").strip()


def _last_boxed(solution: str) -> str:
    """Content of the last \\boxed{...} in a MATH solution (braces balanced)."""
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


def _parse_rg_name(name: str) -> tuple[str, dict]:
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


def _rg_rows(name: str, split: str, size: int, seed: int, heldout_seed: int = HELDOUT_SEED) -> list[dict]:
    """reasoning-gym items. The test split is the same RG_TEST_SIZE draws for every run (`heldout_seed`, not the
    run's seed: neighbouring seeds give shifted copies of the same items), and train (drawn with `seed`) drops every
    test question, so small task spaces (e.g. 1-digit sums) keep disjoint splits."""
    import reasoning_gym

    dataset, config = _parse_rg_name(name)

    def generate(seed: int, size: int) -> list[dict]:
        try:
            return list(reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config))
        except Exception as error:
            raise UsageError(f"reasoning-gym cannot build {dataset!r} with {config}: {error}") from None

    test = generate(heldout_seed, RG_TEST_SIZE)
    if split == "test":
        return test
    held_out = {row["question"] for row in test}
    return [row for row in generate(seed, size) if row["question"] not in held_out]


HUB_TASKS = ("gsm8k", "math", "math500", "aime24")
SPLITS = ("train", "test")


def task_problems(name: str, split: str | None = None, flag: str = "--task") -> list[str]:
    """Whether a task name (and split) can be loaded, checked without loading it: the early check of every script."""
    problems = []
    if split is not None and split not in SPLITS:
        problems.append(f"--split {split!r} is not a split: use train or test")
    if name.startswith("rg:"):
        try:
            dataset, _ = _parse_rg_name(name)
        except UsageError as error:
            return problems + [f"{flag}: {error}"]
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            close = sorted(d for d in DATASETS if d[:3] == dataset[:3])[:5]
            problems.append(
                f"{flag} {name}: reasoning-gym has no dataset {dataset!r}"
                + (f" (similar: {', '.join(close)})" if close else " (e.g. rg:chain_sum, rg:gsm_symbolic)")
            )
    elif name.endswith(".jsonl"):
        if Path(name).is_dir():
            problems.append(f"{flag} {name}: a directory, not a task file")
        elif files.special_file_problem(name):  # a run reads its task more than once, and again on --resume
            problems.append(f"{flag} {files.special_file_problem(name)}")
        elif not Path(name).is_file():
            problems.append(f"{flag} {name}: the file does not exist")
        elif not os.access(name, os.R_OK):
            problems.append(f"{flag} {name}: the file cannot be read (permission denied)")
    elif name not in HUB_TASKS:
        problems.append(
            f"{flag}: unknown task {name!r}: use gsm8k, math, math500, aime24, rg:<reasoning-gym dataset> "
            "or a .jsonl file"
        )
    return problems


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


def _checked_examples(rows: Iterable[dict], name: str, split: str, limit: int | None) -> list[Example]:
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
            if skipped and name.endswith(".jsonl"):  # the user's own file: stop and say which row to fix
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

    name: gsm8k | math (MATH train, MATH500 removed) | math500 | aime24 | rg:<dataset>[:key=value,...] | path.jsonl
    split: "train" or "test" (math500/aime24 have one split; reasoning-gym test items are drawn with `heldout_seed`,
    whatever `seed` draws the training items).
    limit: the first `limit` examples; a file is read, and references are checked, no further than they need.
    """
    if name == "gsm8k":
        rows = [
            {"question": r["question"], "answer": _gsm8k_answer(r["answer"])}
            for r in _hub_rows("openai/gsm8k", "main", split)
        ]
    elif name == "math":
        math500 = {r["problem"] for r in _hub_rows("HuggingFaceH4/MATH-500", None, "test")}
        subjects = [
            "algebra",
            "counting_and_probability",
            "geometry",
            "intermediate_algebra",
            "number_theory",
            "prealgebra",
            "precalculus",
        ]
        rows = [
            {"question": r["problem"], "answer": _last_boxed(r["solution"])}
            for subject in subjects
            for r in _hub_rows("EleutherAI/hendrycks_math", subject, split)
            if r["problem"] not in math500
        ]
    elif name == "math500":
        rows = [
            {"question": r["problem"], "answer": r["answer"]} for r in _hub_rows("HuggingFaceH4/MATH-500", None, "test")
        ]
    elif name == "aime24":
        rows = [
            {"question": r["problem"], "answer": str(r["answer"])}
            for r in _hub_rows("HuggingFaceH4/aime_2024", None, "train")
        ]
    elif name.startswith("rg:"):
        rows = _rg_rows(name, split, size=max(limit or 0, 10_000), seed=seed, heldout_seed=heldout_seed)
    elif name.endswith(".jsonl"):
        rows = ({**row, "answer": _gsm8k_answer(row["answer"])} for row in files.read_task_rows(name))
    else:
        raise UsageError(task_problems(name)[0])

    examples = _checked_examples(rows, name, split, limit)
    if not examples:
        raise UsageError(f"task {name!r} split {split!r} has no examples")
    return add_prompts(examples, tokenizer) if tokenizer is not None else examples


def default_eval_task(task: str) -> str:
    """The held-out task of a training task: MATH is evaluated on MATH500 (the paper's protocol), any other task on
    its own test split."""
    return "math500" if task == "math" else task


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
    if tokenizer is not None:  # one rendering of the chat template for both
        add_prompts(train_examples + held_out, tokenizer)
    if eval_task == task and task.endswith(".jsonl"):  # a file has no test split: say that "held-out" is not
        warnings.warn(
            f"--eval-task is the training file {task} itself: the accuracy reported is on training questions, "
            "not held-out ones; give --eval-task a separate file for a held-out figure",
            stacklevel=2,
        )
    return (
        check_prompt_room(train_examples, context, f"--task {task}", drop=True),
        check_prompt_room(held_out, context, f"--eval-task {eval_task}", drop=False),
    )


# ----------------------------------------------------------------------------------------------
# Evaluation


def final_answer(response: str) -> str:
    """A light normal form of a response's final answer, used only to group votes for majority voting."""
    if "\\boxed" in response:
        answer = _last_boxed(response)
    elif "####" in response:
        answer = response.split("####")[-1]
    else:
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", response.replace("\u2212", "-"))
        answer = numbers[-1] if numbers else ""
    return re.sub(r"[\s$,]", "", answer).rstrip(".")


MAX_VOTE_FORMS = 16  # distinct answers of one question the grader compares pairwise (at most 120 pairs)


def vote_form(answer: str) -> str:
    """A final answer (final_answer's text) with numbers as values, so that equal numbers vote together.

    >>> [vote_form(a) for a in ("5.0", "5", "5.00", "-0", "0.50", "1/2", "x+1", "")]
    ['5', '5', '5', '0', '1/2', '1/2', 'x+1', '']
    """
    if re.fullmatch(r"-?\d+(\.\d+)?(/[1-9]\d*)?", answer) and len(answer) <= 100:
        return str(fractions.Fraction(answer))
    return answer


def majority_votes(responses: list[list[str]], scores: list[list[float]], task: str) -> list[float]:
    """The majority vote's score of each question (maj@k), from its responses and their scores.

    Each response votes for its final answer in vote_form (numbers as values); distinct forms of one question that
    the grader finds equal (each against the other as its reference: one grade() call for every question's pairs,
    up to MAX_VOTE_FORMS forms a question; beyond that, forms alone) vote together. The winning answer scores what
    its best response scored (an unfinished response scores 0 even with the right answer). A tie between answers
    scores the mean of theirs, which is what a random tie-break scores on average: no sample order decides it.

    >>> majority_votes([["#### 5.0", "#### 5", "#### 6", "#### 6", "#### 5.00"]], [[1, 1, 0, 0, 1]], "gsm8k")
    [1.0]
    >>> majority_votes([["#### 6", "#### 5"], ["#### 5", "#### 6"]], [[0, 1], [1, 0]], "gsm8k")  # ties: the mean
    [0.5, 0.5]
    """
    forms = [[vote_form(final_answer(text)) for text in group] for group in responses]
    pairs = []  # (question, form a, form b) with a < b: whether the grader finds them equal
    for question, group in enumerate(forms):
        distinct = sorted(set(group) - {""})
        if len(distinct) <= MAX_VOTE_FORMS:
            pairs += [(question, a, b) for i, a in enumerate(distinct) for b in distinct[i + 1 :]]
    same = grade([f"\\boxed{{{a}}}" for _, a, _ in pairs], [b for _, _, b in pairs], task) if pairs else []
    joined = collections.defaultdict(dict)  # question -> form -> the first form (sorted) it is equal to
    for (question, a, b), equal in zip(pairs, same):
        if equal and b not in joined[question]:
            joined[question][b] = joined[question].get(a, a)
    results = []
    for question, (group, group_scores) in enumerate(zip(forms, scores)):
        answer = [joined[question].get(form, form) for form in group]
        votes = collections.Counter(answer)
        top = max(votes.values())
        tied = [a for a, count in votes.items() if count == top]
        best = {a: max(s for s, b in zip(group_scores, answer) if b == a) for a in tied}
        results.append(sum(best.values()) / len(tied))
    return results


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right (Chen et al. 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    *,
    examples: list[Example] | None = None,
    split: str = "test",
    limit: int | None = None,
    samples: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    context: int | None = None,
    sampler=None,
    seed: int = 0,
    heldout_seed: int = HELDOUT_SEED,
) -> dict:
    """Accuracy of a model on a task: mean over samples, pass@samples, majority vote, truncation, length.

    Pass `examples` (with prompt_ids) to evaluate a fixed held-out set, `sampler` to reuse a rollout engine.
    """
    # Without a context budget, the model's own position limit is one: a longer prompt is never prefilled (it would
    # take minutes to fail); it scores 0, counted in check_prompt_room's one warning.
    context = context or getattr(model.config, "max_position_embeddings", None)
    if examples is None:
        examples = load_task(task, split, limit=limit, seed=seed, tokenizer=tokenizer, heldout_seed=heldout_seed)
        if context is not None:
            examples = check_prompt_room(examples, context, f"--task {task}", drop=False)
    sampler = sampler or HFSampler(model, tokenizer, seed=seed)
    started = time.monotonic()
    # under torchrun each rank evaluates its share; the records are gathered below
    examples = distributed.shard(examples)
    # Greedy decoding (temperature 0) gives every sample of a prompt the same tokens: it is computed once.
    distinct = 1 if temperature == 0 else samples
    completions = sampler.sample(
        [e.prompt_ids for e in examples],
        distinct,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        stop=stop_strings(tokenizer),
        context=context,
        progress="eval",
    )
    completions = [group * (samples // distinct) for group in completions]
    texts = [[tokenizer.decode(c.ids, skip_special_tokens=True) for c in group] for group in completions]
    flat_scores = grade(
        [t for group in texts for t in group], [e.answer for e in examples for _ in range(samples)], task
    )
    # Unfinished (length-limited) responses score 0, in evaluation as in training.
    scores = [
        [s if c.finish_reason == "stop" else 0.0 for s, c in zip(flat_scores[i * samples : (i + 1) * samples], group)]
        for i, group in enumerate(completions)
    ]
    majority = majority_votes(texts, scores, task)
    records = []
    for i, (example, group) in enumerate(zip(examples, completions)):
        records.append(
            {
                "question": example.question,
                "answer": example.answer,
                "responses": texts[i],
                "scores": scores[i],
                "finish_reasons": [c.finish_reason for c in group],
                "response_tokens": [len(c.ids) for c in group],
                "majority_correct": majority[i],
            }
        )
    records = distributed.gather(records)  # every rank's, in the examples' order
    finish_reasons = [reason for r in records for reason in r["finish_reasons"]]
    return {
        "task": task,
        "examples": len(records),
        "samples": samples,
        "accuracy": sum(sum(r["scores"]) for r in records) / (len(records) * samples),
        f"pass@{samples}": sum(pass_at_k(samples, int(sum(r["scores"])), samples) for r in records) / len(records),
        "majority_accuracy": sum(r["majority_correct"] for r in records) / len(records),
        "truncation_rate": finish_reasons.count("length") / len(finish_reasons),
        "response_tokens": sum(n for r in records for n in r["response_tokens"]) / len(finish_reasons),
        "seconds": time.monotonic() - started,
        "records": records,
    }


def evaluate_policy(model, tokenizer, sampler, eval_task: str, eval_examples: list[Example], args) -> dict:
    """A training script's eval/... metrics of the current policy on its held-out questions (the --eval-* settings
    of `args`, a script's Args)."""
    result = evaluate(
        model,
        tokenizer,
        eval_task,
        examples=eval_examples,
        samples=args.eval_samples,
        temperature=args.eval_temperature,
        top_p=args.eval_top_p,
        max_new_tokens=args.max_new_tokens,
        context=args.context,
        sampler=sampler,
        seed=args.seed,
    )
    return {
        "eval/accuracy": result["accuracy"],
        f"eval/pass@{args.eval_samples}": result[f"pass@{args.eval_samples}"],
        "eval/majority_accuracy": result["majority_accuracy"],
        "eval/truncation_rate": result["truncation_rate"],
    }


@dataclass
class EvalArgs:
    model: str = "smollm2-135m"
    (
        """model directory, Hugging Face id, or alias """
        """(rho-1b-sft-gsm8k, rho-1b-sft-math, deepseek-r1-distill-qwen-1.5b, smollm2-135m)"""
    )
    task: str = "rg:chain_sum"
    """gsm8k | math | math500 | aime24 | rg:<reasoning-gym dataset>[:key=value,...] | path/to/file.jsonl"""
    split: str = "test"
    """dataset split"""
    limit: ranges.OptionalPositiveInt = None
    """evaluate only the first N examples"""
    samples: ranges.PositiveInt = 1
    """samples per question (paper GSM8K protocol: 16 at temperature 0.35)"""
    temperature: ranges.NonNegativeFloat = 0.6
    """sampling temperature (0 = greedy)"""
    top_p: ranges.Probability = 0.95
    """nucleus sampling threshold"""
    max_new_tokens: ranges.PositiveInt = 1024
    """token budget per response"""
    context: ranges.bounded(int, 2, optional=True) = None
    """total context budget (prompt + response), e.g. 2048 for the paper's 2K evaluation"""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """hf | vllm | auto (vllm when installed and a GPU is present)"""
    seed: ranges.Seed = 0
    """sampling seed"""
    heldout_seed: ranges.Seed = HELDOUT_SEED
    (
        "seed of a generated task's test questions (rg:*): the training scripts' default, so that a run's held-out "
        "accuracy and this evaluation's are on the same questions"
    )
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision on the CPU: auto = bf16 autocast where the CPU has AVX-512 BF16 or AMX, else fp32 (a GPU
    evaluates bf16 weights)"""
    vllm_enforce_eager: bool = False
    """vLLM without CUDA graphs or torch.compile: a faster engine start and slower decoding (a CPU engine is eager
    always)"""
    output: str | None = None
    """results JSON path (default: runs/eval/<model>__<task>__<time>.json)"""


def validate_eval_args(args: EvalArgs) -> None:
    """Every check that needs no model, before anything is loaded."""
    problems = ranges.problems(args) + task_problems(args.task, args.split) + backend_problems(args.backend)
    if args.output is not None:
        if Path(args.output).is_dir():
            problems.append(f"--output {args.output} is a directory: give a file path for the results JSON")
        else:
            problems += directory_problems(str(Path(args.output).parent), "--output's folder")
    if problems:
        raise UsageError("; ".join(problems))


def main(args: EvalArgs) -> dict:
    device = distributed.init_distributed()  # under torchrun each rank evaluates its share of the questions
    validate_eval_args(args)
    if problems := distributed.world_size_problems(args, per_rank={}):
        raise UsageError("; ".join(problems))
    precision = choose_precision(args.precision, device)
    distributed.print0(precision.line)
    model, tokenizer = load_model(args.model, device=device)
    sampler = make_sampler(
        args.backend,
        model,
        tokenizer,
        args.model,
        seed=args.seed,
        precision=precision,
        context=args.context,
        max_model_len=args.context or 4096,
        # the flag asks for eager; without it the engine's own default: CUDA graphs on a GPU, eager on a CPU
        enforce_eager=args.vllm_enforce_eager or None,
    )
    result = evaluate(
        model,
        tokenizer,
        args.task,
        split=args.split,
        limit=args.limit,
        samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        context=args.context,
        sampler=sampler,
        seed=args.seed,
        heldout_seed=args.heldout_seed,
    )
    safe = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")  # noqa: E731
    output = distributed.broadcast(
        Path(args.output or f"runs/eval/{safe(args.model)}__{safe(args.task)}__{int(time.time())}.json")
    )
    if distributed.rank() > 0:  # rank 0 writes the gathered result
        return result
    try:
        files.write_atomic(output, json.dumps({"args": asdict(args), **result}, indent=1), "the results")
    except UsageError as error:  # the evaluation is not lost: its numbers go to the terminal with the error
        print(json.dumps({"args": asdict(args), **result}), file=sys.stdout)
        raise UsageError(f"{error}; the results are printed above") from None
    print(
        f"{args.task}: accuracy {result['accuracy']:.3f}  pass@{args.samples} {result[f'pass@{args.samples}']:.3f}  "
        f"majority {result['majority_accuracy']:.3f}  truncated {result['truncation_rate']:.2f}  "
        f"{result['response_tokens']:.0f} tokens/response  {result['examples']} questions in "
        f"{result['seconds']:.0f}s -> {output}"
    )
    return result


if __name__ == "__main__":
    run_cli(main, tyro.cli(EvalArgs))
