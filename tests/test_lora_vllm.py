"""LoRA in the vLLM engine (the fake vllm of test_vllm_glue.py, which keeps a digest of the weights it receives and
runs no model): the engine starts from the base model and receives the adapted policy as merged weights, W + alpha /
R B A computed out of place in fp32 under the base model's own names, after every update and on a resume; the
training model is never merged in place."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.vllm_ranks_run import digests
from safetensors import safe_open
from test_vllm_glue import calls, engine  # noqa: F401 (the fake-vllm fixture)

from conftest import SMOKE_SETTINGS, cli_flags, read_metrics
from plumbing import lora, models
from plumbing.engines import VLLMSampler

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_names(model_dir: Path) -> dict[str, tuple]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        return {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}


def trained_adapters(model_dir: Path, base_dtype=None):
    """The tiny model with rank-4 adapters whose B is no longer zero (as after some updates)."""
    model, _ = models.load_model(str(model_dir), dtype=torch.float32, device="cpu")
    lora.add_adapters(model, lora.lora_config(4, None, 0.0, lora.DEFAULT_TARGET), base_dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("base_dtype", [None, torch.bfloat16])
def test_the_engine_receives_peft_s_merge_under_the_base_names_and_the_model_stays_unmerged(
    engine,  # noqa: F811
    tiny_model_dir,
    base_dtype,
):
    engine.weights = checkpoint_names(tiny_model_dir)  # FakeWorker: every name a base checkpoint name, each once
    model = trained_adapters(tiny_model_dir, base_dtype)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sampler = VLLMSampler(str(tiny_model_dir), max_model_len=64, dtype="float32")
    sampler.load_weights(model)
    [(_, pushed, _, _)] = calls(engine, "reload_weights")
    assert not any("lora_" in name or "base_layer" in name or name.startswith("base_model.") for name, _ in pushed)

    # peft's own merge, of a copy held in fp32
    reference = copy.deepcopy(model)
    for parameter in reference.parameters():
        parameter.data = parameter.data.float()
    merged = dict(reference.peft_wrapper.merge_and_unload().named_parameters())
    assert set(dict(pushed)) == set(merged)
    for name, tensor in pushed:
        assert tensor.dtype == torch.float32
        assert torch.allclose(tensor, merged[name], atol=1e-6, rtol=0), name
    adapted = [name for name, _ in pushed if name.endswith("proj.weight")]
    base = dict(models.load_model(str(tiny_model_dir), dtype=torch.float32, device="cpu")[0].named_parameters())
    assert adapted and all(not torch.equal(dict(pushed)[n], base[n].to(dict(pushed)[n].dtype)) for n in adapted)

    # the training model is untouched: same tensors, same values, adapters still separate and on
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert not any(getattr(m, "merged", False) for m in model.modules())


def engine_run(out: Path, *flags: str) -> dict:
    """A script run in one process with the fake vLLM (tests/helpers/vllm_ranks_run.py): what its engine was built
    with and received."""
    out.mkdir(parents=True, exist_ok=True)
    driver = ROOT / "tests" / "helpers" / "vllm_ranks_run.py"
    command = [sys.executable, str(driver), str(out), "script", "grpo_baseline.py"]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.slow
def test_a_lora_run_samples_the_adapted_policy_in_vllm_and_its_resume_too(tiny_model_dir, gsm8k_jsonl, tmp_path):
    settings = {
        **SMOKE_SETTINGS["grpo_baseline"],
        "questions": 2,
        "batch_size": 8,
        "micro_batch_size": 4,
        "max_new_tokens": 10,
        "context": 160,
        "iterations": 2,
        "model": str(tiny_model_dir),
        "task": str(gsm8k_jsonl),
        "output_dir": str(tmp_path / "runs"),
        "backend": "vllm",
        "lora_rank": 4,
        "lr": 1e-2,
        "precision": "fp32",  # a subprocess: the fp32 fixture does not reach it (bf16 would hold the base in bf16)
        "top_p": 1.0,  # vLLM's sampled log-probs are the trainer's quantity only at top-p 1 (sampler/* logged)
    }
    first = engine_run(tmp_path / "first", *cli_flags(settings))
    (run_dir,) = (tmp_path / "runs").iterdir()
    checkpoint = run_dir / "checkpoint"
    assert lora.is_adapter_checkpoint(checkpoint)
    base_names = set(checkpoint_names(tiny_model_dir))

    # Built from the base model (an adapter checkpoint is no model directory); after every update the merged policy,
    # under the base's names; the last sync is the checkpoint's adapters merged onto the base, as peft merges them.
    assert first["model"] == str(tiny_model_dir)
    cycle = ["sleep", "wake_up ['weights']", "reload_weights", "wake_up ['kv_cache']", "reset_prefix_cache"]
    assert first["events"] == cycle * 2
    assert all(set(sync) == base_names for sync in first["syncs"])
    initial = digests(models.load_model(str(tiny_model_dir), dtype=torch.float32)[0].named_parameters())
    adapted, _ = models.load_model(str(checkpoint), dtype=torch.float32)
    merged = digests(adapted.peft_wrapper.merge_and_unload().named_parameters())
    assert first["syncs"][-1] == merged and initial != first["syncs"][0] != first["syncs"][1]
    assert any("sampler/kl_per_token" in m for m in read_metrics(run_dir))  # the sampler-vs-trainer gap is logged

    # The resume: the engine again from the base, then the checkpoint's merge before anything is sampled.
    # (--iterations 4: the learning rate decays to 0 at a run's end; the later updates move the weights)
    resumed = engine_run(tmp_path / "resumed", "--resume", str(run_dir), "--iterations", "4")
    assert resumed["model"] == str(tiny_model_dir)
    assert resumed["events"][:2] == ["reload_weights", "reset_prefix_cache"] and resumed["events"][2:] == cycle * 2
    assert resumed["syncs"][0] == merged and resumed["syncs"][-1] != merged
