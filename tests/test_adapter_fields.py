"""Every field peft writes into adapter_config.json is honoured or refused by name (plumbing/lora.py,
read_adapter_config): an adapter with rslora or per-layer alpha and rank merges, evaluates and syncs as peft's own
merge_and_unload computes it; one with an option this project does not load is refused in one line naming it; a run's
checkpoint whose scales or targets were edited does not resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from conftest import make_tiny_model
from plumbing import UsageError, checkpoints, lora, models

SCALED = {
    "rslora": {"use_rslora": True},
    "alpha_pattern": {"alpha_pattern": {"q_proj": 64}},
    "rank_pattern": {"rank_pattern": {"down_proj": 8}, "alpha_pattern": {"down_proj": 3}},
    "rslora_and_patterns": {"use_rslora": True, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"o_proj": 16}},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fields") / "base", alphabet="0123456789 ")


def peft_adapter(base: Path, directory: Path, **options) -> dict[str, torch.Tensor]:
    """Write an adapter as peft itself writes it (A and B random, so every layer moves), with this project's base
    record and the tokenizer beside it; returns peft's own merge_and_unload of it (a state dict)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **options)
    wrapped = get_peft_model(model, config)
    wrapped.save_pretrained(directory)
    record = {"model": str(base), "fingerprint": models.fingerprint(str(base))}
    (directory / lora.BASE_RECORD).write_text(json.dumps(record))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, directory)
    return {k: v.detach().clone() for k, v in wrapped.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize("options", SCALED.values(), ids=SCALED.keys())
def test_a_scaled_adapter_merges_syncs_and_evaluates_as_peft_merges_it(options, base, tmp_path):
    expected = peft_adapter(base, tmp_path / "adapter", **options)
    # the merge command
    checkpoints.merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    for name, tensor in expected.items():
        if name in merged:
            assert torch.allclose(merged[name], tensor, atol=1e-6), name
    assert any(not torch.equal(expected[k], v) for k, v in load_file(base / "model.safetensors").items())
    # eval.py's load and the vLLM engine's weight sync (merged_parameters)
    model, _ = models.load_model(str(tmp_path / "adapter"), dtype=torch.float32, device="cpu")
    synced = dict(lora.merged_parameters(model))
    for name, tensor in synced.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name


@pytest.mark.parametrize("options", SCALED.values(), ids=SCALED.keys())
def test_a_run_checkpoint_whose_scales_were_edited_does_not_resume(options, base, tmp_path):
    """A run trains at alpha / rank on every layer (its args.json has no rslora nor patterns): a checkpoint that says
    otherwise was edited, and resuming it would train at other scales from the next step on."""
    peft_adapter(base, tmp_path / "checkpoint", **options)
    model, _ = models.load_model(str(tmp_path / "checkpoint"), dtype=torch.float32, device="cpu")
    run_config = lora.lora_config(4, 8.0, 0.0, lora.DEFAULT_TARGET, str(base))
    fields = "|".join(options)
    with pytest.raises(UsageError, match=rf"checkpoint/adapter_config.json holds ({fields}) .* the file was edited"):
        lora.train_adapters(model, run_config, source=str(tmp_path / "checkpoint"))


def test_a_resumed_adapter_keeps_its_scales_and_saves_them_back(base, tmp_path):
    peft_adapter(base, tmp_path / "checkpoint")
    model, _ = models.load_model(str(tmp_path / "checkpoint"), dtype=torch.float32, device="cpu")
    scales = {name: model.get_submodule(name).scaling["default"] for name in lora.adapted_modules(model)}
    run_config = lora.lora_config(4, 8.0, 0.0, lora.DEFAULT_TARGET, str(base))
    lora.train_adapters(model, run_config, source=str(tmp_path / "checkpoint"))
    assert scales and set(scales.values()) == {2.0}
    lora.save_adapter(model, tmp_path / "again", str(base), models.fingerprint(str(base)))
    again, _ = models.load_model(str(tmp_path / "again"), dtype=torch.float32, device="cpu")
    assert {name: again.get_submodule(name).scaling["default"] for name in lora.adapted_modules(again)} == scales


REFUSED = {
    "use_dora": True,
    "modules_to_save": ["lm_head"],
    "bias": "all",
    "layers_to_transform": [0],
    "fan_in_fan_out": True,
    "lora_bias": True,
    "exclude_modules": ["q_proj"],
    "init_lora_weights": "pissa",
    "layer_replication": [[0, 1]],
    "trainable_token_indices": [1, 2],
    "a_field_from_a_newer_peft": {"x": 1},
}


@pytest.mark.parametrize("field, value", REFUSED.items(), ids=REFUSED.keys())
def test_an_option_this_project_does_not_load_is_refused_by_name(field, value, base, tmp_path):
    peft_adapter(base, tmp_path / "adapter")
    path = tmp_path / "adapter" / lora.ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(UsageError, match=rf"adapter_config.json sets {field} .*merge it with peft itself") as error:
        models.load_model(str(tmp_path / "adapter"), device="cpu")
    assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match=rf"sets {field} "):
        checkpoints.merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_fields_at_their_defaults_or_only_about_initialisation_load(base, tmp_path):
    peft_adapter(base, tmp_path / "adapter")
    path = tmp_path / "adapter" / lora.ADAPTER_CONFIG
    defaults = {"use_dora": False, "modules_to_save": None, "bias": "none", "layers_to_transform": None}
    path.write_text(json.dumps({**json.loads(path.read_text()), **defaults, "init_lora_weights": "gaussian"}))
    assert lora.has_adapters(models.load_model(str(tmp_path / "adapter"), device="cpu")[0])


def test_a_rank_pattern_above_a_layers_width_is_refused_before_peft_allocates(base, tmp_path):
    peft_adapter(base, tmp_path / "adapter")
    path = tmp_path / "adapter" / lora.ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), "rank_pattern": {"k_proj": 10**8}}))
    with pytest.raises(UsageError, match=r"rank_pattern's rank 100000000 for model.layers.0.self_attn.k_proj is above"):
        models.load_model(str(tmp_path / "adapter"), device="cpu")
