"""CI: run the README's offline quickstart exactly as written there, then check what it promises.

The command is the ```bash block that follows the `<!-- quickstart` comment in README.md. It must
finish, print its closing line (held-out accuracy before -> after, metrics and checkpoint paths), and
the checkpoint must load and evaluate with `python eval.py --model <checkpoint>`.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLOSING = re.compile(r"^accuracy (\d\.\d{3}) -> (\d\.\d{3}) on (\S+); metrics (\S+); checkpoint (\S+)$", re.M)
EVAL_LINE = re.compile(r"^(\S+): accuracy (\d\.\d{3}) .* questions in \d+s -> (\S+)$", re.M)


def readme_block(marker: str = "<!-- quickstart") -> str:
    readme = (ROOT / "README.md").read_text()
    if marker not in readme:
        sys.exit(f"quickstart: README.md has no {marker} marker before the quickstart command")
    block = re.search(r"```bash\n(.*?)```", readme.split(marker, 1)[1], re.S)
    if block is None:
        sys.exit(f"quickstart: no ```bash block after {marker} in README.md")
    return block.group(1)


def run(command: list[str], what: str) -> str:
    """Run a command in the repository root, its output streamed to the CI log and returned."""
    start = time.monotonic()
    process = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = "\n".join(process.stdout.splitlines()[-15:])
    print(
        f"quickstart: {what} exited {process.returncode} after {time.monotonic() - start:.0f} s; last lines:\n{tail}",
        flush=True,
    )
    if process.returncode != 0:
        sys.exit(f"quickstart: {what} failed")
    return process.stdout


def main() -> None:
    command = readme_block()
    print(f"quickstart: running the README's command:\n{command}", flush=True)
    output = run(["bash", "-euo", "pipefail", "-c", command], "the README quickstart")
    closing = CLOSING.findall(output)
    if not closing:
        sys.exit("quickstart: no closing line 'accuracy X -> Y on TASK; metrics PATH; checkpoint PATH'")
    before, after, task, metrics, checkpoint = closing[-1]
    if not (ROOT / metrics).is_file() or not (ROOT / checkpoint / "config.json").is_file():
        sys.exit(f"quickstart: the closing line names {metrics} and {checkpoint}, which do not exist")
    evaluation = run(
        [
            sys.executable,
            "eval.py",
            "--model",
            checkpoint,
            "--task",
            task,
            "--limit",
            "8",
            "--max-new-tokens",
            "32",
            "--temperature",
            "0",
        ],
        f"eval.py --model {checkpoint}",
    )
    if not EVAL_LINE.search(evaluation):
        sys.exit("quickstart: eval.py printed no accuracy line for the checkpoint")
    print(f"quickstart: ok, accuracy {before} -> {after} on {task}; the checkpoint {checkpoint} loads in eval.py")


if __name__ == "__main__":
    main()
