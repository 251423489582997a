"""plumbing.training.response_logprobs, which every script uses: LM head in chunks, recomputed in backward when the
logits are large (kept when small), equal to the full logits either way; the no-grad passes (sample_logprobs) cut
by a token budget sized to free GPU memory (no_grad_batch_tokens), with the same log-probs for any budget."""

import random
import types

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from plumbing import UsageError, distributed, models, training
from plumbing.precision import Precision


def _full_logits_logprobs(model, samples, temperature):
    """Reference: log_softmax of the model's own full logits, one sequence at a time."""
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logits = model(ids).logits[0, :-1] / temperature  # [T - 1, vocab]
        out.append(
            torch.log_softmax(logits, -1)[len(s["prompt_ids"]) - 1 :]
            .gather(-1, ids[0, len(s["prompt_ids"]) :, None])
            .squeeze(-1)
        )
    return out


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(recompute, tiny_model_dir):
    model, _ = models.load_model(str(tiny_model_dir))
    samples = [
        {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23, 24, 25]},
    ]
    weights = [torch.randn(len(s["response_ids"])) for s in samples]

    model.zero_grad()
    expected = _full_logits_logprobs(model, samples, 0.7)
    sum((w * lp).sum() for w, lp in zip(weights, expected)).backward()
    expected_grad = torch.cat([p.grad.flatten() for p in model.parameters()])

    model.zero_grad()
    batch = training.collate(samples, 0, "cpu")
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    # 2 rows x 5 positions x vocab logits: over 0 entries they are recomputed, under the default 2**28 kept
    limit = {"recompute_above": 0} if recompute else {}
    logps = training.response_logprobs(model, batch, 0.7, chunk_tokens=3, **limit)  # 4 chunks, one cut mid-row
    for row, (w, lp) in enumerate(zip(weights, expected)):
        assert torch.allclose(logps[row, : len(lp)], lp, atol=1e-5)
    sum((w * logps[row, : len(w)]).sum() for row, w in enumerate(weights)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grad.abs().sum() > 0 and torch.allclose(grad, expected_grad, atol=1e-5)
    assert len(head_calls) == (8 if recompute else 4)  # each chunk's LM head ran again in backward only when recomputed


def test_models_that_change_logits_after_the_lm_head_are_refused(tiny_model_dir):
    model, _ = models.load_model(str(tiny_model_dir))
    models.check_logits_from_hidden(model)  # Llama: logits = lm_head(hidden)
    config = Gemma2Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=0.5,
    )
    with pytest.raises(UsageError, match="soft-capping"):
        models.check_logits_from_hidden(Gemma2ForCausalLM(config))


# Three rows continue one prompt, two continue a shorter one (left-padded in the micro-batch), one is alone.
SHARED_PROMPTS = [
    {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
    {"prompt_ids": [20], "response_ids": [21, 22, 23, 24]},
    {"prompt_ids": [10, 11, 12], "response_ids": [15]},
    {"prompt_ids": [20], "response_ids": [25, 26]},
    {"prompt_ids": [10, 11, 12], "response_ids": [16, 17, 18]},
    {"prompt_ids": [30, 31], "response_ids": [32, 33]},
]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["cached", "activation-checkpointed"])
def test_rows_of_one_prompt_share_its_forward_pass_with_the_gradient_of_separate_passes(checkpointed, tiny_model_dir):
    model, _ = models.load_model(str(tiny_model_dir))
    model.train()  # activation checkpointing acts in training mode only (the tiny Llama has no dropout)
    weights = [torch.randn(len(s["response_ids"])) for s in SHARED_PROMPTS]
    model.zero_grad()
    expected = _full_logits_logprobs(model, SHARED_PROMPTS, 0.7)
    sum((w * lp).sum() for w, lp in zip(weights, expected)).backward()
    expected_grad = torch.cat([p.grad.flatten() for p in model.parameters()])

    if checkpointed:
        model.activation_checkpointing_enable()
    model.zero_grad()
    batch = training.collate(SHARED_PROMPTS, 0, "cpu")
    assert batch["prompt_of_row"].tolist() == [0, 1, 0, 1, 0, 2]
    assert batch["prompt_ids"].tolist() == [[10, 11, 12], [0, 0, 20], [0, 30, 31]]
    shapes = []  # [rows, positions] of every forward pass
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    logps = training.response_logprobs(model, batch, 0.7)
    # each distinct prompt runs once, then the responses on its keys and values; checkpointed layers take no
    # KV cache, so there every row runs prompt and response in one pass
    assert shapes == ([(6, 7)] if checkpointed else [(3, 3), (6, 4)])
    for row, (w, lp) in enumerate(zip(weights, expected)):
        assert torch.allclose(logps[row, : len(lp)], lp, atol=1e-5)
    sum((w * logps[row, : len(w)]).sum() for row, w in enumerate(weights)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grad.abs().sum() > 0 and torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)
    shapes.clear()
    with torch.no_grad():  # a pass without gradients checkpoints nothing: prompts are shared again
        assert torch.allclose(training.response_logprobs(model, batch, 0.7), logps, atol=1e-6)
    assert shapes == [(3, 3), (6, 4)]


def test_shared_prompts_with_sliding_window_layers_keep_the_full_logits():
    """A sliding-window layer caches only its window: the responses that continue it must still attend as in one
    pass."""
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,  # layer 2 slides
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    samples = [  # prompts longer than the window, shared by two rows
        {"prompt_ids": [10, 11, 12, 9, 8], "response_ids": [13, 14, 15, 16]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23, 24, 25]},
        {"prompt_ids": [10, 11, 12, 9, 8], "response_ids": [3]},
    ]
    expected = _full_logits_logprobs(model, samples, 0.7)
    logps = training.response_logprobs(model, training.collate(samples, 0, "cpu"), 0.7)
    for row, lp in enumerate(expected):
        assert torch.allclose(logps[row, : len(lp)], lp, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# No-grad passes: a token budget instead of the training micro-batch


def _random_samples(count: int, seed: int = 0) -> list[dict]:
    """Rows over a few shared prompts (as a question's responses, a tree node's children), lengths all different."""
    rng = random.Random(seed)
    prompts = [[rng.randint(4, 90) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    return [
        {"prompt_ids": rng.choice(prompts), "response_ids": [rng.randint(4, 90) for _ in range(rng.randint(1, 15))]}
        for _ in range(count)
    ]


def test_micro_batches_keep_the_row_limit_split_and_hold_a_token_budget():
    rng = random.Random(1)
    for _ in range(300):
        samples = _random_samples(rng.randint(1, 30), seed=rng.randint(0, 10**6))
        size = rng.randint(1, 9)
        # the update's split (and a CPU's no-grad passes): consecutive runs of `size` rows of one of the two orders
        assert all(len(micro) == size for micro in training.micro_batches(samples, size)[:-1])
        budget = rng.randint(1, 200)
        micros = training.micro_batches(samples, max_positions=budget)
        assert sorted(i for micro in micros for i in micro) == list(range(len(samples)))
        for micro in micros:  # rows x (longest prompt + longest response) within the budget, or one sample alone
            cached = len(micro) * (
                max(len(samples[i]["prompt_ids"]) for i in micro) + max(len(samples[i]["response_ids"]) for i in micro)
            )
            assert cached <= budget or len(micro) == 1


def test_log_probs_do_not_depend_on_the_budget(tiny_model_dir):
    model, _ = models.load_model(str(tiny_model_dir))
    samples = _random_samples(40)
    one_by_one = training.sample_logprobs(model, samples, 1, 0.7, 0)
    for micro_batch_size, budget in ((3, None), (40, None), (1, 30), (1, 100), (1, 1000), (1, 10**6)):
        logps = training.sample_logprobs(model, samples, micro_batch_size, 0.7, 0, batch_tokens=budget)
        # not bit-equal: padding changes the order of fp32 sums; a few ulps of log-probs near -5
        assert all(torch.allclose(a, b, rtol=0, atol=2e-6) for a, b in zip(one_by_one, logps))
    assert [len(lp) for lp in one_by_one] == [len(s["response_ids"]) for s in samples]


def test_the_budget_is_the_micro_batch_on_a_cpu_and_grows_with_free_gpu_memory(tiny_model_dir, monkeypatch):
    model, _ = models.load_model(str(tiny_model_dir))
    samples = _random_samples(8)
    assert training.no_grad_batch_tokens(model, samples) is None  # a CPU: the passes keep the micro-batches
    calls = []
    monkeypatch.setattr(
        training,
        "micro_batches",
        lambda s, m=None, max_positions=None: calls.append((m, max_positions)) or [list(range(len(s)))],
    )
    training.sample_logprobs(model, samples, 4, 0.7, 0)
    assert calls == [(4, None)]

    # DeepSeek-R1-Distill-Qwen-1.5B's shape on a GPU (faked: no CUDA here), at the paper's 2K context
    config = Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    weights = types.SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: 1_777_088_000)
    gpu_model = types.SimpleNamespace(parameters=lambda: iter([weights]), config=config)
    long_rows = [{"prompt_ids": [1] * 1024, "response_ids": [2] * 1024}]
    free = {"free": 40 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["free"], 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * 2**30)  # 2 GiB cached by torch count as free
    bf16 = Precision(bf16=frozenset({"cuda"}))
    budget = training.no_grad_batch_tokens(gpu_model, long_rows, bf16)
    assert 8 * 2048 < budget < 42 * 2**30 / 100_000  # more than the micro-batch of 8 rows; over 100 kB per position
    assert training.no_grad_batch_tokens(gpu_model, long_rows) < budget  # fp32: every activation twice the bytes
    free["free"] = 80 * 2**30
    assert budget < training.no_grad_batch_tokens(gpu_model, long_rows, bf16) < 3 * budget
    monkeypatch.setattr(distributed, "is_sharded", lambda model: True)  # --fsdp, shards not gathered: micro-batches
    assert training.no_grad_batch_tokens(gpu_model, long_rows, bf16) is None


def test_every_rank_draws_its_own_random_stream(monkeypatch):
    """torch's CPU generator (mt19937) reads a seed's low 32 bits only: ranks whose seeds differ above them (seed +
    (rank << 32)) drew identical streams. rank_seed keeps rank 0's seed (a single-process run's) and parts the rest."""
    from plumbing import distributed

    draws = []
    for rank in range(4):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        draws.append(
            torch.rand(4, generator=torch.Generator().manual_seed(distributed.rank_seed(3 * 1_000_003 + 2))).tolist()
        )
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    assert distributed.rank_seed(12345) == 12345
    assert len({tuple(d) for d in draws}) == 4
    # the trap itself
    assert torch.equal(
        torch.rand(4, generator=torch.Generator().manual_seed(7)),
        torch.rand(4, generator=torch.Generator().manual_seed(7 + (1 << 32))),
    )
