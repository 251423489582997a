"""What a rollout engine reports of its sampled tokens is data: one finite log-prob per token, else one line; and
--rollout-correction tis refuses to run when the engine reports no log-prob to correct with (it would weigh every
token 1 without a word)."""

import math

import pytest
import torch

from plumbing import UsageError, rollout_correction, training
from plumbing.completions import Completion


def test_a_sampled_responses_log_probs_are_kept_per_token():
    sample = training.new_sample([1, 2], Completion([5, 6, 7], "stop", [-0.1, -2.0, -0.5]))
    assert sample["sampler_logps"].tolist() == pytest.approx([-0.1, -2.0, -0.5])
    assert "sampler_logps" not in training.new_sample([1, 2], Completion([5], "stop", None))  # greedy: none


@pytest.mark.parametrize(
    "logprobs,named",
    [
        ([-0.1, -2.0], "reported 2 log-probs for a response of 3 tokens"),
        ([-0.1, -2.0, -0.5, -0.3], "reported 4 log-probs for a response of 3 tokens"),
        ([-0.1, math.nan, -0.5], "a log-prob of nan"),
        ([-0.1, -math.inf, -0.5], "a log-prob of -inf"),
    ],
)
def test_log_probs_that_do_not_fit_the_tokens_are_one_line(logprobs, named):
    with pytest.raises(UsageError, match=named) as error:
        training.new_sample([1, 2], Completion([5, 6, 7], "stop", logprobs))
    assert "\n" not in str(error.value)


def test_tis_without_any_sampler_log_prob_is_refused_and_none_changes_nothing():
    samples = [{"old_logps": torch.zeros(2), "advantages": torch.ones(2)}]
    rollout_correction.correct_rollouts(samples, "none", 2.0)
    assert samples[0]["advantages"].tolist() == [1.0, 1.0]
    with pytest.raises(UsageError, match="--rollout-correction tis needs the log-prob each token was sampled with"):
        rollout_correction.correct_rollouts(samples, "tis", 2.0)


def test_tis_weighs_the_samples_that_have_sampler_log_probs():
    with_logps = {
        "old_logps": torch.log(torch.tensor([0.5, 0.9])),
        "sampler_logps": torch.log(torch.tensor([0.25, 0.9])),
        "advantages": torch.ones(2),
    }
    without = {"old_logps": torch.zeros(1), "advantages": torch.ones(1)}  # e.g. a buffered edge: weight 1
    rollout_correction.correct_rollouts([with_logps, without], "tis", 2.0)
    assert with_logps["advantages"].tolist() == pytest.approx([2.0, 1.0]) and without["advantages"].tolist() == [1.0]
