"""experiments/credit_exact.py and the toy it measures on (exact_toy.py): the exact answer against brute-force
sampling and a finite difference, and every estimator's column against the scripts' own functions called directly on
the same samples; a tiny end-to-end run."""

import copy
import dataclasses
import doctest
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from experiments import credit_exact as ce
from experiments import exact_toy as toy
from experiments import measures
from plumbing import UsageError, engines
from plumbing.training import collate, response_logprobs, sample_logprobs

ARGS = dataclasses.replace(ce.Args(), **ce.TINY)  # horizon 4, prompts 21 and 13


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the benchmark runs (on 2 busy cores two threads made the pre-training 30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    model, *_ = toy.make_policy(ARGS)
    exacts = [
        toy.enumerate_exact(model, *toy.parse_prompt(text), ARGS.horizon, ARGS.temperature, 64) for text in ARGS.prompts
    ]
    return model, exacts, toy.exact_gradient(model, exacts, ARGS.temperature, 64)


def sample_mean_reward(model, exact, prefix: list[int], n: int) -> float:
    """Brute force with the project's own sampler (plumbing.engines.HFSampler, the model's forward passes, not the
    tables): the mean reward of n continuations of prompt + prefix."""
    sampler = engines.HFSampler(model, SimpleNamespace(pad_token_id=toy.EOS, eos_token_id=toy.EOS), seed=1)
    (group,) = sampler.sample(
        [exact.prompt + prefix], n, temperature=ARGS.temperature, top_p=1.0, max_new_tokens=exact.horizon - len(prefix)
    )
    return float(np.mean([toy.reward(exact, prefix + c.ids, c.finish_reason) for c in group]))


# ----------------------------------------------------------------------------------------------
# (a) The exact answer


def test_the_policy_is_neither_uniform_nor_deterministic(world):
    _, exacts, _ = world
    for exact in exacts:
        assert 0.1 < exact.values[0][0] < 0.9  # success neither ~0 nor ~1
        assert 0.1 < exact.low_probability_share(0.9) < 0.95  # cutpoints, and confident tokens
        total = sum((reach * probs[:, toy.EOS]).sum() for reach, probs in zip(exact.reach, exact.probs))
        # finished + unfinished
        assert total + (exact.reach[-1][:, None] * exact.probs[-1][:, 1:]).sum() == pytest.approx(1.0, abs=1e-9)


def test_exact_values_agree_with_brute_force_sampling(world):
    model, exacts, _ = world
    n = 4000
    for exact in exacts:
        for prefix in ([], [2]):  # the prompt, and the state after the digit 1
            value = exact.value(prefix)
            mean = sample_mean_reward(model, exact, prefix, n)
            assert abs(mean - value) < 4 * math.sqrt(value * (1 - value) / n) + 1e-9, (
                exact.target,
                prefix,
                mean,
                value,
            )


def test_table_probabilities_are_the_training_log_probs(world):
    model, exacts, _ = world
    responses = [[2, 3, toy.EOS], [3, 1, 2, 4], [toy.EOS], [1, 1, 1, 2]]
    for exact in exacts:
        samples = [{"prompt_ids": exact.prompt, "response_ids": r} for r in responses]
        for s, logps in zip(samples, sample_logprobs(model, samples, 8, ARGS.temperature, toy.EOS)):
            assert logps.exp().tolist() == pytest.approx(exact.token_probs(s["response_ids"]), abs=2e-6)


def test_exact_advantages_average_to_zero_under_the_policy_and_add_up_to_the_return(world):
    _, exacts, _ = world
    rng = np.random.default_rng(0)
    for exact in exacts:
        for _ in range(20):
            prefix = [int(d) + 1 for d in rng.integers(0, toy.DIGITS, rng.integers(0, exact.horizon))]
            row = exact.probs[len(prefix)][
                sum((t - 1) * toy.DIGITS ** (len(prefix) - 1 - j) for j, t in enumerate(prefix))
            ]
            expected = sum(row[token] * exact.advantages(prefix + [token])[-1] for token in range(toy.VOCAB))
            assert expected == pytest.approx(0.0, abs=1e-12)  # E_a[A*(s, a)] = 0: V(s) is the mean of its next states
        response = [2, 3, toy.EOS] if exact.target == 3 else [3, 3, toy.EOS]
        assert sum(exact.advantages(response)) == pytest.approx(
            toy.reward(exact, response, "stop") - exact.values[0][0]
        )


def test_exact_gradient_is_the_finite_difference_of_the_exact_expected_reward(world):
    model64 = copy.deepcopy(world[0]).double()
    exacts = [
        toy.enumerate_exact(model64, *toy.parse_prompt(text), ARGS.horizon, ARGS.temperature, 64)
        for text in ARGS.prompts
    ]
    gradient = toy.exact_gradient(model64, exacts, ARGS.temperature, 64)
    assert toy.expected_reward(exacts) == pytest.approx(toy.expected_reward(world[1]), abs=1e-6)

    def directional(direction: torch.Tensor, eps: float = 1e-3) -> float:
        """(J(theta + eps d) - J(theta - eps d)) / 2 eps, J enumerated exactly. eps 1e-3: Llama's RMSNorm computes in
        float32 even in a float64 model, which leaves J noise of ~1e-9; smaller steps would measure that noise."""

        def shifted(sign: float) -> float:
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(
                    torch.nn.utils.parameters_to_vector(model64.parameters()) + sign * eps * direction,
                    model64.parameters(),
                )
            return toy.expected_reward(
                [toy.enumerate_exact(model64, e.prompt, e.target, ARGS.horizon, ARGS.temperature, 64) for e in exacts]
            )

        high, low = shifted(1.0), shifted(-2.0)  # +eps, then -eps
        shifted(1.0)  # back
        return (high - low) / (2 * eps)

    # Richardson extrapolation cancels the central difference's eps^2 error term (2e-4 of the value on some CPUs, and
    # 2.4e-3 along one tensor on a Zen 3 EPYC, whose toy policy trains to other weights), leaving eps^4 and the noise.
    def extrapolated(unit: torch.Tensor) -> float:
        return (4 * directional(unit, 5e-4) - directional(unit, 1e-3)) / 3

    assert extrapolated(gradient / gradient.norm()) == pytest.approx(float(gradient.norm()), rel=1e-4)
    offset = 0
    for name, parameter in model64.named_parameters():  # each tensor on its own: along its part of the gradient
        part = torch.zeros_like(gradient)
        part[offset : offset + parameter.numel()] = gradient[offset : offset + parameter.numel()]
        offset += parameter.numel()
        assert extrapolated(part / part.norm()) == pytest.approx(float(part.norm()), rel=1e-3), name


def test_exact_sampler_draws_the_policy_distribution_and_counts_tokens(world):
    _, exacts, _ = world
    exact, n = exacts[0], 20000
    sampler = toy.ExactSampler(exacts, ARGS.temperature, seed=0)
    (group,) = sampler.sample([exact.prompt], n, temperature=ARGS.temperature, top_p=1.0, max_new_tokens=exact.horizon)
    first = np.bincount([c.ids[0] for c in group], minlength=toy.VOCAB) / n
    assert np.all(
        np.abs(first - exact.probs[0][0]) < 4 * np.sqrt(exact.probs[0][0] * (1 - exact.probs[0][0]) / n) + 1e-9
    )
    assert sampler.tokens == sum(len(c.ids) for c in group)
    assert all((c.finish_reason == "stop") == (c.ids[-1] == toy.EOS) for c in group)
    assert all(c.finish_reason == "stop" or len(c.ids) == exact.horizon for c in group)
    assert np.mean([toy.reward(exact, c.ids, c.finish_reason) for c in group]) == pytest.approx(
        exact.values[0][0], abs=4 * math.sqrt(0.25 / n)
    )
    with pytest.raises(ValueError, match="horizon"):
        sampler.sample(
            [exact.prompt + [2]], 1, temperature=ARGS.temperature, top_p=1.0, max_new_tokens=exact.horizon, generated=1
        )


# ----------------------------------------------------------------------------------------------
# (b) Each estimator's column is what the scripts' functions give on the same samples


def fresh(samples: list[dict]) -> list[dict]:
    return [{"prompt_ids": s["prompt_ids"], "response_ids": s["response_ids"]} for s in samples]


def gradient_of(model, accumulate, samples) -> torch.Tensor:
    return ce.loss_gradient(model, accumulate, samples, ARGS)


def test_grpo_column_is_group_advantages_and_its_loss(world):
    model, exacts, exact_grad = world
    run = ce.run_grpo(model, toy.ExactSampler(exacts, ARGS.temperature, 3), exacts, 6, ARGS)["grpo"]
    samples, rewards = run.record["samples"], run.record["rewards"]
    assert run.tokens == sum(len(s["response_ids"]) for s in samples)
    advantages = grpo_baseline.group_advantages(torch.tensor(rewards), 6)
    by_hand = np.array(rewards).reshape(-1, 6) - np.mean(np.array(rewards).reshape(-1, 6), 1, keepdims=True)
    by_hand = (by_hand / (np.array(rewards).reshape(-1, 6).std(1, keepdims=True) + 1e-8)).reshape(-1)
    assert advantages.tolist() == pytest.approx(by_hand.tolist(), abs=1e-6)
    assert run.token_estimates == pytest.approx(
        [float(a) for a, s in zip(advantages, samples) for _ in s["response_ids"]]
    )
    owner = {tuple(e.prompt): e for e in exacts}
    assert run.token_truth == [a for s in samples for a in owner[tuple(s["prompt_ids"])].advantages(s["response_ids"])]
    direct = fresh(samples)
    script_args = grpo_baseline.Args(temperature=ARGS.temperature, micro_batch_size=3, prob_mask=False, beta=0.0)
    grpo_baseline.attach_targets(direct, advantages, model, None, script_args, toy.EOS)
    assert torch.allclose(gradient_of(model, grpo_baseline.accumulate_gradients, direct), run.gradient, atol=1e-7)
    # At ratio 1 the clipped surrogate's gradient is that of -sum(whitened A * log p) / masked tokens: by hand.
    model.zero_grad(set_to_none=True)
    batch = collate(direct, toy.EOS, model.device)
    logps = response_logprobs(model, batch, ARGS.temperature)
    (-(logps * batch["advantages"] * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    assert torch.allclose(toy.flat_gradient(model), run.gradient, atol=1e-6)
    model.zero_grad(set_to_none=True)
    column = ce.score(run, exact_grad, ARGS.sign_threshold)
    assert column["gradient_cosine"] == pytest.approx(ce.cosine(-run.gradient, exact_grad))
    assert column["token_pearson"] == pytest.approx(np.corrcoef(run.token_estimates, run.token_truth)[0, 1])


@pytest.mark.parametrize("interval", [1, 5, None])
def test_spo_chain_and_mc_token_columns_are_cutpoints_chain_advantages_and_their_loss(world, interval):
    model, exacts, exact_grad = world
    runs = ce.run_chain(model, toy.ExactSampler(exacts, ARGS.temperature, 4), exacts, 4, ARGS, interval=interval)
    assert set(runs) == (
        {"mc_token"} if interval is None else {f"spo_chain_int{interval}", f"spo_chain_int{interval}_nomask"}
    )
    for name, run in runs.items():
        record, prob_mask = run.record, interval is not None and not name.endswith("_nomask")
        samples, probs = record["samples"], record["probs"]
        # p_t are the training log-probs; the cutpoints are find_cutpoints' (every state for the per-token MC).
        for s, p in zip(samples, probs):
            assert p == pytest.approx(s["old_logps"].exp().tolist())
        expected_cuts = [
            list(range(-1, len(p) - 1)) if interval is None else spo_chain.find_cutpoints(p, 0.9, interval)
            for p in probs
        ]
        assert record["cutpoints"] == expected_cuts
        # Each value is the mean of K continuation rewards (a multiple of 1/K), one per distinct state (shared).
        value_of = {}
        for s, cuts, values in zip(samples, record["cutpoints"], record["values"]):
            assert all(abs(v * ARGS.mc_samples - round(v * ARGS.mc_samples)) < 1e-9 for v in values)
            for c, v in zip(cuts, values):
                assert value_of.setdefault((tuple(s["prompt_ids"]), tuple(s["response_ids"][: c + 1])), v) == v
        assert len(value_of) < sum(map(len, record["cutpoints"]))  # some states recur, and were estimated once
        advantages = [
            spo_chain.chain_advantages(p, c, v, r, 0.9, prob_mask)
            for p, c, v, r in zip(probs, record["cutpoints"], record["values"], record["rewards"])
        ]
        assert run.token_estimates == pytest.approx([a for response in advantages for a in response])
        direct = fresh(samples)
        for s, old in zip(direct, samples):
            s["old_logps"] = s["ref_logps"] = old["old_logps"]
        spo_chain.attach_advantages(
            direct, advantages, torch.cat([s["old_logps"] for s in direct]).exp(), 0.9, prob_mask
        )
        gradient = gradient_of(model, spo_chain.accumulate_gradients, direct)
        assert torch.allclose(gradient, run.gradient, atol=1e-7)
        assert ce.score(run, exact_grad, 0.25)["gradient_cosine"] == pytest.approx(
            ce.cosine(-gradient, exact_grad), abs=1e-9
        )
    if interval is None:  # one segment per token: the per-token MC advantage is V-hat(s_t) - V-hat(s_{t-1})
        run = runs["mc_token"]
        assert run.segment_estimates == run.token_estimates and run.segment_truth == run.token_truth


def test_spo_tree_column_is_tree_segments_and_its_loss(world):
    model, exacts, exact_grad = world
    runs = ce.run_tree(model, toy.ExactSampler(exacts, ARGS.temperature, 5), exacts, 3, ARGS)
    roots = runs["spo_tree"].record["roots"]
    for exact, root in zip(exacts, roots):  # the trees follow SPEC's rules: b children per open node, M-token segments
        assert len(root.children) == 3
        for node, before in spo_tree.walk(root):
            if node.children:
                assert (
                    len(node.children) == 3
                    and node.finish_reason == "length"
                    and len(node.tokens) == ARGS.segment_tokens
                )
            else:
                assert node.reward == toy.reward(exact, before + node.tokens, node.finish_reason)
    assert runs["spo_tree"].tokens == sum(len(node.tokens) for root in roots for node, _ in spo_tree.walk(root))
    expected = [(q, seg, a) for root in roots for q, seg, a, _ in spo_tree.tree_segments(root, "rloo")]
    for name, prob_mask in (("spo_tree", True), ("spo_tree_nomask", False)):
        run = runs[name]
        assert [(s["prompt_ids"], s["response_ids"], s["advantage"]) for s in run.record["samples"]] == expected
        direct = [{"prompt_ids": q, "response_ids": seg, "advantage": a} for q, seg, a in expected]
        ce.attach_old_logprobs(model, direct, ARGS)
        spo_tree.attach_targets(
            direct,
            None,
            micro_batch_size=3,
            temperature=ARGS.temperature,
            pad_id=toy.EOS,
            prob_threshold=0.9,
            prob_mask=prob_mask,
        )
        assert torch.allclose(gradient_of(model, spo_tree.accumulate_gradients, direct), run.gradient, atol=1e-7)
        # Per token: the edge's advantage where the loss mask keeps the token (a zero edge is not trained).
        kept = [
            a
            for s in direct
            for a, keep in zip([s["advantage"]] * len(s["response_ids"]), s["loss_mask"].tolist())
            if keep
        ]
        assert sorted(a for a in run.token_estimates if a != 0) == pytest.approx(sorted(a for a in kept if a != 0))
    # Per edge: V(child) - V(parent) from backup_values beside the exact difference.
    edges = [
        child.value - node.value
        for root in roots
        for node, _ in [(root, [])] + list(spo_tree.walk(root))
        for child in node.children
    ]
    assert sorted(runs["spo_tree"].segment_estimates) == pytest.approx(sorted(edges))


@pytest.mark.parametrize("lam", [1.0, 0.96])
def test_ppo_column_is_gae_of_the_critics_values_and_its_loss(world, lam):
    model, exacts, exact_grad = world
    run = ce.run_ppo(model, toy.ExactSampler(exacts, ARGS.temperature, 6), exacts, 4, ARGS, lam=lam)[f"ppo_lam{lam:g}"]
    samples, rewards = run.record["samples"], run.record["rewards"]
    values = torch.nn.utils.rnn.pad_sequence([s["old_values"] for s in samples], batch_first=True)  # [N, T]
    lengths = torch.tensor([len(s["response_ids"]) for s in samples])
    mask = torch.arange(values.shape[1])[None] < lengths[:, None]
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(len(samples)), lengths - 1] = torch.tensor(rewards)
    advantages, _ = ppo_baseline.gae_advantages(token_rewards, values, mask, 1.0, lam)
    assert run.token_estimates == pytest.approx(advantages[mask].tolist(), abs=1e-6)
    if lam == 1.0:  # A_t = R - V(s_{t-1})
        assert run.token_estimates == pytest.approx(
            [r - v for s, r in zip(samples, rewards) for v in s["old_values"].tolist()], abs=1e-6
        )
    assert any(abs(v) > 1e-3 for s in samples for v in s["old_values"].tolist())  # the critic learned something
    critic = ppo_baseline.make_critic(model)  # the policy's gradient does not depend on the critic
    gradient = gradient_of(
        model, lambda m, ss, **k: ppo_baseline.accumulate_gradients(m, critic, ss, value_clip_eps=0.2, **k), samples
    )
    assert torch.allclose(gradient, run.gradient, atol=1e-7)
    assert ce.score(run, exact_grad, 0.25)["gradient_cosine"] == pytest.approx(
        ce.cosine(-gradient, exact_grad), abs=1e-9
    )


# ----------------------------------------------------------------------------------------------
# Budgets, scores and the run


def test_size_for_and_summary_pair_the_seeds():
    assert ce.size_for(3.5, 32, 2) == 9 and ce.size_for(20.0, 32, 2) is None
    assert ce.size_for({1: 10.0, 2: 30.0, 3: 70.0}, 64, 1) == 2
    rows = {
        name: [{"seed": s, "size": 2, "tokens": 10, **{m: base + 0.01 * s for m in ce.METRICS}} for s in range(10)]
        for name, base in (("a", 0.5), ("b", 0.3), ("exact_advantage", 0.9))
    }
    summary = ce.summarise(rows, 200, 0)
    assert summary["best"]["token_pearson"] == "a" and summary["best"]["token_mse"] == "b"  # references are not ranked
    entry = summary["estimators"]["b"]["token_pearson"]
    assert entry["minus_best"] == pytest.approx(-0.2) and entry["minus_best_ci"] == pytest.approx([-0.2, -0.2])
    assert entry["ci"][0] < 0.3 + 0.045 < entry["ci"][1]  # the mean over seeds 0.345, inside its interval
    assert summary["pairwise"]["token_pearson"] == {"a - b": pytest.approx([0.2, 0.2, 0.2])}  # references not paired


def test_docstring_examples():
    for module in (ce, toy, measures):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_tiny_run_writes_every_estimator_per_budget_with_paired_intervals(tmp_path):
    results = ce.main(dataclasses.replace(ce.Args(), tiny=True, out=str(tmp_path / "exact.json")))
    saved = json.loads((tmp_path / "exact.json").read_text())
    assert (tmp_path / "exact.png").stat().st_size > 10_000
    assert (
        saved["settings"]["seeds"] == [0, 1, 2] and saved["machine"]["commit"] and saved["command"].startswith("python")
    )
    top = saved["budgets"][-1]
    assert set(top["estimators"]) >= {
        "grpo",
        "spo_chain_int1",
        "spo_chain_int1_nomask",
        "spo_chain_int5",
        "spo_tree",
        "ppo_lam1",
        "ppo_lam0.96",
        "mc_token",
        "exact_advantage",
    }
    for name, row in top["estimators"].items():
        assert row["tokens"] <= 1.5 * top["budget"], name  # spends about its budget
        assert row["gradient_cosine"]["n"] == 3 and -1 <= row["gradient_cosine"]["mean"] <= 1
        if name != top["best"]["gradient_cosine"]:
            assert len(row["gradient_cosine"]["minus_best_ci"]) == 2
    assert results["policy"]["prompts"][0]["responses_enumerated"] == 4**4 + sum(4**k for k in range(4))


# ----------------------------------------------------------------------------------------------
# (c) The critical-token task: one key bit decides the reward, --filler free bits follow (the same checks as (a))

CRITICAL = dataclasses.replace(
    ce.Args(), task="critical", filler=4, horizon=6, prompts=["011", "110", "000"], pretrain_steps=300
)


def critical_world(settings) -> tuple:
    """The critical task's pre-trained policy under `settings` and its enumerated Exact per prompt."""
    torch.manual_seed(0)
    model, *_ = toy.make_policy(settings)
    exacts = [
        toy.enumerate_exact(model, *toy.parse_prompt(text, "critical"), 6, settings.temperature, 64, "critical", 4)
        for text in settings.prompts
    ]
    return model, exacts


@pytest.fixture(scope="module")
def critical():
    return critical_world(CRITICAL)


def test_critical_reward_is_the_key_bit_then_the_filler_then_eos():
    exact = toy.Exact(
        [1, 2, 2], 0, [], [], [], digits=2, finish=[toy.finish_rewards("critical", 0, k, 4) for k in range(6)]
    )
    assert toy.reward(exact, [1, 2, 1, 2, 2, toy.EOS], "stop") == 1.0  # key 0, four filler bits of any value
    assert toy.reward(exact, [1, 1, 1, 1, 1, toy.EOS], "stop") == 1.0
    assert toy.reward(exact, [2, 1, 1, 1, 1, toy.EOS], "stop") == 0.0  # the wrong key
    assert toy.reward(exact, [1, 1, 1, 1, toy.EOS], "stop") == 0.0  # one filler bit short
    assert toy.reward(exact, [1, 1, 1, 1, 1, 1], "length") == 0.0  # unfinished
    assert (
        toy.parse_prompt("110", "critical") == ([toy.EOS, 2, 2, 1], 1) and toy.parse_prompt("011", "critical")[1] == 0
    )


def test_critical_policy_has_a_key_to_learn_and_free_filler(critical):
    _, exacts = critical
    for exact in exacts:
        assert exact.digits == 2 and exact.probs[0].shape == (1, 3)
        assert 0.1 < exact.values[0][0] < 0.95  # the key bit is not yet learned
        assert exact.low_probability_share(0.9) > 0.4  # the filler bits: near a coin flip each
        finished = sum((reach * probs[:, toy.EOS]).sum() for reach, probs in zip(exact.reach, exact.probs))
        unfinished = (exact.reach[-1][:, None] * exact.probs[-1][:, 1:]).sum()
        assert finished + unfinished == pytest.approx(1.0, abs=1e-9)


def test_critical_values_agree_with_brute_force_sampling(critical):
    model, exacts = critical
    n = 3000
    for exact in exacts[:2]:
        for prefix in ([], [exact.target + 1], [2 - exact.target, 1]):  # the prompt, the right key, the wrong key
            value, mean = exact.value(prefix), sample_mean_reward(model, exact, prefix, n)
            assert abs(mean - value) < 4 * math.sqrt(value * (1 - value) / n) + 1e-9, (exact.prompt, prefix, mean)
    responses = [[1, 2, 1, 2, 2, toy.EOS], [2, toy.EOS], [1, 1, 1, 1, 1, 1]]
    for exact in exacts:
        samples = [{"prompt_ids": exact.prompt, "response_ids": r} for r in responses]
        for s, logps in zip(samples, sample_logprobs(model, samples, 8, CRITICAL.temperature, toy.EOS)):
            assert logps.exp().tolist() == pytest.approx(exact.token_probs(s["response_ids"]), abs=2e-6)


def test_critical_exact_gradient_is_the_finite_difference_of_j(critical):
    model64 = copy.deepcopy(critical[0]).double()

    def j() -> float:
        return toy.expected_reward(
            [
                toy.enumerate_exact(model64, e.prompt, e.target, 6, CRITICAL.temperature, 64, "critical", 4)
                for e in critical[1]
            ]
        )

    exacts = [
        toy.enumerate_exact(model64, e.prompt, e.target, 6, CRITICAL.temperature, 64, "critical", 4)
        for e in critical[1]
    ]
    gradient = toy.exact_gradient(model64, exacts, CRITICAL.temperature, 64)
    unit, eps = gradient / gradient.norm(), 5e-4
    start = torch.nn.utils.parameters_to_vector(model64.parameters()).detach().clone()
    values = {}
    for sign in (1.0, -1.0, 2.0, -2.0):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(start + sign * eps * unit, model64.parameters())
        values[sign] = j()
    central = lambda h: (values[h] - values[-h]) / (2 * h * eps)  # noqa: E731
    extrapolated = (4 * central(1.0) - central(2.0)) / 3  # Richardson: the eps^2 term cancels
    assert extrapolated == pytest.approx(float(gradient.norm()), rel=1e-4)


# (d) SPO's regime: the same task with confident filler (--filler-kind confident), checked by enumeration against
# brute-force sampling from the model

CONFIDENT = dataclasses.replace(CRITICAL, filler_kind="confident")


@pytest.fixture(scope="module")
def confident():
    return critical_world(CONFIDENT)


def test_confident_filler_leaves_the_key_bit_the_only_uncertain_token(confident):
    _, exacts = confident
    for exact in exacts:
        table = exact.position_map(0.9)
        assert table["low_probability"][0] > 0.9  # the key bit: a cutpoint
        assert max(table["low_probability"][1:5]) < 0.05  # every filler bit: p > 0.9 nearly always
        assert 0.1 < exact.values[0][0] < 0.95  # the key is still to learn
        assert table["abs_advantage"][0] > 0.15 and max(table["abs_advantage"][1:5]) < 0.05


def test_the_advantage_map_agrees_with_brute_force_sampling(confident):
    """Per position: the enumerated E|A*| and low-probability share against their means over responses the project's
    sampler draws from the model (forward passes, not the tables), each A* from V of the sampled prefixes."""
    model, exacts = confident
    n = 3000
    sampler = engines.HFSampler(model, SimpleNamespace(pad_token_id=toy.EOS, eos_token_id=toy.EOS), seed=2)
    for exact in exacts[:2]:
        (group,) = sampler.sample([exact.prompt], n, temperature=CONFIDENT.temperature, top_p=1.0, max_new_tokens=6)
        credit, low = [[] for _ in range(6)], [[] for _ in range(6)]
        for c in group:
            for k, (a, p) in enumerate(zip(exact.advantages(c.ids), exact.token_probs(c.ids))):
                credit[k].append(abs(a))
                low[k].append(float(p < 0.9))
        table = exact.position_map(0.9)
        for k in range(5):
            for key, samples in (("abs_advantage", credit[k]), ("low_probability", low[k])):
                spread = 4 * np.std(samples) / math.sqrt(len(samples)) + 0.01
                assert abs(np.mean(samples) - table[key][k]) < spread, (exact.prompt, k, key)
        rewards = [toy.reward(exact, c.ids, c.finish_reason) for c in group]
        assert np.mean(rewards) == pytest.approx(exact.values[0][0], abs=4 * math.sqrt(0.25 / n))
        right = np.mean([c.finish_reason == "stop" and len(c.ids) == 6 for c in group])  # key, 4 bits, EOS
        assert right == pytest.approx(toy.length_right(exact, 4), abs=4 * math.sqrt(0.25 / n))


def test_pre_training_goes_on_until_every_prompt_has_the_length_right():
    """One recipe at every L: a policy whose length is still wrong after --pretrain-steps trains on, a tenth of them at
    a time, until the length is right CRITICAL_LENGTH_RIGHT of the time on every prompt."""
    settings = dataclasses.replace(
        CRITICAL, filler=3, horizon=5, prompts=list(toy.CRITICAL["prompts"]), pretrain_steps=40
    )
    model, _, steps = toy.make_policy(settings)
    assert 40 < steps <= toy.PRETRAIN_EXTENSION * 40 and steps % 4 == 0
    rights = [toy.length_right(exact, 3) for exact in toy.enumerate_prompts(model, settings)]
    assert min(rights) >= toy.CRITICAL_LENGTH_RIGHT
    straight, _, again = toy.make_policy(dataclasses.replace(settings, pretrain_steps=steps))
    assert again == steps  # trained straight for as many steps: the same policy, nothing more to do
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight.parameters()))


def test_a_policy_that_never_gets_the_length_right_is_refused():
    settings = dataclasses.replace(CRITICAL, filler=3, horizon=5, pretrain_steps=4)
    with pytest.raises(UsageError, match=r"length right on prompt \d{3} only .* after 16 steps.*--policy-seed"):
        toy.make_policy(settings)


def test_the_exact_sampler_draws_bits(critical):
    _, exacts = critical
    exact, n = exacts[0], 20000
    sampler = toy.ExactSampler(exacts, CRITICAL.temperature, seed=0)
    (group,) = sampler.sample([exact.prompt], n, temperature=CRITICAL.temperature, top_p=1.0, max_new_tokens=6)
    first = np.bincount([c.ids[0] for c in group], minlength=3) / n
    assert np.all(
        np.abs(first - exact.probs[0][0]) < 4 * np.sqrt(exact.probs[0][0] * (1 - exact.probs[0][0]) / n) + 1e-9
    )
    assert all(set(c.ids) <= {0, 1, 2} for c in group)
    assert np.mean([toy.reward(exact, c.ids, c.finish_reason) for c in group]) == pytest.approx(
        exact.values[0][0], abs=4 * math.sqrt(0.25 / n)
    )
