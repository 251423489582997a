"""A training run's directory: found or created, locked (run_lock.py), its args.json and starts.jsonl (every start
and resume), its metrics log, sample files and closing line. It runs no model: what a script saves of its samples
(responses, SPO-tree's nodes) is built by the script; this module writes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from plumbing import UsageError, checkpoints, distributed, files, memory, models, shown
from plumbing.completions import Completion, token_pieces
from plumbing.run_lock import active_run, lock_run, release_run
from plumbing.settings import check_resume_settings, first_start
from plumbing.vllm_preflight import resolve_backend


def code_commit(short: bool = False) -> str | None:
    """The git commit of the code that runs (None outside a checkout): recorded by runs and benchmark results."""
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def code_state() -> dict:
    """The code a benchmark's figures came from: {"commit": its short commit, "tree_modified": whether the checkout
    held uncommitted changes (None outside a checkout)}. Every results file records it. New files in a results/
    folder do not count: they are what a run writes (a sweep's earlier cases), not code."""
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=30,
        )
        changes = [line for line in status.stdout.splitlines() if not re.match(r"\?\? (.*/)?results/", line)]
        modified = bool(changes) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        modified = None
    return {"commit": code_commit(short=True), "tree_modified": modified}


def record_start(run_dir: Path, resumed: bool, precision_line: str | None = None, **how) -> None:
    """Append this start or resume (time, command line, commit, the precision chosen, and `how` it runs: world size,
    backend, device) to RUN/starts.jsonl."""
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resumed": resumed,
        "argv": sys.argv,
        "commit": code_commit(),
        "precision": precision_line,
        **how,
    }
    # first: a Ctrl-C from here on names the run
    active_run.update(run_dir=run_dir, script=Path(sys.argv[0]).name, new=not resumed)
    files.append_line(run_dir / "starts.jsonl", entry, "the run's start log")


# ----------------------------------------------------------------------------------------------
# A training run's directory, metrics, samples and closing line (every script's main)


MAX_NAME_PART = 60  # characters of the task and of the experiment name in a run's name (filesystems stop at 255 bytes)


def run_name(task: str, exp_name: str, seed: int, started: int) -> str:
    """A new run's directory name, "<task>__<exp_name>__<seed>__<unix time>" in file-name characters; a task or an
    experiment name longer than MAX_NAME_PART is cut, with a short hash of the whole so that cut names stay apart.

    >>> run_name("rg:chain_sum", "spo_chain", 1, 1700000000)
    'rg-chain_sum__spo_chain__1__1700000000'
    >>> run_name("data/" + "x" * 300 + ".jsonl", "grpo", 1, 1700000000)[45:]
    'xxxxxx-2f7e3b29__grpo__1__1700000000'
    """

    def part(text: str) -> str:
        text = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
        if len(text) <= MAX_NAME_PART:
            return text
        return f"{text[: MAX_NAME_PART - 9]}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"

    return f"{part(task)}__{part(exp_name)}__{seed}__{started}"


# What a run records of its base model and task file at its first start (starts.jsonl), so that a resume may find them
# at a new path: the model's config and weight headers, the task file's bytes.
FINGERPRINTS = {"model": models.fingerprint, "task": files.file_fingerprint}


def locate_run(args) -> tuple[Path, Path | None, dict | None]:
    """Where the run lives and what it starts from, before anything is written: (the run directory, its newest intact
    checkpoint, its first start's record in starts.jsonl). --resume RUN: RUN's settings are checked (only
    RESUMABLE_SETTINGS may change), and a run that stopped before its first checkpoint has none (it starts over). A new
    run: rank 0's name for it (its clock; open_run creates it), no checkpoint, no record."""
    if not args.resume:
        return Path(args.output_dir) / run_name(args.task, args.exp_name, args.seed, int(time.time())), None, None
    run_dir = Path(args.resume)
    if run_dir.is_dir():
        files.refuse_links(run_dir)  # before anything in it is read or written
    checkpoint = checkpoints.latest_checkpoint(run_dir)
    if checkpoint is None and not (run_dir / "args.json").exists():
        raise UsageError(
            f"--resume {run_dir}: no checkpoint found there (expected {run_dir}/checkpoint/trainer_state.pt)"
        )
    # the run owns its settings; only RESUMABLE_SETTINGS may change, and a moved model or task file is checked
    check_resume_settings(args, run_dir, FINGERPRINTS)
    if checkpoint is None:
        distributed.print0(
            f"--resume {run_dir}: no checkpoint: it starts over from --model (its metrics log starts anew)"
        )
    else:  # each rank's questions and seeds depend on the world size (checkpoints from before torchrun: 1)
        state = checkpoints.load_trainer_state(checkpoint, mmap=True)
        planned = files.read_json(run_dir / "args.json", "the run's settings").get("iterations")
        if isinstance(planned, int) and state["iteration"] > planned:
            raise UsageError(
                f"--resume {run_dir}: {checkpoint}/trainer_state.pt says iteration {state['iteration']}, past the "
                f"{planned} its args.json planned: one of the two was edited or comes from another run; restore them "
                "or start a new run"
            )
        distributed.check_world_size(checkpoint, state.get("world_size", 1))
    # A resumed run keeps the sampler batch of its first start (memory.size_run): every rank reads rank 0's record.
    return run_dir, checkpoint, distributed.broadcast(first_record(run_dir) if distributed.rank() == 0 else None)


def open_run(run_dir: Path, args, precision_line: str, device, plan: memory.Plan) -> Path:
    """Open the run locate_run found, on rank 0 (under torchrun the others read the same directory): create a new
    run's directory exclusively (a name already taken gets a suffix), lock the run for this process (lock_run), write
    the settings as given to args.json (`auto` stays auto) and record this start in starts.jsonl with the memory `plan`
    (memory.size_run). Returns the run directory (a suffixed name on every rank)."""
    problem = None
    if distributed.rank() == 0:
        try:
            if not args.resume:
                run_dir = make_new_directory(run_dir)
            lock_run(run_dir)
            given = asdict(args)
            if args.resume:  # a resumed run stays where it is: its args.json keeps the run's own --output-dir
                given["output_dir"] = files.read_json(run_dir / "args.json", "the run's settings")["output_dir"]
            files.write_atomic(run_dir / "args.json", json.dumps(given, indent=1), "the run's settings")
            record_start(
                run_dir,
                resumed=bool(args.resume),
                precision_line=precision_line,
                world_size=distributed.world_size(),
                backend=resolve_backend(args.backend)[0],
                device=str(device) if device is not None else None,
                memory={**plan.settings(), "update_peak_gib": plan.peak_gb, "line": plan.line},
                fingerprints={name: fingerprint(getattr(args, name)) for name, fingerprint in FINGERPRINTS.items()},
            )
        except UsageError as error:
            problem = str(error)
    run_dir, problem = distributed.broadcast((run_dir, problem))  # a suffixed name, or rank 0's error, on every rank
    if problem:
        raise UsageError(problem)
    if distributed.rank() > 0:
        # every rank can name the run when a signal or a dead peer ends it (rank 0 never discards it)
        active_run.update(run_dir=run_dir, script=Path(sys.argv[0]).name, new=False)
    active_run["world_size"] = distributed.world_size()
    return run_dir


def first_record(run_dir: Path) -> dict | None:
    """The first entry of RUN/starts.jsonl (the run's first start), or None; the values a resume reads back from it
    checked within their ranges (settings.first_start)."""
    return first_start(run_dir)


def make_new_directory(run_dir: Path) -> Path:
    """Create a new run directory that no other process has: `run_dir`, else run_dir-2, run_dir-3, ..."""
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--output-dir {run_dir.parent} cannot be created: {error.strerror or error}") from None
    for attempt in range(1, 1000):
        candidate = run_dir if attempt == 1 else run_dir.with_name(f"{run_dir.name}-{attempt}")
        try:
            candidate.mkdir()  # atomic: of two processes asking for one name, exactly one gets it
            return candidate
        except FileExistsError:
            continue
        except OSError as error:
            raise UsageError(f"cannot create the run directory {candidate}: {error.strerror or error}") from None
    raise UsageError(f"{run_dir} and 998 suffixed names are taken: give another --exp-name or --output-dir")


def check_kept_row(row: dict, path: Path, number: int) -> None:
    """A metrics row a resume keeps is read back as data: its iteration must be a whole number and its
    time/train_seconds (the training time the run goes on counting from) a finite number of seconds, else one line
    naming the file and line."""
    iteration = row.get("iteration")
    seconds = row.get("time/train_seconds", 0.0)
    fix = "the log was edited or damaged: restore it, or delete that line and the lines after it"
    if type(iteration) is not int:
        raise UsageError(
            f"{path} line {number}: iteration is {shown(json.dumps(iteration))}, not a whole number; {fix}"
        )
    if type(seconds) not in (int, float) or not 0 <= seconds < math.inf:  # NaN compares False
        raise UsageError(
            f"{path} line {number}: time/train_seconds is {shown(json.dumps(seconds))}, not a number of seconds; {fix}"
        )


class RunLog:
    """The run's metrics.jsonl, TensorBoard and (with --track) W&B. A resumed run drops the metrics of iterations
    after its checkpoint (they are redone) and continues the training-time count of the kept ones."""

    def __init__(self, run_dir: Path, start_iteration: int, args):
        self.path, self.train_seconds, self.writer, self.wandb = run_dir / "metrics.jsonl", 0.0, None, None
        if distributed.rank() > 0:  # under torchrun only rank 0 logs (the metrics are already reduced over ranks)
            return
        from torch.utils.tensorboard import SummaryWriter

        # A resume keeps the iterations before its checkpoint's; a run that starts over (no checkpoint) keeps none.
        records = files.read_log(self.path, "metrics log") if start_iteration > 1 else []
        for number, record in enumerate(records, 1):
            check_kept_row(record, self.path, number)
        kept = [r for r in records if r.get("iteration", 0) < start_iteration]
        files.write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept), "metrics log")
        self.train_seconds = max([r.get("time/train_seconds", 0.0) for r in kept], default=0.0)
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if args.track:
            import wandb

            wandb.init(project="spo", name=run_dir.name, config=asdict(args), dir=str(run_dir), resume="allow")
            self.wandb = wandb

    def write(self, iteration: int, metrics: dict) -> None:
        if self.writer is None:
            return
        files.append_line(self.path, {"iteration": iteration, **metrics}, "metrics log")
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, iteration)
        if self.wandb is not None:
            self.wandb.log(metrics, step=iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def finished_run(run_dir: Path, checkpoint: Path | None, iterations: int) -> dict | None:
    """A resumed run whose checkpoint is at --iterations already: reported, and left as it is (nothing in its directory
    is written); returns its summary. None for a run with iterations still to train."""
    if checkpoint is None or checkpoints.load_trainer_state(checkpoint, mmap=True)["iteration"] < iterations:
        return None
    summary_path = run_dir / "summary.json"
    summary = files.read_json(summary_path, "the run's summary") if summary_path.exists() else {}
    distributed.print0(
        f"{run_dir} finished its {iterations} iteration(s): nothing to train (give --iterations above {iterations} "
        f"to go on); accuracy {summary.get('accuracy_before')} -> {summary.get('accuracy_after')}, left as it is"
    )
    return {"run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoint"), **summary}


def write_samples(path: Path, records: list[dict]) -> None:
    """One JSON record per line (the format viewer.py reads); floats rounded to keep the files small."""

    def rounded(value):
        if isinstance(value, float):
            return round(value, 5)
        if isinstance(value, list):
            return [rounded(v) for v in value]
        if isinstance(value, dict):
            return {key: rounded(v) for key, v in value.items()}
        return value

    files.write_atomic(path, "".join(json.dumps(rounded(r)) + "\n" for r in records), "samples file")


def response_record(
    algorithm: str,
    iteration: int,
    question_index: int,
    question,
    completion: Completion,
    reward: float,
    sample: dict,
    advantages: list[float],
    prob_threshold: float,
    tokenizer,
    cutpoints: list[int] | None = None,
    cutpoint_values: list[float] | None = None,
    values: list[float] | None = None,
) -> dict:
    """One saved response, as viewer.py reads it (grpo_baseline, ppo_baseline, spo_chain): the question (an
    tasks.Example), the response's tokens, p_t (from the sample's old_logps), `advantages` as the script states them,
    the loss mask, and what the algorithm adds (SPO-chain's cutpoints and their values, PPO's values)."""
    return {
        "algorithm": algorithm,
        "iteration": iteration,
        "question_index": question_index,
        "question": question.question,
        "reference": question.answer,
        "prompt": question.prompt,
        "reward": reward,
        "finish_reason": completion.finish_reason,
        "token_ids": completion.ids,
        "tokens": token_pieces(tokenizer, completion.ids),
        "probs": sample["old_logps"].exp().tolist(),
        "advantages": advantages,
        "loss_mask": sample["loss_mask"].tolist(),
        "prob_threshold": prob_threshold,
        "cutpoints": cutpoints,
        "cutpoint_values": cutpoint_values,
        "values": values,
    }


def finish_run(
    run_dir: Path, log: RunLog, accuracy_before: float | None, accuracy_after: float | None, eval_task: str
) -> dict:
    """Close the log, write summary.json and print the one-line result (rank 0 under torchrun)."""
    log.close()
    summary = {
        "run_dir": str(run_dir),
        "checkpoint": str(run_dir / "checkpoint"),
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
    }
    if distributed.rank() > 0:
        return summary
    release_run()
    files.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=1), "the run's summary")
    before = f"{accuracy_before:.3f}" if accuracy_before is not None else "n/a (resumed, or --no-eval-before)"
    after = f"{accuracy_after:.3f}" if accuracy_after is not None else "n/a (no iteration ran)"
    print(
        shown(f"accuracy {before} -> {after} on {eval_task}; metrics {log.path}; checkpoint {run_dir / 'checkpoint'}")
    )
    return summary
