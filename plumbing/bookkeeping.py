"""What every main() does around the algorithm, written once: the run's start (seed, precision, run directory,
newest checkpoint, finished-run check, memory plan) and, per iteration, the bar, the clock, the time budget, the
metrics log and progress line, sample files, evaluation, the guard against non-finite losses and the closing line.

    run = bookkeeping.start_run(args, device)
    args = replace(args, **run.plan.settings())
    book = bookkeeping.Loop(run, args, eval_task, evaluate)
    for iteration in book.iterations():
        with book.timed("rollout"):
            ...
        seconds, last = book.end_iteration()
        book.log(iteration, metrics, line)
        if book.due(iteration, args.eval_every, last):
            book.evaluate(iteration)
    return book.finish()
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import tqdm

from plumbing import UsageError, checkpoints, cli, distributed, memory, rollout_correction, runs
from plumbing.precision import Precision, choose_precision


@dataclass
class Run:
    """What a training run starts from (start_run)."""

    dir: Path
    """the run directory (new, or the --resume run's)"""
    checkpoint: Path | None
    """its newest intact checkpoint (None: a new run, or one that stopped before its first)"""
    state: dict | None
    """that checkpoint's trainer_state.pt: optimizer, scheduler, iteration and what the script adds"""
    precision: Precision
    """bf16 autocast or fp32, as chosen for this device"""
    plan: memory.Plan | None
    """the `auto` memory settings resolved for this device (memory.size_run)"""
    finished: dict | None = None
    """a resumed run already at --iterations: its summary, and nothing else is set or written"""


def start_run(args, device, second_model: bool = False) -> Run:
    """Seed torch, choose and print the precision, find the run (--resume: its settings checked, its newest
    checkpoint), stop at a run that already finished, size the `auto` memory settings for this device and open the
    run directory (lock, args.json as given, this start in starts.jsonl). main() then applies the plan to its args.
    second_model: the script trains a second model in full beside the policy (memory.plan sizes for both)."""
    torch.manual_seed(args.seed)
    precision = choose_precision(args.precision, device)
    distributed.print0(precision.line)
    run_dir, checkpoint, first_start = runs.locate_run(args)
    if (finished := runs.finished_run(run_dir, checkpoint, args.iterations)) is not None:
        return Run(run_dir, checkpoint, None, precision, None, finished)
    plan = memory.size_run(args, device, precision, str(checkpoint or args.model), first_start, second_model)
    run_dir = runs.open_run(run_dir, args, precision.line, device, plan)
    state = checkpoints.load_trainer_state(checkpoint) if checkpoint else None
    return Run(run_dir, checkpoint, state, precision, plan)


# Iterations a second no run reaches (a rollout and an update: a random 2-layer test model with 4-token responses
# runs 16 a second on a CPU): what a budget holds at most.
FASTEST_ITERATIONS_PER_SECOND = 100


def schedule_line(args, first: int, train_seconds: float = 0.0) -> str | None:
    """With --max-minutes: one line when the learning-rate schedule, planned for --iterations (make_optimizer), cannot
    finish its warmup within what is left of the budget even at 100 iterations a second, so the rate stays a sliver of
    --lr all run; None otherwise, and always without --max-minutes. `first`: the iteration this start trains first;
    `train_seconds`: the budget a resumed run spent already.

    The schedule is stated, not planned for the budget: how many iterations a budget holds is known only once they
    run, and a schedule planned from timings would train the same command otherwise on another machine, under another
    load or after a resume.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(max_minutes=30, iterations=10**9, warmup_ratio=0.03, lr=1e-6)
    >>> schedule_line(args, 1).split(", so ")[1]  # 30 minutes: at most 180,000 of the warmup's 30,000,000 iterations
    'the rate stays below 6e-09; give --iterations about as many as fit in the budget, or --warmup-ratio 0'
    >>> schedule_line(SimpleNamespace(max_minutes=30, iterations=1000, warmup_ratio=0.03, lr=1e-6), 1) is None
    True
    """
    if args.max_minutes is None:
        return None
    # Iterations of warmup: at least this many, whatever the optimizer steps per iteration (int(ratio x steps)).
    warmup = int(args.warmup_ratio * args.iterations)
    plausible = int(max(0.0, 60 * args.max_minutes - train_seconds) * FASTEST_ITERATIONS_PER_SECOND)
    if first - 1 + plausible >= warmup:
        return None
    return (
        f"--max-minutes {args.max_minutes:g} ends the run inside the learning-rate warmup: the schedule is planned for "
        f"--iterations {args.iterations:,}, whose first {warmup:,} warm up to --lr {args.lr:g} (--warmup-ratio "
        f"{args.warmup_ratio:g}), and the budget holds at most {plausible:,} more even at 100 iterations a second, so "
        f"the rate stays below {args.lr * (first - 1 + plausible) / warmup:.2g}; give --iterations about as many as "
        "fit in the budget, or --warmup-ratio 0"
    )


class Loop:
    """The iterations of a run and their bookkeeping. `evaluate()` returns the policy's eval/... metrics (the
    script's call of eval.evaluate_policy); it runs before the first iteration (--eval-before, new runs only), every
    --eval-every iterations and at the last one."""

    def __init__(self, run: Run, args, eval_task: str, evaluate: Callable[[], dict]):
        self.run, self.args, self.eval_task, self.evaluate_policy = run, args, eval_task, evaluate
        self.first = run.state["iteration"] + 1 if run.state else 1
        self.log_file = runs.RunLog(run.dir, self.first, args)
        if (line := schedule_line(args, self.first, self.log_file.train_seconds)) is not None:
            distributed.print0(line)
        self.accuracy_before = self.accuracy_after = None
        self.guard = NonFiniteGuard()  # skips non-finite steps; three in a row end the run
        self.sampler_warned = False  # the sampler-vs-trainer warning was printed (rollout_correction.sampler_warning)
        self.seconds: dict[str, float] = {}
        self.started = time.monotonic()
        self.iteration = 0
        self.last = False  # set by end_iteration: the loop ends after this iteration
        self.progress = None

    def iterations(self) -> Iterator[int]:
        """The iterations still to train, under a progress bar. Each ends with a barrier (under torchrun no rank
        runs ahead of the checkpoint); the last (--iterations, or --max-minutes spent) ends the loop."""
        if self.first == 1 and self.args.eval_before:
            self.evaluate(0)
            self.accuracy_before = self.accuracy_after
        self.progress = tqdm.tqdm(
            range(self.first, self.args.iterations + 1),
            desc="iterations",
            initial=self.first - 1,
            total=self.args.iterations,
            disable=distributed.rank() > 0,
        )
        for iteration in self.progress:
            cli.raise_if_stopped()  # a stop signal dropped where it landed ends the run here
            self.iteration, self.seconds, self.started = iteration, {}, time.monotonic()
            yield iteration
            distributed.barrier()
            if self.last:  # the bar counts an iteration when the next one is asked for: show this one done, end it
                self.progress.n = iteration
                self.progress.close()
                return

    @contextlib.contextmanager
    def timed(self, name: str):
        """Time the block as this iteration's `name` seconds (time/<name>_seconds)."""
        cli.raise_if_stopped()
        started = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - started
        cli.raise_if_stopped()

    def end_iteration(self) -> tuple[dict[str, float], bool]:
        """End the iteration's training: stop its clock (evaluation and checkpoint are not counted) and decide whether
        it is the last (--iterations reached or --max-minutes spent), the same on every rank; iterations() ends the
        loop after it. Returns the timed blocks with "iteration" and the run's "train" total, and `last`."""
        self.seconds["iteration"] = time.monotonic() - self.started
        self.log_file.train_seconds += self.seconds["iteration"]
        self.seconds["train"] = self.log_file.train_seconds
        budget = self.args.max_minutes
        self.last = distributed.broadcast(
            self.iteration == self.args.iterations
            or (budget is not None and self.log_file.train_seconds >= 60 * budget)
        )
        return dict(self.seconds), self.last

    @staticmethod
    def due(iteration: int, every: int, last: bool) -> bool:
        """Every `every` iterations, and at the last one."""
        return iteration % every == 0 or last

    def log(self, iteration: int, metrics: dict, line: str) -> None:
        """Write the iteration's metrics (metrics.jsonl, TensorBoard, W&B), show its reward on the bar and print its
        one-line summary (rank 0)."""
        self.log_file.write(iteration, metrics)
        self.progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}")
        distributed.print0(line, tqdm.tqdm.write)
        if not self.sampler_warned and (warning := rollout_correction.sampler_warning(iteration, metrics)):
            distributed.print0(warning, tqdm.tqdm.write)  # once per run: the metric goes on showing it
            self.sampler_warned = True

    def saves_samples(self, iteration: int) -> bool:
        """--save-samples is due (on every rank: with --fsdp what the records need takes every rank's pass)."""
        every = self.args.save_samples
        return bool(every) and iteration % every == 0

    def write_samples(self, iteration: int, records: list[dict]) -> None:
        """RUN/samples/iter_<iteration>.jsonl: rank 0 writes its own questions' records."""
        if distributed.rank() == 0:
            runs.write_samples(self.run.dir / "samples" / f"iter_{iteration}.jsonl", records)

    def evaluate(self, iteration: int) -> None:
        """Evaluate the policy on the held-out questions and log it at `iteration` (0: before training)."""
        evaluation = self.evaluate_policy()
        self.log_file.write(iteration, evaluation)
        self.accuracy_after = evaluation["eval/accuracy"]

    def finish(self) -> dict:
        """Close the log, write summary.json, print the closing line; returns the summary."""
        return runs.finish_run(self.run.dir, self.log_file, self.accuracy_before, self.accuracy_after, self.eval_task)


def loss_metrics(update_stats: list[dict]) -> dict:
    """Every statistic the optimizer steps report (the script's update: loss, pg_loss, kl, ... and whatever its loss
    adds), each averaged over the steps that report it (no step taken: nothing), as losses/<key>; the loss's KL term
    (summed over a sequence's masked tokens, mean over sequences) is named losses/kl_per_sequence, so that it is not
    taken for the per-token KL other trainers log as their KL (losses/kl_per_token here).

    >>> loss_metrics([{"loss": 1.0, "kl": 0.5, "my_stat": 2.0}, {"loss": 3.0, "kl": 0.5, "my_stat": 4.0}])
    {'losses/loss': 2.0, 'losses/kl_per_sequence': 0.5, 'losses/my_stat': 3.0}
    """
    keys = dict.fromkeys(key for stats in update_stats for key in stats)  # first-seen order
    averages = {}
    for key in keys:
        values = [stats[key] for stats in update_stats if key in stats]
        averages[f"losses/{'kl_per_sequence' if key == 'kl' else key}"] = sum(values) / len(values)
    return averages


def whitening_metrics(raw: torch.Tensor, whitened: torch.Tensor, mask: torch.Tensor) -> dict:
    """The iteration's loss-masked token count and how many of those tokens had advantage 0 before the whitening
    (--whiten) and a positive one after it (centring moves them when the masked mean is negative), over every rank's
    tokens; `raw`, `whitened`, `mask`: this rank's flat tokens.

    >>> raw, whitened = torch.tensor([0.0, 0.0, -3.0, 4.0]), torch.tensor([0.7, 0.7, -1.4, 3.5])
    >>> whitening_metrics(raw, whitened, torch.tensor([1, 1, 1, 0]))
    {'charts/loss_mask_tokens': 3, 'charts/zero_advantages_made_positive': 2}
    """
    mask = mask.bool()
    counts = torch.stack([mask.sum(), ((raw == 0) & (whitened > 0) & mask).sum()])
    masked, made_positive = distributed.all_sum(counts).tolist()
    return {"charts/loss_mask_tokens": masked, "charts/zero_advantages_made_positive": made_positive}


TINY_TEMPERATURE = 0.01  # below it, logits / temperature overflow where a logit is large (named as the likely cause)
FP32_HINT = "compute in fp32 (--precision fp32) if it ran in bf16"


def non_finite_cause(
    stats: dict, fix: str = "lower --lr", temperature: float | None = None, causes: dict[str, str] | None = None
) -> str:
    """What a non-finite optimizer step points to, from which of its stats are inf or nan, and the setting to change.
    The scripts' losses are pg_loss + beta * kl, with both log-ratios clamped to [-10, 10], so a step size cannot
    overflow the ratio: a term that is not finite names the input that is not. `causes`: what a loss term the script
    adds means when it is not finite, and the fix ({stat: cause}), read after kl and before pg_loss; a gradient norm
    `<name>_grad_norm` is <name>'s. `fix`: the caller's answer when the stats name nothing; a `temperature` below
    TINY_TEMPERATURE comes first, since every log-prob divides the logits by it.

    >>> nan = float("nan")
    >>> cause = non_finite_cause({"loss": nan, "pg_loss": nan, "kl": nan})
    >>> cause.split(": ")[0], "lower --lr" in cause, "--precision fp32" in cause
    ('pg_loss = nan and kl = nan', True, True)
    >>> non_finite_cause({"loss": float("inf"), "pg_loss": 0.5, "kl": 3.0})
    'loss = pg_loss + beta * kl = inf while pg_loss and kl are finite: lower --beta'
    >>> non_finite_cause({"loss": nan, "pg_loss": nan, "kl": 0.1, "aux": nan}, causes={"aux": "lower --aux-lr"})
    'aux = nan, and pg_loss with it: lower --aux-lr'
    >>> non_finite_cause({"loss": 0.5, "pg_loss": 0.5, "kl": 0.1, "aux_grad_norm": nan}).split(": ")[0]
    "the losses are finite but the aux's gradient norm is not"
    >>> non_finite_cause({"loss": nan}, "lower --lr")
    'lower --lr'
    """
    if temperature is not None and temperature < TINY_TEMPERATURE:
        return (
            f"--temperature {temperature:g} divides the logits by so little that the log-probs overflow: "
            f"sample at {TINY_TEMPERATURE:g} or above"
        )
    bad = {key: value for key, value in stats.items() if isinstance(value, float) and not math.isfinite(value)}
    if "pg_loss" in bad and "kl" in bad:
        return (
            f"pg_loss = {bad['pg_loss']:g} and kl = {bad['kl']:g}: the policy's log-probs are not finite, its weights "
            f"diverged or its logits overflow: lower --lr, or {FP32_HINT}"
        )
    if "kl" in bad:
        return (
            f"kl = {bad['kl']:g} while pg_loss is finite: the reference model's log-probs are not finite: "
            f"{FP32_HINT}, or check the reference model"
        )
    for key, cause in (causes or {}).items():
        if key in bad:
            also = ", and pg_loss with it" if "pg_loss" in bad else ""
            return f"{key} = {bad[key]:g}{also}: {cause}"
    if "pg_loss" in bad:
        return (
            f"pg_loss = {bad['pg_loss']:g} while kl is finite: the rollout's log-probs (old_logps) or the advantages "
            f"are not finite: {FP32_HINT}"
        )
    if "loss" in bad and "pg_loss" in stats and "kl" in stats:
        return f"loss = pg_loss + beta * kl = {bad['loss']:g} while pg_loss and kl are finite: lower --beta"
    norms = [key for key in bad if key == "grad_norm" or key.endswith("_grad_norm")]
    if norms:
        which = "the policy's" if "grad_norm" in norms else f"the {norms[0].removesuffix('_grad_norm')}'s"
        return f"the losses are finite but {which} gradient norm is not: the backward pass overflowed: {FP32_HINT}"
    return fix


class NonFiniteGuard:
    """Skips an optimizer step whose losses are inf or nan; three in a row end the run with one line naming what the
    stats point to and the setting to change (non_finite_cause). The run's loop owns one (bookkeeping.Loop.guard), so
    the count carries across steps and iterations."""

    def __init__(self):
        self.in_a_row = 0  # non-finite steps in a row

    def skips(
        self,
        stats: dict,
        iteration: int,
        keys: tuple[str, ...] = ("loss",),
        fix: str = "lower --lr",
        temperature: float | None = None,
        causes: dict[str, str] | None = None,
    ) -> bool:
        """True when one of this optimizer step's `keys` of stats (its losses; a gradient norm, where the caller
        computed it first) is inf or nan, so the step is skipped; the third in a row raises UsageError (`fix`: the
        setting to change where the stats name nothing; `causes`: non_finite_cause's)."""
        if all(math.isfinite(stats[key]) for key in keys):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        warnings.warn(f"iteration {iteration}: non-finite loss, update skipped")
        if self.in_a_row >= 3:
            cause = non_finite_cause(stats, fix, temperature, causes)
            raise UsageError(f"three non-finite losses in a row: {cause}, or check the model and data")
        return True
