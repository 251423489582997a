"""grpo_baseline.py's algorithm functions: group advantages, the loss, the probability mask, whitening."""

import doctest

import pytest
import torch

import grpo_baseline as grpo
from plumbing import UsageError


def test_docstring_examples():
    assert doctest.testmod(grpo).failed == 0


def test_group_advantages_worked_example():
    advantages = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    # group 1: mean 1/3, population std sqrt(2)/3; group 2: all equal -> zeros, not NaN
    expected = torch.tensor([2**0.5, -(2**0.5) / 2, -(2**0.5) / 2, 0.0, 0.0, 0.0])
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_group_advantages_matches_definition_on_random_groups():
    torch.manual_seed(0)
    rewards = torch.rand(5 * 4)
    advantages = grpo.group_advantages(rewards, 4)
    for g in range(5):
        r = rewards[g * 4 : (g + 1) * 4]
        assert torch.allclose(
            advantages[g * 4 : (g + 1) * 4], (r - r.mean()) / (r.std(unbiased=False) + 1e-8), atol=1e-5
        )


def test_policy_loss_at_ratio_one_is_minus_mean_advantage_plus_kl():
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    advantages = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = grpo.policy_loss(
        logps, logps, ref, advantages, mask, 0.2, beta=0.5, batch_tokens=2, batch_sequences=1
    )
    k3 = lambda d: torch.exp(d) - d - 1  # noqa: E731
    kl = (k3(ref - logps)[0, :2]).sum()
    assert stats["kl"] == pytest.approx(kl.item(), rel=1e-5)
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2 + 0.5 * kl.item(), rel=1e-5)
    assert stats["clip_count"] == 0


def test_policy_loss_clips_the_ratio():
    old = torch.zeros(1, 2)
    logps = torch.tensor([[0.5, -0.5]])  # ratios e^0.5 = 1.65 and e^-0.5 = 0.61, both outside [0.8, 1.2]
    loss, stats = grpo.policy_loss(
        logps, old, logps, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.2, 0.0, 2, 1
    )
    # positive advantage: min(1.65, 1.2) * 1 = 1.2; negative: min(0.61 * -1, 0.8 * -1) = -0.8
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2, rel=1e-5)
    assert stats["clip_count"] == 2


def test_prob_mask_and_fallback():
    response = torch.tensor([True, True, True, False])
    probs = torch.tensor([0.95, 0.5, 0.89, 0.1])
    assert grpo.loss_mask(response, probs, 0.9, prob_mask=False).tolist() == [True, True, True, False]
    assert grpo.loss_mask(response, probs, 0.9, prob_mask=True).tolist() == [False, True, True, False]
    confident = torch.tensor([0.95, 0.99, 0.91, 0.1])
    assert grpo.loss_mask(response, confident, 0.9, prob_mask=True).tolist() == [True, True, True, False]


def test_whiten_uses_masked_tokens_only():
    advantages = torch.tensor([1.0, 3.0, 100.0])
    out = grpo.whiten(advantages, torch.tensor([True, True, False]))
    assert out[:2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)


def test_impossible_batch_configuration_is_one_clear_error():
    with pytest.raises(UsageError, match="multiple of --micro-batch-size"):
        grpo.validate(grpo.Args(batch_size=6, micro_batch_size=4))
    with pytest.raises(UsageError, match="group-size"):
        grpo.validate(grpo.Args(group_size=1))
