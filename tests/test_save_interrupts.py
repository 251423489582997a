"""A kill or signal at any step of a checkpoint save leaves a run that --resume continues to the same numbers."""

import shutil
from pathlib import Path

import pytest
import torch

import grpo_baseline as grpo
from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import checkpoints, run_lock

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

# The steps of save_checkpoint, in order, and where an interrupt lands in each.
STEPS = ["writing checkpoint.new", "checkpoint -> checkpoint.old", "checkpoint.new -> checkpoint", "removing .old"]


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    """Digits and a task whose every answer is 7: rewards vary, so every save follows a real update."""
    folder = tmp_path_factory.mktemp("sevens")
    model = make_tiny_model(folder / "digits", alphabet="0123456789 ")
    data = write_jsonl(folder / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    return model, data


@pytest.fixture
def uninterrupted(sevens, tmp_path):
    # function scope: the autouse fp32 fixture (conftest) is in force, as for the interrupted run
    return read_metrics(grpo.main(smoke_args(grpo, *sevens, tmp_path / "full", iterations=3))["run_dir"])


def interrupt_at(step: str, monkeypatch):
    """Make the save of iteration 2 raise KeyboardInterrupt (what Ctrl-C and SIGTERM raise) at `step`."""
    saves = []
    real_save, real_rename, real_remove = torch.save, Path.rename, checkpoints._remove

    def save(obj, path, *args, **kwargs):
        if Path(path).name == "trainer_state.pt":
            saves.append(1)
            if len(saves) == 2 and step == STEPS[0]:
                Path(path).write_bytes(b"PK\x03\x04 half of a trainer state")
                raise KeyboardInterrupt
        return real_save(obj, path, *args, **kwargs)

    def rename(self, target):
        if len(saves) == 2 and (self.name, Path(target).name) in {
            ("checkpoint", "checkpoint.old") if step == STEPS[1] else None,
            ("checkpoint.new", "checkpoint") if step == STEPS[2] else None,
        }:
            raise KeyboardInterrupt
        return real_rename(self, target)

    def remove(path):
        if len(saves) == 2 and path.name == "checkpoint.old" and path.exists() and step == STEPS[3]:
            (path / "trainer_state.pt").unlink()  # part of the tree is gone when the signal lands
            raise KeyboardInterrupt
        return real_remove(path)

    monkeypatch.setattr(checkpoints.torch, "save", save)
    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(checkpoints, "_remove", remove)


@pytest.mark.parametrize("step", STEPS)
def test_an_interrupt_at_each_step_of_a_save_resumes_to_the_uninterrupted_numbers(
    step, sevens, uninterrupted, tmp_path, monkeypatch
):
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        interrupt_at(step, patch)
        grpo.main(smoke_args(grpo, *sevens, tmp_path / "runs", iterations=3))
    run_lock.release_run()  # cli.run_cli's finally
    [run_dir] = (tmp_path / "runs").iterdir()
    left = sorted(p.name for p in run_dir.glob("checkpoint*"))
    assert left != ["checkpoint"] or step == STEPS[0], left  # the interrupt left the swap part-way

    resumed = grpo.main(smoke_args(grpo, *sevens, tmp_path / "unused", iterations=3, resume=str(run_dir)))
    assert read_metrics(resumed["run_dir"]) == uninterrupted
    assert sorted(p.name for p in run_dir.glob("checkpoint*")) == ["checkpoint"]
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 3


def _checkpoint(directory: Path, iteration: int, state: str) -> None:
    """A checkpoint folder in `state`: whole, damaged (its trainer state cut short), or a link to a whole one."""
    if state == "link":
        target = directory.with_name(directory.name + "-target")
        _checkpoint(target, iteration, "whole")
        directory.symlink_to(target)
        return
    directory.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, directory / "model.safetensors")
    torch.save({"iteration": iteration}, directory / "trainer_state.pt")
    if state == "damaged":
        data = (directory / "trainer_state.pt").read_bytes()
        (directory / "trainer_state.pt").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("final", ["absent", "whole", "damaged"])
@pytest.mark.parametrize("staging", ["absent", "whole", "damaged", "link"])
@pytest.mark.parametrize("previous", ["absent", "whole", "damaged", "link"])
def test_settle_leaves_the_newest_whole_checkpoint_alone(final, staging, previous, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name, state, iteration in (
        ("checkpoint", final, 3),
        ("checkpoint.new", staging, 4),
        ("checkpoint.old", previous, 2),
    ):
        if state != "absent":
            _checkpoint(run_dir / name, iteration, state)
    expected = 3 if final == "whole" else 2 if previous == "whole" else None

    checkpoints.settle(run_dir)
    names = sorted(p.name for p in run_dir.iterdir())
    if expected is None:
        assert "checkpoint.new" not in names and "checkpoint.old" not in names
    else:
        assert names == ["checkpoint"] + sorted(n for n in names if n.endswith("-target"))
        assert checkpoints.load_trainer_state(checkpoints.latest_checkpoint(run_dir))["iteration"] == expected
    assert all((tmp_path / "run" / n).exists() for n in names if n.endswith("-target"))  # links removed, not followed


def test_a_save_after_an_interrupted_removal_succeeds(tmp_path):
    """The reported failure: checkpoint/ and checkpoint.old/ both left; the next save died ('Directory not empty')."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _checkpoint(run_dir / "checkpoint", 3, "whole")
    _checkpoint(run_dir / "checkpoint.old", 2, "whole")
    model_dir = make_tiny_model(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    checkpoints.save_checkpoint(run_dir, model, tokenizer, {"iteration": 4})
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint"]
    assert checkpoints.load_trainer_state(run_dir / "checkpoint")["iteration"] == 4
    shutil.rmtree(run_dir)
