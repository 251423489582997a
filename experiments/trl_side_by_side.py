"""GRPO side by side: grpo_baseline.py against Hugging Face TRL's GRPOTrainer, same work, same machine.

Both sides start from the same model directory and train on the same prompts (the questions
grpo_baseline.py draws for each iteration, as the same token ids), with the same group size, token
budget, temperature, learning rate and schedule, beta = 0 and a loss normalised by the token count of
the whole batch. One GRPO iteration of grpo_baseline.py (rollout of questions x G completions, one
optimizer step) is one TRL optimizer step. Each side runs in its own process, one after the other,
nothing concurrent; rounds repeat the pair (ours, TRL, ours, TRL, ...). Reported per side: median
wall-clock and CPU seconds per step, peak resident memory, generated tokens and reward per step, and
the ratios ours / TRL against the targets (time <= 0.8x, memory <= 0.5x). TRL is a benchmark-only
dependency (requirements-bench.txt); no training script imports it.

How it is measured
- wall s/step: grpo_baseline.py's own `time/iteration_seconds` (rollout to weights updated; evaluation
  and checkpoint excluded); TRL: a TrainerCallback, on_step_begin -> on_step_end (generation, rewards,
  forward/backward of every micro-batch, clipping, optimizer step).
- CPU s/step: the same method on both sides: this process polls the training process (user + system
  CPU seconds, grading workers not included on either side) every --poll-seconds and takes the
  difference between the moments two consecutive per-step records appear (grpo_baseline.py's
  metrics.jsonl, the TRL child's progress file). TRL's in-process time.process_time() per step is kept
  beside it as a cross-check.
- peak RSS: the kernel's high-water mark (VmHWM) of the training process, read when its last step's
  record appears ("train", the headline) and at exit ("overall": grpo_baseline.py then evaluates and
  writes a checkpoint). The summed RSS of the process tree (grading workers included) is kept too.
- the first step of every side includes warm-up (first allocations, thread pools): the headline medians
  are over steps 2..N of every round (over all steps when --steps 1), the all-step medians are kept too.

Settings that differ (also written to the JSON as "mismatches"; none changes the amount of work except
where said):
- sampler: grpo_baseline.py samples with eval.HFSampler (one prefill per prompt whose KV cache is
  repeated G times; finished rows leave the batch); TRL calls model.generate on the questions x G rows
  (each prompt prefilled G times; finished rows keep decoding padding until the last row ends).
  Different random streams, so completions, lengths and rewards differ: compare tokens per step.
- old log-probs: matched. With one optimizer step per iteration both sides skip the separate no-grad
  pass and use the detached log-probs of the update's own forward pass (TRL: num_iterations 1).
- advantages: grpo_baseline.py uses (r - mean) / (std + 1e-8) with the population std, then whitens
  the token advantages over the whole batch; TRL (scale_rewards="group") uses (r - mean) / (std + 1e-4)
  with Bessel's std and no whitening. TRL has no option for either difference.
- loss normalisation: matched. TRL loss_type="dapo" (its default) divides the summed token loss by the
  number of completion tokens in the whole generation batch, which is grpo_baseline.py's batch_tokens
  normalisation; "bnpo" would normalise per micro-batch and "grpo" per sequence.
- log-probs: neither side holds the [rows, T, vocab] logits: TRL projects through its fused, tiled LM
  head (and also computes per-token entropies), grpo_baseline.py runs the LM head on chunks of 512
  response positions, recomputed in the backward pass.
- prompts and padding in the update: grpo_baseline.py runs each distinct prompt of a micro-batch once and the G
  completions on its KV cache (response_logprobs; without activation checkpointing, whose layers take no cache),
  in micro-batches of whole groups or of similar length, whichever computes fewer positions (micro_batches), each
  padded to its own longest prompt and response; TRL runs every prompt once per completion, and pads every
  micro-batch to the longest completion of the generation batch. Same gradient, less work on our side.
- optimizer and schedule: both torch.optim.AdamW (betas 0.9/0.999, eps 1e-8, no weight decay, gradient
  clipping at 1.0; TRL optim="adamw_torch", its default is the fused AdamW) and the same linear decay
  from --lr to 0 over --steps steps, no warmup (grpo_baseline.py has no constant schedule, so TRL gets
  lr_scheduler_type="linear" with warmup 0 and grpo_baseline.py --warmup-ratio 0).
- precision and memory options: fp32 weights on both, compute in --precision on both (fp32 by default:
  grpo_baseline.py --precision fp32, TRL bf16=False; with --precision bf16, grpo_baseline.py --precision bf16
  and TRL bf16=True, both bf16 autocast over fp32 weights; TRL's default is bf16); gradient
  checkpointing off on both (TRL's default is on; --gradient-checkpointing turns it on for both).
- prompts: TRL gets the already formatted prompt text as a standard (non-conversational) prompt and
  tokenizes it with the tokenizer's default special tokens; the TRL child stops if that differs from
  tasks.encode_prompt's ids (it does not for SmolLM2-135M, whose tokenizer adds no BOS of its own).
- stop strings: for a model without a chat template grpo_baseline.py also stops at "\\n\\n\\nProblem:";
  TRL stops at EOS only (not the case for SmolLM2-135M, which has a chat template).
- rewards: both call tasks.grade on the completion text decoded without special tokens; a completion
  that did not end with EOS (length-limited) scores 0 on both.
- evaluation: grpo_baseline.py evaluates before the first and after the last iteration (1 question,
  1 sample) and writes a checkpoint at the end, outside the per-step times; TRL does neither.

  python -m venv .venv-bench && . .venv-bench/bin/activate && pip install -r requirements.txt \\
    && pip install --no-deps -r requirements-offline.txt && pip install -r requirements-bench.txt
  HF_HUB_OFFLINE=1 python -m experiments.trl_side_by_side                   # 8 x 8, 64 tokens, 3 steps x 2 rounds
  HF_HUB_OFFLINE=1 python -m experiments.trl_side_by_side --steps 2 --rounds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from plumbing import ranges  # imports no torch

REPO = Path(__file__).resolve().parents[1]

TIME_TARGET = 0.8  # ours / TRL seconds per step, at most
MEMORY_TARGET = 0.5  # ours / TRL peak resident memory, at most
NEVER = 1_000_000  # --eval-every / --save-every that never trigger (the last iteration still does)
TRL_SETTINGS_RECORDED = (  # GRPOConfig fields written to the results (the full config has ~200)
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "learning_rate",
    "beta",
    "num_iterations",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "mask_truncated_completions",
    "optim",
    "weight_decay",
    "max_grad_norm",
    "lr_scheduler_type",
    "warmup_steps",
    "bf16",
    "use_cpu",
    "gradient_checkpointing",
    "shuffle_dataset",
    "max_steps",
    "seed",
)


@dataclass
class Args:
    steps: ranges.PositiveInt = 3
    """optimizer steps per side and round (one grpo_baseline.py iteration = one TRL step)"""
    rounds: ranges.PositiveInt = 2
    """repetitions of the pair (grpo_baseline.py, then TRL)"""
    model: str = "smollm2-135m"
    """model directory or alias (eval.resolve_model), the same for both sides"""
    task: str = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    """training task (tasks.load_task), the same for both sides"""
    questions: ranges.PositiveInt = 8
    """prompts per step"""
    group_size: ranges.bounded(int, 2) = 8
    """completions per prompt (G; TRL num_generations)"""
    max_new_tokens: ranges.PositiveInt = 64
    """completion token budget (TRL max_completion_length)"""
    context: ranges.PositiveInt = 2047
    """prompt + completion positions grpo_baseline.py admits (its --context; at most the model's positions); TRL
    has no such limit, and the prompts here are far shorter"""
    temperature: ranges.PositiveFloat = 0.7
    """sampling temperature; both sides divide the logits of the loss by it too"""
    lr: ranges.PositiveFloat = 5e-6
    """AdamW learning rate, decayed linearly to 0 over --steps on both sides"""
    micro_batch_size: ranges.PositiveInt = 16
    """sequences per forward/backward (grpo_baseline.py --micro-batch-size, TRL per_device_train_batch_size)"""
    gradient_checkpointing: bool = False
    """gradient checkpointing on both sides"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """compute precision of both sides over fp32 weights: fp32, or bf16 autocast (grpo_baseline.py --precision bf16,
    TRL bf16=True); bf16 pays off only where the CPU has AVX-512 BF16 or AMX"""
    seed: ranges.Seed = 1
    """seed of both sides (also picks the questions of every step)"""
    threads: ranges.OptionalPositiveInt = None
    """OMP_NUM_THREADS for both sides (default: inherited from this shell)"""
    poll_seconds: ranges.PositiveFloat = 0.1
    """how often the training process's CPU time and memory are read"""
    out: str = "experiments/results/trl_side_by_side.json"
    """where the results are written (relative to the current directory)"""
    side: str = "both"
    """internal: "trl" runs one TRL measurement in this process (the parent starts it with --child-out)"""
    child_out: str | None = None
    """internal: result file of a --side trl run"""


# ----------------------------------------------------------------------------------------------
# Pure helpers: prompts of each step, per-step intervals, medians, summary, table


def prompts_for_steps(examples: list, questions: int, steps: int, seed: int) -> list[list]:
    """The questions grpo_baseline.py trains on at iterations 1..steps: `questions` draws with replacement,
    from random.Random(seed * 1_000_003 + iteration), as in its main loop.

    >>> prompts_for_steps(list("abcdefghij"), questions=3, steps=2, seed=1)
    [['h', 'c', 'c'], ['e', 'a', 'b']]
    """
    out = []
    for iteration in range(1, steps + 1):
        rng = random.Random(seed * 1_000_003 + iteration)
        out.append([rng.choice(examples) for _ in range(questions)])
    return out


def first_seen(marks: list[dict], line: int) -> dict:
    """The first observation at which record number `line` (0-based) of a growing JSONL file was present.

    marks: observations in time order, each {"lines": complete lines then, "wall": ..., "cpu": ..., "hwm": ...}.
    >>> first_seen([{"lines": 1, "cpu": 2.0}, {"lines": 3, "cpu": 5.0}], 2)
    {'lines': 3, 'cpu': 5.0}
    """
    for mark in marks:
        if mark["lines"] > line:
            return mark
    raise ValueError(f"record {line} was never observed (last observation: {marks[-1]['lines'] if marks else 0} lines)")


def intervals(marks: list[dict], lines: list[int], key: str) -> list[float | None]:
    """For each record number in `lines`, `key` (wall or cpu seconds) elapsed between the appearance of the
    record before it and its own: the cost of one step when each step appends one record. None when both
    records appeared within the same poll (a step shorter than the polling interval cannot be resolved).

    >>> marks = [{"lines": 1, "cpu": 20.0}, {"lines": 2, "cpu": 29.0}, {"lines": 4, "cpu": 41.5}]
    >>> intervals(marks, [1, 2, 3], "cpu")
    [9.0, 12.5, None]
    """
    spans = [(first_seen(marks, line - 1), first_seen(marks, line)) for line in lines]
    return [None if start is end else end[key] - start[key] for start, end in spans]


def median_of(steps: list[dict], key: str, skip_first: bool) -> float | None:
    """Median of `key` over step records ({"step": k, key: ...}, pooled over rounds); steps 2..N when skip_first.

    >>> median_of([{"step": 1, "s": 9.0}, {"step": 2, "s": 2.0}, {"step": 3, "s": 4.0}], "s", skip_first=True)
    3.0
    """
    values = [s[key] for s in steps if s.get(key) is not None and not (skip_first and s["step"] == 1)]
    return statistics.median(values) if values else None


def mean_or_none(values: list) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is 0."""
    return ours / theirs if ours is not None and theirs else None


def summarise(runs: list[dict], steps: int) -> dict:
    """Per-side medians (steps 2..N of every round as the headline, all steps beside it), peak memory
    (max over rounds), tokens and reward per step (mean over rounds), ratios ours / TRL and the targets."""
    skip_first = steps > 1
    summary = {"median_over": f"steps 2..{steps} of every round" if skip_first else "all steps of every round"}
    for side in ("ours", "trl"):
        side_runs = [r for r in runs if r["side"] == side]
        step_records = [s for r in side_runs for s in r["steps"]]
        by_step = {k: [s for s in step_records if s["step"] == k] for k in range(1, steps + 1)}
        summary[side] = {
            "rounds": len(side_runs),
            "wall_seconds_per_step": median_of(step_records, "wall_seconds", skip_first),
            "cpu_seconds_per_step": median_of(step_records, "cpu_seconds", skip_first),
            "wall_seconds_per_step_all_steps": median_of(step_records, "wall_seconds", False),
            "cpu_seconds_per_step_all_steps": median_of(step_records, "cpu_seconds", False),
            "peak_rss_gb": max((r["peak_rss_train_gb"] for r in side_runs), default=None),
            "peak_rss_overall_gb": max((r["peak_rss_overall_gb"] for r in side_runs), default=None),
            "peak_tree_rss_gb": max((r["peak_tree_rss_gb"] for r in side_runs), default=None),
            "generated_tokens_per_step": mean_or_none([s["generated_tokens"] for s in step_records]),
            "reward_per_step": [mean_or_none([s["reward"] for s in by_step[k]]) for k in by_step],
        }
    ours, trl = summary["ours"], summary["trl"]
    summary["ratio"] = {
        "wall": ratio(ours["wall_seconds_per_step"], trl["wall_seconds_per_step"]),
        "cpu": ratio(ours["cpu_seconds_per_step"], trl["cpu_seconds_per_step"]),
        "memory": ratio(ours["peak_rss_gb"], trl["peak_rss_gb"]),
        "generated_tokens": ratio(ours["generated_tokens_per_step"], trl["generated_tokens_per_step"]),
    }
    summary["targets"] = {
        f"time_at_most_{TIME_TARGET}x": summary["ratio"]["wall"] is not None
        and summary["ratio"]["wall"] <= TIME_TARGET,
        f"memory_at_most_{MEMORY_TARGET}x": summary["ratio"]["memory"] is not None
        and summary["ratio"]["memory"] <= MEMORY_TARGET,
    }
    return summary


def format_table(summary: dict) -> str:
    """The printed summary: one row per side, then the ratios and whether the targets are met."""

    def number(value, digits=2):
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [f"{'side':<6}{'s/step wall':>13}{'CPU s/step':>12}{'peak RSS GB':>13}{'tokens/step':>13}  reward per step"]
    for side in ("ours", "trl"):
        s = summary[side]
        rewards = " ".join(number(r, 3) for r in s["reward_per_step"])
        lines.append(
            f"{side:<6}{number(s['wall_seconds_per_step'], 1):>13}{number(s['cpu_seconds_per_step'], 1):>12}"
            f"{number(s['peak_rss_gb']):>13}{number(s['generated_tokens_per_step'], 0):>13}  {rewards}"
        )
    r, t = summary["ratio"], summary["targets"]
    verdict = lambda met: "met" if met else "NOT met"  # noqa: E731
    lines.append(
        f"ours/TRL: time {number(r['wall'])}x "
        f"(target <= {TIME_TARGET}x: {verdict(t[f'time_at_most_{TIME_TARGET}x'])}), "
        f"CPU {number(r['cpu'])}x, memory {number(r['memory'])}x (target <= {MEMORY_TARGET}x: "
        f"{verdict(t[f'memory_at_most_{MEMORY_TARGET}x'])}), generated tokens {number(r['generated_tokens'])}x"
    )
    lines.append(
        f"medians over {summary['median_over']} (step 1 includes warm-up); all steps: ours "
        f"{number(summary['ours']['wall_seconds_per_step_all_steps'], 1)} s, "
        f"TRL {number(summary['trl']['wall_seconds_per_step_all_steps'], 1)} s"
    )
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented JSON, atomically (a killed run never leaves half a results file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(staging, path)


def mismatches(stop_strings: list[str], precision: str = "fp32") -> list[str]:
    """Every setting that differs between the two sides (see the module docstring); one line each."""
    found = [
        "sampler: eval.HFSampler (one prefill per prompt, KV cache repeated G times, finished rows leave the batch) "
        "vs TRL model.generate (each prompt prefilled G times, rows decode until the last one ends); different random "
        "streams, so completions, lengths and rewards differ",
        "old log-probs: matched (one optimizer step per iteration: both use the detached log-probs of the update's "
        "own forward pass, no separate no-grad pass)",
        "advantages: grpo_baseline.py (r - mean) / (population std + 1e-8) then whitened over the batch's tokens; TRL "
        "(scale_rewards='group') (r - mean) / (Bessel std + 1e-4), no whitening (not configurable in TRL)",
        "loss normalisation: matched (TRL loss_type='dapo': summed token loss / completion tokens of the whole "
        "generation batch = grpo_baseline.py's batch_tokens)",
        "log-probs: TRL uses a fused tiled LM head and also computes entropies; grpo_baseline.py runs the LM head on "
        "chunks of 512 response positions, kept for backward while a micro-batch's logits hold at most 2**28 entries "
        "and recomputed in backward above that",
        "prompts and padding in the update: grpo_baseline.py runs each distinct prompt of a micro-batch once and its "
        "completions on its KV cache (not under gradient checkpointing), micro-batches of whole groups or of similar "
        "length (whichever computes fewer positions), padded to their own longest; TRL runs every prompt once per "
        "completion and pads every micro-batch to the longest completion of the generation batch",
        "optimizer: both torch.optim.AdamW, betas 0.9/0.999, eps 1e-8, weight decay 0, clip 1.0 "
        "(TRL optim='adamw_torch'; "
        "TRL's default is adamw_torch_fused)",
        "schedule: both linear decay from lr to 0 over --steps steps, no warmup (grpo_baseline.py --warmup-ratio 0, "
        "it has no constant schedule; TRL lr_scheduler_type='linear', warmup_steps 0)",
        (
            "precision: fp32 on both (TRL bf16=False; TRL's default is bf16)"
            if precision == "fp32"
            else "precision: bf16 autocast over fp32 weights on both (grpo_baseline.py --precision bf16, TRL bf16=True)"
        )
        + "; gradient checkpointing as --gradient-checkpointing "
        "on both (TRL's default is on)",
        "evaluation/checkpoint: grpo_baseline.py evaluates 1 question before and after training and saves a checkpoint "
        "at the end (outside the per-step times, inside 'overall' memory); TRL neither",
    ]
    if stop_strings:
        found.append(
            f"stop strings: grpo_baseline.py also stops at {stop_strings} (model without chat template); "
            "TRL at EOS only"
        )
    return found


# ----------------------------------------------------------------------------------------------
# TRL side (runs in its own process: python -m experiments.trl_side_by_side --side trl --child-out ...)


def run_trl(args: Args) -> None:
    import datasets
    import torch
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from plumbing import models, tasks
    from plumbing.precision import cpu_description

    model, tokenizer = models.load_model(args.model, dtype=torch.float32, device="cpu")
    train_examples = tasks.load_task(args.task, "train", seed=args.seed, tokenizer=tokenizer)
    step_questions = prompts_for_steps(train_examples, args.questions, args.steps, args.seed)
    for example in {id(q): q for step in step_questions for q in step}.values():
        trl_ids = tokenizer(text=[example.prompt])["input_ids"][0]  # what TRL does with a standard prompt
        if list(trl_ids) != example.prompt_ids:
            raise SystemExit(
                f"TRL would tokenize the prompt to other ids than grpo_baseline.py ({list(trl_ids)[:8]}... vs "
                f"{example.prompt_ids[:8]}...): the two sides would not train on the same prompts"
            )
    # Row order = step order; shuffle_dataset=False and one generation per step make step k train on rows of step k.
    dataset = datasets.Dataset.from_list(
        [{"prompt": q.prompt, "answer": q.answer, "question": q.question} for step in step_questions for q in step]
    )
    eos = models.eos_ids(model, tokenizer)
    seen_questions = []

    def graded_answer(prompts, completions, completion_ids, answer, question, **kwargs):
        """tasks.grade on the completion text; a completion that did not end with EOS scores 0 (as in
        grpo_baseline.py)."""
        seen_questions.append(question[:: args.group_size])
        scores = tasks.grade(completions, answer, args.task)
        return [s if ids and ids[-1] in eos else 0.0 for s, ids in zip(scores, completion_ids)]

    progress_path = Path(args.child_out).with_suffix(".progress.jsonl")

    class StepTimer(transformers.TrainerCallback):
        """Wall and process CPU seconds of each optimizer step; one progress record per step for the parent."""

        def __init__(self):
            self.steps, self.logs = [], []

        def record(self, entry: dict) -> None:
            with progress_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

        def on_train_begin(self, args_, state, control, **kwargs):
            self.record({"event": "train_begin"})

        def on_step_begin(self, args_, state, control, **kwargs):
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args_, state, control, **kwargs):
            entry = {
                "event": "step_end",
                "step": state.global_step,
                "wall_seconds": time.perf_counter() - self.wall,
                "cpu_seconds_in_process": time.process_time() - self.cpu,
            }
            self.steps.append(entry)
            self.record(entry)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            self.logs.append({"step": state.global_step, **(logs or {})})

    batch = args.questions * args.group_size
    if batch % args.micro_batch_size:
        raise SystemExit(f"--micro-batch-size ({args.micro_batch_size}) must divide questions x group size ({batch})")
    config = GRPOConfig(
        output_dir=str(Path(args.child_out).with_suffix(".trainer")),
        max_steps=args.steps,
        seed=args.seed,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=batch // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        warmup_steps=0,
        bf16=args.precision == "bf16",
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        gradient_checkpointing=args.gradient_checkpointing,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[graded_answer],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()

    logs = {entry["step"]: entry for entry in timer.logs if "reward" in entry}
    steps = []
    for entry in timer.steps:
        log = logs.get(entry["step"], {})
        steps.append(
            {
                **entry,
                "reward": log.get("reward"),
                "truncation_rate": log.get("completions/clipped_ratio"),
                "generated_tokens": log["completions/mean_length"] * batch
                if "completions/mean_length" in log
                else None,
                "trl_step_time": log.get("step_time"),
            }
        )
    write_json(
        Path(args.child_out),
        {
            "steps": steps,
            "logs": timer.logs,
            "questions_per_step": seen_questions,
            "ru_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
            "torch_threads": torch.get_num_threads(),
            "cpu": cpu_description(),
            "stop_strings": tasks.stop_strings(args.task, tokenizer),
            "versions": {
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "datasets": datasets.__version__,
            },
            "config": {k: v for k, v in config.to_dict().items() if k in TRL_SETTINGS_RECORDED},
        },
    )


# ----------------------------------------------------------------------------------------------
# Parent: start one side, watch it, collect its per-step records


def vm_hwm_bytes(pid: int) -> int | None:
    """The kernel's peak resident set size of a process (Linux /proc; None elsewhere or once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def watch(command: list[str], env: dict, log_path: Path, record_files, poll_seconds: float) -> tuple[list[dict], dict]:
    """Run `command` and observe the training process until it exits: every poll, its CPU seconds, memory
    high-water mark and process-tree RSS, and a mark each time the JSONL files `record_files()` hold more
    complete lines. At exit, its own rusage (os.wait4: this child only) gives exact totals.
    Returns (marks, totals); stops with the tail of the log if the command fails."""
    import psutil

    started = time.perf_counter()
    marks, peak_tree, peak_hwm, seen = [], 0, 0, 0

    def lines_now() -> int:
        return sum(p.read_text().count("\n") for p in record_files() if p.exists())

    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watched = psutil.Process(process.pid)
        try:
            while True:
                try:
                    cpu = sum(watched.cpu_times()[:2])  # user + system of the training process itself
                    rss = watched.memory_info().rss
                    hwm = vm_hwm_bytes(process.pid) or rss
                    for child in watched.children(recursive=True):
                        try:
                            rss += child.memory_info().rss
                        except psutil.Error:
                            pass
                    peak_tree, peak_hwm = max(peak_tree, rss), max(peak_hwm, hwm)
                    lines = lines_now()
                    if lines > seen:
                        seen = lines
                        marks.append({"lines": lines, "wall": time.perf_counter() - started, "cpu": cpu, "hwm": hwm})
                except psutil.Error:
                    pass  # exited between two reads: os.wait4 below has it
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    process.returncode = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(poll_seconds)
        except BaseException:  # interrupted: do not leave a training process running
            process.kill()
            process.wait()
            raise
    if process.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(
            f"{' '.join(command[:3])} ... failed with exit code {process.returncode}; last lines of {log_path}:\n{tail}"
        )
    exit_cpu, exit_hwm = usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # ru_maxrss in KiB on Linux
    if lines_now() > seen:  # records written after the last poll
        marks.append({"lines": lines_now(), "wall": time.perf_counter() - started, "cpu": exit_cpu, "hwm": exit_hwm})
    totals = {
        "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": exit_cpu,
        "peak_rss_overall_gb": max(peak_hwm, exit_hwm) / 2**30,
        "peak_tree_rss_gb": peak_tree / 2**30,
    }
    return marks, totals


def run_ours(args: Args, work: Path, round_index: int, env: dict) -> dict:
    """One grpo_baseline.py run of --steps iterations; per-step records from its metrics.jsonl."""
    output_dir = work / f"ours_r{round_index}"
    command = [
        sys.executable,
        str(REPO / "grpo_baseline.py"),
        "--model",
        args.model,
        "--task",
        args.task,
        "--seed",
        str(args.seed),
        "--exp-name",
        f"trl_side_by_side_r{round_index}",
        "--output-dir",
        str(output_dir),
        "--backend",
        "hf",
        "--iterations",
        str(args.steps),
        "--questions",
        str(args.questions),
        "--group-size",
        str(args.group_size),
        "--batch-size",
        str(args.questions * args.group_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--epochs",
        "1",
        "--beta",
        "0",
        "--lr",
        str(args.lr),
        "--warmup-ratio",
        "0",
        "--temperature",
        str(args.temperature),
        "--top-p",
        "1.0",
        "--context",
        str(args.context),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--eval-every",
        str(NEVER),
        "--eval-limit",
        "1",
        "--eval-samples",
        "1",
        "--save-every",
        str(NEVER),
        "--save-samples",
        str(args.steps),
        "--save-questions",
        str(args.questions),  # the last step's questions, for the prompt check
        "--gradient-checkpointing",
        str(bool(args.gradient_checkpointing)),
        "--precision",
        args.precision,  # TRL's bf16 flag follows it (its bf16 default is turned off for fp32)
    ]
    marks, totals = watch(
        command,
        env,
        work / f"ours_r{round_index}.log",
        lambda: list(output_dir.glob("*/metrics.jsonl")),
        args.poll_seconds,
    )
    run_dir = next(output_dir.glob("*/metrics.jsonl")).parent
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [i for i, r in enumerate(records) if "charts/reward" in r]
    cpu, wall_polled = intervals(marks, train_lines, "cpu"), intervals(marks, train_lines, "wall")
    steps = []
    for k, (line, cpu_seconds, wall) in enumerate(zip(train_lines, cpu, wall_polled), 1):
        r = records[line]
        wall_seconds = r.get("time/iteration_seconds", r["time/rollout_seconds"] + r["time/update_seconds"])
        tokens = r.get("charts/generated_tokens", r["charts/response_tokens"] * args.questions * args.group_size)
        steps.append(
            {
                "step": k,
                "wall_seconds": wall_seconds,
                "cpu_seconds": cpu_seconds,
                "wall_seconds_polled": wall,
                "wall_source": "time/iteration_seconds"
                if "time/iteration_seconds" in r
                else "time/rollout_seconds + time/update_seconds",
                "rollout_seconds": r["time/rollout_seconds"],
                "update_seconds": r["time/update_seconds"],
                "generated_tokens": tokens,
                "reward": r["charts/reward"],
                "truncation_rate": r["charts/truncation_rate"],
            }
        )
    samples = run_dir / "samples" / f"iter_{args.steps}.jsonl"
    last_questions = (
        [json.loads(line)["question"] for line in samples.read_text().splitlines()][:: args.group_size]
        if samples.exists()
        else None
    )
    return {
        "side": "ours",
        "round": round_index,
        "steps": steps,
        "command": command[1:],
        "peak_rss_train_gb": first_seen(marks, train_lines[-1])["hwm"] / 2**30,
        **totals,
        "last_step_questions": last_questions,
    }


def run_trl_child(args: Args, work: Path, round_index: int, env: dict) -> dict:
    """One TRL run of --steps optimizer steps in a child process; per-step records from its callback."""
    child_out = work / f"trl_r{round_index}.json"
    command = [sys.executable, "-m", "experiments.trl_side_by_side", "--side", "trl", "--child-out", str(child_out)]
    for name, value in asdict(args).items():
        if name in ("side", "child_out", "out", "rounds", "threads", "poll_seconds"):
            continue
        flag = "--" + name.replace("_", "-")
        command += (
            ([flag] if value else [f"--no-{name.replace('_', '-')}"]) if isinstance(value, bool) else [flag, str(value)]
        )
    progress = child_out.with_suffix(".progress.jsonl")
    marks, totals = watch(command, env, work / f"trl_r{round_index}.log", lambda: [progress], args.poll_seconds)
    child = json.loads(child_out.read_text())
    step_lines = list(range(1, len(child["steps"]) + 1))  # line 0 is train_begin, line k is the end of step k
    cpu, wall_polled = intervals(marks, step_lines, "cpu"), intervals(marks, step_lines, "wall")
    steps = [{**s, "cpu_seconds": c, "wall_seconds_polled": w} for s, c, w in zip(child["steps"], cpu, wall_polled)]
    return {
        "side": "trl",
        "round": round_index,
        "steps": steps,
        "command": command[1:],
        "peak_rss_train_gb": first_seen(marks, step_lines[-1])["hwm"] / 2**30,
        **totals,
        "ru_maxrss_gb": child["ru_maxrss_gb"],
        "last_step_questions": child["questions_per_step"][-1],
        "questions_per_step": child["questions_per_step"],
        "child": {k: child[k] for k in ("torch_threads", "cpu", "stop_strings", "versions", "config")},
    }


def main(args: Args) -> None:
    if args.side == "trl":
        return run_trl(args)
    import importlib.util

    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("psutil") is None:
        raise SystemExit(
            "this benchmark needs TRL and psutil: pip install -r requirements-bench.txt (see the docstring)"
        )
    if args.steps < 1 or args.rounds < 1 or (args.questions * args.group_size) % args.micro_batch_size:
        raise SystemExit(
            "--steps and --rounds must be positive and --micro-batch-size must divide questions x group size"
        )
    from plumbing.runs import code_state

    code = code_state()  # the code the figures come from: commit, tree_modified
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"}
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    out = Path(args.out)
    runs = []
    with tempfile.TemporaryDirectory(prefix="trl_side_by_side_") as tmp:  # checkpoints and logs; removed at the end
        work = Path(tmp)
        for round_index in range(1, args.rounds + 1):
            for side, run in (("ours", run_ours), ("trl", run_trl_child)):
                print(f"round {round_index}/{args.rounds}: {side} ({args.steps} steps) ...", flush=True)
                runs.append(run(args, work, round_index, env))
                walls = ", ".join(f"{s['wall_seconds']:.1f}" for s in runs[-1]["steps"])
                print(f"  s/step wall: {walls}; peak RSS {runs[-1]['peak_rss_train_gb']:.2f} GB", flush=True)

    summary = summarise(runs, args.steps)
    trl_run = next(r for r in runs if r["side"] == "trl")
    same_prompts = all(r["last_step_questions"] == trl_run["last_step_questions"] for r in runs)
    result = {
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "cpu": trl_run["child"]["cpu"],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
            "torch_threads_trl_child": trl_run["child"]["torch_threads"],
        },
        "code": code,
        "versions": trl_run["child"]["versions"],  # both sides run with this interpreter
        "settings": {k: v for k, v in asdict(args).items() if k not in ("side", "child_out")},
        "trl_config": trl_run["child"]["config"],
        "mismatches": mismatches(trl_run["child"]["stop_strings"], args.precision),
        "same_prompts_last_step": same_prompts,
        "measurement": {
            "wall_seconds": "ours: grpo_baseline.py time/iteration_seconds; "
            "TRL: TrainerCallback on_step_begin -> on_step_end",
            "cpu_seconds": "both: user+system CPU of the training process, polled, "
            "between consecutive per-step records "
            "(TRL's in-process time.process_time() is cpu_seconds_in_process)",
            "peak_rss_gb": "VmHWM of the training process when its last step's record appeared (overall: at exit)",
        },
        "summary": summary,
        "runs": runs,
    }
    write_json(out, result)
    print(format_table(summary))
    if not same_prompts:
        print(
            "WARNING: the two sides did not train on the same questions at the last step "
            "(see runs[*].last_step_questions)"
        )
    print(f"-> {out}")


if __name__ == "__main__":  # the guard matters: tasks.grade starts forkserver workers that import this file
    main(ranges.cli(Args))
