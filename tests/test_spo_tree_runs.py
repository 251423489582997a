"""spo_tree.py run as a researcher runs it: the rollout on a tiny model, micro-batch invariance, a smoke run,
memory-sized passes, samples per iteration, resume, reward that rises, --dry-run, error lines, --max-minutes and
saved trees."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as ev
import spo_tree as spo
from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import engines, models, training

ROOT = Path(__file__).resolve().parents[1]


def nodes_by_depth(tree: spo.Node) -> dict[int, list[spo.Node]]:
    out = {}
    for node, _ in spo.walk(tree):
        out.setdefault(node.depth, []).append(node)
    return out


def test_rollout_on_the_tiny_model_builds_the_tree_shape_2_2(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    sampler = engines.HFSampler(model, tokenizer, seed=0)
    prompts = [
        tokenizer("question 1:")["input_ids"],
        tokenizer("another question:")["input_ids"],
        tokenizer("q3")["input_ids"],
    ]
    trees, seconds = spo.grow_trees(
        sampler,
        prompts,
        [2, 2],
        segment_tokens=4,
        max_new_tokens=10,
        context=96,
        temperature=1.0,
        top_p=1.0,
        stop=[],
    )
    assert len(trees) == 3 and len(seconds) == 2
    for prompt, tree in zip(prompts, trees):
        assert tree.tokens == prompt
        levels = nodes_by_depth(tree)
        assert len(levels[1]) == 2
        expanded = [node for node in levels[1] if node.children]
        for node in levels[1]:  # a depth-1 node is expanded iff it filled its M tokens without stopping
            assert bool(node.children) == (node.finish_reason == "length" and len(node.tokens) == 4)
            assert node.finish_reason == "length" or node.tokens[-1] == tokenizer.eos_token_id
        assert len(levels.get(2, [])) == 2 * len(expanded) and 3 not in levels
        for leaf in levels.get(2, []):  # last level: the rest of the 10-token budget
            assert not leaf.children and 1 <= len(leaf.tokens) <= 10 - 4
            assert leaf.finish_reason == "stop" or len(leaf.tokens) == 10 - 4  # unfinished only at the budget
    assert sum(len(nodes_by_depth(t).get(2, [])) for t in trees) > 0  # a random model rarely stops within 4 tokens


def test_gradient_does_not_depend_on_micro_batch_split(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):  # edges: queries of different depths, constant advantage per edge
        response = torch.randint(4, len(tokenizer), (2 + i % 3,), generator=g).tolist() + (
            [tokenizer.eos_token_id] if i % 2 else []
        )
        n = len(response)
        samples.append(
            {
                "prompt_ids": tokenizer(f"question {i}:" + "x" * i)["input_ids"],
                "response_ids": response,
                "old_logps": -torch.rand(n, generator=g) * 3,
                "ref_logps": -torch.rand(n, generator=g) * 3,
                "advantages": torch.full((n,), float(torch.randn(1, generator=g))),
                "loss_mask": torch.rand(n, generator=g) > 0.2,
            }
        )
    grads = []
    for micro in (1, 2, 6):
        model.zero_grad()
        spo.accumulate_gradients(
            model,
            samples,
            micro_batch_size=micro,
            temperature=0.7,
            clip_eps=0.2,
            beta=0.1,
            pad_id=tokenizer.pad_token_id,
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    """A digits-only model (EOS is 1 token in 15, so trees have finished leaves) and a task whose answer is always 7."""
    directory = tmp_path_factory.mktemp("sevens")
    model_dir = make_tiny_model(directory / "model", alphabet="0123456789 ")
    data = write_jsonl(directory / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    return model_dir, data


def test_smoke_run_trains_on_tree_edges_and_writes_a_checkpoint_with_the_buffer(sevens, tmp_path):
    model_dir, data = sevens
    # 0: every edge offered, once
    summary = spo.main(smoke_args(spo, model_dir, data, tmp_path, samples_per_iteration=0))
    metrics = read_metrics(summary["run_dir"])
    train = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1, 2]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for m in metrics for v in m.values())
    assert all("losses/kl_per_sequence" in m and "losses/grad_norm" in m and m["charts/samples"] > 0 for m in train)
    assert all(m["charts/unique_samples"] == m["charts/samples"] for m in train)
    for m in train:  # tree 4,3: every depth-1 node that did not stop has 3 children (the context never binds here)
        open_nodes = 4 - m["tree/early_leaves_depth1"]
        assert m["tree/nodes"] == pytest.approx(4 + 3 * open_nodes) and m["tree/leaves"] == pytest.approx(
            4 - open_nodes + 3 * open_nodes
        )
        assert m["charts/samples"] <= 3 * 4 * 2 and 0 <= m["charts/zero_advantage_fraction"] <= 1
    assert train[0]["charts/zero_advantage_fraction"] < 1  # iteration 2 may train on iteration 1's leftover edges only
    state = torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=True)
    assert state["iteration"] == 2 and isinstance(state["buffer"], list)
    assert len(state["buffer"]) == train[-1]["buffer/size"]
    assert all(2 - edge["born"] < 2 and len(edge["old_logps"]) == len(edge["response_ids"]) for edge in state["buffer"])
    model, tokenizer = models.load_model(summary["checkpoint"])
    result = ev.evaluate(model, tokenizer, str(data), limit=2, max_new_tokens=4)
    assert result["examples"] == 2


def test_no_grad_passes_sized_to_memory_and_a_parked_reference_make_the_same_update(sevens, tmp_path, monkeypatch):
    """The old-log-prob and reference passes cut by a token budget (a GPU's free memory; here 90 positions: passes of
    2 edges where the CPU's micro-batches hold 4) and the reference parked between its passes: the same trees,
    losses and weights, up to fp32 summation order (the KL differs in its 5th digit)."""
    model_dir, data = sevens
    runs = {}
    for name, budget, on_device in (("micro-batches", None, True), ("token budget", 90, False)):
        passes = []
        monkeypatch.setattr(training, "no_grad_batch_tokens", lambda *a, budget=budget, **k: passes.append(1) or budget)
        summary = spo.main(
            smoke_args(spo, model_dir, data, tmp_path / name, samples_per_iteration=0, reference_on_device=on_device)
        )
        runs[name] = read_metrics(summary["run_dir"]), models.load_model(summary["checkpoint"])[0].state_dict()
        assert passes  # every no-grad pass asked for its budget
    (metrics, weights), (budget_metrics, budget_weights) = runs.values()
    assert [m.keys() for m in metrics] == [m.keys() for m in budget_metrics]
    for m, b in zip(metrics, budget_metrics):
        assert m == pytest.approx(b, rel=1e-4, abs=1e-6)
    assert all(torch.allclose(weights[k], budget_weights[k], rtol=0, atol=1e-6) for k in weights)


def test_samples_per_iteration_trains_exactly_that_many_samples(sevens, tmp_path, monkeypatch):
    model_dir, data = sevens
    offered, trained, real_fill, real_step = [], [], spo.fill_samples, spo.accumulate_gradients

    def recording_fill(taken, remaining, n, rng):
        offered.append(len(taken))
        return real_fill(taken, remaining, n, rng)

    def recording_step(model, batch_samples, **kwargs):
        trained.append(batch_samples)
        return real_step(model, batch_samples, **kwargs)

    monkeypatch.setattr(spo, "fill_samples", recording_fill)
    monkeypatch.setattr(spo, "accumulate_gradients", recording_step)
    summary = spo.main(smoke_args(spo, model_dir, data, tmp_path, samples_per_iteration=5))
    train = [m for m in read_metrics(summary["run_dir"]) if "charts/samples" in m]
    assert offered == [4, 7]  # seed 3: iteration 1 offers fewer edges than 5 (repeats), iteration 2 more (two go back)
    assert [m["charts/samples"] for m in train] == [5, 5] and [m["charts/unique_samples"] for m in train] == [4, 5]
    assert [len(batch) for batch in trained] == [5, 5]  # batch 8: one optimizer step of 5 samples per iteration
    assert len({id(s) for s in trained[0]}) == 4  # the repeats are trained as copies
    state = torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=True)
    # the edge that went back is kept for the next iteration
    assert len(state["buffer"]) == train[-1]["buffer/size"] >= 1
    assert not any("loss_mask" in edge for edge in state["buffer"])  # and was not trained on


def test_resume_after_a_kill_continues_exactly_where_it_stopped(sevens, tmp_path, monkeypatch):
    model_dir, data = sevens
    # seed 3, 5 samples per iteration: iteration 1 repeats edges, iteration 2 sends 2 back to the buffer,
    # iteration 3 trains on the edges the checkpoint kept.
    settings = dict(iterations=3, seed=3, samples_per_iteration=5)
    full = spo.main(smoke_args(spo, model_dir, data, tmp_path / "full", **settings))

    class Killed(Exception):
        pass

    sleeps, real_sleep = [], engines.HFSampler.sleep

    def dies_in_iteration_3(self):  # called once per iteration: after the buffer step, before the update
        sleeps.append(1)
        if len(sleeps) == 3:
            raise Killed
        return real_sleep(self)

    with monkeypatch.context() as patch, pytest.raises(Killed):  # the resume below runs unpatched
        patch.setattr(engines.HFSampler, "sleep", dies_in_iteration_3)
        spo.main(smoke_args(spo, model_dir, data, tmp_path / "killed", **settings))
    run_dir = next((tmp_path / "killed").iterdir())
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 2

    resumed = spo.main(smoke_args(spo, model_dir, data, tmp_path / "unused", **settings, resume=str(run_dir)))
    assert resumed["run_dir"] == str(run_dir)
    expected = read_metrics(full["run_dir"])
    assert read_metrics(run_dir) == expected  # same seed: same numbers with or without the kill
    train = [m for m in expected if "charts/samples" in m]
    assert [m["charts/samples"] for m in train] == [5, 5, 5]
    # iteration 3 trained on edges the checkpoint kept
    assert train[1]["buffer/size"] > 0 and train[2]["buffer/taken_mean_age"] > 0


@pytest.mark.slow
def test_reward_rises_on_a_trivially_learnable_task(sevens, tmp_path):
    # Every answer is 7 and the vocabulary is digits: "7<eos>" (or "7" then <eos> one level down) is always right.
    model_dir, data = sevens
    summary = spo.main(
        spo.Args(
            model=str(model_dir),
            task=str(data),
            backend="hf",
            iterations=14,
            questions=8,
            tree="4,4",
            segment_tokens=1,
            max_new_tokens=3,
            context=64,
            batch_size=64,
            micro_batch_size=64,
            lr=1e-2,
            beta=0.0,
            warmup_ratio=0.0,
            edges_per_question=8,
            samples_per_iteration=0,
            buffer_max_age=1,
            eval_every=1000,
            eval_samples=4,
            eval_limit=8,
            eval_temperature=0.6,
            save_every=1000,
            output_dir=str(tmp_path / "runs"),
            seed=0,  # seeds 0 and 2 reach ~0.9 by iteration 10; seed 1 is slower
        )
    )
    values = [m["charts/root_value"] for m in read_metrics(summary["run_dir"]) if "charts/root_value" in m]
    assert sum(values[:3]) / 3 < 0.15
    assert sum(values[-3:]) / 3 > 0.5
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.5


def test_dry_run_resolves_the_paper_config_and_loads_nothing(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "spo_tree.py"),
            "--model",
            "deepseek-r1-distill-qwen-1.5b",
            "--tree",
            "6,6,6",
            "--dry-run",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "0 difference(s)" in result.stdout.strip().splitlines()[-1], result.stdout
    assert "nodes_per_full_tree 258" in result.stdout
    assert not (tmp_path / "runs").exists()

    config = spo.main(
        spo.Args(model="deepseek-r1-distill-qwen-1.5b", tree="6,6,6", dry_run=True, output_dir=str(tmp_path / "runs"))
    )
    resolved, settings = config["resolved"], config["settings"]
    assert resolved["model_id"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" and resolved["eval_task"] == "math500"
    assert (
        resolved["branches"] == [6, 6, 6]
        and resolved["nodes_per_full_tree"] == 6 + 36 + 216
        and resolved["leaves_per_full_tree"] == 216
    )
    assert (settings["task"], settings["segment_tokens"], settings["context"], settings["questions"]) == (
        "math",
        600,
        2048,
        32,
    )
    assert (settings["batch_size"], settings["epochs"], settings["temperature"], settings["top_p"]) == (
        128,
        1,
        0.6,
        1.0,
    )
    assert (settings["lr"], settings["beta"], settings["prob_mask"], settings["samples_per_iteration"]) == (
        1e-6,
        1e-4,
        True,
        512,
    )
    assert config["paper_run"] == "math" and config["differences"] == []
    assert not (tmp_path / "runs").exists()


def test_bad_tree_on_the_command_line_is_one_clear_error_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "spo_tree.py"), "--tree", "6,0,6", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: --tree '6,0,6': branch factor '0' at depth 1 is not a positive integer "
        "(write one per depth, e.g. 6,6,6)"
    ]


def test_max_minutes_stops_early_and_save_samples_writes_the_trees(tiny_model_dir, gsm8k_jsonl, tmp_path):
    summary = spo.main(
        smoke_args(
            spo, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=5, max_minutes=1e-6, save_samples=1, save_questions=2
        )
    )
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1] and [m["iteration"] for m in lines if "eval/accuracy" in m] == [0, 1]
    assert train[0]["time/train_seconds"] == train[0]["time/iteration_seconds"] > 0
    assert train[0]["charts/generated_tokens"] == pytest.approx(train[0]["charts/generated_tokens_per_question"] * 3)

    records = [json.loads(line) for line in (run_dir / "samples" / "iter_1.jsonl").read_text().splitlines()]
    assert [r["question_index"] for r in records] == [0, 1] and all(r["algorithm"] == "spo_tree" for r in records)

    def check(node, parent_value, depth):
        assert len(node["tokens"]) == len(node["token_ids"]) == len(node["probs"])
        if depth:
            assert node["advantage"] == pytest.approx(node["value"] - parent_value, abs=1e-4)  # rloo
        if node["children"]:
            assert node["value"] == pytest.approx(
                sum(c["value"] for c in node["children"]) / len(node["children"]), abs=1e-4
            )
            assert len(node["children"]) == (4 if depth == 0 else 3) and node["reward"] is None
        else:
            assert node["value"] == node["reward"] and node["finish_reason"] in ("stop", "length")
        for child in node["children"]:
            check(child, node["value"], depth + 1)

    for r in records:
        assert r["tree"]["token_ids"] == [] and r["tree"]["advantage"] is None
        check(r["tree"], None, 0)


def test_depth_weighting_reaches_the_loss_of_a_main_run(tmp_path, monkeypatch):
    """The same trees (same seed) under --edge-weight uniform and depth: other per-token weights on the surrogate,
    another gradient; the rewards, which come before the weights, are the same."""
    from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl

    # digits only (EOS is 1 token in 15: trees have finished leaves), every answer 7: some leaves are right
    model_dir = make_tiny_model(tmp_path / "model", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])

    seen = {}
    real = spo.attach_targets

    def recording(samples, *rest, **kw):
        whitening = real(samples, *rest, **kw)
        seen.setdefault(run, []).append([(s.get("weight", 1.0), s["advantages"].clone()) for s in samples])
        return whitening

    monkeypatch.setattr(spo, "attach_targets", recording)
    metrics = {}
    for run in ("uniform", "depth"):
        args = smoke_args(spo, model_dir, data, tmp_path / run, iterations=1, buffer_max_age=1, edge_weight=run)
        args = spo.Args(**{**vars(args), "edges_per_question": 100})  # every edge: weights by depth alone
        metrics[run] = read_metrics(spo.main(args)["run_dir"])[-2]  # iteration 1 (before its evaluation row)
    uniform, depth = seen["uniform"][0], seen["depth"][0]
    assert {w for w, _ in uniform} == {1.0} and len({w for w, _ in depth}) == 2  # depth 1 and depth 2 weights
    assert sorted({w for w, _ in depth}) == pytest.approx(sorted(spo.depth_weights([4, 3])))
    for (w, a_depth), (_, a_uniform) in zip(depth, uniform):
        assert torch.allclose(a_depth, w * a_uniform)  # the same trees, whitened alike, then weighted
    assert metrics["uniform"]["charts/reward"] == metrics["depth"]["charts/reward"]
    assert metrics["uniform"]["losses/grad_norm"] != pytest.approx(metrics["depth"]["losses/grad_norm"], rel=1e-3)
