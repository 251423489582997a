"""eval.py — the small evaluation script every algorithm is scored by: evaluate(), its metrics and its CLI.

  evaluate  evaluate(model, tokenizer, task, ...) -> accuracy (avg@k), pass@k, majority vote (maj@k), records
  metrics   majority_votes (maj@k: equal answers vote together), pass_at_k (unbiased, Chen et al. 2021)
  CLI       EvalArgs and main: a model (checkpoint, alias or Hub id) on a task, the results written as JSON

The tasks (which there are, their loading, prompts and answer kinds) are plumbing/tasks.py's registry; grading by task
name, grade(responses, references, task) -> [1.0 | 0.0], is re-exported here (plumbing/grading.py: math-verify in
sandboxed workers).

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
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from plumbing import UsageError, distributed, files, lora, ranges
from plumbing.cli import run_cli
from plumbing.engines import HFSampler, VLLMSampler, backend_problems, make_sampler
from plumbing.grading import grade_failures  # noqa: F401  (eval.grade_failures)
from plumbing.models import load_model, resolve_model
from plumbing.precision import choose_precision
from plumbing.settings import HELDOUT_SEED, directory_problems
from plumbing.tasks import (  # noqa: F401  (eval.grade, eval.check_reference(s): grading by task name)
    Example,
    check_prompt_room,
    check_reference,
    check_references,
    grade,
    known_tasks,
    last_boxed,
    load_task,
    stop_strings,
    task_problems,
)

# ----------------------------------------------------------------------------------------------
# Metrics: the majority vote (maj@k) and pass@k


def final_answer(response: str) -> str:
    """A light normal form of a response's final answer, used only to group votes for majority voting."""
    if "\\boxed" in response:
        answer = last_boxed(response)
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


# ----------------------------------------------------------------------------------------------
# Evaluation


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
        stop=stop_strings(task, tokenizer),
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


# ----------------------------------------------------------------------------------------------
# The command line

# --task's help: the registry's tasks
TASK_HELP = f"{known_tasks()} (rg:<dataset>:key=value,... sets a generated task's options)"


@dataclass
class EvalArgs:
    model: str = "smollm2-135m"
    (
        """model directory, Hugging Face id, or alias """
        """(rho-1b-sft-gsm8k, rho-1b-sft-math, deepseek-r1-distill-qwen-1.5b, smollm2-135m)"""
    )
    task: Annotated[str, tyro.conf.arg(help=TASK_HELP)] = "rg:chain_sum"
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
    # an adapter checkpoint is no model directory: the engine starts from its base, then takes the adapted weights
    # merged, as in training (engines.run_sampler)
    path = resolve_model(args.model)
    adapter = lora.is_adapter_checkpoint(path)
    sampler = make_sampler(
        args.backend,
        model,
        tokenizer,
        lora.base_record(Path(path))["model"] if adapter else args.model,
        seed=args.seed,
        precision=precision,
        context=args.context,
        max_model_len=args.context or 4096,
        # the flag asks for eager; without it the engine's own default: CUDA graphs on a GPU, eager on a CPU
        enforce_eager=args.vllm_enforce_eager or None,
    )
    if adapter and isinstance(sampler, VLLMSampler):
        sampler.load_weights(model)
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
