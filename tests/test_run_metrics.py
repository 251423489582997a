"""What a run shows while it learns: the KL named by its unit, the policy's entropy, the sampler checked against the
trainer on every token (over the top-p nucleus where the sampler reports log-probs renormalised over it), the optional
rollout correction, and RUNNING.md's table of every metric."""

import copy
import doctest
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import make_tiny_model, smoke_args, write_jsonl
from plumbing import UsageError, bookkeeping, engines, models, paper, rollout_correction, settings, tasks, training
from plumbing.engines import HFSampler

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"G": grpo_baseline, "C": spo_chain, "T": spo_tree, "P": ppo_baseline}


# ----------------------------------------------------------------------------------------------
# KL per sequence (the loss's) and per token (logged)


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=lambda s: s.__name__)
def test_kl_per_token_is_the_loss_kl_spread_over_the_masked_tokens(script):
    # Two sequences: 3 masked tokens and 1 (its other two padded or masked out). k3 with d = ref - logp.
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.9, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 1.0], [0.125, 0.1, 0.1]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    d = [[math.log(0.5), 0.0, math.log(2.0)], [math.log(0.25)]]
    per_sequence = (sum(map(k3, d[0])) + k3(d[1][0])) / 2  # summed over a sequence's tokens, mean over sequences
    per_token = (sum(map(k3, d[0])) + k3(d[1][0])) / 4  # mean over the 4 masked tokens
    advantages = torch.zeros(2, 3)
    _, stats = script.policy_loss(logps, logps, ref, advantages, mask, 0.2, 0.1, batch_tokens=4, batch_sequences=2)
    assert stats["kl"] == pytest.approx(per_sequence) and stats["kl_per_token"] == pytest.approx(per_token)
    # The logged names say which is which; the loss's term stays "kl" inside the loss.
    logged = bookkeeping.loss_metrics([{**stats, "loss": 0.0, "clip_frac": 0.0, "grad_norm": 1.0}])
    assert logged["losses/kl_per_sequence"] == pytest.approx(per_sequence)
    assert logged["losses/kl_per_token"] == pytest.approx(per_token)
    assert "losses/kl" not in logged


# ----------------------------------------------------------------------------------------------
# Entropy of the sampling distribution


def test_entropy_worked_example():
    # A head whose logits at temperature 0.5 are log 0.5, log 0.25, log 0.25 (up to a constant): entropy
    # -(0.5 log 0.5 + 2 x 0.25 log 0.25) = 1.0397; and a flat head: log 4.
    head = torch.nn.Linear(1, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.5 * torch.log(torch.tensor([[0.5], [0.25], [0.25]])))
    logps, entropy = training.token_logprobs(head, torch.ones(1, 1), torch.tensor([1]), 0.5, entropy=True)
    assert logps.item() == pytest.approx(math.log(0.25))
    assert entropy.item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    flat = torch.nn.Linear(1, 4, bias=False)
    torch.nn.init.zeros_(flat.weight)
    assert (
        training.token_logprobs(flat, torch.ones(2, 1), torch.tensor([0, 3]), 0.7, entropy=True)[1].tolist()
        == [pytest.approx(math.log(4))] * 2
    )
    logps, entropy = training.token_logprobs(flat, torch.ones(1, 1), torch.tensor([0]), 1.0, entropy=True)
    assert logps.requires_grad and not entropy.requires_grad  # a metric: no gradient flows through it


def test_entropy_of_the_chunked_pass_equals_the_full_logits(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    samples = [
        {"prompt_ids": tokenizer("3 + 4 =")["input_ids"], "response_ids": tokenizer(" 7 apples")["input_ids"]},
        {"prompt_ids": tokenizer("10 + 5")["input_ids"], "response_ids": tokenizer(" = 15")["input_ids"]},
    ]
    batch = training.collate(samples, tokenizer.pad_token_id, model.device)
    full = [
        torch.log_softmax(model(torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0] / 0.6, -1)[
            len(s["prompt_ids"]) - 1 : -1
        ]
        for s in samples
    ]
    expected = [-(p.exp() * p).sum(-1) for p in full]  # [R] per sample
    for chunk, recompute_above in ((3, 2**28), (2, 0)):  # kept logits; recomputed in the backward pass
        with torch.enable_grad():
            logps, entropy = training.response_logprobs(
                model, batch, 0.6, chunk_tokens=chunk, recompute_above=recompute_above, entropy=True
            )
        for row, s, want in zip(entropy, samples, expected):
            assert torch.allclose(row[: len(s["response_ids"])], want, atol=1e-5)
        assert logps.requires_grad and not entropy.requires_grad
    attached = [dict(s) for s in samples]
    training.attach_old_logprobs(model, attached, 8, 0.6, tokenizer.pad_token_id)
    for s, want, p in zip(attached, expected, full):
        assert torch.allclose(s["entropy"], want, atol=1e-5)
        assert torch.allclose(
            s["old_logps"], p.gather(-1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1), atol=1e-5
        )


def test_entropy_metrics_over_response_and_loss_masked_tokens():
    samples = [
        {"entropy": torch.tensor([1.0, 2.0, 3.0]), "loss_mask": torch.tensor([True, False, True])},
        {"entropy": torch.tensor([4.0]), "loss_mask": torch.tensor([False])},
    ]
    metrics = rollout_correction.rollout_metrics(samples)
    assert metrics == {"policy/entropy": 2.5, "policy/entropy_loss_masked": 2.0}


# ----------------------------------------------------------------------------------------------
# The sampler against the trainer


def hf_rollout_samples(sampler, model, tokenizer, prompts, top_p=1.0):
    groups = sampler.sample(prompts, 4, temperature=0.8, top_p=top_p, max_new_tokens=8)
    samples = [training.new_sample(p, c) for p, group in zip(prompts, groups) for c in group]
    training.attach_old_logprobs(model, samples, 8, 0.8, tokenizer.pad_token_id)
    for s in samples:
        s["loss_mask"] = torch.ones(len(s["response_ids"]), dtype=torch.bool)
    return samples


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_hf_sampler_agrees_with_the_trainer_in_fp32(tiny_model_dir, top_p):
    # KV-cached decoding against the trainer's prompt-then-response passes: the same numbers up to rounding, at any
    # top_p (the HF sampler reports the whole vocabulary's log-prob, before the nucleus cut).
    model, tokenizer = models.load_model(str(tiny_model_dir))
    sampler = HFSampler(model, tokenizer, seed=0)
    prompts = [tokenizer("3 + 4 =")["input_ids"], tokenizer("Tom has 10")["input_ids"]]
    samples = hf_rollout_samples(sampler, model, tokenizer, prompts, top_p)
    assert all(len(s["sampler_logps"]) == len(s["response_ids"]) > 0 for s in samples)
    # the whole vocabulary's log-probs at any top_p: nothing is renormalised, no nucleus rebuilt
    assert not any("sampler_top_p" in s or "nucleus_logps" in s for s in samples)
    gaps = torch.cat([(s["sampler_logps"] - s["old_logps"]).abs() for s in samples])
    assert gaps.max() < 1e-4
    metrics = rollout_correction.rollout_metrics(samples)
    assert metrics["sampler/logp_gap_max"] < 1e-4 and metrics["sampler/kl_per_token"] < 1e-8
    assert rollout_correction.sampler_warning(1, metrics) is None


def test_a_stale_sampler_is_caught_after_an_update(tiny_model_dir):
    # The HF sampler is the training model itself, so it cannot go stale on its own: here it samples from a frozen
    # copy of the starting model, as an engine whose weights never arrive would.
    model, tokenizer = models.load_model(str(tiny_model_dir))
    stale = HFSampler(copy.deepcopy(model), tokenizer, seed=0)
    prompts = [tokenizer("3 + 4 =")["input_ids"], tokenizer("Tom has 10")["input_ids"]]
    before = rollout_correction.rollout_metrics(hf_rollout_samples(stale, model, tokenizer, prompts))
    assert before["sampler/kl_per_token"] < 1e-8
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):  # make the trained policy prefer "7" everywhere
        batch = training.collate(
            [{"prompt_ids": p, "response_ids": tokenizer("7777")["input_ids"]} for p in prompts],
            tokenizer.pad_token_id,
            model.device,
        )
        optimizer.zero_grad()
        (-training.response_logprobs(model, batch, 0.8).sum()).backward()
        optimizer.step()
    after = rollout_correction.rollout_metrics(hf_rollout_samples(stale, model, tokenizer, prompts))
    assert after["sampler/kl_per_token"] > rollout_correction.SAMPLER_KL_WARNING
    assert after["sampler/logp_gap_max"] > 0.5
    line = rollout_correction.sampler_warning(4, after)
    assert line.startswith("warning: iteration 4: the sampler's log-probs differ from the trainer's")


def nucleus_by_hand(logits: list[float], top_p: float) -> dict[int, float]:
    """vLLM's nucleus, one row, by hand: walk the tokens from the least likely up, cutting each while the probability
    summed so far (it included) is at most 1 - top_p, never the last (likeliest); {kept token: logit - log of the
    kept tokens' summed exp}."""
    probs = torch.tensor(logits, dtype=torch.float64).softmax(-1).tolist()
    ascending = sorted(range(len(logits)), key=lambda v: probs[v])
    kept, cumulative = [], 0.0
    for position, token in enumerate(ascending):
        cumulative += probs[token]
        if cumulative > 1 - top_p or position == len(ascending) - 1:
            kept.append(token)
    log_mass = math.log(sum(math.exp(logits[v]) for v in kept))
    return {v: logits[v] - log_mass for v in kept}


def test_nucleus_logprobs_are_the_nucleus_by_hand_and_log_softmax_at_top_p_one():
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        vocab = int(torch.randint(2, 40, (1,), generator=generator))
        row = [
            torch.randn(vocab, generator=generator) * 3,
            torch.randint(0, 3, (vocab,), generator=generator).float(),  # many ties, some at the nucleus's edge
            (torch.randn(vocab, generator=generator) * 2).bfloat16().float(),  # bf16 logits: ties as in a bf16 run
        ][trial % 3]
        for top_p in (0.3, 0.7, 0.9, 0.95, 0.999):
            # every token of the row as the target
            got = training.nucleus_logprobs(row.expand(vocab, vocab), torch.arange(vocab), top_p)
            want = nucleus_by_hand(row.tolist(), top_p)
            kept = torch.isfinite(got)
            assert got[~kept].eq(-math.inf).all()
            # Tied tokens are interchangeable: which of them the sort puts first is the sort's (the same for vLLM's
            # on the same device), so kept sets are compared as their logits, then the log-probs as values.
            assert sorted(row[kept].tolist()) == sorted(row[list(want)].tolist()), (trial, top_p)
            assert sorted(got[kept].tolist()) == pytest.approx(sorted(want.values()), abs=1e-5)
        # top_p 1: the whole vocabulary (no token's probability underflows here), log softmax
        whole = training.nucleus_logprobs(row.expand(vocab, vocab), torch.arange(vocab), 1.0)
        assert torch.allclose(whole, row.log_softmax(-1), atol=1e-6)
    assert doctest.testmod(training).failed == 0


def test_the_nucleus_is_a_metric_beside_the_unchanged_old_log_probs(tiny_model_dir):
    # Samples whose sampler reported log-probs renormalised over the top-p 0.8 nucleus get nucleus_logps, the
    # trainer's own logits cut by the same rule, from the same pass (chunks of 3 positions, the nucleus 2 at a time);
    # old_logps, which the loss reads, are the same numbers as without it, and a top_p 1 pass returns what it did.
    model, tokenizer = models.load_model(str(tiny_model_dir))
    prompts = [tokenizer("3 + 4 =")["input_ids"], tokenizer("Tom has 10")["input_ids"]]
    groups = HFSampler(model, tokenizer, seed=0).sample(prompts, 3, temperature=0.8, top_p=0.8, max_new_tokens=6)
    plain = [training.new_sample(p, c) for p, group in zip(prompts, groups) for c in group]
    truncated = [{**s, "sampler_top_p": 0.8} for s in plain]
    training.attach_old_logprobs(model, plain, 4, 0.8, tokenizer.pad_token_id)
    training.attach_old_logprobs(model, truncated, 4, 0.8, tokenizer.pad_token_id)
    assert not any("nucleus_logps" in s for s in plain)
    for s, t in zip(plain, truncated):
        assert torch.equal(s["old_logps"], t["old_logps"]) and torch.equal(s["entropy"], t["entropy"])
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logits = model(ids).logits[0, len(s["prompt_ids"]) - 1 : -1] / 0.8  # [R, vocab]
        want = training.nucleus_logprobs(logits, ids[0, len(s["prompt_ids"]) :], 0.8)
        assert torch.isfinite(t["nucleus_logps"]).all()  # the trainer's nucleus holds what the sampler drew
        assert torch.allclose(t["nucleus_logps"], want, atol=1e-5)
        assert (t["nucleus_logps"] >= t["old_logps"]).all()  # renormalised over less than the whole vocabulary
    assert any((t["nucleus_logps"] > t["old_logps"] + 0.01).all() for t in truncated)  # the nucleus cut something
    batch = training.collate(truncated, tokenizer.pad_token_id, model.device)
    with torch.no_grad():
        logps, nucleus = training.response_logprobs(model, batch, 0.8, chunk_tokens=3, top_p=0.8)
        assert torch.equal(logps, training.response_logprobs(model, batch, 0.8, chunk_tokens=3))
    for row, s in zip(nucleus, truncated):
        assert torch.allclose(row[: len(s["response_ids"])], s["nucleus_logps"], atol=1e-6)
    with pytest.raises(ValueError, match="one pass rebuilds one nucleus"):
        training.attach_old_logprobs(model, [truncated[0], {**plain[1], "sampler_top_p": 0.9}], 4, 0.8, 0)


# ----------------------------------------------------------------------------------------------
# --rollout-correction


def test_tis_weights_worked_example():
    old = torch.log(torch.tensor([0.5, 0.5, 0.9, 0.2]))
    sampled = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.4]))
    edge = {"old_logps": old, "sampler_logps": sampled, "advantages": torch.tensor([1.0, -2.0, 0.5, 3.0])}
    greedy = {"old_logps": old[:2], "advantages": torch.tensor([1.0, 1.0])}  # no sampler log-probs: weight 1
    samples = [edge, greedy, edge]  # a repeated SPO-tree edge is one dict, weighted once
    rollout_correction.correct_rollouts(samples, "tis", cap=2.0)
    # weights min(pi_old / pi_sampler, 2): 1, 2, min(9, 2) = 2, 0.5
    assert edge["rollout_weights"].tolist() == pytest.approx([1.0, 2.0, 2.0, 0.5])
    assert edge["advantages"].tolist() == pytest.approx([1.0, -4.0, 1.0, 1.5])
    assert greedy["advantages"].tolist() == [1.0, 1.0] and "rollout_weights" not in greedy
    edge["loss_mask"] = torch.ones(4, dtype=torch.bool)
    metrics = rollout_correction.rollout_metrics([edge])
    assert metrics["sampler/tis_weight_mean"] == pytest.approx(5.5 / 4)
    assert metrics["sampler/tis_capped_fraction"] == pytest.approx(2 / 4)
    # none: nothing is touched
    plain = {"old_logps": old, "sampler_logps": sampled, "advantages": torch.ones(4)}
    rollout_correction.correct_rollouts([plain], "none", cap=2.0)
    assert plain["advantages"].tolist() == [1.0] * 4 and "rollout_weights" not in plain


def test_tis_weight_scales_the_surrogate_per_token():
    # A weight w > 0 on a token's advantage is the same as w on its PPO-clip surrogate term.
    torch.manual_seed(0)
    logps, old = torch.randn(2, 5), torch.randn(2, 5)
    advantages, weights = torch.randn(2, 5), torch.rand(2, 5) * 2
    mask = torch.ones(2, 5, dtype=torch.bool)
    weighted, _ = grpo_baseline.policy_loss(logps, old, logps, advantages * weights, mask, 0.2, 0.0, 10, 2)
    ratio = torch.exp(logps - old)
    surrogate = torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    assert weighted.item() == pytest.approx(-(surrogate * weights).sum().item() / 10, abs=1e-6)


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=lambda s: s.__name__)
def test_dry_run_shows_no_correction_as_the_papers(script, capsys):
    report = paper.dry_run(script.Args(), script.PAPER_SETTINGS, "gsm8k")
    assert report["settings"]["rollout_correction"] == "none" and report["paper"]["rollout_correction"] == "none"
    assert "rollout_correction" not in report["differences"]
    assert re.search(r"\s--rollout-correction\s+none\s+paper: none", capsys.readouterr().out)


def test_vllm_at_top_p_below_one_refuses_the_correction(monkeypatch, capsys):
    # named on the command line: refused before anything loads
    args = grpo_baseline.Args(backend="vllm", top_p=0.9, rollout_correction="tis")
    assert any(
        "needs --top-p 1" in problem
        for problem in settings.setting_problems(args, tasks.task_problems, engines.backend_problems)
    )
    assert not any(
        "--top-p" in p
        for p in settings.setting_problems(replace(args, top_p=1.0), tasks.task_problems, engines.backend_problems)
    )
    # --backend auto that resolves to vLLM: refused once the engine is known
    engine = object.__new__(engines.VLLMSampler)
    monkeypatch.setattr(engines, "make_sampler", lambda *a, **k: engine)
    args = grpo_baseline.Args(top_p=0.9, rollout_correction="tis")
    with pytest.raises(UsageError, match="--rollout-correction tis needs each token's log-prob under the whole vocab"):
        engines.run_sampler(args, None, None, None, None)
    assert (
        engines.run_sampler(grpo_baseline.Args(top_p=1.0, rollout_correction="tis"), None, None, None, None) is engine
    )
    assert "sampler/*" not in capsys.readouterr().out
    # without the correction the run goes on, and its start line says which gap sampler/* logs
    assert engines.run_sampler(grpo_baseline.Args(top_p=0.9), None, None, None, None) is engine
    assert (
        "sampler/* compare vLLM's log-probs with the trainer's, both renormalised over the top-p 0.9 nucleus (the "
        "trainer's rebuilt from its own logits by vLLM's rule;" in capsys.readouterr().out
    )


# ----------------------------------------------------------------------------------------------
# RUNNING.md's table: every metric the four scripts write, and nothing else


def metric_table() -> dict[str, set[str]]:
    """RUNNING.md "What a run logs": metric pattern -> the letters of the scripts that log it."""
    text = (ROOT / "RUNNING.md").read_text()
    section = text[text.index("## What a run logs") :]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", section, flags=re.M)
    return {key: set(SCRIPTS) if who.strip() == "all" else set(who.split()) for key, who in rows}


def pattern(key: str) -> re.Pattern:
    return re.compile(re.sub(r"<[a-z]+>", "[a-z0-9]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">")))


@pytest.fixture(scope="module")
def written_keys(tmp_path_factory) -> dict[str, set[str]]:
    """The keys each script's 2-iteration run writes to metrics.jsonl, with the correction on (its metrics too), on a
    digits model whose task it sometimes gets right (every algorithm then has something to train on)."""
    directory = tmp_path_factory.mktemp("digits")
    model_dir = make_tiny_model(directory / "model", alphabet="0123456789 ")
    data = write_jsonl(directory / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    written = {}
    for letter, script in SCRIPTS.items():
        args = smoke_args(script, model_dir, data, directory / letter, rollout_correction="tis", eval_samples=2)
        run_dir = Path(script.main(args)["run_dir"])
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        written[letter] = {key for line in lines for key in line} - {"iteration"}
    return written


# Rows only a vLLM run at --top-p < 1 writes (tests/test_vllm_cpu_engine.py runs each script so and reads them)
VLLM_TOP_P_ROWS = {"sampler/outside_nucleus_fraction"}


def test_running_md_lists_every_metric_the_scripts_write(written_keys):
    table = metric_table()
    for letter, keys in written_keys.items():
        for key in keys:
            rows = [row for row in table if pattern(row).fullmatch(key)]
            assert rows, f"{SCRIPTS[letter].__name__} writes {key}, which RUNNING.md's metric table does not list"
            assert letter in table[rows[0]], f"RUNNING.md's row {rows[0]} does not name {SCRIPTS[letter].__name__}"
    for row, letters in table.items():
        assert letters <= set(SCRIPTS), f"RUNNING.md's row {row}: unknown scripts {letters - set(SCRIPTS)}"
        if row in VLLM_TOP_P_ROWS:
            continue
        for letter in letters:
            assert any(pattern(row).fullmatch(key) for key in written_keys[letter]), (
                f"RUNNING.md's row {row} names {SCRIPTS[letter].__name__}, whose run did not write it"
            )


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=lambda s: s.__name__)
def test_a_new_loss_statistic_is_logged_with_no_plumbing_edit(
    script, tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch
):
    """Changing a script's loss is that script (and its RUNNING.md row): a statistic its policy_loss adds reaches
    metrics.jsonl as losses/<name>, averaged over the optimizer steps, through no plumbing code."""
    real = script.policy_loss

    def with_a_new_statistic(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss, {**stats, "masked_tokens_seen": float(args[4].sum())}  # args[4]: the loss mask

    monkeypatch.setattr(script, "policy_loss", with_a_new_statistic)
    # a digits-only model whose trees have finished leaves, so that SPO-tree has edges to train on
    model_dir = make_tiny_model(tmp_path / "model", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    extra = {"samples_per_iteration": 0} if script is spo_tree else {}
    args = smoke_args(script, model_dir, data, tmp_path / "runs", iterations=1, eval_before=False, **extra)
    script.main(args)
    [metrics_file] = (tmp_path / "runs").glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    [row] = [row for row in rows if row.get("iteration") == 1 and "losses/loss" in row]
    assert row["losses/masked_tokens_seen"] >= 1 and math.isfinite(row["losses/masked_tokens_seen"])


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=lambda s: s.__name__)
def test_each_iteration_logs_the_loss_masked_tokens_and_what_centring_made_positive(script, tmp_path):
    """charts/loss_mask_tokens counts the tokens in the loss; under --whiten scale no advantage-0 token turns positive,
    and the run says --whiten in its args.json and --dry-run."""
    model_dir = make_tiny_model(tmp_path / "model", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    extra = {"samples_per_iteration": 0} if script is spo_tree else {}
    for mode in ("centre-scale", "scale"):
        args = smoke_args(
            script, model_dir, data, tmp_path / mode, iterations=1, eval_before=False, whiten=mode, **extra
        )
        summary = script.main(args)
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        [row] = [row for row in rows if "charts/reward" in row]
        assert row["charts/loss_mask_tokens"] >= 1
        assert 0 <= row["charts/zero_advantages_made_positive"] <= row["charts/loss_mask_tokens"]
        if mode == "scale":
            assert row["charts/zero_advantages_made_positive"] == 0
        assert json.loads((Path(summary["run_dir"]) / "args.json").read_text())["whiten"] == mode
    assert "whiten" in script.main(replace(args, dry_run=True))["settings"]
