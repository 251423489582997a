"""--whiten, every script's own copy: centre-scale (the paper's: mean 0, std 1 over the masked tokens), scale (divided
by the masked tokens' root mean square: an advantage of 0 stays 0, every sign kept) and none, against the definitions
written out in plain Python on random cases."""

import math
import random

import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree

SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]


def reference(advantages: list[float], mask: list[bool], mode: str, eps: float = 1e-8) -> list[float]:
    masked = [a for a, m in zip(advantages, mask) if m]
    if mode == "none" or not masked:
        return advantages
    if mode == "scale":
        rms = math.sqrt(sum(a * a for a in masked) / len(masked))
        return advantages if rms == 0 else [a / (rms + eps) for a in advantages]
    mean = sum(masked) / len(masked)
    std = math.sqrt(sum((a - mean) ** 2 for a in masked) / len(masked))
    return [(a - mean) / (std + eps) for a in advantages]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("mode", ["centre-scale", "scale", "none"])
def test_whiten_matches_its_definition_on_random_cases(script, mode):
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 12)
        advantages = [rng.choice([0.0, 0.0, rng.uniform(-2, 2)]) for _ in range(n)]
        mask = [rng.random() < 0.6 for _ in range(n)]
        out = script.whiten(torch.tensor(advantages, dtype=torch.float64), torch.tensor(mask), mode=mode)
        assert out.tolist() == pytest.approx(reference(advantages, mask, mode), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_the_default_is_the_papers_centre_scale(script):
    advantages, mask = torch.tensor([0.0, 0.0, -3.0, 4.0]), torch.tensor([True, True, True, False])
    assert torch.equal(script.whiten(advantages, mask), script.whiten(advantages, mask, mode="centre-scale"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_scale_keeps_a_zero_advantage_zero_where_centring_makes_it_positive(script):
    """The mask nearly empty: two tokens earned nothing, one lost. Centring lifts the two to +0.71; scale leaves 0."""
    advantages, mask = torch.tensor([0.0, 0.0, -3.0, 4.0]), torch.tensor([True, True, True, False])
    centred = script.whiten(advantages, mask)
    scaled = script.whiten(advantages, mask, mode="scale")
    assert (centred[:2] > 0.7).all()
    assert scaled[:2].tolist() == [0.0, 0.0] and scaled[2] < 0 and scaled[3] > 0
    assert torch.equal(script.whiten(torch.zeros(3), torch.ones(3, dtype=torch.bool), mode="scale"), torch.zeros(3))
    assert torch.equal(script.whiten(advantages, mask, mode="none"), advantages)
