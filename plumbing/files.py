"""Reading and writing the project's files so that damage is one line and a failed write loses nothing.

Reads: a file that is missing, unreadable, not UTF-8 or not the JSON it should be raises UsageError naming the
file and what is wrong; `read_lines` reads JSON Lines as JSON Lines readers do (a line ends at "\\n" alone) and refuses
an object with a repeated key. Writes: `write_atomic` writes beside the target and renames, so a full disk, a read-only
folder or a kill mid-write leaves the previous file whole and no partial one. Append-only logs (metrics.jsonl):
`read_log` drops a torn or blank last line, which is what a kill or a full disk during an append leaves.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from plumbing import UsageError, shown

# A task file's row whose question or answer is longer than this is dropped while the file is read, before anything
# tokenises it (a 30 MB question would take 12.5 GB and 193 s of tokenising, train and held-out, before the context
# check dropped it). GSM8K questions are under 1,000 characters and MATH problems a few thousand; 100,000
# characters is some 25,000 tokens of English, far past the paper's 2,048-token contexts, so no real question is lost.
MAX_QUESTION_CHARS = 100_000
MAX_ANSWER_CHARS = 100_000  # the answer field is a whole solution ("... #### 42"): GSM8K's and MATH's are far shorter


def read_text(path: str | Path, what: str = "file") -> str:
    """The text of a UTF-8 file; any reason it cannot be read is one UsageError naming it."""
    path = Path(path)
    if problem := special_file_problem(path):  # open() on a named pipe waits for a writer, maybe forever
        raise UsageError(f"{what} {problem}")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory, not a file") from None
    except PermissionError:
        raise UsageError(f"{what} {path} cannot be read: permission denied") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {error.start}): give a text file") from None
    except OSError as error:
        raise UsageError(f"{what} {path} cannot be read ({error.strerror or error})") from None


def special_file_problem(path: str | Path) -> str | None:
    """Why `path` (links followed) is not a file to read: a named pipe, socket or device, which open() would wait on
    or read without end; None for a regular file, a directory or nothing (their readers say so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{path} is {kind}, not a regular file: write what it gives to a file and give that (a pipe reads once)"


def read_json(path: str | Path, what: str = "file", shape: type = dict):
    """A JSON file whose top level must be `shape` (dict or list)."""
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except ValueError as error:
        raise UsageError(f"{what} {path} is not valid JSON ({error})") from None
    except RecursionError:  # json.loads recurses once per level: a crafted or damaged file can nest 10,000 deep
        raise UsageError(
            f"{what} {path} nests deeper than the JSON reader allows (not a file the project wrote)"
        ) from None
    if not isinstance(value, shape):
        raise UsageError(
            f"{what} {path} holds a JSON {type(value).__name__}, not a JSON {'object' if shape is dict else 'array'}"
        )
    return value


class _RepeatedKey(ValueError):
    """A JSON object that names `key` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook: the object json.loads would build, unless a key repeats (json.loads would keep
    its last value without a word)."""
    record = {}
    for key, value in pairs:
        if key in record:
            raise _RepeatedKey(key)
        record[key] = value
    return record


def read_lines(path: str | Path, what: str = "file") -> Iterator[tuple[int, str]]:
    """(line number, line) of a JSON Lines file, read one line at a time: a reader that needs the first rows of a
    million-row file stops after them, and only one line is held in memory. A line ends at "\\n" alone, as JSON Lines
    says (a "\\r" before it is cut too): not at the other breaks of str.splitlines (\\r, \\x0b, \\x1c, \\x85, \\u2028,
    ...), which a JSON string may hold raw. A file that cannot be opened raises read_text's UsageError; a line that is
    not UTF-8 raises one naming its byte offset in the file, and a line holding a JSON object with a repeated key
    one naming the line and the key, when the reader gets to it. Whether a line is JSON at all is the caller's to
    say."""
    path = Path(path)
    if problem := special_file_problem(path):
        raise UsageError(f"{what} {problem}")
    try:
        handle = path.open("rb")
    except OSError:
        read_text(path, what)  # the same one-line error for a missing, unreadable or directory path
        raise
    number, offset = 0, 0
    with handle:
        while True:
            try:
                raw = handle.readline()  # up to b"\n", which no multi-byte UTF-8 character contains
            except OSError as error:
                raise UsageError(f"{what} {path} cannot be read ({error.strerror or error})") from None
            if not raw:
                return
            try:
                line = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
            except UnicodeDecodeError as error:
                raise UsageError(
                    f"{what} {path} is not UTF-8 text (byte {offset + error.start}): give a text file"
                ) from None
            offset, number = offset + len(raw), number + 1
            try:
                json.loads(line, object_pairs_hook=_refuse_repeated_keys)
            except _RepeatedKey as repeated:
                read_text(path, what)  # a file that is not UTF-8 text says that first, as when it is read whole
                key = shown(repeated.key[:80]) + "..." * (len(repeated.key) > 80)
                raise UsageError(
                    f'{what} {path} line {number} repeats the key "{key}" (JSON readers keep one of the values): '
                    "give each key once"
                ) from None
            except (ValueError, RecursionError):  # not JSON: the caller says so, in its words
                pass
            yield number, line


def read_log(path: Path, what: str = "log") -> list[dict]:
    """The records of an append-only JSON-lines log (none when it does not exist). A torn or blank tail (the last
    line cut short by a kill or a full disk) is dropped with a warning and cut from the file, so the next append
    starts on a clean line; damage before the last line is a UsageError naming the line."""
    if not path.exists():
        return []
    lines = read_text(path, what).split("\n")
    records, good_bytes = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            if any(rest.strip() for rest in lines[number:]):
                raise UsageError(f"{what} {path} line {number} is blank in the middle of the file: delete that line")
            break
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            if any(rest.strip() for rest in lines[number:]):
                raise UsageError(f"{what} {path} line {number} is damaged ({error}): delete that line") from None
            warnings.warn(f"{path}: its last line is cut short (a write was interrupted); dropped it", stacklevel=2)
            break
        records.append(record)
        good_bytes += len(line.encode("utf-8")) + 1
    size = path.stat().st_size
    if good_bytes == size + 1:  # a whole last record whose newline was not written
        with open_no_link(path, os.O_WRONLY | os.O_APPEND) as f:
            f.write(b"\n")
    elif good_bytes < size:
        with open_no_link(path, os.O_WRONLY) as f:  # cut the torn or blank tail
            f.truncate(good_bytes)
    return records


def write_atomic(path: str | Path, text: str | bytes, what: str = "file") -> None:
    """Write `text` (or bytes) to `path` whole or not at all: a temporary file beside it, flushed, then renamed over it.
    A failure (disk full, read-only, the parent is a file) removes the temporary file and is one UsageError."""
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(descriptor, "wb") as f:
            text = text.encode("utf-8") if isinstance(text, str) else text
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocking} is a file, not a folder" if blocking else error.strerror or str(error)
        raise UsageError(f"cannot write {what} {path}: {reason}") from None


def append_line(path: Path, record: dict, what: str = "log") -> None:
    """Append one JSON record to a JSON-lines log; a failed write (disk full) is one UsageError, and whatever part
    of the line reached the disk is cut again, so the log stays whole."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with open_no_link(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as f:
            f.write((json.dumps(record) + "\n").encode("utf-8"))
    except OSError as error:
        try:
            with open_no_link(path, os.O_WRONLY) as f:
                f.truncate(size)
        except OSError:
            pass
        reason = "it is a symbolic link (never written through)" if path.is_symlink() else error.strerror or error
        raise UsageError(f"cannot write {what} {path}: {reason}") from None


def open_no_link(path: Path, flags: int):
    """A binary file object for `path` opened with `flags` that never follows a symbolic link at `path` (O_NOFOLLOW:
    the open fails instead), so a run's appends and cuts stay inside its directory."""
    return os.fdopen(os.open(path, flags | os.O_NOFOLLOW, 0o644), "ab" if flags & os.O_APPEND else "r+b")


def refuse_links(run_dir: Path, limit: int = 100_000) -> None:
    """Refuse a run directory that holds a symbolic link anywhere inside it (one line naming the first). A run directory
    may come from someone else; a link in it would send the run's writes (a truncated log tail, a checkpoint, sample
    files) to wherever it points, so the run writes only into files and folders it holds itself. `run_dir` itself may
    be a link (a shortcut to the run). At most `limit` entries are looked at; a larger directory is refused too."""
    seen = 0
    for folder, directories, names in os.walk(run_dir, followlinks=False):
        for name in directories + names:
            path, seen = Path(folder) / name, seen + 1
            if path.is_symlink():
                # the names are the sender's text: escaped, since a terminal would act on them
                raise UsageError(
                    f"{shown(path)} is a symbolic link (to {shown(os.readlink(path))}): a run directory must hold its "
                    "own files, since a run would write through the link; replace it with the file itself, or start a "
                    "new run"
                )
            if seen > limit:
                raise UsageError(f"{run_dir} holds more than {limit:,} files: it is not a run directory")


def file_fingerprint(path: str | Path) -> str | None:
    """A short hash of a local file's bytes (None where `path` is no file, e.g. a task name such as gsm8k): a resumed
    run given its task file at another path checks it against its first start's."""
    path = Path(path).expanduser()
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_task_rows(path: str) -> Iterator[dict]:
    """The rows of a GSM8K-format task file ({"question", "answer": the whole solution as text, "line"}), read one
    line at a time (tasks.load_task stops reading once it has its --limit).
    A row whose question or answer is longer than MAX_QUESTION_CHARS / MAX_ANSWER_CHARS is dropped here, before
    anything tokenises it, with one warning for the file; a file of nothing but such rows is a UsageError."""

    def bad_line(message: str) -> UsageError:
        read_text(path, "task file")  # a file that is not UTF-8 text says that first, as when it was read whole
        return UsageError(message)

    kept = 0
    dropped = 0
    first_dropped = None
    try:
        for number, line in read_lines(path, "task file"):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as error:  # ValueError: also an integer of over 4,300 digits
                reason = getattr(error, "msg", None) or str(error).split(":")[0]
                raise bad_line(
                    f'{path} line {number} is not valid JSON ({reason}); expected {{"question": ..., "answer": ...}}'
                ) from None
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("question"), str)
                or not isinstance(row.get("answer"), (str, int, float))
            ):
                raise bad_line(f'{path} line {number} needs a string "question" and an "answer" (GSM8K format)')
            answer = str(row["answer"])
            if len(row["question"]) > MAX_QUESTION_CHARS or len(answer) > MAX_ANSWER_CHARS:
                dropped = dropped + 1
                first_dropped = first_dropped or number
                continue
            kept += 1
            yield {"question": row["question"], "answer": answer, "line": number}
        if dropped and not kept:
            raise UsageError(
                f"{path} has no row within the limits of a task row: {dropped} with a question over "
                f"{MAX_QUESTION_CHARS:,} characters or an answer over {MAX_ANSWER_CHARS:,}; give a file of "
                "GSM8K-format questions"
            )
    finally:  # also when load_task stops reading early: the rows read so far are counted
        if dropped and kept:
            warnings.warn(
                f"{path}: dropped {dropped} row{'s' * (dropped != 1)} whose question is over {MAX_QUESTION_CHARS:,} "
                f"characters or whose answer is over {MAX_ANSWER_CHARS:,} (first: line {first_dropped}), before "
                "tokenising them"
            )
