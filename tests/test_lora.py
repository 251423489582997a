"""LoRA (--lora-rank > 0, plumbing/lora.py): frozen base, trained adapters, the base as the reference, the HF sampler
on the adapted policy, adapter checkpoints that resume, evaluate and merge, and one line for each bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_baseline as grpo
import ppo_baseline as ppo
import spo_tree
from conftest import killed_at_step, make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import UsageError, engines, lora, models, settings, training
from plumbing.engines import HFSampler

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A digits-only tiny model and a task whose answer is always 7 (rewards vary within groups)."""
    directory = tmp_path_factory.mktemp("digits")
    model_dir = make_tiny_model(directory / "model", alphabet="0123456789 ")
    data = write_jsonl(directory / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    return model_dir, data


def adapted(model_dir, rank=4, beta=0.1, **overrides):
    args = grpo.Args(model=str(model_dir), lora_rank=rank, beta=beta, **overrides)
    return models.load_run_models(args, None, "cpu")


def push_towards(model, tokenizer, text: str, steps: int = 5, lr: float = 0.05):
    """A few optimizer steps making `text` likely after any digit: enough to change greedy output."""
    optimizer = torch.optim.Adam(lora.trainable_parameters(model), lr=lr)
    batch = training.collate(
        [{"prompt_ids": tokenizer(p)["input_ids"], "response_ids": tokenizer(text)["input_ids"]} for p in "0123"],
        tokenizer.pad_token_id,
        model.device,
    )
    for _ in range(steps):
        optimizer.zero_grad()
        (-training.response_logprobs(model, batch, 1.0).sum()).backward()
        optimizer.step()


def test_rank_0_wraps_nothing_and_rank_r_freezes_the_base(digits):
    model_dir, _ = digits
    plain, _, reference = models.load_run_models(grpo.Args(model=str(model_dir)), None, "cpu")
    assert not lora.has_adapters(plain) and all(p.requires_grad for p in plain.parameters())
    assert isinstance(reference, torch.nn.Module)  # beta > 0: a separately loaded reference model
    model, _, reference = adapted(model_dir)
    assert lora.has_adapters(model) and isinstance(reference, lora.AdaptersOff) and reference.policy is model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in lora.trainable_parameters(model))
    # every linear layer of the attention and MLP blocks, never the LM head
    adapted_layers = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n in trainable if ".lora_A." in n}
    assert adapted_layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    optimizer, _ = training.make_optimizer(model, 1e-3, 0.0, 0.0, 10)
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for p in lora.trainable_parameters(model)
    }


def test_only_adapters_train_and_every_adapter_gets_a_gradient(digits):
    model_dir, _ = digits
    model, tokenizer, _ = adapted(model_dir)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    push_towards(model, tokenizer, "777", steps=2)  # B starts at 0: A's gradient is 0 until B has moved
    model.zero_grad()
    batch = training.collate(
        [{"prompt_ids": tokenizer("12")["input_ids"], "response_ids": tokenizer("77")["input_ids"]}], 0, "cpu"
    )
    (-training.response_logprobs(model, batch, 1.0).sum()).backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert parameter.grad is None and torch.equal(parameter, frozen[name]), name


def test_the_reference_is_the_base_model(digits):
    # Right because the adapters start at zero; after an update the adapters-off pass still gives the base's numbers.
    model_dir, _ = digits
    model, tokenizer, reference = adapted(model_dir)
    push_towards(model, tokenizer, "777")
    base, _ = models.load_model(str(model_dir), dtype=torch.float32, device="cpu")
    samples = [{"prompt_ids": tokenizer("12 3")["input_ids"], "response_ids": tokenizer("4 77")["input_ids"]}]
    with models.on_device(reference):
        off = training.sample_logprobs(reference, samples, 4, 0.6, 0)
    on = training.sample_logprobs(model, samples, 4, 0.6, 0)  # and the adapters are back on afterwards
    expected = training.sample_logprobs(base, samples, 4, 0.6, 0)
    assert torch.allclose(off[0], expected[0], atol=1e-6)
    assert (on[0] - expected[0]).abs().max() > 1e-2


def test_the_hf_sampler_samples_the_adapted_policy(digits):
    model_dir, _ = digits
    model, tokenizer, _ = adapted(model_dir)
    base, _ = models.load_model(str(model_dir), dtype=torch.float32, device="cpu")
    prompts = [tokenizer(p)["input_ids"] for p in ("12", "3 4")]
    greedy = dict(temperature=0.0, top_p=1.0, max_new_tokens=4)
    before = [c.ids for g in HFSampler(model, tokenizer).sample(prompts, 1, **greedy) for c in g]
    assert before == [c.ids for g in HFSampler(base, tokenizer).sample(prompts, 1, **greedy) for c in g]
    push_towards(model, tokenizer, "7777")
    after = [c.ids for g in HFSampler(model, tokenizer).sample(prompts, 1, **greedy) for c in g]
    assert after != before and after == [tokenizer("7777")["input_ids"]] * 2


def test_adapter_checkpoint_resumes_evaluates_and_merges(digits, tmp_path, monkeypatch):
    model_dir, data = digits
    lora_args = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2, iterations=3)
    full = grpo.main(smoke_args(grpo, model_dir, data, tmp_path / "full", **lora_args))
    checkpoint = Path(full["checkpoint"])
    assert {p.name for p in checkpoint.iterdir()} >= {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.BASE_RECORD}
    assert not (checkpoint / "config.json").exists() and not list(checkpoint.glob("*.bin"))

    # kill in iteration 3 (2 optimizer steps per iteration: the 5th is its first) and --resume: the uninterrupted run
    with killed_at_step(monkeypatch, grpo, 5):
        grpo.main(smoke_args(grpo, model_dir, data, tmp_path / "killed", **lora_args))
    run_dir = next((tmp_path / "killed").iterdir())
    grpo.main(smoke_args(grpo, model_dir, data, tmp_path / "unused", **lora_args, resume=str(run_dir)))
    assert read_metrics(run_dir) == read_metrics(full["run_dir"])
    # the HF sampler is the adapted training model itself: the sampler-vs-trainer gap is logged, at rounding (fp32)
    gaps = [m["sampler/kl_per_token"] for m in read_metrics(run_dir) if "sampler/kl_per_token" in m]
    assert len(gaps) == 3 and max(gaps) < 1e-6
    # a --lora-* setting changed on resume: refused in one line
    with pytest.raises(UsageError, match="--lora-rank"):
        grpo.main(
            smoke_args(grpo, model_dir, data, tmp_path / "unused", **{**lora_args, "lora_rank": 8}, resume=str(run_dir))
        )

    # evaluation loads the adapter onto its recorded base; peft itself reads the same files
    trained, tokenizer = models.load_model(str(checkpoint), dtype=torch.float32, device="cpu")
    ids = torch.tensor([tokenizer("12 3 77")["input_ids"]])
    logits = trained(ids).logits
    from peft import PeftModel

    base, _ = models.load_model(str(model_dir), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert (logits - base(ids).logits).abs().max() > 1e-3  # the adapter moved the policy
        peft_model = PeftModel.from_pretrained(base, str(checkpoint))
        assert torch.allclose(peft_model(ids).logits, logits, atol=1e-5)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "eval.py"),
            "--model",
            str(checkpoint),
            "--task",
            str(data),
            "--limit",
            "2",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]

    # the merge command: a plain transformers directory, the same numbers
    merged = tmp_path / "merged"
    result = subprocess.run(
        [sys.executable, "-m", "plumbing.checkpoints", "merge", str(checkpoint), str(merged)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (merged / "config.json").exists() and not (merged / lora.ADAPTER_CONFIG).exists()
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, logits, atol=1e-5)
    assert not any("lora" in name for name in plain.state_dict())


@pytest.mark.parametrize("script", [grpo, ppo], ids=["grpo", "ppo"])
def test_a_bf16_lora_run_killed_and_resumed_logs_what_the_uninterrupted_one_logs(script, digits, tmp_path, monkeypatch):
    """The frozen base of a resumed run is in bf16 as a fresh run's is (not the fp32 it loads in), so a run killed in
    iteration 2 and resumed takes the uninterrupted run's steps."""
    model_dir, data = digits
    lora_args = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2, iterations=2, precision="bf16")
    full = script.main(smoke_args(script, model_dir, data, tmp_path / "full", **lora_args))
    with killed_at_step(monkeypatch, script, 3):  # 2 optimizer steps an iteration: the 3rd is iteration 2's first
        script.main(smoke_args(script, model_dir, data, tmp_path / "killed", **lora_args))
    run_dir = next((tmp_path / "killed").iterdir())
    script.main(smoke_args(script, model_dir, data, tmp_path / "unused", **lora_args, resume=str(run_dir)))
    assert read_metrics(run_dir) == read_metrics(full["run_dir"])


def test_ppo_and_spo_tree_train_with_adapters(digits, tmp_path):
    # PPO's critic keeps a plain copy of the backbone, trained in full; the policy trains its adapters alone.
    model_dir, data = digits
    summary = ppo.main(smoke_args(ppo, model_dir, data, tmp_path / "ppo", lora_rank=4, lr=1e-2))
    checkpoint = Path(summary["checkpoint"])
    critic = torch.load(checkpoint / "critic.pt", weights_only=True)
    assert not any("lora" in key for key in critic) and lora.is_adapter_checkpoint(checkpoint)
    policy, _, _ = models.load_run_models(ppo.Args(model=str(model_dir), lora_rank=4), None, "cpu", wrap=False)
    made = ppo.make_critic(policy)
    assert all(p.requires_grad for p in made.parameters()) and not any("lora" in n for n, _ in made.named_parameters())
    summary = spo_tree.main(smoke_args(spo_tree, model_dir, data, tmp_path / "tree", lora_rank=4, lr=1e-2))
    assert lora.is_adapter_checkpoint(summary["checkpoint"])
    assert any("losses/kl_per_sequence" in m for m in read_metrics(summary["run_dir"]))


def test_bad_lora_input_is_one_line_each(digits, tmp_path):
    model_dir, data = digits
    with pytest.raises(UsageError, match=r"--lora-rank 99 is above the width of the narrowest adapted layer \(32\)"):
        adapted(model_dir, rank=99)
    with pytest.raises(UsageError, match="--lora-target nothing_here: .*give module names the model has"):
        adapted(model_dir, lora_target="nothing_here")
    problems = settings.setting_problems(
        grpo.Args(lora_rank=4, fsdp=True), lambda *a, **k: [], engines.backend_problems
    )
    assert any("--fsdp with --lora-rank is not supported" in p and "leave out --fsdp (DDP" in p for p in problems)
    vllm = settings.setting_problems(
        grpo.Args(lora_rank=4, backend="vllm"), lambda *a, **k: [], engines.backend_problems
    )
    assert not any("lora" in p for p in vllm), vllm  # vLLM samples the merged adapters (tests/test_lora_vllm.py)
    result = subprocess.run(
        [sys.executable, str(ROOT / "grpo_baseline.py"), "--lora-rank", "-1", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr and "--lora-rank" in result.stderr

    # an adapter checkpoint whose base is gone, or another model
    summary = grpo.main(smoke_args(grpo, model_dir, data, tmp_path / "run", lora_rank=4, iterations=1))
    checkpoint = Path(summary["checkpoint"])
    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    record = json.loads((moved / lora.BASE_RECORD).read_text())
    (moved / lora.BASE_RECORD).write_text(json.dumps({**record, "model": str(tmp_path / "gone")}))
    with pytest.raises(UsageError, match="its base model .*gone is not there; put it back"):
        models.load_model(str(moved))
    other = make_tiny_model(tmp_path / "other", alphabet="0123456789 +")  # another vocabulary: another fingerprint
    with pytest.raises(UsageError, match="is not the one it was trained on"):
        models.load_model(str(checkpoint), base=str(other))
    with pytest.raises(UsageError, match="is an adapter checkpoint: --resume its run, or start from its merged model"):
        adapted(checkpoint)
    (moved / lora.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 0, "lora_alpha": 8}))
    with pytest.raises(UsageError, match="r 0 is not a positive integer"):
        models.load_model(str(moved), base=str(model_dir))
