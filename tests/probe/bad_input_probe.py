"""Bad-input probe: what a user can type, or a machine can leave behind, against every command line of the project.

Each case is a real command (a subprocess, as a user runs it) that must fail with one clear line: exit code not 0,
no traceback, and an `error:` line naming the problem (tyro's own parse errors: exit 2, naming the flag). A case's
verdict is `ok`, `traceback`, `silent` (exit 0: the bad input ran), `unclear` (the message does not name the
problem) or `hung` (still running at --timeout: it started work it should have refused). The cases are not the
tests' cases (tests/inputs/test_bad_input.py, test_damaged_files.py): they were written after those, to find what
the tests miss. Damaged files and models are made here, in a temporary folder, on a
tiny random model (no network).

  python tests/probe/bad_input_probe.py          # writes tests/probe/bad_input_probe.json
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from plumbing import files, ranges  # noqa: E402  (torch-free)


@dataclass
class Args:
    out: str = "tests/probe/bad_input_probe.json"
    """where the JSON rows go (relative to the repository)"""
    workers: ranges.PositiveInt = 2
    """cases run at once (each is a Python process that imports torch)"""
    only: str = ""
    """run only the cases whose command contains this text"""
    timeout: ranges.PositiveFloat = 300.0
    (
        """seconds a case may run; one still running then is stopped and judged `hung` """
        """(it started work it should have refused)"""
    )


def make_fixtures(folder: Path) -> dict[str, str]:
    """The damaged files and models the cases name, as {NAME: path}."""
    import grpo_baseline
    import spo_tree
    from conftest import make_tiny_model

    tiny = make_tiny_model(folder / "tiny")
    paths = {
        name: folder / name.lower()
        for name in (
            "EMPTY",
            "ONLYCONFIG",
            "RUNDIR",
            "NOTOKENIZER",
            "TRUNCATED",
            "ARGSLIST",
            "ARGSNULL",
            "ARGSBADTYPE",
            "TREERUN",
            "NOMETRICS",
        )
    }
    for path in paths.values():
        path.mkdir()
    paths["TINY"] = tiny
    (paths["ONLYCONFIG"] / "config.json").write_text((tiny / "config.json").read_text())
    (paths["RUNDIR"] / "checkpoint").mkdir()
    for path in tiny.iterdir():
        (paths["TRUNCATED"] / path.name).write_bytes(path.read_bytes())
        if path.name in ("config.json", "model.safetensors"):
            (paths["NOTOKENIZER"] / path.name).write_bytes(path.read_bytes())
    weights = paths["TRUNCATED"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    paths["DIRJSONL"] = folder / "questions.jsonl"
    paths["DIRJSONL"].mkdir()
    paths["BINARY"] = folder / "binary.jsonl"
    paths["BINARY"].write_bytes(bytes(range(256)) * 4)
    paths["NOANSWER"] = folder / "no_answer.jsonl"
    paths["NOANSWER"].write_text(json.dumps({"question": "1+1?"}) + "\n")
    paths["NOTJSON"] = folder / "not_json.jsonl"
    paths["NOTJSON"].write_text('{"question": "1+1?", "answer": "#### 2"}\nquestion: 2+2\n')
    paths["AFILE"] = folder / "a_file"
    paths["AFILE"].write_text("not a folder")
    (paths["ARGSLIST"] / "args.json").write_text("[]")
    (paths["ARGSNULL"] / "args.json").write_text("null")
    (paths["ARGSBADTYPE"] / "args.json").write_text(json.dumps({**vars(grpo_baseline.Args()), "lr": "fast"}))
    (paths["TREERUN"] / "args.json").write_text(json.dumps(vars(spo_tree.Args())))
    make_untrusted_inputs(folder, paths)
    make_untrusted_runs(folder, paths, tiny)
    make_untrusted_models(folder, paths, tiny)
    make_adapters(folder, paths, tiny)
    make_special_files(folder, paths, tiny)
    make_handed_over(folder, paths, tiny)
    paths["SHORTPOS"] = folder / "short_positions"  # the tiny model with 64 positions
    shutil.copytree(tiny, paths["SHORTPOS"])
    config = json.loads((tiny / "config.json").read_text())
    (paths["SHORTPOS"] / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    return {name: str(path) for name, path in paths.items()}


def make_untrusted_inputs(folder: Path, paths: dict[str, Path]) -> None:
    """Task files too large to tokenise or to read whole, a local model folder to mistype, damaged viewer inputs."""

    def solved(i: int) -> dict:
        return {"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}

    paths["GOODTASK"] = folder / "good.jsonl"
    paths["GOODTASK"].write_text("".join(json.dumps(solved(i)) + "\n" for i in range(3)))
    paths["HUGEANSWER"] = folder / "huge_answers.jsonl"  # every answer over plumbing.files.MAX_ANSWER_CHARS
    paths["HUGEANSWER"].write_text(json.dumps({"question": "1+1?", "answer": "2 " * 75_000 + "#### 2"}) + "\n")
    paths["BIGQUESTION"] = folder / "big_question.jsonl"  # line 2 is dropped untokenised; line 3 has no reference
    rows = [solved(1), {"question": "How many? " * 20_000, "answer": "#### 3"}, {"question": "2+2?", "answer": "####"}]
    paths["BIGQUESTION"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths["LARGE"] = folder / "large.jsonl"  # 1,000,000 rows (61 MB): --limit 2 reads two of them
    paths["LARGE"].write_text(
        "".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(10**6))
    )
    (folder / "models" / "tiny").mkdir(parents=True)  # for "models/tny"
    for name in ("LATIN1RUN", "ARGSSTRING", "DEEPTREE", "SAMPLESDIR", "HUGEMETRIC"):
        paths[name] = folder / name.lower()
        (paths[name] / "samples").mkdir(parents=True)
    record = {
        "algorithm": "grpo",
        "question_index": 0,
        "question": "3 + 4?",
        "reference": "7",
        "prompt": "3 + 4?",
        "reward": 1.0,
        "finish_reason": "stop",
        "token_ids": [5],
        "tokens": ["7"],
        "probs": [0.9],
        "advantages": [0.5],
        "loss_mask": [1],
    }
    (paths["LATIN1RUN"] / "metrics.jsonl").write_bytes(b'{"iteration": 1, "charts/reward": 0.5, "note": "caf\xe9"}\n')
    (paths["HUGEMETRIC"] / "metrics.jsonl").write_text('{"iteration": 1, "charts/reward": ' + "9" * 400 + "}\n")
    (paths["ARGSSTRING"] / "args.json").write_text('"grpo"')
    (paths["ARGSSTRING"] / "samples" / "iter_1.jsonl").write_text(json.dumps(record) + "\n")
    (paths["ARGSSTRING"] / "metrics.jsonl").write_text('{"iteration": 1, "charts/reward": 0.5}\n')
    node = '"token_ids": [1], "tokens": ["a"], "probs": [0.5], "loss_mask": [1], "value": 0.5'
    tree = ("{" + node + ', "children": [') * 20_000 + "]}" * 20_000  # 20,000 deep: json.dumps could not write it
    (paths["DEEPTREE"] / "samples" / "iter_1.jsonl").write_text(
        '{"algorithm": "spo_tree", "question_index": 0, "question": "q", "reference": "1", "tree": ' + tree + "}\n"
    )
    (paths["SAMPLESDIR"] / "samples" / "iter_1.jsonl").mkdir()


class _Payload:
    """Pickles to a call that writes a file: what a crafted .pt file would run if it were unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "the payload ran"))


def make_untrusted_models(folder: Path, paths: dict[str, Path], tiny: Path) -> None:
    """Model directories from someone else: copies of the tiny model that ask to run their own code, declare more
    layers than their weights hold, or carry a chat template that loops, raises or tries to leave Jinja's sandbox."""
    marker = folder / "custom-code-ran"

    def model(name: str, config: dict | None = None, tokenizer: dict | None = None, template: str | None = None):
        directory = paths[name] = folder / name.lower()
        shutil.copytree(tiny, directory)
        for file, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
            if changes:
                path = directory / file
                path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
        if template is not None:
            (directory / "chat_template.jinja").write_text(template)
        (directory / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")

    model(
        "CUSTOMCODE",
        config={
            "model_type": "custom",
            "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomForCausalLM"},
        },
    )
    model("TOKCODE", tokenizer={"auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}})
    model(
        "DEEPER", config={"num_hidden_layers": json.loads((tiny / "config.json").read_text())["num_hidden_layers"] + 2}
    )
    model("LOOPTEMPLATE", template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    model("RAISETEMPLATE", template="{{ raise_exception('This model only supports system-first conversations') }}")
    model("ESCAPETEMPLATE", template="{{ cycler.__init__.__globals__.os.system('touch ESCAPED') }}")
    model("HUGETEMPLATE", template="{{ 'x' * 10**8 }}")


def make_adapters(folder: Path, paths: dict[str, Path], tiny: Path) -> None:
    """LoRA adapter checkpoints (plumbing/lora.py) gone wrong: the base they record moved away; a config that is not
    one this project writes."""
    from plumbing import lora, models

    for name in ("ADAPTERNOBASE", "ADAPTERBADCONFIG"):
        model, _ = models.load_model(str(tiny), device="cpu")
        lora.add_adapters(model, lora.lora_config(4, None, 0.0, lora.DEFAULT_TARGET, str(tiny)))
        paths[name] = folder / name.lower()
        lora.save_adapter(model, paths[name], str(tiny), models.fingerprint(str(tiny)))
        shutil.copy(tiny / "tokenizer.json", paths[name])
    for name in ("ADAPTERSELF", "ADAPTERNANALPHA", "ADAPTERRANK", "ADAPTERNANWEIGHT", "ADAPTERRELATIVE", "MERGED"):
        paths[name] = folder / name.lower()
        shutil.copytree(paths["ADAPTERNOBASE"], paths[name])

    def edit(name: str, file: str, **changes) -> None:
        path = paths[name] / file
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    paths["INSIDEMERGED"] = paths["MERGED"] / "merged"  # a merge into the checkpoint it reads: its next save deletes it
    edit("ADAPTERSELF", lora.BASE_RECORD, model=str(paths["ADAPTERSELF"]))  # recursed
    edit("ADAPTERNANALPHA", lora.ADAPTER_CONFIG, lora_alpha=float("nan"))  # blamed on the architecture
    edit("ADAPTERRANK", lora.ADAPTER_CONFIG, r=8)  # a state_dict traceback
    edit("ADAPTERRELATIVE", lora.BASE_RECORD, model="./models/tiny")  # a fingerprint mismatch from another directory
    from safetensors.torch import load_file, save_file

    weights = load_file(paths["ADAPTERNANWEIGHT"] / lora.ADAPTER_WEIGHTS)
    weights[next(key for key in weights if "lora_A" in key)][0, 0] = float("nan")
    save_file(weights, paths["ADAPTERNANWEIGHT"] / lora.ADAPTER_WEIGHTS)
    record = json.loads((paths["ADAPTERNOBASE"] / lora.BASE_RECORD).read_text())
    (paths["ADAPTERNOBASE"] / lora.BASE_RECORD).write_text(json.dumps({**record, "model": str(folder / "gone")}))
    config = paths["ADAPTERBADCONFIG"] / lora.ADAPTER_CONFIG
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": "16", "target_modules": 3}))


def make_special_files(folder: Path, paths: dict[str, Path], tiny: Path) -> None:
    """Named pipes where a task file or a model's config.json should be (open() on one waits for a writer), a merge
    destination that is a dangling link, and chat templates transformers reads but cannot render: named templates
    without a default, a number, one that renders every prompt empty."""
    paths["FIFOTASK"] = folder / "fifo.jsonl"
    os.mkfifo(paths["FIFOTASK"])
    paths["FIFOMODEL"] = folder / "fifo_model"
    shutil.copytree(tiny, paths["FIFOMODEL"])
    (paths["FIFOMODEL"] / "config.json").unlink()
    os.mkfifo(paths["FIFOMODEL"] / "config.json")
    paths["DANGLING"] = folder / "dangling"
    paths["DANGLING"].symlink_to(folder / "nowhere")
    for name, template in (
        ("NAMEDTEMPLATES", [{"name": "tool_use", "template": "{{ 'x' }}"}, {"name": "rag", "template": "{{ 'y' }}"}]),
        ("NUMBERTEMPLATE", 7),
        ("EMPTYTEMPLATE", "{{ '' }}"),
    ):
        paths[name] = folder / name.lower()
        shutil.copytree(tiny, paths[name])
        config = paths[name] / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))


def make_handed_over(folder: Path, paths: dict[str, Path], tiny: Path) -> None:
    """What others hand over, read as data: a named pipe for a checkpoint's trainer_state.pt or a base model's weights,
    paths and link targets holding terminal escapes, two sample files of one iteration, a work dir of the user's for
    tools/identical_outputs.sh, experiments' results files cut short or edited by hand."""
    import grpo_baseline
    from plumbing import lora

    paths["FIFOSTATE"] = folder / "fifo_state"
    shutil.copytree(tiny, paths["FIFOSTATE"] / "checkpoint")
    (paths["FIFOSTATE"] / "args.json").write_text(json.dumps(vars(grpo_baseline.Args(model=str(tiny)))))
    os.mkfifo(paths["FIFOSTATE"] / "checkpoint" / "trainer_state.pt")
    paths["FIFOWEIGHTS"] = folder / "fifo_weights"  # a base model whose weights are a pipe
    shutil.copytree(tiny, paths["FIFOWEIGHTS"])
    (paths["FIFOWEIGHTS"] / "model.safetensors").unlink()
    os.mkfifo(paths["FIFOWEIGHTS"] / "model.safetensors")
    for name, base in (("ADAPTERFIFOBASE", paths["FIFOWEIGHTS"]), ("ADAPTERESCBASE", folder / "gone\x1b[31mred")):
        paths[name] = folder / name.lower()
        shutil.copytree(paths["ADAPTERNOBASE"], paths[name])
        record = paths[name] / lora.BASE_RECORD
        record.write_text(json.dumps({**json.loads(record.read_text()), "model": str(base)}))
    record = {
        "algorithm": "grpo",
        "question_index": 0,
        "question": "3 + 4?",
        "reference": "7",
        "prompt": "3 + 4?",
        "reward": 1.0,
        "finish_reason": "stop",
        "token_ids": [5],
        "tokens": ["7"],
        "probs": [0.9],
        "advantages": [0.5],
        "loss_mask": [1],
    }
    for name in ("LINKESC", "DUPITER"):
        paths[name] = folder / name.lower()
        (paths[name] / "samples").mkdir(parents=True)
        (paths[name] / "samples" / "iter_1.jsonl").write_text(json.dumps(record) + "\n")
        (paths[name] / "metrics.jsonl").write_text('{"iteration": 1, "charts/reward": 0.5}\n')
    (paths["LINKESC"] / "notes").symlink_to("\x1b]0;owned\x07")  # would set the terminal's title
    (paths["DUPITER"] / "samples" / "iter_01.jsonl").write_text(json.dumps(record) + "\n")
    paths["USERWORK"] = folder / "user_work"  # IDENTICAL_WORK: a folder of the user's, its other/ theirs
    (paths["USERWORK"] / "other").mkdir(parents=True)
    (paths["USERWORK"] / "other" / "thesis.tex").write_text("a year of work")
    paths["TRUNCPOOL"] = folder / "truncated_paired.json"
    paths["TRUNCPOOL"].write_text('{"seeds": {"2": {"scores": {"spo_chain_int20": [1, 0')
    paths["NANPOOL"] = folder / "nan_paired.json"
    paths["NANPOOL"].write_text('{"seeds": {"2": {"scores": {"spo_chain_int20": [1, NaN], "grpo": [1, 0]}}}}')
    # learning_critical.py --tiny's first case, reused by its settings and the code's hash, policy edited to null
    from experiments import learning_critical

    paths["CRITICAL"] = folder / "critical" / "critical.json"
    paths["CRITICAL"].parent.mkdir()
    args = learning_critical.Args(tiny=True, out=str(paths["CRITICAL"]))
    run = learning_critical.run_args("coin", "tokens", 1, dataclasses.replace(args, **learning_critical.TINY))
    case = json.loads((ROOT / "experiments/results/learning_critical_confident_samples_L3.json").read_text())
    case["given_settings"] = json.loads(json.dumps(learning_critical.rounded(run)))
    case["machine"]["code_hash"] = learning_critical.toy.code_hash(*learning_critical.toy.LEARNING_EXACT_CODE)
    Path(run["out"]).write_text(json.dumps({**case, "policy": None}))


def make_untrusted_runs(folder: Path, paths: dict[str, Path], tiny: Path) -> None:
    """Run directories from someone else: .pt files holding pickled objects, symbolic links to outside targets.
    Each is a run of the script it is resumed with (its args.json), with a whole checkpoint of the tiny model."""
    import shutil

    import torch

    import grpo_baseline
    import ppo_baseline
    import spo_chain
    import spo_tree

    outside = folder / "outside"
    (outside / "samples").mkdir(parents=True)
    (outside / "metrics.jsonl").write_text('{"iteration": 0}\n')
    marker = folder / "payload-ran"

    def run(name: str, script, state=None) -> Path:
        run_dir = paths[name] = folder / name.lower()
        shutil.copytree(tiny, run_dir / "checkpoint")
        (run_dir / "args.json").write_text(json.dumps(vars(script.Args(model=str(tiny)))))
        torch.save(state or {"iteration": 1, "world_size": 1}, run_dir / "checkpoint" / "trainer_state.pt")
        return run_dir

    run("PICKLESTATE", grpo_baseline, {"iteration": 1, "world_size": 1, "optimizer": _Payload(marker)})
    run("PICKLEOLD", spo_tree, {"iteration": 2, "world_size": 1, "buffer": [_Payload(marker)]})
    shutil.move(paths["PICKLEOLD"] / "checkpoint", paths["PICKLEOLD"] / "checkpoint.old")  # killed between renames
    critic = run("PICKLECRITIC", ppo_baseline)
    torch.save({"value_head.weight": _Payload(marker)}, critic / "checkpoint" / "critic.pt")
    os.symlink(outside / "metrics.jsonl", run("LINKMETRICS", spo_chain) / "metrics.jsonl")
    os.symlink(outside / "samples", run("LINKSAMPLES", spo_tree) / "samples")
    os.symlink(outside, run("LINKSTAGING", grpo_baseline) / "checkpoint.new")
    os.symlink(outside / "metrics.jsonl", run("LINKDEEP", ppo_baseline) / "checkpoint" / "tokenizer.json.bak")
    # numbers in a received trainer_state.pt outside their ranges (args.json plans 1000 iterations)
    lora_run = folder / "lora_runs"
    args = grpo_baseline.Args(model=str(tiny), task=str(paths["GOODTASK"]), output_dir=str(lora_run), lora_rank=4)
    args = dataclasses.replace(args, iterations=1, questions=2, group_size=2, max_new_tokens=4, context=64)
    args = dataclasses.replace(args, eval_before=False, eval_every=10**6, batch_size=4)
    paths["LORAALPHARUN"] = Path(grpo_baseline.main(args)["run_dir"])
    edited_runs(folder, paths)
    config = paths["LORAALPHARUN"] / "checkpoint" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 800}))  # the run's: 8
    run("NEGITER", grpo_baseline, {"iteration": -1, "world_size": 1})
    run("PASTITER", spo_chain, {"iteration": 10**9, "world_size": 1})
    run("ZEROWORLD", ppo_baseline, {"iteration": 1, "world_size": 0})
    # task rows JSON readers take differently: a repeated key (json.loads keeps the last value), also nested
    paths["REPEATKEY"] = folder / "repeat_key.jsonl"
    paths["REPEATKEY"].write_text('{"question": "What is 2 + 3?", "answer": "#### 5", "answer": "#### 6"}\n')
    paths["NESTEDKEY"] = folder / "nested_key.jsonl"
    paths["NESTEDKEY"].write_text('{"question": "q", "answer": "#### 5", "meta": {"k": 1, "k": 2}}\n')


def edited_runs(folder: Path, paths: dict[str, Path]) -> None:
    """Copies of the LoRA run LORAALPHARUN (before its alpha is edited) with one thing changed between the run and its
    resume (issue 78): args.json's --lora-target, its task file rewritten under the same path, a sampler batch of -5
    positions in starts.jsonl; one whose last save was cut short (only checkpoint.old/), the destination of a merge;
    and adapters with peft options this project does not load (DoRA, a trained LM head)."""
    from plumbing import lora

    def copy(name: str) -> Path:
        paths[name] = folder / name.lower()
        shutil.copytree(paths["LORAALPHARUN"], paths[name])
        return paths[name]

    def edit(path: Path, **changes) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    edit(copy("LORATARGETRUN") / "args.json", lora_target="q_proj,v_proj")  # the adapter covers every linear layer
    task = folder / "rewritten.jsonl"
    shutil.copy(paths["GOODTASK"], task)  # the same bytes as the run's task, at a path of its own
    edit(copy("TASKRUN") / "args.json", task=str(task))
    task.write_text(task.read_text() + json.dumps({"question": "What is 1 + 1?", "answer": "#### 3"}) + "\n")
    starts = copy("SAMPLERRUN") / "starts.jsonl"
    first, *rest = starts.read_text().splitlines()
    first = json.loads(first)
    first["memory"]["sampler_batch_tokens"] = -5
    starts.write_text("\n".join([json.dumps(first), *rest]) + "\n")
    cut = copy("CUTRUN")
    (cut / "checkpoint").rename(cut / "checkpoint.old")  # a save stopped between its two renames
    paths["CUTRUNOLD"], paths["CUTRUNDEST"] = cut / "checkpoint.old", cut / "checkpoint"
    for name, changes in (("ADAPTERDORA", {"use_dora": True}), ("ADAPTERHEAD", {"modules_to_save": ["lm_head"]})):
        paths[name] = folder / name.lower()
        shutil.copytree(paths["LORAALPHARUN"] / "checkpoint", paths[name])
        edit(paths[name] / lora.ADAPTER_CONFIG, **changes)


DEEP_TREE = ",".join(["2"] * 101)  # 101 levels

# (command, text the error must contain). NAMES in capitals are replaced by make_fixtures' paths.
CASES = [
    # numbers outside their ranges, non-finite, of the wrong type
    ("spo_chain.py --top-p nan", "--top-p (nan) must be a finite number"),
    ("grpo_baseline.py --eval-top-p inf", "--eval-top-p (inf)"),
    ("ppo_baseline.py --lam -0.1", "--lam (-0.1) must be in [0, 1]"),
    ("ppo_baseline.py --value-clip-eps 0", "--value-clip-eps (0.0) must be positive"),
    ("spo_tree.py --buffer-max-age 0", "--buffer-max-age (0) must be at least 1"),
    ("spo_tree.py --segment-tokens -5", "--segment-tokens (-5)"),
    ("spo_chain.py --mc-samples 0", "--mc-samples (0) must be at least 1"),
    ("grpo_baseline.py --micro-batch-size 0", "--micro-batch-size (0)"),
    ("grpo_baseline.py --eval-samples -3", "--eval-samples (-3)"),
    ("spo_chain.py --save-questions 0", "--save-questions (0)"),
    ("spo_tree.py --samples-per-iteration -2", "--samples-per-iteration (-2)"),
    ("spo_chain.py --prob-threshold nan", "--prob-threshold (nan)"),
    ("grpo_baseline.py --max-minutes -1", "--max-minutes (-1.0)"),
    ("grpo_baseline.py --eval-limit 0", "--eval-limit (0)"),
    ("grpo_baseline.py --iterations 1e3", "--iterations"),
    ("grpo_baseline.py --lr abc", "--lr"),
    ("spo_tree.py --tree 6,,6", "--tree"),
    ("spo_tree.py --tree 6,-1", "--tree"),
    ("spo_tree.py --tree 40,40,40", "over the 1,000,000-leaf limit"),
    ("spo_tree.py --advantage foo", "--advantage"),
    ("eval.py --limit -1", "--limit (-1)"),
    ("eval.py --context 1", "--context (1) must be at least 2"),
    ("eval.py --top-p 2", "--top-p (2.0)"),
    ("eval.py --seed 99999999999", "--seed (99999999999)"),
    ("eval.py --samples 1.5", "--samples"),
    # runs that cannot be resumed
    ("grpo_baseline.py --resume /no/such/run", "/no/such/run: not a directory"),
    ("grpo_baseline.py --resume ARGSLIST", "holds a JSON list, not a JSON object"),
    ("grpo_baseline.py --resume ARGSNULL", "holds a JSON NoneType"),
    ("grpo_baseline.py --resume ARGSBADTYPE", 'wrong type (lr = "fast")'),
    ("grpo_baseline.py --resume TREERUN", "resume a run with the script that started it"),
    ("grpo_baseline.py --resume EMPTY", "args.json does not exist"),
    # task files and models that are not what they claim
    ("grpo_baseline.py --model TINY --task DIRJSONL", "a directory, not a task file"),
    ("grpo_baseline.py --model TINY --task BINARY --output-dir RUNS", "is not UTF-8 text"),
    ("grpo_baseline.py --model TINY --task NOANSWER --output-dir RUNS", 'needs a string "question" and an "answer"'),
    ("grpo_baseline.py --model TINY --task NOTJSON --output-dir RUNS", "line 2 is not valid JSON"),
    ("grpo_baseline.py --model EMPTY --task NOANSWER --output-dir RUNS", "has no config.json"),
    ("spo_chain.py --model ONLYCONFIG --task NOANSWER --output-dir RUNS", "has config.json but no weights"),
    ("spo_tree.py --model RUNDIR --task NOANSWER --output-dir RUNS", "did you mean"),
    ("ppo_baseline.py --model NOTOKENIZER --task NOANSWER --output-dir RUNS", "has no tokenizer files"),
    ("grpo_baseline.py --model TRUNCATED --task NOANSWER --output-dir RUNS", "may be damaged"),
    ("grpo_baseline.py --output-dir AFILE", "is a file, not a directory"),
    ("eval.py --model TINY --task BINARY", "is not UTF-8 text"),
    ("eval.py --model RUNDIR --task NOANSWER", "did you mean"),
    ("eval.py --output EMPTY", "is a directory"),
    # the viewer and the benchmarks
    ("viewer.py html /no/such/run", "/no/such/run"),
    ("viewer.py curves NOMETRICS -o OUT.png", "metrics.jsonl"),
    ("viewer.py html NOMETRICS -o page.pdf", "give a file name ending in .html"),
    ("viewer.py curves NOMETRICS --x hours", "--x"),
    # untrusted inputs: rows too long to tokenise, files too long to read whole, mistyped model paths, damaged
    # viewer inputs (tests/inputs/test_untrusted_inputs.py has other instances)
    ("eval.py --model TINY --task HUGEANSWER", "or an answer over 100,000"),
    ("spo_chain.py --model TINY --task HUGEANSWER --output-dir RUNS", "or an answer over 100,000"),
    ("eval.py --model TINY --task BIGQUESTION", "row 3 has a missing or unparseable reference"),
    ("eval.py --model TINY --task LARGE --limit 2 --context 2", "--context 2 leaves no room for a response"),
    ("eval.py --model ./missing-dir --task GOODTASK", "the directory ./missing-dir does not exist"),
    ("grpo_baseline.py --model models/tny --task GOODTASK --output-dir RUNS", "(did you mean models/tiny?)"),
    ("viewer.py curves LATIN1RUN -o OUT.png", "is not UTF-8 text"),
    ("viewer.py curves HUGEMETRIC -o OUT.png", "is an integer too large to plot"),
    ("viewer.py html ARGSSTRING -o OUT.html", "holds a JSON str, not a JSON object"),
    ("viewer.py curves ARGSSTRING -o OUT.png", "holds a JSON str, not a JSON object"),
    ("viewer.py html DEEPTREE -o OUT.html", "nests deeper than the JSON reader allows"),
    ("viewer.py html SAMPLESDIR -o OUT.html", "is a directory, not a file"),
    # settings that pass the range checks but would train nothing, run past the model or wait for ranks that never
    # come (tests/test_run_bookkeeping.py has other instances)
    ("spo_tree.py --tree 1", "--tree 1: depth 0 has one child per node"),
    ("spo_tree.py --tree 4,1,4", "--tree 4,1,4: depth 1 has one child per node"),
    ("spo_tree.py --tree 3,1", "depth 1 has one child per node"),
    ("spo_tree.py --tree 1,1", "depth 0 has one child per node"),
    (
        f"spo_tree.py --segment-tokens 1 --max-new-tokens 4096 --context 8192 --tree {DEEP_TREE}",
        "levels: at most 100",
    ),
    (
        "grpo_baseline.py --model SHORTPOS --task GOODTASK --context 300 --output-dir RUNS",
        "beyond the model's 64 positions",
    ),
    ("ppo_baseline.py --model SHORTPOS --task GOODTASK --context 100000 --output-dir RUNS", "beyond the model's 64"),
    ("spo_chain.py --model SHORTPOS --task GOODTASK --context 65 --max-new-tokens 8 --output-dir RUNS", "64 positions"),
    ("WORLD_SIZE=abc grpo_baseline.py --model TINY --task GOODTASK", "WORLD_SIZE='abc' is not a positive integer"),
    ("WORLD_SIZE=0 spo_chain.py --model TINY --task GOODTASK", "WORLD_SIZE='0' is not a positive integer"),
    ("WORLD_SIZE=-1 spo_tree.py --model TINY --task GOODTASK", "WORLD_SIZE='-1' is not a positive integer"),
    ("WORLD_SIZE=2 RANK=0 grpo_baseline.py --model TINY --task GOODTASK", "was not started by torchrun"),
    (
        "WORLD_SIZE=4 RANK=1 MASTER_ADDR=localhost MASTER_PORT=29999 ppo_baseline.py --model TINY",
        "not started by torchrun",
    ),
    ("WORLD_SIZE=2 TORCHELASTIC_RUN_ID=x RANK=0 spo_chain.py --model TINY", "without MASTER_ADDR and MASTER_PORT"),
    ("WORLD_SIZE=2 TORCHELASTIC_RUN_ID=x RANK=5 MASTER_ADDR=h MASTER_PORT=1 spo_tree.py", "RANK=5 is not below"),
    ("grpo_baseline.py --collective-timeout-minutes 0", "--collective-timeout-minutes (0.0) must be positive"),
    ("spo_chain.py --collective-timeout-minutes nan", "--collective-timeout-minutes (nan)"),
    # run directories from someone else: pickled objects in .pt files, links out of the run (test_run_directory_safety)
    ("grpo_baseline.py --resume PICKLESTATE", "holds objects other than tensors and numbers"),
    ("spo_tree.py --resume PICKLEOLD", "checkpoint.old/trainer_state.pt holds objects other than tensors"),
    ("ppo_baseline.py --resume PICKLECRITIC", "critic.pt holds objects other than tensors and numbers"),
    ("spo_chain.py --resume LINKMETRICS", "metrics.jsonl is a symbolic link"),
    ("spo_tree.py --resume LINKSAMPLES", "samples is a symbolic link"),
    ("grpo_baseline.py --resume LINKSTAGING", "checkpoint.new is a symbolic link"),
    ("ppo_baseline.py --resume LINKDEEP", "tokenizer.json.bak is a symbolic link"),
    ("grpo_baseline.py --resume NEGITER", "holds an iteration of -1"),
    ("spo_chain.py --resume PASTITER", "says iteration 1000000000, past the 1000 its args.json planned"),
    ("ppo_baseline.py --resume ZEROWORLD", "a world size of 0"),
    ("eval.py --model TINY --task REPEATKEY", 'line 1 repeats the key "answer"'),
    ("grpo_baseline.py --model TINY --task NESTEDKEY --output-dir RUNS", 'line 1 repeats the key "k"'),
    # model directories from someone else: custom code, missing weights, chat templates (tests/test_model_dirs.py)
    ("grpo_baseline.py --model CUSTOMCODE --task GOODTASK --output-dir RUNS", "asks to run the model's own code"),
    ("eval.py --model TOKCODE --task GOODTASK", "asks to run the tokenizer's own code"),
    ("spo_chain.py --model DEEPER --task GOODTASK --output-dir RUNS", "holds no weights for"),
    ("eval.py --model LOOPTEMPLATE --task GOODTASK", "of CPU time"),
    ("grpo_baseline.py --model RAISETEMPLATE --task GOODTASK --output-dir RUNS", "This model only supports"),
    ("eval.py --model ESCAPETEMPLATE --task GOODTASK", "tried to leave Jinja's sandbox"),
    ("ppo_baseline.py --model HUGETEMPLATE --task GOODTASK --output-dir RUNS", "100,000,000 characters"),
    # LoRA (plumbing/lora.py): ranges, targets, what it does not run with (--fsdp), adapter checkpoints gone wrong
    ("grpo_baseline.py --lora-rank -1", "--lora-rank (-1)"),
    ("spo_chain.py --lora-rank 4 --lora-dropout 1", "--lora-dropout (1.0)"),
    ("grpo_baseline.py --model TINY --task GOODTASK --lora-rank 999 --output-dir RUNS", "above the width"),
    ("spo_tree.py --model TINY --task GOODTASK --lora-rank 4 --lora-target qkv --output-dir RUNS", "--lora-target qkv"),
    ("ppo_baseline.py --lora-rank 4 --fsdp", "--fsdp with --lora-rank is not supported: with LoRA"),
    ("eval.py --model ADAPTERNOBASE --task GOODTASK", "is not there; put it back"),
    ("eval.py --model ADAPTERBADCONFIG --task GOODTASK", "not an adapter this project wrote"),
    ("grpo_baseline.py --model ADAPTERNOBASE --task GOODTASK --output-dir RUNS", "is an adapter checkpoint: --resume"),
    # adapters, merges, pipes and chat templates from elsewhere (tests/test_lora_inputs.py, test_model_dirs.py)
    ("eval.py --model ADAPTERSELF --task GOODTASK", "is itself an adapter checkpoint"),
    ("eval.py --model ADAPTERNANALPHA --task GOODTASK", "lora_alpha nan is not a number"),
    ("eval.py --model ADAPTERRANK --task GOODTASK", "(r 8) and its base model make [8,"),
    ("eval.py --model ADAPTERNANWEIGHT --task GOODTASK", "holds NaN or infinite values"),
    ("eval.py --model ADAPTERRELATIVE --task GOODTASK", "relative to where its run started"),
    ("grpo_baseline.py --resume LORAALPHARUN --iterations 2", "holds lora_alpha 800.0, the run's args.json"),
    ("grpo_baseline.py --model TINY --task GOODTASK --lora-rank 100000000 --output-dir RUNS", "narrowest adapted"),
    ("spo_chain.py --model TINY --task GOODTASK --lora-rank 4 --lora-target q_proj,typo", "no module named typo"),
    ("ppo_baseline.py --lora-rank 4 --lora-alpha 1e300", "--lora-alpha (1e+300)"),
    ("-m plumbing.checkpoints merge MERGED INSIDEMERGED", "which its run replaces at its next save"),
    ("-m plumbing.checkpoints merge ADAPTERSELF DANGLING", "dangling exists: give a new directory"),
    # a run and its resume disagree, adapters with peft options this project does not load (issue 78)
    ("-m plumbing.checkpoints merge CUTRUNOLD CUTRUNDEST", "which its run replaces at its next save"),
    ("-m plumbing.checkpoints merge ADAPTERSELF CUTRUNDEST", "which its run replaces at its next save"),
    ("-m plumbing.checkpoints merge ADAPTERDORA OUT.dora", "sets use_dora true: peft options this project does not"),
    ("eval.py --model ADAPTERHEAD --task GOODTASK", 'sets modules_to_save ["lm_head"]: peft options'),
    ("grpo_baseline.py --resume LORATARGETRUN --iterations 2", "where the run's args.json --lora-target q_proj,v_proj"),
    ("grpo_baseline.py --resume TASKRUN --iterations 2", "rewritten.jsonl was rewritten since the run started"),
    ("grpo_baseline.py --resume SAMPLERRUN --iterations 2", "memory.sampler_batch_tokens is -5, not a positive"),
    ("eval.py --model FIFOMODEL --task GOODTASK", "config.json is a named pipe, not a regular file"),
    ("grpo_baseline.py --model TINY --task FIFOTASK --output-dir RUNS", "fifo.jsonl is a named pipe"),
    ("eval.py --model NAMEDTEMPLATES --task GOODTASK", 'none named "default"'),
    ("eval.py --model NUMBERTEMPLATE --task GOODTASK", "is not Jinja text but the int 7"),
    ("spo_tree.py --model EMPTYTEMPLATE --task GOODTASK --output-dir RUNS", "as empty text"),
    # what others hand over (tests/inputs/test_handed_over.py, tests/test_viewer.py, tests/experiments/)
    ("grpo_baseline.py --resume FIFOSTATE", "trainer_state.pt is a named pipe, not a regular file"),
    ("eval.py --model ADAPTERFIFOBASE --task GOODTASK", "model.safetensors is a named pipe, not a regular file"),
    ("-m plumbing.checkpoints merge ADAPTERFIFOBASE OUT.merged", "model.safetensors is a named pipe"),
    ("-m plumbing.checkpoints merge ADAPTERESCBASE OUT.merged", "gone\\x1b[31mred is not there"),
    ("viewer.py html LINKESC -o OUT.html", "is a symbolic link (to \\x1b]0;owned\\x07)"),
    ("viewer.py curves LINKESC -o OUT.png", "is a symbolic link (to \\x1b]0;owned\\x07)"),
    ("viewer.py html DUPITER -o OUT.html", "iter_01.jsonl and iter_1.jsonl, which are both iteration 1"),
    ("IDENTICAL_WORK=USERWORK tools/identical_outputs.sh HEAD", "was not made by this tool"),
    ("-m experiments.learning_paired --pool TRUNCPOOL --out OUT.pooled.json", "is not valid JSON"),
    ("-m experiments.learning_paired --pool NANPOOL --out OUT.pooled.json", "scores.spo_chain_int20[1] is NaN, not"),
    ("-m experiments.learning_critical --tiny --out CRITICAL", "policy is null, not an object"),
    ("-m experiments.lora --settings r16 --out OUT.lora.json", "--settings r16: give full:RATE or rRANK:RATE"),
    ("-m experiments.lora --settings full:fast --out OUT.lora.json", "the rate fast is not a positive number"),
    ("-m experiments.learning --algorithms foo", "unknown algorithm"),
    ("-m experiments.learning --results EMPTY", "is a directory"),
    ("-m experiments.learning --lr 0", "--lr (0.0) must be positive"),
    ("-m experiments.credit_assignment --questions 0", "--questions (0)"),
    ("-m experiments.trl_side_by_side --steps 0", "--steps (0)"),
    ("-m benchmarks.logprob_memory --prompt-tokens -1", "--prompt-tokens (-1)"),
]


def run_case(command: str, text: str, fixtures: dict[str, str], cwd: Path, timeout: float = 300.0) -> dict:
    """Run one case; leading NAME=value words set the process's environment (a shell left from another launch)."""
    words = [fixtures.get(word, word) for word in command.split()]
    environment = dict(word.split("=", 1) for word in words[: next(i for i, w in enumerate(words) if "=" not in w)])
    environment = {name: fixtures.get(value, value) for name, value in environment.items()}
    words = words[len(environment) :]
    words = [
        str(cwd / "out" / word) if word.startswith("OUT.") else str(cwd / "runs") if word == "RUNS" else word
        for word in words
    ]
    started = time.time()
    program = ["-m", words[1], *words[2:]] if words[0] == "-m" else [str(ROOT / words[0]), *words[1:]]
    interpreter = "bash" if words[0].endswith(".sh") else sys.executable  # the tools are shell scripts
    environment.setdefault("PYTHONPATH", str(ROOT))  # for -m; a script finds the repository from its own folder
    process = subprocess.Popen(
        [interpreter, *program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **environment},
        # its own process group: a hung case is stopped with its children
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
        result = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return {
            "command": command,
            "expected": text,
            "exit_code": None,
            "stderr_line": f"still running after {timeout:.0f} s",
            "verdict": "hung",
            "seconds": round(time.time() - started, 1),
        }
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    error_line = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "")
    if "Traceback" in result.stderr:
        verdict = "traceback"
    elif result.returncode == 0:
        verdict = "silent"
    elif text not in (error_line if result.returncode != 2 else result.stderr):  # tyro's parse errors are a box
        verdict = "unclear"
    else:
        verdict = "ok"
    return {
        "command": command,
        "expected": text,
        "exit_code": result.returncode,
        "stderr_line": error_line[:300],
        "verdict": verdict,
        "seconds": round(time.time() - started, 1),
    }


def main(args: Args) -> list[dict]:
    cases = [(command, text) for command, text in CASES if args.only in command]
    with tempfile.TemporaryDirectory() as folder:
        fixtures = make_fixtures(Path(folder))
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            rows = list(pool.map(lambda case: run_case(*case, fixtures, Path(folder), args.timeout), cases))
    for row in rows:
        print(f"{row['verdict']:<9} exit {str(row['exit_code']):<4} {row['command']}\n          {row['stderr_line']}")
    counts = {
        verdict: sum(r["verdict"] == verdict for r in rows)
        for verdict in ("ok", "traceback", "silent", "unclear", "hung")
    }
    print(f"{len(rows)} cases: " + ", ".join(f"{n} {verdict}" for verdict, n in counts.items()))
    if not args.only:
        from plumbing.precision import cpu_description
        from plumbing.runs import code_state

        files.write_atomic(
            ROOT / args.out,
            json.dumps(
                {
                    "measured": time.strftime("%Y-%m-%d"),
                    **code_state(),  # commit, tree_modified
                    "machine": cpu_description(),
                    "counts": counts,
                    "cases": rows,
                },
                indent=1,
            ),
            "the probe's results",
        )
        print(f"-> {args.out}")
    return rows


if __name__ == "__main__":
    main(ranges.cli(Args))
