"""Run a training script under torchrun with extra flags on one rank (RANK_FLAGS_RANK, RANK_FLAGS), as a multi-node
launch whose nodes were given different command lines would: tests/test_run_bookkeeping.py."""

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plumbing import cli  # noqa: E402

script, argv = sys.argv[1], sys.argv[2:]
if os.environ.get("RANK") == os.environ.get("RANK_FLAGS_RANK"):
    argv += os.environ.get("RANK_FLAGS", "").split()
module = importlib.import_module(script)
sys.argv = [f"{script}.py", *argv]
cli.run_cli(module.main, cli.parse(module.Args, argv))
