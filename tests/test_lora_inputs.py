"""Adapter checkpoints and LoRA flags from elsewhere (plumbing/lora.py): edited adapter files and base records, a
relative --model, ranks and targets a model cannot take, NaN scales; and the merge command, atomic and kept out of
the run it reads. Each is one line naming the file or flag, or the designed behaviour; nothing is lost."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import grpo_baseline as grpo
from conftest import make_tiny_model, smoke_args, write_jsonl
from plumbing import UsageError, checkpoints, lora, models, ranges

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model directory, task, run directory, checkpoint) of a one-iteration LoRA run started with a relative --model
    from the folder that holds the model."""
    folder = tmp_path_factory.mktemp("lora_inputs")
    make_tiny_model(folder / "model", alphabet="0123456789 ")
    data = write_jsonl(folder / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        summary = grpo.main(smoke_args(grpo, "./model", data, folder / "runs", lora_rank=4, lr=1e-2, iterations=1))
    return folder / "model", data, Path(summary["run_dir"]), Path(summary["checkpoint"])


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "adapter"
    shutil.copytree(checkpoint, copy)
    return copy


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_relative_model_is_recorded_as_an_absolute_path_and_loads_from_anywhere(trained, tmp_path, monkeypatch):
    model_dir, _, _, checkpoint = trained
    record = json.loads((checkpoint / lora.BASE_RECORD).read_text())
    assert record["model"] == str(model_dir.resolve())
    assert json.loads((checkpoint / lora.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == record["model"]
    monkeypatch.chdir(tmp_path)  # another directory: eval.py and merge find the base
    model, _ = models.load_model(str(checkpoint), device="cpu")
    assert lora.has_adapters(model)
    # a record written relative (by an older run) names the fix, not a fingerprint mismatch
    old = copy_of(checkpoint, tmp_path)
    edit_json(old / lora.BASE_RECORD, model="./model")
    with pytest.raises(
        UsageError,
        match=r"base model ./model is not there \(relative to where its run started.*"
        r"write where it is now \(an absolute path\) into",
    ):
        models.load_model(str(old), device="cpu")


def test_a_base_record_naming_an_adapter_checkpoint_is_refused(trained, tmp_path):
    adapter = copy_of(trained[3], tmp_path)
    edit_json(adapter / lora.BASE_RECORD, model=str(adapter))  # itself: this recursed
    with pytest.raises(UsageError, match="is itself an adapter checkpoint; write the full model"):
        models.load_model(str(adapter), device="cpu")


def test_edited_adapter_files_are_refused_in_one_line(trained, tmp_path):
    model_dir, _, _, checkpoint = trained
    config_file = "adapter_config.json"
    for change, message in (
        ({"lora_alpha": float("nan")}, r"lora_alpha nan is not a number in \(0, 1e\+06\]"),
        ({"lora_alpha": 1e300}, r"lora_alpha 1e\+300 is not a number"),
        ({"r": 8}, r"holds base_model.model.*lora_A.weight of shape \[4, \d+\], where .* \(r 8\) .* make \[8, \d+\]"),
    ):
        adapter = copy_of(checkpoint, tmp_path / str(len(message)))
        edit_json(adapter / config_file, **change)
        with pytest.raises(UsageError, match=message):
            models.load_model(str(adapter), device="cpu")
    adapter = copy_of(checkpoint, tmp_path / "nan")
    weights = load_file(adapter / lora.ADAPTER_WEIGHTS)
    weights[next(k for k in weights if "lora_B" in k)][0, 0] = math.nan
    save_file(weights, adapter / lora.ADAPTER_WEIGHTS)
    with pytest.raises(UsageError, match="holds NaN or infinite values in .*lora_B.*: the adapter is damaged"):
        models.load_model(str(adapter), device="cpu")


def test_an_edited_alpha_is_refused_on_resume(trained, tmp_path):
    model_dir, data, run_dir, _ = trained
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    edit_json(run / "checkpoint" / lora.ADAPTER_CONFIG, lora_alpha=800)  # the run's is 2 x 4 = 8: 100x the scale
    with pytest.raises(
        UsageError,
        match=r"adapter_config.json holds lora_alpha 800.0, the run's args.json "
        r"--lora-alpha 8.*cannot change on --resume",
    ):
        grpo.main(
            smoke_args(grpo, model_dir, data, tmp_path / "unused", lora_rank=4, lr=1e-2, iterations=2, resume=str(run))
        )


def test_ranks_targets_and_alphas_a_model_cannot_take(trained):
    model_dir = trained[0]

    def adapted(**flags):
        return models.load_run_models(grpo.Args(model=str(model_dir), **flags), None, "cpu")

    started = time.monotonic()
    with pytest.raises(UsageError, match=r"--lora-rank 100000000 is above .* narrowest adapted layer \(32\)"):
        adapted(lora_rank=100_000_000)  # refused before peft allocates (tens of GB at this rank)
    assert time.monotonic() - started < 30
    with pytest.raises(UsageError, match="--lora-target q_proj,typo: the model has no module named typo"):
        adapted(lora_rank=4, lora_target="q_proj,typo")
    with pytest.raises(UsageError, match="--lora-target self_attn.q_proj,v_pro: the model has no module named v_pro"):
        adapted(lora_rank=4, lora_target="self_attn.q_proj,v_pro")
    model, _, _ = adapted(lora_rank=4, lora_target="self_attn.q_proj,v_proj")  # suffixes as peft matches them
    assert {n.split(".")[-1] for n in model.peft_wrapper.base_model.targeted_module_names} == {"q_proj", "v_proj"}
    field = ranges.field_range(grpo.Args, "lora_alpha")[0]
    assert field.contains(ranges.MAX_LORA_ALPHA) and not field.contains(1e300) and not field.contains(0.0)


def test_a_lora_run_prints_no_library_warning_a_user_cannot_act_on(trained, tmp_path, monkeypatch):
    model_dir = trained[0]
    monkeypatch.chdir(model_dir.parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.load_run_models(grpo.Args(model="./model", lora_rank=4), None, "cpu")
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "base_model_name_or_path" in m or "is_gradient_checkpointing" in m], messages


# The merge command, its tokenizer's save held until the test signals it: the weights are written by then.
MERGE_HELD = """import runpy, sys, time, transformers
def held(*args, **kwargs):
    print("writing the tokenizer", file=sys.stderr, flush=True)
    time.sleep(300)
transformers.PreTrainedTokenizerBase.save_pretrained = held
sys.argv = ["checkpoints.py", "merge", sys.argv[1], sys.argv[2]]
runpy.run_module("plumbing.checkpoints", run_name="__main__")
"""


def merge(checkpoint: Path, output: Path, held: bool = False) -> subprocess.Popen:
    command = ["-c", MERGE_HELD] if held else ["-m", "plumbing.checkpoints", "merge"]
    return subprocess.Popen(
        [sys.executable, *command, str(checkpoint), str(output)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default, whatever this process inherited (a background job ignores SIGINT, and so would the child)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_a_merge_stays_out_of_the_run_it_reads(trained, tmp_path):
    _, _, run_dir, checkpoint = trained
    for inside in (checkpoint / "merged", run_dir / "checkpoint.new" / "m", checkpoint):
        with pytest.raises(UsageError, match="(is inside .* which its run replaces at its next save|exists)"):
            checkpoints.merge_adapter(checkpoint, inside)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="dangling exists: give a new directory"):
        checkpoints.merge_adapter(checkpoint, dangling)


def test_a_merge_that_fails_or_is_stopped_leaves_nothing(trained, tmp_path, monkeypatch):
    checkpoint = trained[3]

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", full_disk)
    with pytest.raises(
        UsageError,
        match=r"cannot write the merged model to .*out \(.*No space left on device\); "
        "nothing was left there",
    ):
        checkpoints.merge_adapter(checkpoint, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # no OUTPUT, no staging folder
    monkeypatch.undo()
    # Ctrl-C or SIGTERM (as a scheduler sends) after the weights are written: one line, nothing left, a re-run works
    output = tmp_path / "merged"
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        process = merge(checkpoint, output, held=True)
        while "writing the tokenizer" not in process.stderr.readline():
            assert process.poll() is None, process.stderr.read()
        process.send_signal(stop)
        stderr = process.communicate(timeout=120)[1]
        assert process.returncode != 0 and "Traceback" not in stderr, stderr
        assert f"interrupted: nothing was written to {output}" in stderr
        assert list(tmp_path.iterdir()) == []
    process = merge(checkpoint, output)
    assert (
        process.wait(timeout=300) == 0 and (output / "config.json").is_file() and (output / "tokenizer.json").is_file()
    )


def test_a_merge_into_any_runs_checkpoint_folders_is_refused_whatever_the_source(trained, tmp_path):
    """A run whose last save was cut short has only checkpoint.old/: a merge of it into RUN/checkpoint (or of another
    adapter into any run's checkpoint folders) would be deleted by that run's next save or --resume."""
    _, _, run_dir, checkpoint = trained
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "checkpoint").rename(run / "checkpoint.old")
    for source, output in (
        (run / "checkpoint.old", run / "checkpoint"),
        (checkpoint, run / "checkpoint"),
        (checkpoint, run / "checkpoint.new" / "merged"),
        (checkpoint, run / "checkpoint.old" / "merged"),
    ):
        with pytest.raises(UsageError, match="which its run replaces at its next save: give a directory outside"):
            checkpoints.merge_adapter(source, output)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint.old"]
    # a folder named checkpoint that no run holds is a destination like any other
    checkpoints.merge_adapter(checkpoint, tmp_path / "elsewhere" / "checkpoint")
    assert (tmp_path / "elsewhere" / "checkpoint" / "config.json").is_file()


def test_an_args_json_whose_lora_target_was_edited_does_not_resume(trained, tmp_path, monkeypatch):
    """The run's adapters cover every linear layer (all-linear); an args.json edited to q_proj,v_proj would resume on
    them all the same, as if the run had adapted two."""
    from plumbing import settings

    model_dir, _, run_dir, _ = trained
    monkeypatch.chdir(model_dir.parent)  # the run's --model is ./model
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    edit_json(run / "args.json", lora_target="q_proj,v_proj")
    args = settings.saved_settings(grpo.Args, run)
    args.resume = str(run)
    with pytest.raises(
        UsageError,
        match=r"adapter_config.json puts adapters on down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj, where "
        r"the run's args.json --lora-target q_proj,v_proj names q_proj,v_proj: one of the two was edited",
    ):
        models.load_run_models(args, run / "checkpoint", "cpu")
    edit_json(run / "args.json", lora_target="all-linear")  # as it was: resumes
    args.lora_target = "all-linear"
    assert lora.has_adapters(models.load_run_models(args, run / "checkpoint", "cpu")[0])
