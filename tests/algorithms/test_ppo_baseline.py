"""ppo_baseline.py's algorithm functions: GAE, the clipped value loss, the policy loss, the probability mask, the
non-finite guard, bad configurations."""

import doctest

import pytest
import torch

import ppo_baseline as ppo
from plumbing import UsageError, bookkeeping


def test_docstring_examples():
    assert doctest.testmod(ppo).failed == 0


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, -0.1, 0.9]])
    advantages, returns = ppo.gae_advantages(rewards, values, torch.ones(1, 4, dtype=torch.bool))
    assert torch.allclose(advantages, 1.0 - values)
    assert torch.allclose(returns, torch.ones(1, 4))  # every state's target is the final reward


def test_gae_worked_by_hand_with_gamma_and_lambda_below_one():
    # T = 3, gamma 0.9, lambda 0.8, reward 1 on the last token, V = (0.5, 0.6, 0.7), V after the end = 0:
    # delta_2 = 1 + 0 - 0.7 = 0.3                 A_2 = 0.3
    # delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03        A_1 = 0.03 + 0.72 * 0.3 = 0.246
    # delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04        A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    advantages, returns = ppo.gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.8
    )
    assert advantages[0].tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)


def test_gae_lambda_zero_is_one_step_td():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    advantages, _ = ppo.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.0)
    assert advantages[0].tolist() == pytest.approx([0.9 * 0.6 - 0.5, 0.9 * 0.7 - 0.6, 1.0 - 0.7], abs=1e-6)


def test_gae_padding_is_ignored_and_gives_the_unpadded_result():
    torch.manual_seed(0)
    lengths = [5, 2, 3]
    rows = [(torch.rand(n), torch.rand(n)) for n in lengths]
    for rewards, _ in rows:
        rewards[:-1] = 0.0  # terminal reward only, as in training
    padded_rewards = torch.full((3, 5), 7.0)  # garbage in the padding must not leak in
    padded_values = torch.full((3, 5), -3.0)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, (rewards, values) in enumerate(rows):
        padded_rewards[i, : lengths[i]], padded_values[i, : lengths[i]], mask[i, : lengths[i]] = rewards, values, True
    advantages, returns = ppo.gae_advantages(padded_rewards, padded_values, mask, gamma=0.95, lam=0.9)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()
    for i, (rewards, values) in enumerate(rows):
        alone_advantages, alone_returns = ppo.gae_advantages(
            rewards[None], values[None], torch.ones(1, lengths[i]), 0.95, 0.9
        )
        assert torch.allclose(advantages[i, : lengths[i]], alone_advantages[0], atol=1e-6)
        assert torch.allclose(returns[i, : lengths[i]], alone_returns[0], atol=1e-6)


def test_gae_returns_are_advantages_plus_values():
    torch.manual_seed(1)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.arange(6)[None] < torch.tensor([6, 4, 1, 3])[:, None]
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma=0.99, lam=0.96)
    assert torch.allclose(returns[mask], (advantages + values)[mask], atol=1e-6)


def test_value_loss_clips_around_the_old_values():
    old = torch.zeros(1, 3)
    returns = torch.ones(1, 3)
    values = torch.tensor([[0.5, 0.1, 1.5]])
    loss, stats = ppo.value_loss(values, old, returns, torch.ones(1, 3, dtype=torch.bool), clip_eps=0.2, batch_tokens=3)
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped to 0.2: (0.2-1)^2 = 0.64 -> 0.64 (the clipped term binds)
    # token 1: inside the band: (0.1-1)^2 = 0.81 both ways
    # token 2: unclipped (1.5-1)^2 = 0.25, clipped to 0.2: 0.64 -> 0.64
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3, rel=1e-5)
    assert stats["value_clip_count"] == 2


def test_value_loss_is_normalised_by_the_batch_token_count_and_masks_padding():
    values, returns = torch.tensor([[0.0, 5.0]]), torch.tensor([[1.0, -5.0]])
    mask = torch.tensor([[True, False]])
    loss, _ = ppo.value_loss(values, values, returns, mask, clip_eps=0.2, batch_tokens=4)
    assert loss.item() == pytest.approx(0.5 * 1.0 / 4)  # padding's huge error is ignored; 4 tokens in the whole batch
    default, _ = ppo.value_loss(values, values, returns, mask)
    assert default.item() == pytest.approx(0.5)


def test_policy_loss_at_ratio_one_is_minus_mean_advantage_plus_kl():
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    advantages = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ppo.policy_loss(logps, logps, ref, advantages, mask, 0.2, beta=0.5, batch_tokens=2, batch_sequences=1)
    k3 = lambda d: torch.exp(d) - d - 1  # noqa: E731
    kl = k3(ref - logps)[0, :2].sum()
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2 + 0.5 * kl.item(), rel=1e-5)


def test_prob_mask_off_masks_nothing():
    response = torch.tensor([True, True, True])
    probs = torch.tensor([0.95, 0.5, 0.99])
    assert ppo.loss_mask(response, probs, 0.9, prob_mask=False).tolist() == [True, True, True]
    assert ppo.loss_mask(response, probs, 0.9, prob_mask=True).tolist() == [False, True, False]


def test_bad_configuration_is_one_clear_error():
    with pytest.raises(UsageError, match="multiple of --micro-batch-size"):
        ppo.validate(ppo.Args(batch_size=6, micro_batch_size=4))
    with pytest.raises(UsageError, match="--lam"):
        ppo.validate(ppo.Args(lam=1.5))


def test_three_non_finite_losses_in_a_row_are_one_clear_error():
    guard = bookkeeping.NonFiniteGuard()

    def skipped(stats, iteration):  # as ppo_baseline.update_policy checks its two losses
        return guard.skips(stats, iteration, keys=("loss", "value_loss"), fix="lower --lr / --critic-lr")

    finite = {"loss": 0.5, "value_loss": 0.1}
    non_finite = {"loss": 0.5, "value_loss": float("nan")}
    with pytest.warns(UserWarning, match="iteration 4: non-finite loss, update skipped"):
        assert skipped(non_finite, 4) and skipped(non_finite, 4)
    assert not skipped(finite, 5) and guard.in_a_row == 0  # a finite loss ends the run of them
    with pytest.warns(UserWarning):
        assert skipped(non_finite, 6) and skipped(non_finite, 6)
    with pytest.warns(UserWarning), pytest.raises(UsageError, match="three non-finite losses in a row"):
        skipped({"loss": float("inf"), "value_loss": 0.1}, 6)  # the policy loss counts too
