"""The policy loss every script shares (each has its own copy): PPO-clip surrogate + beta * k3 KL with both
log-ratios clamped to [-10, 10], checked against the SPEC's formula on random cases and at the clamp."""

import math

import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree

SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]


def reference_loss(logps, old_logps, ref_logps, advantages, mask, clip_eps, beta, batch_tokens, batch_sequences):
    """The SPEC's definition written out token by token in plain Python."""
    pg, kl = 0.0, 0.0
    for row in range(len(logps)):
        for t in range(len(logps[row])):
            if not mask[row][t]:
                continue
            ratio = math.exp(min(10.0, max(-10.0, logps[row][t] - old_logps[row][t])))
            a = advantages[row][t]
            pg -= min(ratio * a, min(1 + clip_eps, max(1 - clip_eps, ratio)) * a)
            d = min(10.0, max(-10.0, ref_logps[row][t] - logps[row][t]))
            kl += math.exp(d) - d - 1
    return pg / batch_tokens + beta * kl / batch_sequences


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_policy_loss_matches_the_formula_on_random_cases(script):
    g = torch.Generator().manual_seed(0)
    for case in range(20):
        rows, T = 1 + case % 3, 2 + case % 5
        logps = -torch.rand(rows, T, generator=g) * 4
        old_logps = logps + torch.randn(rows, T, generator=g) * (0.1 if case % 2 else 3.0)
        ref_logps = logps + torch.randn(rows, T, generator=g) * (0.1 if case % 3 else 15.0)  # some beyond the clamp
        advantages, mask = torch.randn(rows, T, generator=g), torch.rand(rows, T, generator=g) > 0.3
        batch_tokens, batch_sequences = int(mask.sum()) + 3, rows + 1  # a micro-batch of a bigger batch
        loss, stats = script.policy_loss(
            logps, old_logps, ref_logps, advantages, mask, 0.2, 0.05, batch_tokens, batch_sequences
        )
        expected = reference_loss(
            logps.tolist(),
            old_logps.tolist(),
            ref_logps.tolist(),
            advantages.tolist(),
            mask.tolist(),
            0.2,
            0.05,
            batch_tokens,
            batch_sequences,
        )
        assert loss.item() == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_kl_of_a_token_the_policy_ruled_out_is_clamped_not_infinite(script):
    logps = torch.tensor([[-200.0, -1.0]], requires_grad=True)  # the policy has all but ruled out token 0
    ref_logps, old_logps = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-200.0, -1.0]])
    loss, stats = script.policy_loss(
        logps,
        old_logps,
        ref_logps,
        torch.zeros(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
        clip_eps=0.2,
        beta=1.0,
        batch_tokens=2,
        batch_sequences=1,
    )
    assert stats["kl"] == pytest.approx(math.exp(10) - 10 - 1, rel=1e-5)  # d = 199.5 clamped to 10; token 1 adds 0
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
