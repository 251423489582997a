"""ppo_baseline.py run as a researcher runs it: the critic (init, layout, shapes, one prefill per prompt), micro-batch
invariance, --dry-run, a smoke run, resume, reward that rises, --max-minutes and saved values."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as ev
import ppo_baseline as ppo
from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import UsageError, cli, models

ROOT = Path(__file__).resolve().parents[1]


def _samples(tokenizer, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = tokenizer(f"question {i}:")["input_ids"]
        response = torch.randint(4, len(tokenizer), (3 + i % 4,), generator=g).tolist() + [tokenizer.eos_token_id]
        length = len(response)
        samples.append(
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "old_logps": -torch.rand(length, generator=g) * 3,
                "ref_logps": -torch.rand(length, generator=g) * 3,
                "advantages": torch.randn(length, generator=g),
                "loss_mask": torch.rand(length, generator=g) > 0.2,
                "old_values": torch.randn(length, generator=g) * 0.1,
                "returns": torch.rand(length, generator=g),
            }
        )
    return samples


def _critic_with_random_head(model, seed=0):
    critic = ppo.make_critic(model)
    torch.manual_seed(seed)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # the zero init would hide layout mistakes
    return critic


def test_critic_starts_from_the_policy_weights_with_a_zero_head(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    critic = ppo.make_critic(model)
    policy_backbone = dict(model.base_model.named_parameters())
    critic_backbone = dict(critic.backbone.named_parameters())
    assert critic_backbone.keys() == policy_backbone.keys()
    for name, param in critic_backbone.items():
        assert torch.equal(param, policy_backbone[name])
        # a copy: training the critic leaves the policy alone
        assert param.data_ptr() != policy_backbone[name].data_ptr()
    assert critic.value_head.weight.abs().sum() == 0 and critic.value_head.bias.abs().sum() == 0
    values = ppo.sample_values(critic, _samples(tokenizer, 3), 2, tokenizer.pad_token_id)
    assert all((v == 0).all() for v in values)


def test_value_shapes_and_positions_match_a_plain_forward(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    critic = _critic_with_random_head(model)
    samples = [
        {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23]},
    ]
    batch = ppo.collate(samples, 0, "cpu")
    values = ppo.response_values(critic, batch)
    assert values.shape == (2, 3)  # [batch, R]
    for row, s in enumerate(samples):
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        hidden = critic.backbone(ids).last_hidden_state[0]  # [P + R, hidden]
        # value of the state before y_t is read at the position of the token preceding y_t
        expected = critic.value_head(hidden[len(s["prompt_ids"]) - 1 : -1]).squeeze(-1)
        assert torch.allclose(values[row, : len(s["response_ids"])], expected, atol=1e-5)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["cached", "activation-checkpointed"])
def test_critic_runs_a_shared_prompt_once_with_the_values_and_gradient_of_separate_passes(checkpointed, tiny_model_dir):
    model, _ = models.load_model(str(tiny_model_dir))
    critic = _critic_with_random_head(model)
    critic.train()  # activation checkpointing acts in training mode only (the tiny Llama has no dropout)
    samples = [  # two prompts of two rows each (the second left-padded), one alone
        {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23]},
        {"prompt_ids": [10, 11, 12], "response_ids": [15, 16, 17]},
        {"prompt_ids": [20], "response_ids": [24]},
        {"prompt_ids": [30, 31], "response_ids": [32]},
    ]
    weights = [torch.randn(len(s["response_ids"])) for s in samples]
    expected = []
    for s in samples:
        # [P + R, hidden]
        hidden = critic.backbone(torch.tensor([s["prompt_ids"] + s["response_ids"]])).last_hidden_state[0]
        expected.append(critic.value_head(hidden[len(s["prompt_ids"]) - 1 : -1]).squeeze(-1))  # V before each y_t
    sum((w * v).sum() for w, v in zip(weights, expected)).backward()
    expected_grad = torch.cat([p.grad.flatten() for p in critic.parameters()])

    if checkpointed:
        critic.backbone.activation_checkpointing_enable()
    critic.zero_grad()
    shapes = []  # [rows, positions] of every forward pass
    critic.backbone.get_input_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape))
    )
    values = ppo.response_values(critic, ppo.collate(samples, 0, "cpu"))  # [rows, R]
    # each prompt once, then the responses on its cache
    assert shapes == ([(5, 6)] if checkpointed else [(3, 3), (5, 3)])
    for row, v in enumerate(expected):
        assert torch.allclose(values[row, : len(v)], v, atol=1e-5)
    sum((w * values[row, : len(w)]).sum() for row, w in enumerate(weights)).backward()
    grad = torch.cat([p.grad.flatten() for p in critic.parameters()])
    # equal up to fp32 rounding: the random head makes entries up to ~80 (embeddings summed over shared tokens)
    assert grad.abs().sum() > 0 and (grad - expected_grad).abs().max() <= 1e-6 * expected_grad.abs().max()
    shapes.clear()
    with torch.no_grad():  # a pass without gradients checkpoints nothing: prompts are shared again
        assert torch.allclose(ppo.response_values(critic, ppo.collate(samples, 0, "cpu")), values, atol=1e-6)
    assert shapes == [(3, 3), (5, 3)]


def test_gradients_do_not_depend_on_micro_batch_split(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    critic = _critic_with_random_head(model)
    samples = _samples(tokenizer)
    policy_grads, critic_grads = [], []
    for micro in (1, 2, 6):
        model.zero_grad()
        critic.zero_grad()
        stats = ppo.accumulate_gradients(
            model,
            critic,
            samples,
            micro_batch_size=micro,
            temperature=0.7,
            clip_eps=0.2,
            beta=0.1,
            value_clip_eps=0.05,
            pad_id=tokenizer.pad_token_id,
        )
        assert stats["value_clip_frac"] > 0  # the clipped branch is exercised
        policy_grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        critic_grads.append(torch.cat([p.grad.flatten() for p in critic.parameters()]))
    for grads in (policy_grads, critic_grads):  # equal up to fp32 rounding (entries up to ~20: its step is ~2e-6)
        assert grads[0].abs().sum() > 0
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5) and torch.allclose(
            grads[0], grads[2], rtol=1e-5, atol=1e-5
        )


def test_critic_fits_its_returns(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    critic = ppo.make_critic(model)
    samples = _samples(tokenizer)
    for s in samples:
        s["returns"] = torch.full_like(s["returns"], 0.3)
        s["old_values"] = torch.zeros_like(s["old_values"])
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    batch = ppo.collate(samples, tokenizer.pad_token_id, "cpu")
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss, _ = ppo.value_loss(
            ppo.response_values(critic, batch),
            batch["old_values"],
            batch["returns"],
            batch["response_mask"],
            clip_eps=1.0,
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


def test_dry_run_compares_with_the_paper_and_creates_nothing(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    # the defaults are the paper's run
    assert ppo.main(ppo.Args(dry_run=True, output_dir=str(runs_dir)))["differences"] == []
    result = ppo.main(cli.parse(ppo.Args, ["--dry-run", "--lam", "0.96", "--output-dir", str(runs_dir)]))
    assert result["differences"] == ["lam"]
    assert result["resolved"] == {"eval_task": "gsm8k", "model_id": "realtreetune/rho-1b-sft-GSM8K"}
    assert "* --lam" in capsys.readouterr().out
    assert ppo.main(ppo.Args(dry_run=True, task="math", output_dir=str(runs_dir)))["resolved"]["eval_task"] == "math500"
    assert not runs_dir.exists()  # nothing loaded, nothing written


def test_cli_bad_input_prints_one_error_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "ppo_baseline.py"), "--gamma", "2", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --gamma (2.0) must be in [0, 1]")
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    """A tiny model over the alphabet "7 " and questions whose answer is 7: even the random model earns some
    reward, so the critic has non-zero returns to learn and the resume test compares a critic that moved."""
    directory = tmp_path_factory.mktemp("sevens")
    model_dir = make_tiny_model(directory / "model", alphabet="7 ")
    return model_dir, write_jsonl(
        directory / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)]
    )


def _critic_state(checkpoint):
    return torch.load(Path(checkpoint) / "critic.pt", weights_only=True)


def test_smoke_run_writes_finite_metrics_and_a_checkpoint_with_the_critic(sevens, tmp_path):
    summary = ppo.main(smoke_args(ppo, *sevens, tmp_path))
    metrics = read_metrics(summary["run_dir"])
    train = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1, 2]
    assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for m in metrics for v in m.values())
    for key in (
        "losses/value_loss",
        "losses/value_clip_frac",
        "charts/mean_value",
        "losses/critic_grad_norm",
        "losses/kl_per_sequence",
        "losses/kl_per_token",
        "policy/entropy",
        "sampler/kl_per_token",
    ):
        assert key in train[0]
    assert train[0]["charts/reward"] > 0  # the critic has something to learn
    # zero head at first, then trained
    assert train[0]["charts/mean_value"] == 0.0 and train[1]["charts/mean_value"] != 0.0
    assert -10 < train[0]["losses/explained_variance"] <= 1
    # The policy is a plain save_pretrained directory that eval.py loads.
    model, tokenizer = models.load_model(summary["checkpoint"])
    result = ev.evaluate(model, tokenizer, str(sevens[1]), limit=2, max_new_tokens=4)
    assert result["examples"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    # The critic: the policy's backbone layout plus a value head, trained away from its zero init.
    critic = ppo.make_critic(model)
    critic.load_state_dict(_critic_state(summary["checkpoint"]))
    assert critic.value_head.weight.abs().sum() > 0
    state = torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=True)
    assert state["iteration"] == 2 and state["critic_optimizer"]["state"]


def test_resume_after_a_kill_restores_policy_and_critic_exactly(sevens, tmp_path, monkeypatch):
    full = ppo.main(smoke_args(ppo, *sevens, tmp_path / "full", iterations=3))

    class Killed(Exception):
        pass

    calls, real_step = [], ppo.accumulate_gradients

    def dies_in_iteration_3(*args, **kwargs):  # 2 optimizer steps per iteration: the 5th is iteration 3's first
        calls.append(1)
        if len(calls) == 5:
            raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(ppo, "accumulate_gradients", dies_in_iteration_3)
    with pytest.raises(Killed):
        ppo.main(smoke_args(ppo, *sevens, tmp_path / "killed", iterations=3))
    monkeypatch.setattr(ppo, "accumulate_gradients", real_step)
    run_dir = next((tmp_path / "killed").iterdir())
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 2

    resumed = ppo.main(smoke_args(ppo, *sevens, tmp_path / "unused", iterations=3, resume=str(run_dir)))
    assert resumed["run_dir"] == str(run_dir)
    assert read_metrics(run_dir) == read_metrics(full["run_dir"])  # same seed: same numbers with or without the kill
    killed_critic, full_critic = _critic_state(resumed["checkpoint"]), _critic_state(full["checkpoint"])
    assert full_critic["value_head.weight"].abs().sum() > 0  # the critic did train: comparing it means something
    assert killed_critic.keys() == full_critic.keys()
    assert all(torch.equal(killed_critic[k], full_critic[k]) for k in full_critic)


def test_prob_mask_gradient_checkpointing_and_no_reference_model_run(sevens, tmp_path):
    summary = ppo.main(
        smoke_args(
            ppo,
            *sevens,
            tmp_path,
            iterations=1,
            prob_mask=True,
            prob_threshold=0.17,
            gradient_checkpointing=True,
            beta=0.0,
        )
    )
    train = [m for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    assert 0 < train[0]["charts/loss_mask_fraction"] < 1  # the mask drops the confident tokens from the policy loss
    assert train[0]["losses/loss"] == pytest.approx(train[0]["losses/pg_loss"])  # beta 0: no KL term in the loss
    assert train[0]["losses/critic_grad_norm"] > 0


def test_resume_from_a_directory_without_checkpoint_is_one_clear_error(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint found"):
        ppo.main(ppo.Args(resume=str(tmp_path)))


@pytest.mark.slow
def test_reward_rises_on_a_trivially_learnable_task(tmp_path):
    # Digits-only vocabulary; every answer is 7, so "7<eos>" is always right and PPO must find it.
    model_dir = make_tiny_model(tmp_path / "digits", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    summary = ppo.main(
        ppo.Args(
            model=str(model_dir),
            task=str(data),
            backend="hf",
            iterations=25,
            questions=8,
            group_size=8,
            max_new_tokens=3,
            context=64,
            batch_size=64,
            micro_batch_size=64,
            epochs=1,
            lr=1e-2,
            critic_lr=1e-2,
            beta=0.0,
            warmup_ratio=0.0,
            eval_every=1000,
            eval_samples=4,
            eval_limit=8,
            eval_temperature=0.6,
            save_every=1000,
            output_dir=str(tmp_path / "runs"),
        )
    )
    train = [m for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    rewards = [m["charts/reward"] for m in train]
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-3:]) / 3 > 0.8
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.5
    assert train[-1]["charts/mean_value"] > 0.5  # the critic followed the reward up


def test_max_minutes_stops_early_and_save_samples_writes_values_and_advantages(tiny_model_dir, gsm8k_jsonl, tmp_path):
    summary = ppo.main(
        smoke_args(
            ppo, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=5, max_minutes=1e-6, save_samples=1, save_questions=1
        )
    )
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1] and [m["iteration"] for m in lines if "eval/accuracy" in m] == [0, 1]
    assert train[0]["time/train_seconds"] == train[0]["time/iteration_seconds"] > 0
    assert train[0]["charts/generated_tokens"] == train[0]["charts/response_tokens"] * 3 * 4

    records = [json.loads(line) for line in (run_dir / "samples" / "iter_1.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["algorithm"] == "ppo" for r in records)
    for r in records:
        n = len(r["token_ids"])
        assert (
            len(r["tokens"]) == len(r["probs"]) == len(r["advantages"]) == len(r["values"]) == len(r["loss_mask"]) == n
        )
        if n:  # GAE with gamma 1 and the reward on the last token: A_t = lam-weighted; lam 0.9 here, so recompute it
            rewards = torch.zeros(1, n)
            rewards[0, -1] = r["reward"]
            expected, _ = ppo.gae_advantages(
                rewards, torch.tensor([r["values"]]), torch.ones(1, n, dtype=torch.bool), 1.0, 0.9
            )
            assert r["advantages"] == pytest.approx(expected[0].tolist(), abs=1e-3)
