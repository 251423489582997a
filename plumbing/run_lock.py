"""The run directory's lock (RUN/lock: host, PID, time) and the run this process works in.

Process-wide on purpose: `active_run`, the run this process works in, which cli.run_cli names when Ctrl-C or an
error ends it (runs.py fills it in as it opens the run). A module of its own, importing no other plumbing module, so
that the command line (cli.py) can release the lock without importing the run directory's machinery.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from pathlib import Path

from plumbing import UsageError

active_run: dict = {}  # the run directory main() is working in (runs.record_start) and its lock, for cli.run_cli


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
    active_run["lock"] = lock


def release_run() -> None:
    """Remove this process's lock on its run directory (a no-op where it holds none)."""
    lock = active_run.pop("lock", None)
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
