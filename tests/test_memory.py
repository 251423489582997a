"""plumbing/memory.py: the `auto` memory knobs. The formula's terms against measured bytes, its choices on GPUs of
24, 80 and 141 GiB for the paper's models, and how a run resolves, records and resumes them."""

import json
import types

import pytest
import torch
import transformers

from plumbing import UsageError, lora, memory, training
from plumbing.precision import FP32, choose_precision

GiB = 2**30
# DeepSeek-R1-Distill-Qwen-1.5B (the long-CoT runs) and Rho-1B (TinyLlama shape: the GSM8K runs), from their configs.
QWEN_1_5B = transformers.Qwen2Config(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=False,
)
RHO_1B = transformers.LlamaConfig(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def long_cot_plan(total_gib: float, backend: str = "vllm", **overrides) -> memory.Plan:
    """The plan for SPO-tree's long-CoT run (context 2048, batch 128) on one GPU with `total_gib`, half a GiB in use."""
    settings = dict(
        total=int(total_gib * GiB),
        free=int((total_gib - 0.5) * GiB),
        context=2048,
        batch_per_rank=128,
        backend=backend,
        beta=1e-4,
        requested={},
    )
    return memory.plan(memory.model_shape(QWEN_1_5B), **{**settings, **overrides})


@pytest.mark.parametrize(
    "config",
    [
        transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            tie_word_embeddings=False,
        ),
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
    ],
)
def test_parameter_count_is_the_models(config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert memory.model_shape(config).params == sum(p.numel() for p in model.parameters())


def test_paper_model_has_its_published_size():
    assert memory.model_shape(QWEN_1_5B).params == 1_777_088_000  # "1.5B" counts the tied-size backbone; 1.78B untied


def _saved_bytes_per_token(config, checkpointing: bool, lora_rank: int = 0) -> float:
    """Bytes autograd saves for the backward pass per response token of response_logprobs under bf16 autocast (the
    slope between 4 rows of 256 and of 512 tokens, so the weights' bf16 copies and per-row terms cancel); with
    lora_rank, adapters on every linear layer of a frozen bf16 base, as a LoRA run trains."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().train()
    if lora_rank:
        lora.add_adapters(model, lora.lora_config(lora_rank, None, 0.0, lora.DEFAULT_TARGET), torch.bfloat16)
    if checkpointing:
        model.activation_checkpointing_enable()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    precision = choose_precision("bf16", "cpu")

    def saved(length: int) -> int:
        samples = [
            {"prompt_ids": [1, 2, 3, 4], "response_ids": torch.randint(5, config.vocab_size - 1, (length,)).tolist()}
            for _ in range(4)
        ]
        storages = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            training.response_logprobs(model, training.collate(samples, 0, "cpu"), 1.0, precision=precision)
        return sum(storages.values())

    return (saved(512) - saved(256)) / (4 * 256)


@pytest.mark.parametrize("hidden,intermediate,heads,kv_heads", [(256, 1408, 8, 2), (128, 1024, 4, 4)])
def test_activation_term_matches_what_autograd_saves(hidden, intermediate, heads, kv_heads):
    config = transformers.Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    shape = memory.model_shape(config)
    logits = 4 * config.vocab_size  # fp32 logits per token, kept for the backward pass at this size
    measured = _saved_bytes_per_token(config, checkpointing=False)
    assert measured == pytest.approx(memory.activation_bytes_per_token(shape, False) + logits, rel=0.10)
    # With checkpointing the forward pass saves each layer's input; the one layer recomputed at a time is in the
    # formula but appears only during the backward pass.
    one_layer = memory.activation_bytes_per_token(shape, True) - 4 * shape.layers * hidden - 8 * hidden
    measured = _saved_bytes_per_token(config, checkpointing=True)
    assert measured == pytest.approx(memory.activation_bytes_per_token(shape, True) - one_layer + logits, rel=0.15)


def test_141_gib_trains_the_long_cot_run_at_micro_batch_8_with_everything_on_the_gpu():
    plan = long_cot_plan(141)
    assert (plan.micro_batch_size, plan.gradient_checkpointing, plan.reference_on_device) == (8, False, True)
    assert 95 <= plan.peak_gb <= 125  # 28 GiB of training state, 7 of reference, ~60 of activations
    assert 0.55 <= plan.vllm_gpu_memory_utilization <= 0.8  # the rest, less the weights, AdamW and the no-grad passes
    assert plan.fits and "computed" in plan.line


def test_80_gib_halves_the_micro_batch_rather_than_recompute():
    plan = long_cot_plan(80)
    assert (plan.micro_batch_size, plan.gradient_checkpointing, plan.reference_on_device) == (4, False, True)
    assert plan.peak_gb <= 80 - 0.05 * 80 - 1
    assert 0.35 <= plan.vllm_gpu_memory_utilization <= 0.6


def test_24_gib_refuses_the_1_5b_model_with_the_flags_that_would_help():
    with pytest.raises(UsageError) as refused:
        long_cot_plan(24)
    message = str(refused.value)
    assert "--micro-batch-size 1" in message and "--gradient-checkpointing True" in message and "--fsdp" in message
    assert "24 GiB" in message


def test_24_gib_fits_the_1b_gsm8k_run_with_the_hf_sampler_by_recomputing_and_parking_the_reference():
    settings = dict(total=24 * GiB, free=int(23.5 * GiB), context=2047, batch_per_rank=64, beta=1e-4, requested={})
    plan = memory.plan(memory.model_shape(RHO_1B), backend="hf", **settings)
    assert plan.gradient_checkpointing and not plan.reference_on_device and plan.micro_batch_size >= 1
    assert plan.peak_gb <= 23.5 - 0.05 * 24 - 1
    # vLLM's engine beside the weights, AdamW and the no-grad passes' room does not fit: refused, naming the HF sampler
    with pytest.raises(UsageError, match="--backend hf"):
        memory.plan(memory.model_shape(RHO_1B), backend="vllm", **settings)


def test_vllm_share_leaves_the_no_grad_passes_their_room():
    """The old-log-prob and reference passes run while the engine is awake, after the first update made AdamW's
    state: weights, AdamW, the engine's share and those passes' room must fit together."""
    from plumbing.memory import no_grad_pass_bytes

    shape = memory.model_shape(QWEN_1_5B)
    for total in (80, 141):
        plan = long_cot_plan(total)
        per_position, once = no_grad_pass_bytes(shape, 2, 2048)
        awake = (
            12 * shape.params
            + plan.vllm_gpu_memory_utilization * total * GiB
            + 4 * shape.params
            + once
            + 2048 * per_position
        )
        assert awake <= (total - 0.5) * GiB - 0.05 * total * GiB - GiB, total
        assert plan.vllm_gpu_memory_utilization * total * GiB >= 2 * shape.params + 2 * GiB  # its weights and more


def test_more_memory_never_chooses_a_slower_setting():
    previous = None
    for total in range(50, 200, 10):
        plan = long_cot_plan(total)
        key = (not plan.gradient_checkpointing, plan.micro_batch_size, plan.reference_on_device)
        assert previous is None or key >= previous, total
        previous = key


def test_given_values_are_kept_and_a_warning_is_planned_when_they_exceed_the_estimate():
    plan = long_cot_plan(80, requested={"micro_batch_size": 8, "gradient_checkpointing": False})
    assert (plan.micro_batch_size, plan.gradient_checkpointing) == (8, False)
    assert not plan.fits and "as given" in plan.line
    plan = long_cot_plan(141, requested={"vllm_gpu_memory_utilization": 0.3, "sampler_batch_tokens": 4096})
    assert (plan.vllm_gpu_memory_utilization, plan.sampler_batch_tokens) == (0.3, 4096)


def test_ppo_counts_its_critic_and_fsdp_divides_the_state():
    alone, ppo = long_cot_plan(141), long_cot_plan(141, second_model=True)
    assert ppo.peak_gb > alone.peak_gb + 28  # a second fp32 training state
    with pytest.raises(UsageError):
        long_cot_plan(40)
    sharded = long_cot_plan(40, fsdp_ranks=8, batch_per_rank=16)  # refused on one 40 GiB GPU, fits over eight
    assert sharded.fits and sharded.peak_gb <= 40 - 0.05 * 40 - 1


def test_micro_batch_divides_the_ranks_batch():
    plan = long_cot_plan(141, batch_per_rank=6)
    assert plan.micro_batch_size == 6
    assert memory.micro_batch_candidates(12, "auto") == [6, 4, 3, 2, 1]


def test_cpu_keeps_todays_values():
    args = types.SimpleNamespace(
        micro_batch_size="auto",
        gradient_checkpointing="auto",
        reference_on_device="auto",
        vllm_gpu_memory_utilization="auto",
        sampler_batch_tokens="auto",
        batch_size=64,
        fsdp=False,
    )
    plan = memory.size_run(args, "cpu", FP32, "unused")
    assert (plan.micro_batch_size, plan.gradient_checkpointing, plan.reference_on_device) == (8, False, True)
    assert (plan.vllm_gpu_memory_utilization, plan.sampler_batch_tokens) == (0.3, 2**16)
    assert "CPU" in plan.line
    assert args.micro_batch_size == "auto"  # args is left as given: main() takes the plan's settings
    args = types.SimpleNamespace(
        micro_batch_size=2,
        gradient_checkpointing=True,
        reference_on_device="auto",
        vllm_gpu_memory_utilization="auto",
        sampler_batch_tokens="auto",
        batch_size=6,
        fsdp=False,
    )
    plan = memory.size_run(args, "cpu", FP32, "unused", first_start={"memory": {"sampler_batch_tokens": 1234}})
    assert (plan.micro_batch_size, plan.gradient_checkpointing, plan.sampler_batch_tokens) == (2, True, 1234)


def test_cuda_sizes_from_free_memory_and_the_models_config(monkeypatch, capsys):
    """size_run on a (faked) 80 GiB GPU: the model's config from its directory, free memory from CUDA."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(79.5 * GiB), 80 * GiB))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path, **kw: QWEN_1_5B)
    args = types.SimpleNamespace(
        micro_batch_size="auto",
        gradient_checkpointing="auto",
        reference_on_device="auto",
        vllm_gpu_memory_utilization="auto",
        sampler_batch_tokens="auto",
        batch_size=128,
        fsdp=False,
        context=2048,
        backend="hf",
        beta=1e-4,
        precision="auto",
    )
    plan = memory.size_run(args, "cuda", FP32, "some/model")  # fp32 chosen: the sampler's KV in fp32
    expected = long_cot_plan(80, backend="hf", element=4)
    assert plan.settings() == expected.settings()
    assert plan.micro_batch_size == 4 and plan.gradient_checkpointing is False
    assert "micro-batch 4" in capsys.readouterr().out


def test_a_run_records_its_sizing_keeps_auto_in_its_settings_and_resumes_with_its_sampler_batch(tmp_path, capsys):
    import grpo_baseline as grpo
    from plumbing import run_lock, runs, settings

    def open_run(args):  # as each script's main() opens its run
        run_dir, checkpoint, first_start = runs.locate_run(args)
        plan = memory.size_run(args, "cpu", FP32, str(checkpoint or args.model), first_start)
        return runs.open_run(run_dir, args, "precision line", "cpu", plan), plan

    args = grpo.Args(output_dir=str(tmp_path), batch_size=6)
    run_dir, plan = open_run(args)
    run_lock.release_run()
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["micro_batch_size"] == "auto" and saved["sampler_batch_tokens"] == "auto"
    assert plan.micro_batch_size == 6 and args.micro_batch_size == "auto"  # the plan resolves; args stays as given
    start = json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])
    assert start["memory"]["micro_batch_size"] == 6 and start["memory"]["sampler_batch_tokens"] == 2**16
    # A resumed run takes the sampler batch its first start chose, whatever this machine would choose now.
    start["memory"]["sampler_batch_tokens"] = 777
    (run_dir / "starts.jsonl").write_text(json.dumps(start) + "\n")
    resumed = settings.saved_settings(grpo.Args, run_dir)
    resumed.resume = str(run_dir)
    _, plan = open_run(resumed)
    run_lock.release_run()
    assert plan.sampler_batch_tokens == 777
    assert json.loads((run_dir / "starts.jsonl").read_text().splitlines()[1])["memory"]["sampler_batch_tokens"] == 777


def test_readme_table_is_what_memory_plan_prints():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("memory_plan", root / "benchmarks" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (root / "RUNNING.md").read_text()
    block = readme.split(module.BEGIN, 1)[1].split(module.END, 1)[0].strip()
    assert block == f"{module.table()}\n\n{module.tree_iteration()}", "run: python -m benchmarks.memory_plan --write"


def test_resume_repeats_with_the_sampler_batch_auto_chose_at_the_first_start(
    tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch
):
    """auto may size the sampler's batches differently on the machine that resumes; the run keeps its first choice,
    so the resumed run samples what the uninterrupted one did."""
    from pathlib import Path

    import grpo_baseline as grpo
    from conftest import smoke_args

    def run(name: str, **settings) -> Path:
        settings = {
            "iterations": 2,
            "context": 160,
            "save_samples": 1,
            "save_questions": 3,
            "eval_before": False,
            **settings,
        }
        return Path(grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / name, **settings))["run_dir"])

    def responses(run_dir: Path) -> list:
        return [
            [
                json.loads(line)["token_ids"]
                for line in (run_dir / "samples" / f"iter_{i}.jsonl").read_text().splitlines()
            ]
            for i in (1, 2)
        ]

    monkeypatch.setattr(memory, "CPU_SAMPLER_TOKENS", 48)  # the first machine's choice: one row of a prompt per batch
    full, first = run("full"), run("first", iterations=1)
    monkeypatch.setattr(memory, "CPU_SAMPLER_TOKENS", 2**16)  # the resuming machine would choose otherwise
    other = run("other")
    assert responses(other) != responses(full)  # the batches do change what is sampled
    resumed = run("unused", resume=str(first))
    assert resumed == first and responses(resumed) == responses(full)


SMALL_QWEN = transformers.Qwen2Config(
    hidden_size=256,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


@pytest.mark.parametrize("target", [lora.DEFAULT_TARGET, "q_proj,v_proj,down_proj"])
def test_adapter_count_is_what_peft_trains(target):
    model = transformers.AutoModelForCausalLM.from_config(SMALL_QWEN)
    lora.add_adapters(model, lora.lora_config(8, None, 0.0, target))
    trained = sum(p.numel() for p in lora.trainable_parameters(model))
    assert memory.adapter_params(memory.model_shape(SMALL_QWEN), 8, target) == trained


def test_lora_activations_stay_within_the_full_fine_tuning_term():
    """LoRA's backward keeps each adapted layer's input for its adapter, not for the frozen weight: measured 5-10 %
    below full fine-tuning at this size, so the plan counts activations as for full fine-tuning (an upper bound)."""
    full = memory.activation_bytes_per_token(memory.model_shape(SMALL_QWEN), False) + 4 * SMALL_QWEN.vocab_size
    measured = _saved_bytes_per_token(SMALL_QWEN, checkpointing=False, lora_rank=16)
    assert 0.8 * full <= measured <= full


def test_lora_fits_the_long_cot_run_on_24_gib_and_counts_no_reference():
    shape = memory.model_shape(QWEN_1_5B)
    adapters = memory.adapter_params(shape, 16)
    assert 18e6 < adapters < 19e6  # 1 % of the model
    plan = long_cot_plan(24, adapters=adapters)  # refused in full fine-tuning (the test above)
    assert plan.fits and plan.peak_gb <= 24 - 0.5 - 0.05 * 24 - 1 and plan.vllm_gpu_memory_utilization >= 0.5
    assert "reference: the base (adapters off)" in plan.line
    # The state: a bf16 base (2 P) and the adapters' 16 bytes each, against 16 P + a 4 P reference in full
    full, adapted = long_cot_plan(141, beta=0.0), long_cot_plan(141, beta=0.0, adapters=adapters)
    assert full.micro_batch_size == adapted.micro_batch_size
    assert (full.peak_gb - adapted.peak_gb) * GiB == pytest.approx(
        (16 + 2 - 2) * shape.params - 16 * adapters - 2 * adapters, rel=0.02
    )
    with pytest.raises(UsageError, match="--lora-rank 16"):  # full fine-tuning's refusal names LoRA
        long_cot_plan(24)


def test_a_7b_model_with_lora_fits_24_gib_with_the_hf_sampler_not_beside_vllm():
    shape = memory.model_shape(
        transformers.Qwen2Config(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
        )
    )
    adapters = memory.adapter_params(shape, 16)
    settings = dict(total=24 * GiB, free=int(23.5 * GiB), context=2048, batch_per_rank=128, beta=1e-4, requested={})
    with pytest.raises(UsageError, match="--backend hf"):
        memory.plan(shape, backend="vllm", adapters=adapters, **settings)
    plan = memory.plan(shape, backend="hf", adapters=adapters, **settings)
    assert plan.fits and plan.gradient_checkpointing
    assert memory.plan(shape, backend="vllm", adapters=adapters, **{**settings, "total": 40 * GiB, "free": 39 * GiB})


def test_a_lora_resume_sizes_from_its_base_models_config(monkeypatch, tmp_path):
    """An adapter checkpoint has no config.json: the plan reads its base's (base_model.json)."""
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "base_model.json").write_text(json.dumps({"model": "some/base", "fingerprint": None}))
    read = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(23.5 * GiB), 24 * GiB))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path, **kw: read.append(path) or QWEN_1_5B)
    args = types.SimpleNamespace(
        **dict.fromkeys(memory.KNOBS, "auto"),
        batch_size=128,
        fsdp=False,
        context=2048,
        backend="vllm",
        beta=1e-4,
        lora_rank=16,
        lora_target=lora.DEFAULT_TARGET,
    )
    plan = memory.size_run(args, "cuda", choose_precision("bf16", "cuda"), str(tmp_path))
    assert read == ["some/base"] and plan.adapters and plan.fits
