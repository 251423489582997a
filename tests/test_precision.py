"""--precision: every forward pass of a run (rollouts, MC values / trees, log-probs, the update, evaluation) follows
the chosen precision, the master weights stay fp32, and the choice is recorded with each start of the run."""

import json
from pathlib import Path

import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import read_metrics, smoke_args
from plumbing import models
from plumbing import precision as precision_module

SCRIPTS = [grpo_baseline, ppo_baseline, spo_chain, spo_tree]


@pytest.fixture
def lm_head_dtypes(monkeypatch) -> list:
    """The output dtype of every LM-head call of the models a run loads (the 4-token model check, fp32 by design,
    excluded)."""
    dtypes, load, check = [], models.load_model, models.check_logits_from_hidden

    def load_and_watch(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        model.get_output_embeddings().register_forward_hook(lambda module, inputs, logits: dtypes.append(logits.dtype))
        return model, tokenizer

    monkeypatch.setattr(models, "load_model", load_and_watch)
    monkeypatch.setattr(models, "check_logits_from_hidden", lambda model: (check(model), dtypes.clear()))
    return dtypes


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_bf16_run_computes_in_bf16_keeps_fp32_weights_and_records_the_choice(
    script, tiny_model_dir, gsm8k_jsonl, tmp_path, lm_head_dtypes
):
    summary = script.main(smoke_args(script, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1, precision="bf16"))
    run_dir = Path(summary["run_dir"])
    # sampler, log-prob passes, update and evaluation alike
    assert lm_head_dtypes and set(lm_head_dtypes) == {torch.bfloat16}
    start = json.loads((run_dir / "starts.jsonl").read_text().splitlines()[-1])
    assert "cpu bf16 autocast (--precision bf16)" in start["precision"]
    weights, _ = models.load_model(str(run_dir / "checkpoint"))
    assert all(p.dtype == torch.float32 for p in weights.parameters())
    assert all(v == v for m in read_metrics(run_dir) for v in m.values() if isinstance(v, float))  # finite, no NaN


def test_fp32_run_computes_in_fp32(tiny_model_dir, gsm8k_jsonl, tmp_path, lm_head_dtypes):
    summary = grpo_baseline.main(
        smoke_args(grpo_baseline, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1, precision="fp32")
    )
    assert lm_head_dtypes and set(lm_head_dtypes) == {torch.float32}
    start = json.loads((Path(summary["run_dir"]) / "starts.jsonl").read_text().splitlines()[-1])
    assert "cpu fp32 (--precision fp32)" in start["precision"]


@pytest.mark.parametrize("gpu, hardware_bf16", [("A100", True), ("V100", False)])
def test_bf16_only_where_the_gpu_has_it(monkeypatch, gpu, hardware_bf16):
    # torch.cuda.is_bf16_supported() counts emulation by default: a V100 answers True, computes bf16 slowly, and
    # vLLM refuses bfloat16 there. Only hardware bf16 (compute capability 8.0+) counts.
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return hardware_bf16 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert precision_module.fast_bf16("cuda")[0] is hardware_bf16
    assert precision_module.engine_dtype() == ("bfloat16" if hardware_bf16 else "float16")
    assert ("cuda bf16 autocast" in precision_module.choose_precision("auto", "cuda").line) is hardware_bf16
    assert asked and not any(asked)


def test_no_gpu_no_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision_module.fast_bf16("cuda")[0] is False and precision_module.engine_dtype() == "float16"
