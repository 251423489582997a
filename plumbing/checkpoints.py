"""Checkpoints: written atomically, and the newest whole one found again.

RUN/checkpoint/ is a plain save_pretrained directory (eval.py loads it) plus trainer_state.pt (optimizer,
scheduler, iteration, world size and whatever the script adds, e.g. SPO-tree's replay buffer), written last.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import warnings
import zipfile
from pathlib import Path

import torch

from plumbing import UsageError, distributed, files, lora, models, shown


def load_data(path: Path, mmap: bool = False):
    """A .pt file of a run (trainer_state.pt, PPO's critic.pt) as data only, on the CPU: torch.load with weights_only,
    which takes tensors, numbers, strings and containers of them (the optimizer's and scheduler's state, SPO-tree's
    replay buffer) and refuses anything else. A run directory may come from someone else: a pickled object in it,
    which could run code as it loads, is refused unread, in one line naming the file."""
    if problem := files.special_file_problem(path):  # torch.load would wait on a named pipe for a writer
        raise UsageError(problem)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{path} holds objects other than tensors and numbers, which could run code as they load, so it was not "
            "loaded: use the file the training script wrote, or start a new run"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise UsageError(f"{path} cannot be read ({reason}): it is damaged; restore it or start a new run") from None


def load_trainer_state(checkpoint: Path, mmap: bool = False) -> dict:
    """A checkpoint's trainer_state.pt (load_data: data only, tensors on the CPU; the optimizer moves its state to its
    parameters' device as it loads it)."""
    state = load_data(checkpoint / "trainer_state.pt", mmap=mmap)
    if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
        raise UsageError(
            f"{checkpoint / 'trainer_state.pt'} is not a trainer state (no iteration): restore it or start a new run"
        )
    # a received run's numbers are checked as args.json's are (locate_run bounds the iteration by the run's)
    world = state.get("world_size", 1)
    if state["iteration"] < 0 or isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UsageError(
            f"{checkpoint / 'trainer_state.pt'} holds an iteration of {state['iteration']} and a world size of "
            f"{shown(repr(world))} (an iteration of 0 or more and a world size of 1 or more expected): it was edited "
            "or damaged; restore it or start a new run"
        )
    return state


def trained_iterations(run_dir: Path) -> int:
    """The iteration of the run's latest complete checkpoint (0: none, or none that reads)."""
    for candidate in (run_dir / "checkpoint", run_dir / "checkpoint.old"):  # as latest_checkpoint()
        if (candidate / "trainer_state.pt").exists() and checkpoint_problem(candidate) is None:
            try:
                return load_trainer_state(candidate, mmap=True)["iteration"]
            except UsageError:
                continue
    return 0


def checkpoint_problem(directory: Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (a missing or truncated file), or None when it is whole.

    Cheap: reads only the safetensors headers and the zip directory at the end of trainer_state.pt, which a
    truncated file no longer has. A named pipe in place of either is a problem, never opened (open() would wait for
    a writer).
    """
    state = directory / "trainer_state.pt"
    if problem := files.special_file_problem(state):
        return problem
    try:
        with zipfile.ZipFile(state):
            pass
    except (OSError, zipfile.BadZipFile) as error:
        return f"{state} is damaged ({type(error).__name__})"
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return f"{directory} has no model.safetensors"
    for path in weights:
        if problem := files.special_file_problem(path):
            return problem
        try:
            with path.open("rb") as f:
                header_size = int.from_bytes(f.read(8), "little")
                if header_size > path.stat().st_size - 8:  # a damaged size field: never allocate from it
                    return f"{path} is damaged (its header claims {header_size} bytes)"
                header = json.loads(f.read(header_size))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if path.stat().st_size < 8 + header_size + end:
                return f"{path} is truncated ({path.stat().st_size} of {8 + header_size + end} bytes)"
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            return f"{path} is damaged ({type(error).__name__})"
    return None


def save_checkpoint(run_dir: Path, model, tokenizer, trainer_state: dict, modules: dict | None = None) -> Path:
    """Write RUN/checkpoint atomically: a SIGKILL mid-save leaves the previous checkpoint intact. Every rank calls
    it (with --fsdp the weights are gathered from the shards); rank 0 writes. `modules` ({"critic": critic}) are
    saved beside the policy as one state dict each (critic.pt); trainer_state.pt, written last, gets the world size."""
    final, staging, previous = run_dir / "checkpoint", run_dir / "checkpoint.new", run_dir / "checkpoint.old"
    adapter = lora.has_adapters(model)  # --lora-rank > 0: the adapter alone (plumbing/lora.py), in peft's format
    weights = None if adapter else distributed.full_state_dict(model)
    module_weights = {name: distributed.full_state_dict(module) for name, module in (modules or {}).items()}
    if distributed.rank() > 0:
        return final
    settle(run_dir)
    try:
        if adapter:
            base = model.peft_config["default"].base_model_name_or_path
            lora.save_adapter(model, staging, base, models.fingerprint(base))
        else:
            model.save_pretrained(staging, state_dict=weights)
        tokenizer.save_pretrained(staging)
        for name, state in module_weights.items():
            torch.save(state, staging / f"{name}.pt")
        torch.save({**trainer_state, "world_size": distributed.world_size()}, staging / "trainer_state.pt")
    except Exception as error:  # disk full, read-only, quota: safetensors and torch raise their own error types
        shutil.rmtree(staging, ignore_errors=True)
        kept = trained_iterations(run_dir)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot write the checkpoint of iteration {trainer_state.get('iteration')} to {staging} ({reason}); "
            + (f"{final} still holds iteration {kept}" if kept else "no earlier checkpoint exists")
            + ": free space (or fix the folder's permissions) and --resume"
        ) from None
    if final.exists():
        final.rename(previous)
    staging.rename(final)
    _remove(previous)
    return final


def settle(run_dir: Path) -> None:
    """Before a save, leave RUN/checkpoint as the newest whole checkpoint and nothing beside it, whatever step of an
    earlier save a kill or signal stopped: (1) writing checkpoint.new, (2) renaming checkpoint to checkpoint.old,
    (3) renaming checkpoint.new to checkpoint, (4) removing checkpoint.old. checkpoint/ whole (after 3, or mid-4):
    the others go. checkpoint/ missing or damaged and checkpoint.old/ whole (after 2: the run resumed from .old, as
    latest_checkpoint() chooses): .old becomes checkpoint/ again. checkpoint.new/ is always stale here: this save
    rewrites it. A link in place of any of them is removed, never followed."""
    final, staging, previous = run_dir / "checkpoint", run_dir / "checkpoint.new", run_dir / "checkpoint.old"
    _remove(staging)
    if not _whole(final) and _whole(previous):
        _remove(final)
        previous.rename(final)
    _remove(previous)


def _whole(directory: Path) -> bool:
    return (
        not directory.is_symlink()
        and (directory / "trainer_state.pt").is_file()
        and checkpoint_problem(directory) is None
    )


def _remove(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a folder tree; one line if it cannot be removed."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
    except OSError as error:
        raise UsageError(
            f"cannot remove {path} before writing a checkpoint ({error.strerror or error}): fix its permissions (or "
            "remove it by hand) and --resume"
        ) from None


def optimizer_checkpoint(model, optimizer, scheduler, prefix: str = "") -> dict:
    """The trainer_state entries of one optimizer and its schedule ({prefix}optimizer, {prefix}scheduler). Every
    rank calls it: with --fsdp the optimizer state is gathered from the shards."""
    return {
        f"{prefix}optimizer": distributed.optimizer_state(model, optimizer),
        f"{prefix}scheduler": scheduler.state_dict(),
    }


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole checkpoint: checkpoint/, else checkpoint.old/ (killed between the two renames, or damaged)."""
    damaged = []
    for candidate in (run_dir / "checkpoint", run_dir / "checkpoint.old"):
        if (candidate / "trainer_state.pt").exists():
            problem = checkpoint_problem(candidate)
            if problem is None:
                if damaged:
                    warnings.warn(f"{damaged[0]}; resuming from {candidate} instead")
                return candidate
            damaged.append(problem)
    if damaged:
        raise UsageError(f"--resume {run_dir}: {'; '.join(damaged)}, and no intact checkpoint is left; start a new run")
    return None


CHECKPOINT_SLOTS = ("checkpoint", "checkpoint.new", "checkpoint.old")  # the folders a run's saves replace (settle)


def merge_adapter(checkpoint: Path, output: Path) -> None:
    """Write an adapter checkpoint (plumbing/lora.py) as a plain transformers model directory: the base with
    W + (alpha / R) B A merged in, in fp32, and the tokenizer; transformers and vLLM load it. Atomic: written into a
    hidden folder beside `output` and renamed to it once whole, so an error, a full disk or a signal the command
    catches (every one that would end it, __main__) leaves no `output` (the folder is removed; only SIGKILL leaves it,
    named .OUTPUT.merging-PID). `output` inside a run's checkpoint folders, whatever the source, is refused: the
    run's next save or --resume would delete it."""
    if not lora.is_adapter_checkpoint(checkpoint):
        raise UsageError(f"{checkpoint} is not an adapter checkpoint (no {lora.ADAPTER_CONFIG}, or a config.json)")
    if output.exists() or output.is_symlink():
        raise UsageError(f"{output} exists: give a new directory for the merged model")
    target = output.parent.resolve() / output.name
    slots = [checkpoint.with_name(f"{checkpoint.name}{suffix}").resolve() for suffix in ("", ".new", ".old")]
    # any run's: a folder named as a checkpoint slot beside a run's args.json or starts.jsonl
    slots += [
        folder
        for folder in (target, *target.parents)
        if folder.name in CHECKPOINT_SLOTS
        and any((folder.parent / name).exists() for name in ("args.json", "starts.jsonl"))
    ]
    for slot in slots:
        if target == slot or slot in target.parents:
            raise UsageError(
                f"{output} is {'' if target == slot else 'inside '}{slot}, which its run replaces at its next save: "
                "give a directory outside the run's checkpoint"
            )
    staging = target.parent / f".{target.name}.merging-{os.getpid()}"
    try:
        model, tokenizer = models.load_model(str(checkpoint), dtype=torch.float32, device="cpu")
        target.parent.mkdir(parents=True, exist_ok=True)
        model.peft_wrapper.merge_and_unload().save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except UsageError:
        raise
    except Exception as error:  # a full disk, a read-only folder: safetensors and the OS raise their own types
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"cannot write the merged model to {output} ({reason}); nothing was left there: free space (or fix the "
            "folder's permissions) and merge again"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# The signals that end a process unless it catches them, other than the ones a fault raises (SIGSEGV, SIGBUS, SIGFPE,
# SIGILL, SIGABRT: the process itself is broken) and SIGKILL, which cannot be caught.
STOPPING_SIGNALS = tuple(
    getattr(signal, name)
    for name in (
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGVTALRM",
        "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPOLL", "SIGPWR", "SIGSYS", "SIGTRAP", "SIGSTKFLT",
    )
    if hasattr(signal, name)
)  # fmt: skip


def _stop(signum, frame):
    """A stopping signal as Ctrl-C: merge_adapter's cleanup runs. Further signals are ignored from here on, so that
    the cleanup itself is not cut short."""
    for number in STOPPING_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":  # python -m plumbing.checkpoints merge runs/<run>/checkpoint merged/
    if len(sys.argv) != 4 or sys.argv[1] != "merge":
        sys.exit("usage: python -m plumbing.checkpoints merge runs/<run>/checkpoint OUTPUT_DIR")
    for number in STOPPING_SIGNALS:
        if signal.getsignal(number) is not signal.SIG_IGN:  # one ignored where it started (nohup's SIGHUP) stays so
            signal.signal(number, _stop)
    try:
        merge_adapter(Path(sys.argv[2]), Path(sys.argv[3]))
    except UsageError as error:  # it may quote base_model.json's path: the sender's text, escaped
        sys.exit(f"error: {shown(error)}")
    except KeyboardInterrupt:
        if Path(sys.argv[3]).is_dir():  # stopped after the rename: the merged model is whole
            sys.exit(f"interrupted after the merged model was written whole to {shown(sys.argv[3])}")
        sys.exit(f"interrupted: nothing was written to {shown(sys.argv[3])}")
    print(f"wrote {shown(sys.argv[3])}: the base with the adapter merged in (transformers and vLLM load it)")
