"""The command line of the training scripts: tyro, with a run's own settings as the defaults on --resume; one-line
errors instead of tracebacks; Ctrl-C and SIGTERM as one line that says what was kept and how to resume.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Sequence

import tyro

from plumbing import UsageError, checkpoints, distributed, files, run_lock, shown
from plumbing.settings import saved_settings


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm, docker stop, timeout) or SIGHUP (the terminal closed): handled as Ctrl-C is."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The stopping signal that arrived, kept beside the exception its handler raises: Python drops an exception raised
# while it runs a callback (an import lock's cleanup, a __del__: "Exception ignored in ..."), and raise_if_stopped
# raises it again at the loop's next safe point, so a scheduler's SIGTERM is never lost.
_arrived: list[int] = []


def _stop(signum, frame):
    """The first stopping signal raises; any that follows while the run winds down (a second Ctrl-C during a save,
    SIGTERM after Ctrl-C) is ignored, so the one line stays the only line (SIGKILL or SIGQUIT still end it at once)."""
    for other in STOPPING_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    _arrived.append(signum)
    raise _stopping(signum)


def _stopping(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_if_stopped() -> None:
    """At a safe point of the run (bookkeeping.Loop: each iteration's start and each timed block): raise the stopping
    signal that arrived if the exception its handler raised was dropped where it landed."""
    if _arrived:
        raise _stopping(_arrived[0])


def run_cli(main, args) -> None:
    """Run a script's main(args): a UsageError becomes one clear error line instead of a traceback, and Ctrl-C or
    SIGTERM one line that says what was kept and how to resume (no extra checkpoint is written). A new run that
    failed before it trained leaves nothing behind; the run directory's lock is released however main ends."""
    _arrived.clear()
    for signum in STOPPING_SIGNALS:
        # a shell starts background jobs with SIGINT ignored: that stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)
    try:
        main(args)
    except UsageError as error:
        _discard_untrained_run()
        sys.exit(f"error: {shown(error)}")
    except Exception as error:
        if (failure := distributed.peer_failure(error)) is None:
            raise
        for signum in STOPPING_SIGNALS:  # torchrun's SIGTERM to the survivors may come now: the line says it all
            signal.signal(signum, signal.SIG_IGN)
        # another rank died or hung: this one ends with the line, before torch's own teardown can abort
        _end(
            f"rank {distributed.rank()}: another process of this run died or stopped answering ({failure}); "
            + _interrupted_message().removeprefix("interrupted: ").removeprefix("interrupted "),
            1,
        )
    except KeyboardInterrupt as interrupt:
        for signum in STOPPING_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        # the shell's codes: 128 + the signal's number (SIGINT 130, SIGTERM 143, SIGHUP 129)
        code = 128 + (interrupt.signum if isinstance(interrupt, Terminated) else signal.SIGINT)
        if distributed.world_size() > 1:
            _end(_interrupted_message(), code)
        run_lock.release_run()
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            print(f"\n{shown(_interrupted_message())}", file=sys.stderr)
        sys.exit(code)
    finally:
        run_lock.release_run()


def _end(line: str, code: int) -> None:
    """Print `line` and end this process now (os._exit: gloo and NCCL can abort in their destructors once a peer is
    gone), its run's lock released."""
    run_lock.release_run()
    with contextlib.suppress(OSError):
        print(f"\n{shown(line)}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    os._exit(code)


def _interrupted_message() -> str:
    if not run_lock.active_run:
        return "interrupted before a run directory was made: nothing was kept"
    run_dir, script = run_lock.active_run["run_dir"], run_lock.active_run["script"]
    resume = distributed.resume_command(script, run_dir, run_lock.active_run.get("world_size", 1))
    iteration = checkpoints.trained_iterations(run_dir)
    if iteration:
        return f"interrupted: {run_dir} keeps its checkpoint of iteration {iteration}; continue with: {resume}"
    return f"interrupted before the first checkpoint: {run_dir} keeps its settings; start it again with: {resume}"


def _discard_untrained_run() -> None:
    """Remove the directory of a run this process created if it never trained (no checkpoint, no training metrics)."""
    if not run_lock.active_run.get("new"):
        return
    run_dir = run_lock.active_run["run_dir"]
    try:
        trained = checkpoints.trained_iterations(run_dir) or any(
            record.get("iteration", 0) >= 1 for record in files.read_log(run_dir / "metrics.jsonl", "metrics log")
        )
    except (UsageError, OSError):
        trained = True  # cannot tell: keep it
    if not trained:
        run_lock.release_run()
        shutil.rmtree(run_dir, ignore_errors=True)
        run_lock.active_run.clear()


def _resume_flag(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--resume" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--resume="):
            return arg.split("=", 1)[1]
    return None


def parse(args_class, argv: Sequence[str] | None = None):
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
        sys.exit(f"error: {shown(error)}")
    return tyro.cli(args_class, args=argv, default=default)
