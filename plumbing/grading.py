"""Grading: the reward. grade(responses, references, kind) -> [1.0 | 0.0], kind the task's answer kind.

Model output is untrusted: parsing it with sympy can take seconds or gigabytes (e.g.
\\boxed{10^{10^{10^{10}}}}), partly in C code no signal interrupts. So grading runs in a small
persistent pool of worker processes, each under an address-space limit; inside a worker every item
gets a soft timeout (SIGALRM on the worker's main thread, so grade() works from any thread), and the
parent kills a worker that has not reported for timeout + grace. An item that timed out, crashed or
was killed scores 0 and is counted by grade_failures().

This module imports no torch and nothing of the project: the grading server loads this file alone, so it
and its workers hold math-verify and sympy, never torch (tests/test_grading.py checks). It knows no task: a task's
answer kind (numeric or expression) comes from its entry in plumbing/tasks.py, whose grade() looks it up in the
training process and passes it here as a value; eval.py re-exports that grade().
"""

from __future__ import annotations

import collections
import decimal
import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from sympy import FiniteSet

_GRADE_MEM_HEADROOM = 4 << 30  # bytes a worker may map beyond what its imports already use
_GRADE_HARD_GRACE = 2.0  # default seconds past the soft timeout before the parent kills a worker
_GRADE_STARTUP_TIMEOUT = 120.0  # the grading server's first answer waits for it to import this module
_GRADE_MAX_CHUNK = 64  # items handed to a worker at once
# A number in scientific notation (numeric tasks): a decimal mantissa, e or E, a signed integer exponent; neither
# inside a word or a longer number ("0x1e5", "v1.2e3", "1,2e3", "1e5.3") nor without exponent digits ("1.2e").
_GRADE_SCIENTIFIC_RE = re.compile(r"(?<![\w.])(?<!\d,)(\d+(?:\.\d+)?|\.\d+)[eE]([+-]?\d+)(?!\w|[.,]\d)")
_GRADE_MAX_EXPONENT = 1000  # "1e1000" is written out to 1,001 digits; a larger exponent is no task's answer

_grade_workers = []  # the persistent pool, see _grade_pool()
_grade_server = None  # forks the workers, see _GradeServer
_grade_lock = threading.Lock()  # one grade() call at a time uses the pool
_grade_failure_count = 0


def grade_failures() -> int:
    """How many items since import timed out, crashed or were killed (each scored 0.0)."""
    return _grade_failure_count


# How a task's references and answers are read: "numeric", a number (scientific notation as its value, a reference
# that is no number does not parse); "expression", LaTeX that math-verify compares as mathematics.
AnswerKind = Literal["numeric", "expression"]
ANSWER_KINDS = ("numeric", "expression")


def _is_numeric(kind: AnswerKind) -> bool:
    if kind not in ANSWER_KINDS:
        raise ValueError(f"unknown answer kind {kind!r}: numeric or expression")
    return kind == "numeric"


# Worker side. Never str() or repr() a parsed object: printing a huge expression can hang too.


class _GradeTimeout(BaseException):
    """Not an Exception, so math-verify's `except Exception` cannot swallow it."""


def _grade_alarm(signum, frame):
    raise _GradeTimeout


def _plain_numbers(text: str) -> tuple[str, bool]:
    """`text` with each number in scientific notation written out as its decimal value, and whether every exponent was
    within _GRADE_MAX_EXPONENT (a larger one is left as written). math-verify reads a reference "2.5e3" as 2.5 * e * 3
    (Euler's e) and an answer "1e6" as 1; written out, 2.5e3 equals 2500 and 2,500.

    >>> _plain_numbers("The answer is 2.5e3, or 1.2E-3, not 1e6x or 1.2e.")
    ('The answer is 2500, or 0.0012, not 1e6x or 1.2e.', True)
    """
    within = True

    def written_out(number: re.Match) -> str:
        nonlocal within
        digits = number[2].lstrip("+-").lstrip("0")  # int() refuses over 4,300 digits: the length is checked first
        if len(digits) > 4 or int(digits or "0") > _GRADE_MAX_EXPONENT:
            within = False
            return number[0]
        return format(decimal.Decimal(f"{number[1]}e{number[2]}"), "f")

    return _GRADE_SCIENTIFIC_RE.sub(written_out, text), within


@functools.lru_cache(maxsize=4096)  # RL grades several samples against each reference
def _parse_reference(reference: str, numeric: bool) -> list:
    if numeric:
        reference, within = _plain_numbers(reference)
        if not within:  # refused rather than read as a product with Euler's e
            return []
    # parsing_timeout=None switches off math-verify's own alarm: the worker's alarm covers the item.
    gold = parse(f"${reference}$", [LatexExtractionConfig()], fallback_mode="no_fallback", parsing_timeout=None)
    if numeric and not (gold and getattr(gold[0], "is_number", False)):
        return []
    return gold


@functools.lru_cache(maxsize=4096)  # answers repeat: the samples of one question, the same value in many responses
def _parse_value(text: str, numeric: bool) -> list:
    """One value of a final answer, parsed ([] where it does not parse, or has an exponent beyond the limit)."""
    if numeric:
        text, within = _plain_numbers(text)
        if not within:  # math-verify would read "1e1001" as its mantissa, 1
            return []
    return parse(
        text, [LatexExtractionConfig(), ExprExtractionConfig()], fallback_mode="no_fallback", parsing_timeout=None
    )


def _grade_item(values: tuple[str, ...] | None, reference: str, numeric: bool) -> float:
    """Score one final answer, the values of its run (final_answer.answer_values); for values=None, whether the
    reference parses. Every value must equal the reference, so that two forms of one value ("1/2 or 0.5") score 1 and
    two values ("5 or 6") 0; under kind "expression" a set reference is answered by its elements, each value one of
    them."""
    gold = _parse_reference(reference, numeric)
    if values is None or not gold:
        return float(values is None and bool(gold))
    elements_may_answer = not numeric and len(values) > 1 and isinstance(gold[0], FiniteSet)
    preds = []
    for text in dict.fromkeys(values):  # a value written twice is parsed once
        pred = _parse_value(text, numeric)
        if not pred:
            return 0.0
        if not elements_may_answer and not verify(gold, pred, timeout_seconds=None):
            return 0.0  # one value differs from the reference: the rest need not be parsed
        preds.append(pred)
    if not elements_may_answer:
        return float(bool(preds))
    if all(verify(gold, pred, timeout_seconds=None) for pred in preds):
        return 1.0
    elements = [[element] for element in gold[0].args]  # "1 or 2", "\\boxed{1}, \\boxed{2}" for {1, 2}
    matched = [[verify(element, pred, timeout_seconds=None) for element in elements] for pred in preds]
    return float(all(any(row) for row in matched) and all(any(column) for column in zip(*matched)))


def _grade_worker_main(conn) -> None:
    """Receive (jobs, timeout) chunks; send (score, failed) after each job."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings quote model output
    # The limit is relative to the footprint after the server's imports (Python, sympy, math-verify; no
    # torch), so every worker may map the same headroom whatever those imports weigh.
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
# alone, by path, once (math-verify and sympy, about a second; no torch, nothing of the project, not even
# plumbing/__init__.py) and then forks a worker per request (milliseconds, so a killed worker is replaced
# at once). Not multiprocessing: its "spawn" and "forkserver" re-run the caller's main script in the
# child, which fails without an `if __name__ == "__main__":` guard, and its "fork" copies a process that
# may run threads (tokenizers, vLLM) and can deadlock. The server runs no threads.

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
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
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
                    raise RuntimeError(
                        "the grading server failed to start a worker; see its error output above"
                    ) from None
        # A pidfd names this process even after it exits, so kill() never hits a process that reused the pid.
        self.pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self.todo = collections.deque()  # indices sent to this worker and not yet answered, in order
        self.deadline = math.inf

    def wait_ready(self) -> _GradeWorker:
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


def _grade_run(jobs: list, timeout: float, workers: int | None, grace: float) -> list[float]:
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
                w.deadline = time.monotonic() + timeout + grace
            busy = [w for w in pool if w.todo]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w in busy], wait_s)
            for w in busy:
                try:
                    while w.todo and w.conn in ready and w.conn.poll():
                        scores[w.todo.popleft()], failed = w.conn.recv()
                        _grade_failure_count += failed
                        w.deadline = time.monotonic() + timeout + grace
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
    responses: list[str],
    references: list[str],
    kind: AnswerKind,
    timeout: float = 5.0,
    workers: int | None = None,
    grace: float = _GRADE_HARD_GRACE,
) -> list[float]:
    """1.0 for each response whose final answer equals its reference, else 0.0.

    Paper: the reward.

    The final answer is read by one rule for every task: the run of values after the last marker of the response's
    tail (a box, "####", "answer is", a correction), each of which must equal the reference, so that a hedge or a list
    scores 0 and two forms of one value score 1 (plumbing/final_answer.py states it, with examples). kind "numeric"
    reads a number in scientific notation as its value, in the answer and in the reference: 2.5e3 = 2500 = 2,500,
    1E-3 = 0.001 (under "expression", "2e-1" in LaTeX may be 2e - 1: left to math-verify there). An exponent beyond
    +-1000 scores 0; a reference with one does not parse.

    timeout: seconds per item. workers: pool size (default: CPUs available, at most 8).
    grace: seconds past timeout before the parent kills a worker that has not answered (one stuck in C
    code that its alarm cannot interrupt); it may be negative, as long as timeout + grace > 0.
    Items that time out, crash or are killed score 0.0 and are counted by grade_failures().
    """
    if len(responses) != len(references):
        raise ValueError(f"grade() got {len(responses)} responses but {len(references)} references")
    if not timeout > 0:
        raise ValueError(f"grade() timeout must be positive, got {timeout}")
    if not timeout + grace > 0:
        raise ValueError(f"grade() timeout + grace must be positive, got {timeout} + {grace}")
    numeric = _is_numeric(kind)
    references = [ref.replace("\u2212", "-") for ref in references]
    from plumbing.final_answer import answer_values  # the parent's part: the server and its workers never import it

    jobs = [(answer_values(r), ref, numeric) for r, ref in zip(responses, references)]
    return _grade_run(jobs, timeout, workers, grace)


def check_references(references: list[str], kind: AnswerKind) -> list[bool]:
    """For each reference, whether it parses (to a number, for kind "numeric"); one pool round trip."""
    numeric = _is_numeric(kind)
    jobs = [(None, r.replace("\u2212", "-"), numeric) for r in references]
    return [s == 1.0 for s in _grade_run(jobs, 5.0, None, _GRADE_HARD_GRACE)]


def check_reference(reference: str, kind: AnswerKind) -> bool:
    """True if the reference parses (to a number, for kind "numeric")."""
    return check_references([reference], kind)[0]
