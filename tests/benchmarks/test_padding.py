"""benchmarks/padding.py: its three ways of running a batch give the same gradient, and it counts the positions each
computes."""

import pytest
import torch

from benchmarks import padding as bench
from plumbing import models

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)


def _samples():
    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt in ([10, 11, 12, 13], [20, 21], [30, 31, 32]):
        for n in (2, 5, 3):
            samples.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": torch.randint(4, 60, (n,), generator=g).tolist(),
                    "advantages": torch.randn(n, generator=g),
                    "loss_mask": torch.ones(n, dtype=torch.bool),
                }
            )
    return samples


def test_positions_count_each_prompt_run_and_each_padded_response():
    samples = _samples()  # 3 prompts (4, 2, 3 tokens) x responses of 2, 5, 3 tokens
    split = [[0, 1, 3], [2, 4, 5, 6, 7, 8]]
    # per row: 3 x (4 + 5) + 6 x (4 + 5) positions; tokens (4 + 4 + 2) + (2 + 5 + 2) and
    # (4 + 2 + 2 + 3 + 3 + 3) + (3 + 5 + 3 + 2 + 5 + 3)
    assert bench.positions(samples, split, shared=False) == (27 + 54, 19 + 38)
    # shared: prompts {4, 2} then {4, 2, 3} tokens run once each: 2 x 4 + 3 x 5 and 3 x 4 + 6 x 5 positions
    assert bench.positions(samples, split, shared=True) == (23 + 42, (6 + 9) + (9 + 21))


def test_the_three_ways_give_the_same_gradient(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    model.train()
    grads = {way: bench.timed_update(model, _samples(), way, tokenizer.pad_token_id)[1] for way in bench.WAYS}
    reference = torch.cat([g.flatten() for g in grads["arrival_order"]])
    assert reference.abs().sum() > 0
    for way in ("by_length", "micro_batches"):
        grad = torch.cat([g.flatten() for g in grads[way]])
        assert (grad - reference).abs().max() <= 1e-5 * reference.abs().max()
