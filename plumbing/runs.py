"""Runs: the command line, one-line errors, resume, Ctrl-C, the run directory, its metrics log and sample files,
and the paper's settings with --dry-run.

A run directory owns its settings: RUN/args.json is written at the start, and `--resume RUN` takes them back;
only RESUMABLE_SETTINGS may be given again with other values. Every start and resume is a line of
RUN/starts.jsonl. Process-wide on purpose: `_active_run`, the run this process works in, which run_cli names
when Ctrl-C or an error ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import tyro

from plumbing import UsageError, checkpoints, distributed, engines, files, memory, models, ranges


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm, docker stop, timeout): handled as Ctrl-C is."""


def _terminate(signum, frame):
    raise Terminated()


def run_cli(main, args) -> None:
    """Run a script's main(args): a UsageError becomes one clear error line instead of a traceback, and Ctrl-C or
    SIGTERM one line that says what was kept and how to resume (no extra checkpoint is written). A new run that
    failed before it trained leaves nothing behind; the run directory's lock is released however main ends."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main(args)
    except UsageError as error:
        _discard_untrained_run()
        sys.exit(f"error: {error}")
    except KeyboardInterrupt as interrupt:
        print(f"\n{_interrupted_message()}", file=sys.stderr)
        sys.exit(143 if isinstance(interrupt, Terminated) else 130)  # the shell's codes for SIGTERM and SIGINT
    finally:
        release_run()


_active_run: dict = {}  # the run directory main() is working in (record_start) and its lock, for run_cli's messages


def _interrupted_message() -> str:
    if not _active_run:
        return "interrupted before a run directory was made: nothing was kept"
    run_dir, script = _active_run["run_dir"], _active_run["script"]
    resume = f"python {script} --resume {run_dir}"
    iteration = checkpoints.trained_iterations(run_dir)
    if iteration:
        return f"interrupted: {run_dir} keeps its checkpoint of iteration {iteration}; continue with: {resume}"
    return f"interrupted before the first checkpoint: {run_dir} keeps its settings; start it again with: {resume}"


def _discard_untrained_run() -> None:
    """Remove the directory of a run this process created if it never trained (no checkpoint, no training metrics)."""
    if not _active_run.get("new"):
        return
    run_dir = _active_run["run_dir"]
    try:
        trained = checkpoints.trained_iterations(run_dir) or any(
            record.get("iteration", 0) >= 1 for record in files.read_log(run_dir / "metrics.jsonl", "metrics log")
        )
    except (UsageError, OSError):
        trained = True  # cannot tell: keep it
    if not trained:
        release_run()
        shutil.rmtree(run_dir, ignore_errors=True)
        _active_run.clear()


# Settings a resumed run may change: how long it runs, how often it evaluates and saves, what it logs,
# memory knobs that leave the update unchanged (the gradient does not depend on the micro-batch split), and
# the matmul precision (a resume on another machine may need another; the choice is logged per start).
# Anything else would change the algorithm mid-run.
RESUMABLE_SETTINGS = (
    "resume",
    "dry_run",
    "output_dir",
    "iterations",
    "max_minutes",
    "eval_every",
    "save_every",
    "track",
    "save_samples",
    "save_questions",
    "micro_batch_size",
    "gradient_checkpointing",
    "vllm_gpu_memory_utilization",
    "vllm_enforce_eager",
    "precision",
    "eval_before",
    "reference_on_device",
)


def _resume_flag(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--resume" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--resume="):
            return arg.split("=", 1)[1]
    return None


def saved_settings(args_class, run_dir: str | Path):
    """The settings a run was started with (RUN/args.json), as an instance of the script's Args."""
    path = Path(run_dir) / "args.json"
    if not Path(run_dir).is_dir():
        raise UsageError(f"--resume {run_dir}: not a directory; give a run directory (runs/<run_name>)")
    try:
        saved = files.read_json(path, "the run's settings")
    except UsageError as error:
        raise UsageError(f"--resume {run_dir}: {error}; give a run directory this script made") from None
    fields = {f.name for f in dataclasses.fields(args_class)}
    # A setting added to the script after the run started is taken at its default when it cannot change the
    # algorithm (e.g. --dry-run); any other difference means another script or version made the run.
    saved |= {
        f.name: f.default
        for f in dataclasses.fields(args_class)
        if f.name not in saved and f.name in RESUMABLE_SETTINGS
    }
    if "sampler_batch_tokens" in fields and "sampler_batch_tokens" not in saved:
        saved["sampler_batch_tokens"] = 2**16  # runs from before the setting sampled in batches of this size
    if set(saved) != fields:
        foreign = sorted(set(saved) ^ fields)
        raise UsageError(
            f"--resume {run_dir}: its args.json does not fit this script's settings (differing: "
            f"{', '.join(foreign[:6])}); resume a run with the script that started it"
        )
    hints = typing.get_type_hints(args_class)
    wrong = [f"{name} = {json.dumps(value)}" for name, value in saved.items() if not _fits(value, hints[name])]
    if wrong:
        raise UsageError(
            f"--resume {run_dir}: {path} holds values of the wrong type ({'; '.join(wrong[:4])}); "
            "it was edited or damaged: restore it or start a new run"
        )
    return args_class(**saved)  # every setting is a JSON scalar or a list of them


def _fits(value, hint) -> bool:
    """Whether a JSON value can be the value of a setting typed `hint` (int for float is fine; bool is not a number)."""
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, part) for part in parts)
    if origin is Literal:
        return value in parts
    if origin in (list, tuple):
        return isinstance(value, list) and all(_fits(v, parts[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def check_resume_settings(args, run_dir: str | Path) -> None:
    """Refuse to resume with a setting that changes the algorithm: only RESUMABLE_SETTINGS may differ."""
    saved, current = asdict(saved_settings(type(args), run_dir)), asdict(args)
    changed = [k for k in saved if k not in RESUMABLE_SETTINGS and saved[k] != current[k]]
    if changed:
        given = ", ".join(f"--{k.replace('_', '-')} {current[k]!r} (the run has {saved[k]!r})" for k in changed)
        raise UsageError(
            f"--resume {run_dir}: {given} would change the run's algorithm mid-run; leave "
            f"{'it' if len(changed) == 1 else 'them'} out (the run keeps its own settings) or start a new run"
        )


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
    _active_run.update(
        run_dir=run_dir, script=Path(sys.argv[0]).name, new=not resumed
    )  # first: a Ctrl-C from here on names the run
    files.append_line(run_dir / "starts.jsonl", entry, "the run's start log")


def setting_problems(args, task_problems: Callable[..., list[str]]) -> list[str]:
    """Problems with the settings every training script shares, found before anything is loaded.

    Reads the fields it finds on `args` (a script's Args); each problem names its flag and the fix.
    `task_problems(name, flag=...)` checks a task name (eval.task_problems).
    """
    problems = ranges.problems(args)  # every numeric setting against the range declared on its field
    get = lambda name: getattr(args, name, None)  # noqa: E731
    if get("backend") is not None:
        problems += engines.backend_problems(args.backend)
    if isinstance(args, TrainArgs):  # the batch, budget and cadence of every training run
        if (
            args.micro_batch_size != "auto"
            and args.micro_batch_size >= 1
            and (args.batch_size < args.micro_batch_size or args.batch_size % args.micro_batch_size)
        ):
            problems.append(
                f"--batch-size ({args.batch_size}) must be a positive multiple of --micro-batch-size ({args.micro_batch_size})"
            )
    if get("output_dir") is not None and not get("resume"):
        problems += directory_problems(args.output_dir, "--output-dir")
    for flag, name in (("--task", get("task")), ("--eval-task", get("eval_task"))):
        if name is not None:
            problems += task_problems(name, flag=flag)
    return problems


def directory_problems(directory: str, flag: str) -> list[str]:
    """Whether `directory` is, or can be made as, a writable directory (nothing is created here)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        return [f"{flag} {directory} is a file, not a directory: give a directory"]
    ancestor = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not ancestor.is_dir():
        return [f"{flag} {directory} cannot be created: {ancestor} is a file"]
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return [f"{flag} {directory} cannot be created or written: no write permission on {ancestor}"]
    return []


def cli(args_class, argv: Sequence[str] | None = None):
    """tyro.cli for a training script. With --resume RUN the defaults are the run's own settings (RUN/args.json),
    so a flag left out keeps the run's value and only flags given explicitly can change it (main() then refuses
    any that would change the algorithm)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _resume_flag(argv)
    if run is None or any(a in ("-h", "--help") for a in argv):
        return tyro.cli(args_class, args=argv)
    try:
        default = saved_settings(args_class, run)
    except UsageError as error:
        sys.exit(f"error: {error}")
    return tyro.cli(args_class, args=argv, default=default)


# ----------------------------------------------------------------------------------------------
# The paper's settings: every script's PAPER_SETTINGS, its --dry-run and the README's table


def paper_run(args, paper_settings: dict[str, dict]) -> tuple[str, str]:
    """The paper's run (a key of the script's PAPER_SETTINGS) that `args` is compared with, and why that one:
    the run of the same task, else the run of the same model, else the script's first (default) run."""
    if args.task in paper_settings:
        return args.task, f"the paper's {args.task} run"
    model_id = models.ALIASES.get(args.model, args.model)
    for name, paper in paper_settings.items():
        if models.ALIASES.get(paper["model"], paper["model"]) == model_id:
            return name, f"the paper's {name} run (same model; the paper has no run on --task {args.task})"
    name = next(iter(paper_settings))
    return name, f"the paper's {name} run (the paper has no run on --task {args.task})"


def format_setting(value) -> str:
    """A setting as the command line writes it: 1e-06 -> 1e-6, 0.0001 -> 1e-4, True -> true, None -> -."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value and abs(value) < 1e-3:
        mantissa, exponent = f"{value:.6e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return str(value)


def dry_run(args, paper_settings: dict[str, dict], resolved: dict) -> dict:
    """--dry-run: print every setting beside the paper's value for the matching run and mark each difference;
    nothing is loaded. `resolved` holds what the script derives from the settings without loading anything
    (its values replace same-named settings in the comparison, e.g. the eval task a missing --eval-task means).
    Returns {"paper_run", "settings", "paper", "differences", "resolved"}."""
    run, why = paper_run(args, paper_settings)
    paper, settings = paper_settings[run], {**asdict(args), **{k: v for k, v in resolved.items() if k in asdict(args)}}
    same = lambda name: (  # noqa: E731  model aliases and hub ids name the same model
        models.ALIASES.get(settings[name], settings[name]) == models.ALIASES.get(paper[name], paper[name])
        if name == "model"
        else settings[name] == paper[name]
    )
    differences = [name for name in settings if name in paper and not same(name)]
    print(
        f"{Path(sys.argv[0]).name} settings beside {why}; * marks a difference, - a setting the paper does not state:"
    )
    width = max(len(name) for name in settings) + 3
    for name, value in settings.items():
        mark = "*" if name in differences else " "
        paper_value = format_setting(paper[name]) if name in paper else "-"
        print(f"{mark} --{name.replace('_', '-'):<{width}} {format_setting(value):<32} paper: {paper_value}")
    extra = {k: v for k, v in resolved.items() if k not in settings}
    if extra:
        print("resolved: " + ", ".join(f"{k} {format_setting(v)}" for k, v in extra.items()))
    print(f"{len(differences)} difference(s) from the paper; nothing was loaded (--dry-run)")
    return {"paper_run": run, "settings": settings, "paper": paper, "differences": differences, "resolved": resolved}


# ----------------------------------------------------------------------------------------------
# The settings every training script shares. A script's Args extends TrainArgs, redeclaring the fields whose
# paper default (or meaning) differs, and adding its algorithm's own; tyro documents every field in --help.


@dataclasses.dataclass
class TrainArgs:
    exp_name: str = "run"
    """experiment name, part of the run name"""
    seed: ranges.Seed = 1
    """seed of question sampling, rollouts and initialisation (same seed on CPU gives identical metrics)"""
    model: str = "rho-1b-sft-gsm8k"
    """policy to start from: model directory, Hugging Face id or alias (rho-1b-sft-gsm8k, rho-1b-sft-math, deepseek-r1-distill-qwen-1.5b, smollm2-135m)"""
    task: str = "gsm8k"
    """training task: gsm8k | math | rg:<reasoning-gym dataset> | path.jsonl"""
    eval_task: str | None = None
    """held-out task (default: the training task's test split; MATH500 for --task math)"""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine: hf | vllm | auto (vllm when installed and a GPU is present)"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision: auto = bf16 autocast where the device has fast bf16 (CUDA; CPUs with AVX-512 BF16 or
    AMX), else fp32; fp32 master weights always"""
    output_dir: str = "runs"
    """where runs/<run_name>/ (metrics, checkpoint, TensorBoard) are written"""
    resume: str | None = None
    """continue the run in this directory (runs/<run_name>) from its last checkpoint"""
    track: bool = False
    """also log to Weights & Biases"""
    dry_run: bool = False
    """print every setting beside the paper's value (PAPER_SETTINGS) and exit; loads nothing"""
    iterations: ranges.PositiveInt = 1000
    """training iterations (rollout + update)"""
    questions: ranges.PositiveInt = 64
    """questions per iteration (sampled with replacement)"""
    temperature: ranges.PositiveFloat = 0.6
    """sampling temperature; log-probs divide logits by it too"""
    top_p: ranges.Probability = 0.9
    """nucleus sampling threshold"""
    max_new_tokens: ranges.PositiveInt = 1024
    """response token budget"""
    context: ranges.PositiveInt = 2047
    """total context budget (prompt + response)"""
    lr: ranges.PositiveFloat = 1e-6
    """AdamW learning rate (3% linear warmup, then linear decay)"""
    warmup_ratio: ranges.WarmupFraction = 0.03
    """fraction of optimizer steps spent warming up"""
    weight_decay: ranges.NonNegativeFloat = 0.0
    """AdamW weight decay"""
    max_grad_norm: ranges.PositiveFloat = 1.0
    """gradient clipping norm"""
    epochs: ranges.PositiveInt = 2
    """passes over each iteration's samples"""
    batch_size: ranges.PositiveInt = 64
    """sequences per optimizer step"""
    micro_batch_size: ranges.AutoPositiveInt = "auto"
    """sequences per forward/backward (memory only: the gradient is the same for any split); auto: sized to the
    GPU's free memory (plumbing/memory.py), 8 on a CPU"""
    clip_eps: ranges.PositiveFloat = 0.2
    """PPO ratio clipping"""
    beta: ranges.NonNegativeFloat = 1e-4
    """k3 KL penalty to the reference model (0 disables the reference model)"""
    fsdp: bool = False
    """under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2), for models whose
    replica does not fit one GPU; the sampler gathers the whole model while it samples"""
    gradient_checkpointing: Literal["auto"] | bool = "auto"
    """recompute activations in the backward pass (about a third more compute, a fraction of the memory); auto: only
    where the update would not fit otherwise"""
    eval_every: ranges.PositiveInt = 10
    """evaluate every N iterations (and before the first and after the last)"""
    eval_before: bool = True
    """evaluate the starting model before the first iteration (the closing line's "before"); --no-eval-before
    skips it when that accuracy is already known"""
    eval_limit: ranges.OptionalPositiveInt = None
    """held-out questions to evaluate on (default: all)"""
    eval_samples: ranges.PositiveInt = 16
    """samples per held-out question (paper GSM8K protocol: 16 at temperature 0.35, top_p 0.9)"""
    eval_temperature: ranges.NonNegativeFloat = 0.35
    """evaluation sampling temperature"""
    eval_top_p: ranges.Probability = 0.9
    """evaluation nucleus threshold (paper GSM8K protocol: 0.9, the authors' eval config)"""
    save_every: ranges.PositiveInt = 10
    """checkpoint every N iterations (and after the last)"""
    max_minutes: ranges.OptionalPositiveFloat = None
    """stop after the iteration that ends past this many minutes of training (evaluation not counted), as if it were the last"""
    save_samples: ranges.NonNegativeInt = 0
    """every N iterations write the first --save-questions groups to runs/<run>/samples/iter_<k>.jsonl for viewer.py (0: never)"""
    save_questions: ranges.PositiveInt = 2
    """questions whose responses --save-samples writes"""
    vllm_gpu_memory_utilization: ranges.AutoProbability = "auto"
    """GPU memory fraction for the vLLM engine (its weights and KV cache); auto: what training leaves free"""
    vllm_enforce_eager: bool = False
    """vLLM without CUDA graphs or torch.compile: a faster engine start and slower decoding (first runs, debugging)"""
    reference_on_device: Literal["auto"] | bool = "auto"
    """keep the frozen reference model on the training device (True), or in pinned CPU memory, moved in for its
    pass each iteration (False); auto: on the GPU when it fits beside training, on the CPU otherwise"""
    sampler_batch_tokens: ranges.AutoPositiveInt = "auto"
    """positions (rows x (prompt + new tokens)) one batch of the HF sampler caches; auto: 65,536 on a CPU, sized to
    free GPU memory at the run's first start and kept on resume (the batches decide which random draws a row gets,
    so a resumed run repeats only with the same value)"""


# ----------------------------------------------------------------------------------------------
# A training run's directory, metrics, samples and closing line (every script's main)


def open_run(args, precision_line: str | None = None, device=None) -> tuple[Path, Path | None]:
    """The run directory (new, or the one --resume names) and its newest intact checkpoint (None: start from
    --model). Rank 0 creates a new directory exclusively (a name already taken gets a suffix) and locks the run for
    this process (lock_run); writes the run's settings to args.json and records this start in starts.jsonl. Replaces
    the `auto` memory knobs of `args` in place with this device's values (memory.size_run; args.json keeps "auto")."""
    if args.resume:
        run_dir = Path(args.resume)
        checkpoint = checkpoints.latest_checkpoint(
            run_dir
        )  # None: stopped before its first checkpoint, so it starts over
        if checkpoint is None and not (run_dir / "args.json").exists():
            raise UsageError(
                f"--resume {run_dir}: no checkpoint found there (expected {run_dir}/checkpoint/trainer_state.pt)"
            )
        check_resume_settings(args, run_dir)  # the run owns its settings; only RESUMABLE_SETTINGS may change
        if checkpoint is not None:
            distributed.check_world_size(checkpoint)  # each rank's questions and seeds depend on it
    else:
        run_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}")
        run_dir, checkpoint = Path(args.output_dir) / run_name, None  # rank 0's name (its clock) is broadcast below
    settings = json.dumps(asdict(args), indent=1)  # as given: `auto` stays auto in args.json
    # The `auto` memory knobs, on every rank, before anything is written: a run that cannot fit leaves nothing behind.
    # A resumed run keeps the sampler batch of its first start.
    first_start = distributed.broadcast(first_record(run_dir) if args.resume and distributed.rank() == 0 else None)
    sizing = memory.size_run(args, device or "cpu", str(checkpoint) if checkpoint else args.model, first_start)
    problem = None
    if distributed.rank() == 0:  # under torchrun rank 0 writes the run's files; the others read the same directory
        try:
            if not args.resume:
                run_dir = make_new_directory(run_dir)
            lock_run(run_dir)
            files.write_atomic(run_dir / "args.json", settings, "the run's settings")
            record_start(
                run_dir,
                resumed=bool(args.resume),
                precision_line=precision_line,
                world_size=distributed.world_size(),
                backend=engines.resolve_backend(args.backend)[0],
                device=str(device) if device is not None else None,
                memory={**sizing.settings(), "update_peak_gib": sizing.peak_gb, "line": sizing.line},
            )
        except UsageError as error:
            problem = str(error)
    run_dir, problem = distributed.broadcast((run_dir, problem))  # a suffixed name, or rank 0's error, on every rank
    if problem:
        raise UsageError(problem)
    return run_dir, checkpoint


def first_record(run_dir: Path) -> dict | None:
    """The first entry of RUN/starts.jsonl (the run's first start), or None."""
    path = Path(run_dir) / "starts.jsonl"
    if not path.exists():
        return None
    records = files.read_log(path, "the run's start log")
    return records[0] if records else None


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


def lock_run(run_dir: Path) -> None:
    """Hold RUN/lock (host, PID, time) for this process's life. A lock held by a live process refuses this one with
    one line naming both; one left by a dead process on this host (kill -9, a crash) is taken over with a warning."""
    lock, me = (
        run_dir / "lock",
        {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")},
    )
    for _ in range(3):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text())
            except (OSError, ValueError):
                holder = {}  # being written this instant, or damaged
            if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                break  # this process already holds it (a second main() in one process)
            if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
                warnings.warn(
                    f"{run_dir} was locked by process {holder['pid']}, which is no longer running: taking it over"
                )
                lock.unlink(missing_ok=True)
                continue
            if not holder:
                time.sleep(0.5)
                continue
            raise UsageError(
                f"{run_dir} is in use by process {holder.get('pid')} on {holder.get('host')} (since "
                f"{holder.get('since')}); this process ({me['pid']} on {me['host']}) would mix its files with "
                f"that run's: wait for it to end, or remove {lock} if that process is gone"
            )
        except OSError as error:
            raise UsageError(f"cannot lock the run directory {run_dir}: {error.strerror or error}") from None
        else:
            with os.fdopen(descriptor, "w") as f:
                f.write(json.dumps(me))
            break
    else:
        raise UsageError(
            f"cannot lock the run directory {run_dir}: {lock} is unreadable; remove it if no run is using it"
        )
    _active_run["lock"] = lock


def release_run() -> None:
    """Remove this process's lock on its run directory (a no-op where it holds none)."""
    lock = _active_run.pop("lock", None)
    if lock is None:
        return
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class RunLog:
    """The run's metrics.jsonl, TensorBoard and (with --track) W&B. A resumed run drops the metrics of iterations
    after its checkpoint (they are redone) and continues the training-time count of the kept ones."""

    def __init__(self, run_dir: Path, start_iteration: int, args):
        self.path, self.train_seconds, self.writer, self.wandb = run_dir / "metrics.jsonl", 0.0, None, None
        if distributed.rank() > 0:  # under torchrun only rank 0 logs (the metrics are already reduced over ranks)
            return
        from torch.utils.tensorboard import SummaryWriter

        kept = [r for r in files.read_log(self.path, "metrics log") if r.get("iteration", 0) < start_iteration]
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
    print(f"accuracy {before} -> {after} on {eval_task}; metrics {log.path}; checkpoint {run_dir / 'checkpoint'}")
    return summary
