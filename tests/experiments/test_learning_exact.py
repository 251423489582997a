"""experiments/learning_exact.py and the training it runs (toy_training.py): the exact J and KL after an update against
a fresh enumeration and brute force, the pure pieces (sizes, iterations to a gain, bootstrap intervals, the sweep's
widening) on hand-made numbers, and a tiny end-to-end run."""

import dataclasses
import doctest
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import spo_tree
from experiments import exact_toy as toy
from experiments import learning_exact as le
from experiments import measures, toy_training

ARGS = dataclasses.replace(le.Args(), **le.TINY)  # horizon 4, prompts 21 and 13


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the benchmark runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world():
    model, *_ = toy.make_policy(le.toy_settings(ARGS))
    exacts = toy_training.enumerate_policy(model, ARGS)
    sizes, _ = le.plan_sizes(exacts, list(toy.SETTINGS), ARGS)
    return toy_training.World(model, exacts, sizes)


def response_probabilities(exact: toy.Exact) -> dict[tuple[int, ...], float]:
    """Brute force: P(y) of every complete response (digits then EOS, or `horizon` digits: unfinished) as the product
    of its tokens' table probabilities."""
    out = {}
    for length in range(exact.horizon + 1):
        for digits in itertools.product(range(1, toy.VOCAB), repeat=length):
            response = list(digits) + ([toy.EOS] if length < exact.horizon else [])
            out[tuple(response)] = math.prod(exact.token_probs(response))
    return out


# ----------------------------------------------------------------------------------------------
# The exact answer after an update


@pytest.mark.parametrize("name", ["grpo", "spo_tree_depth", "ppo_lam1"])
def test_exact_j_and_kl_after_one_update_match_a_fresh_enumeration_and_brute_force(world, name):
    curve, learner = toy_training.train_run(name, 1e-2, 7, world, dataclasses.replace(ARGS, iterations=1))
    fresh = [
        toy.enumerate_exact(learner.model, *toy.parse_prompt(text), ARGS.horizon, ARGS.temperature, 64)
        for text in ARGS.prompts
    ]
    assert curve["J"][0] == toy.expected_reward(world.exacts) and curve["kl"][0] == 0.0
    assert curve["J"][1] == pytest.approx(toy.expected_reward(fresh), abs=1e-12)
    assert curve["J"][1] != pytest.approx(curve["J"][0], abs=1e-6)  # the update moved the policy
    # KL over whole responses, summed over every response's probability under both policies
    brute = np.mean(
        [
            sum(p * math.log(p / start[y]) for y, p in response_probabilities(exact).items())
            for exact, start in zip(fresh, [response_probabilities(e) for e in world.exacts])
        ]
    )
    assert curve["kl"][1] == pytest.approx(brute, rel=1e-9) and brute > 0
    assert 0 < curve["tokens"][0] <= 2 * ARGS.budget


def test_spo_tree_depth_weights_its_edges_as_main_does_and_uniform_does_not(world, monkeypatch):
    seen = []
    original = spo_tree.attach_targets

    def spy(samples, *a, **k):
        seen.append([dict(s) for s in samples])
        return original(samples, *a, **k)

    monkeypatch.setattr(spo_tree, "attach_targets", spy)
    for name in ("spo_tree_uniform", "spo_tree_depth"):
        toy_training.train_run(name, 1e-3, 3, world, dataclasses.replace(ARGS, iterations=1))
    uniform, depth = seen
    branches = [world.sizes["spo_tree_depth"]] * ARGS.tree_depth
    assert uniform and all("weight" not in s for s in uniform)
    # buffer age 1 and every edge taken: E_q / k_q = 1, so each weight is its depth's
    assert [s["weight"] for s in depth] == [spo_tree.depth_weights(branches)[s["depth"] - 1] for s in depth]
    assert {s["depth"] for s in depth} == set(range(1, ARGS.tree_depth + 1))


def test_every_setting_learns_something_from_the_same_start(world):
    for name in toy.SETTINGS:
        curve, _ = toy_training.train_run(name, 1e-2, 11, world, dataclasses.replace(ARGS, iterations=2))
        assert curve["J"][0] == toy.expected_reward(world.exacts), name
        assert all(np.isfinite(curve["J"])) and min(curve["kl"][1:]) > 0, name


# ----------------------------------------------------------------------------------------------
# The pure pieces, on hand-made numbers


def test_iterations_to_gain_counts_the_first_iteration_and_censors_the_rest():
    assert le.iterations_to_gain([0.4, 0.45, 0.5, 0.6], 0.1) == 2  # J_2 = J_0 + 0.1 exactly (up to round-off)
    assert le.iterations_to_gain([0.4, 0.55, 0.3, 0.3], 0.1) == 1  # the first crossing counts, not the last
    assert le.iterations_to_gain([0.4, 0.45, 0.49, 0.3], 0.1) == 4  # never: iterations + 1
    assert le.iterations_to_gain([0.4], 0.1) == 1


def test_summary_pairs_the_seeds_in_its_bootstrap_intervals():
    args = dataclasses.replace(le.Args(), iterations=4, bootstrap=500, gain=0.1)
    rng = np.random.default_rng(0)
    base = [0.3 + np.cumsum(np.r_[0, rng.uniform(0, 0.05, 4)]) + rng.normal(0, 0.2) for _ in range(6)]

    def runs(shift: float) -> list[dict]:  # seed-level noise shared by the settings: paired, the difference is exact
        return [{"J": (b + shift * np.arange(5) / 4).tolist(), "kl": [0.0] * 5, "tokens": [100.0] * 4} for b in base]

    curves = {"grpo": runs(0.0), "spo_tree_uniform": runs(0.2), "spo_tree_depth": runs(0.3)}
    summary, differences = le.summarise(curves, args)
    assert differences["spo_tree_uniform - grpo"]["100%"] == pytest.approx([0.2, 0.2, 0.2])
    assert differences["spo_tree_depth - spo_tree_uniform"]["50%"] == pytest.approx([0.05, 0.05, 0.05])
    mean, low, high = summary["grpo"]["J_100%"]
    assert low < mean < high and mean == pytest.approx(np.mean([b[-1] for b in base]))
    assert summary["spo_tree_depth"]["iterations_to_gain"]["reached"] == 6


def test_the_sweep_widens_its_grid_at_an_edge_until_the_best_is_inside(monkeypatch):
    def fake_run_all(jobs, world, args):  # final J peaks at lr 0.1, beyond the grid's top
        return [{"J": [0.0, 1 - abs(math.log10(lr) + 1)]} for _, lr, _ in jobs]

    monkeypatch.setattr(le, "run_all", fake_run_all)
    # the widening under the mean rule (these curves start at J 0: every rate would count as a collapse)
    args = dataclasses.replace(le.Args(), lrs=[1e-3, 3e-3, 1e-2], lr_step=3.0, max_extensions=3, rate_rule="mean")
    entry = le.sweep(["grpo"], None, args)["grpo"]
    assert [e["side"] for e in entry["extensions"]] == ["high", "high", "high"]
    assert entry["grid"] == pytest.approx([1e-3, 3e-3, 1e-2, 3e-2, 9e-2, 2.7e-1])
    assert entry["chosen"] == pytest.approx(9e-2) and not entry["at_edge"]
    bounded = le.sweep(["grpo"], None, dataclasses.replace(args, max_extensions=1))["grpo"]
    assert bounded["chosen"] == pytest.approx(3e-2) and bounded["at_edge"]  # out of extensions: recorded
    assert len(bounded["grid"]) == 4


def test_sizes_are_the_closest_to_the_budget():
    assert le.closest_size(3.3, 128, 2) == 39  # 39 x 3.3 = 128.7
    assert le.closest_size(100.0, 30, 2) == 2  # at least the smallest size
    assert le.closest_size({1: 56.0, 2: 80.0, 3: 86.0, 9: 141.0}, 128, 1) == 9
    assert le.closest_size({2: 10.0, 3: 50.0}, 30, 2) == 2  # tie: the smaller


def test_docstring_examples():
    from experiments import learning_critical as lc

    assert doctest.testmod(le).failed == 0 and doctest.testmod(lc).failed == 0
    assert doctest.testmod(toy_training).failed == 0


# ----------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
def test_tiny_run_writes_every_setting_with_curves_from_one_start_and_paired_intervals(tmp_path):
    results = le.main(dataclasses.replace(le.Args(), tiny=True, out=str(tmp_path / "learning.json")))
    saved = json.loads((tmp_path / "learning.json").read_text())
    assert (tmp_path / "learning.png").stat().st_size > 10_000
    assert saved["machine"]["commit"] and isinstance(saved["machine"]["imported_code_modified"], bool)
    assert set(saved["curves"]) == set(toy.SETTINGS) == set(saved["summary"]) == set(saved["sweep"])
    start = results["policy"]["expected_reward"]
    for name, runs in results["curves"].items():
        assert [run["seed"] for run in runs] == [0, 1, 2], name
        for run in runs:
            assert len(run["J"]) == len(run["kl"]) == 5 and len(run["tokens"]) == 4, name
            assert all(np.isfinite(run["J"])) and all(0 <= j <= 1 for j in run["J"]), name
            assert run["J"][0] == start and run["kl"][0] == 0.0, name  # the same start policy everywhere
            assert min(run["kl"][1:]) >= 0 and max(run["kl"][1:]) > 0, name
            assert run["lr"] == saved["sweep"][name]["chosen"]
        entry = saved["sweep"][name]
        assert len(entry["grid"]) == 3 and len(entry["extensions"]) == 1  # two values: the best is at an edge
        assert all(len(js) == 1 for js in entry["final_J"].values())  # one tuning seed
    for key in [f"{name} - grpo" for name in toy.SETTINGS if name != "grpo"] + ["spo_tree_depth - spo_tree_uniform"]:
        for measure in ("25%", "50%", "100%", "iterations_to_gain"):
            mean, low, high = saved["differences"][key][measure]
            assert low <= mean + 1e-9 and mean <= high + 1e-9, (key, measure)
    for row in saved["summary"].values():
        assert 0 < row["tokens_per_iteration"] and row["iterations_to_gain"]["runs"] == 3


@pytest.mark.slow
def test_runs_do_not_depend_on_the_number_of_workers(world):
    args = dataclasses.replace(ARGS, iterations=1)
    jobs = [("grpo", 1e-2, 0), ("spo_chain_int1", 1e-2, 1)]
    alone = toy_training.run_all(jobs, world, args)
    side_by_side = toy_training.run_all(jobs, world, dataclasses.replace(args, workers=2))
    assert [c["J"] for c in alone] == [c["J"] for c in side_by_side]


def test_the_token_axis_interpolates_and_scores_by_area():
    run = {"J": [0.2, 0.4, 0.8], "tokens": [10.0, 30.0]}
    assert measures.at_tokens(run, [20.0]).tolist() == pytest.approx([0.4 + 0.4 / 3])  # spent: 10, then 40 (10 + 30)
    # mean J over 0-40 tokens: 0.2 -> 0.4 over 10 (area 3), 0.4 -> 0.8 over 30 (area 18), 0.8 over the last 0
    assert measures.area_under(run, 40) == pytest.approx(21 / 40)
    # the last J holds past the last iteration
    assert measures.area_under(run, 50) == pytest.approx((21 + 0.8 * 10) / 50)
    faster = {"J": [0.2, 0.8, 0.8], "tokens": [10.0, 30.0]}  # the same end, reached sooner
    assert measures.area_under(faster, 40) > measures.area_under(run, 40)
    assert le.rate_score(run, dataclasses.replace(le.Args(), token_budget=40)) == measures.area_under(run, 40)
    assert le.rate_score(run, le.Args()) == 0.8  # without a token budget: final J


@pytest.mark.slow
def test_a_token_budget_run_stops_at_the_budget_and_reports_the_common_rate(tmp_path):
    settings = {**le.TINY, "token_budget": 60, "iterations": 40, "common_lr": 1e-3}
    args = dataclasses.replace(
        le.Args(), **settings, out=str(tmp_path / "tokens.json"), settings=["grpo", "spo_chain_int1"]
    )
    saved = le.main(args)
    assert saved["checkpoints"] == {"25%": 15.0, "50%": 30.0, "100%": 60.0}
    for name, runs in saved["curves"].items():
        for run in runs:
            spent = np.cumsum(run["tokens"])
            assert spent[-1] >= 60 and (len(spent) == 1 or spent[-2] < 60), name  # stopped once B was reached
        assert "auc" in saved["sweep"][name] and "final_J" not in saved["sweep"][name]
        assert saved["summary"][name]["J_100%"][0] == pytest.approx(
            np.mean([measures.at_tokens(run, 60.0) for run in runs]), abs=1e-4
        )
    common = saved["common_rate"]
    assert common["lr"] == 1e-3 and set(common["summary"]) == {"grpo", "spo_chain_int1"}
    assert all(run["lr"] == 1e-3 for runs in common["curves"].values() for run in runs)
    for name in common["curves"]:  # a setting tuned to the common rate: its runs are reused, and equal a fresh run
        if saved["summary"][name]["lr"] == 1e-3:
            assert [r["J"] for r in common["curves"][name]] == [r["J"] for r in saved["curves"][name]]
    model = toy.make_policy(le.toy_settings(args))[0]
    exacts = toy_training.enumerate_policy(model, args)
    world = toy_training.World(model, exacts, le.plan_sizes(exacts, ["grpo", "spo_chain_int1"], args)[0])
    fresh = toy_training.train_run("grpo", 1e-3, args.seeds[0], world, args)[0]
    assert measures.rounded({"J": fresh["J"]})["J"] == common["curves"]["grpo"][0]["J"]
    assert (tmp_path / "tokens.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_critical_sweep_runs_both_regimes_on_both_axes_and_reuses_only_what_the_same_code_made(tmp_path):
    from experiments import learning_critical as lc

    out = str(tmp_path / "critical.json")
    saved = lc.main(dataclasses.replace(lc.Args(), tiny=True, out=out))
    tiny = dataclasses.replace(lc.Args(), **lc.TINY, tiny=True, out=out)
    assert (tmp_path / "critical.png").stat().st_size > 10_000
    assert set(saved["cases"]) == {"coin", "confident"} and set(saved["advantage_maps"]) == {"coin", "confident"}
    for kind, axis, filler in itertools.product(("coin", "confident"), ("tokens", "samples"), (1, 2)):
        name, length = lc.case_name(kind, axis, filler), filler + 2
        run = json.loads(Path(saved["files"][name]).read_text())
        case = saved["cases"][kind][axis][str(filler)]
        assert run["settings"]["filler_kind"] == kind and run["settings"]["horizon"] == length
        given, fixed = run["given_settings"], run["length_from_grpo"]
        assert fixed == case["length"] and fixed["length"] <= fixed["provisional"]
        if axis == "tokens":  # B fixed from GRPO; the per-iteration size from the token budget
            assert given["token_budget"] == 24 * length and run["settings"]["token_budget"] == fixed["length"]
            assert run["settings"]["budget"] == 4 * length and not run["settings"]["samples"]
        else:  # equal samples and steps: G 4, and every run makes exactly the fixed number of steps
            assert given["iterations"] == 6 and run["settings"]["iterations"] == fixed["length"]
            assert case["leads"]["spo_chain_int1"]["size"] == 4 and case["leads"]["spo_tree_depth"]["size"] == 2
            assert all(len(r["J"]) == fixed["length"] + 1 for runs in run["curves"].values() for r in runs)
            assert case["leads"]["spo_chain_int1"]["samples_per_iteration"] == 4  # G responses a prompt
            # at most b + b^2 edges a prompt: update_policy drops the edges whose advantage is 0
            assert 0 < case["leads"]["spo_tree_depth"]["samples_per_iteration"] <= 6
        reached = np.mean(
            [
                measures.at_tokens(measures.in_steps(r) if axis == "samples" else r, fixed["crossing"])
                for r in run["sweep_curves"]["grpo"]
                if r["lr"] == fixed["grpo_lr"]
            ]
        )
        if fixed["reached"]:
            assert reached >= fixed["target_J"] - 1e-6  # measured on the provisional runs
        floor = 2 * (1 if axis == "samples" else run["settings"]["budget"])  # TINY's min_steps 2
        assert fixed["length"] == min(max(fixed["crossing"], floor), fixed["provisional"])
        for setting, row in case["leads"].items():
            if setting != "grpo" and " - " not in setting:  # the lead as a share of the reachable gain, per seed
                areas = lc.seed_areas(run)
                share = (areas[setting] - areas["grpo"]).mean() / (1 - row["J0"])
                assert row["share_of_gain"][0] == pytest.approx(share, abs=1e-5)
                assert row["auc_minus_grpo"] == run["differences"][f"{setting} - grpo"]["auc"]
        areas, j0 = lc.seed_areas(run), run["summary"]["grpo"]["J0"]
        assert case["grpo_gain"]["share_of_gain"][0] == pytest.approx(
            ((areas["grpo"] - j0) / (1 - j0)).mean(), abs=1e-5
        )
        assert case["grpo_gain"]["gains_nothing"] == (case["grpo_gain"]["share_of_gain"][1] <= 0)
        pair = case["leads"]["spo_chain_int1 - grpo_mask"]["share_of_gain"]  # int1 against GRPO + mask too
        assert pair[0] == pytest.approx(((areas["spo_chain_int1"] - areas["grpo_mask"]) / (1 - j0)).mean(), abs=1e-5)
        for setting, row in case["leads"].items():
            if " - " not in setting:
                assert row["collapsed_runs"] == sum(measures.collapsed(r) for r in run["curves"][setting])
                assert row["mean_rule_lr"] == run["sweep"][setting]["choices"]["mean"]
                masked = [[s["masked_tokens"] for s in r["stats"]] for r in run["curves"][setting]]
                assert row["masked_tokens"]["fewest"] == pytest.approx(np.mean([min(m) for m in masked]), abs=1e-5)
        by_setting = run["reported_sweep"]["by_setting"]
        assert set(case["leads_at_rates"]) == set(run["reported_sweep"]["at_common_rates"]) != set()
        for lr, pairs in case["leads_at_rates"].items():
            a, b = (np.array(by_setting[s][lr]["scores"]) for s in ("spo_tree_depth", "grpo"))
            assert pairs["spo_tree_depth - grpo"][0] == pytest.approx(((a - b) / (1 - j0)).mean(), abs=1e-5)
        assert saved["advantage_maps"][kind][str(filler)] == run["policy"]["position_map"]
        start = case["start_policy"]  # one recipe: the length right on every prompt, however many steps that took
        assert start["length_right_min"] == min(run["policy"]["length_right"].values()) >= toy.CRITICAL_LENGTH_RIGHT
        assert 200 <= start["pretrain_steps"] == run["policy"]["pretrain_steps"] <= 800  # TINY_RUN's 200, up to 4x
        assert saved["code_by_case"][name]["code_hash"] == toy.code_hash(*toy.LEARNING_EXACT_CODE)
    first, last = (json.loads(Path(saved["files"][f"confident_samples_L{f}"]).read_text()) for f in (1, 2))
    change = saved["trend"]["confident"]["samples"]["spo_chain_int1"]
    expected = [
        ((a := lc.seed_areas(r))["spo_chain_int1"] - a["grpo"]).mean() / (1 - r["summary"]["grpo"]["J0"])
        for r in (last, first)
    ]
    assert change[0] == pytest.approx(expected[0] - expected[1], abs=1e-5) and change[1] <= change[0] <= change[2]
    # reuse: an interrupted write runs again, the others are read back; other settings or other code run again
    damaged = Path(saved["files"]["coin_samples_L2"])
    damaged.write_text("{")
    again = lc.main(dataclasses.replace(lc.Args(), tiny=True, out=out))
    assert again["cases"] == saved["cases"]
    assert (
        lc.earlier_run(lc.run_args("coin", "tokens", 1, tiny))["summary"]
        == json.loads(Path(saved["files"]["coin_tokens_L1"]).read_text())["summary"]
    )
    assert lc.earlier_run(lc.run_args("coin", "tokens", 1, dataclasses.replace(tiny, seeds=[5]))) is None
    results = json.loads(Path(saved["files"]["coin_tokens_L1"]).read_text())
    results["machine"]["code_hash"] = "0" * 16  # the same settings from other code, whatever the commit
    Path(saved["files"]["coin_tokens_L1"]).write_text(json.dumps(results))
    assert lc.earlier_run(lc.run_args("coin", "tokens", 1, tiny)) is None


def test_the_critical_sweep_refuses_what_cannot_run():
    from experiments import learning_critical as lc

    with pytest.raises(le.UsageError, match="at least 3"):
        lc.validate(dataclasses.replace(lc.Args(), fillers=[2, 5]))
    with pytest.raises(le.UsageError, match="grpo"):
        lc.validate(dataclasses.replace(lc.Args(), settings=["spo_chain_int1"]))
    for bad in (
        dict(samples=8, token_budget=100),
        dict(budget_share=0.5),
        dict(budget_share=0.5, samples=8, settings=["ppo_lam1"]),
    ):
        with pytest.raises(le.UsageError):
            le.validate(dataclasses.replace(le.Args(), **bad))


def test_the_samples_axis_trains_every_setting_on_its_samples_for_equal_steps(world):
    args = dataclasses.replace(ARGS, samples=6, iterations=3)
    sizes = {name: 6 for name in toy.SETTINGS} | {"spo_tree_uniform": 2, "spo_tree_depth": 2}  # tree: 2 + 4 edges
    assert le.plan_sizes(world.exacts, list(toy.SETTINGS), args)[0] == sizes
    steps_world = toy_training.World(world.model, world.exacts, sizes)
    for name in toy.SETTINGS:
        curve, _ = toy_training.train_run(name, 1e-3, 0, steps_world, args)
        assert len(curve["J"]) == 4 and len(curve["tokens"]) == 3  # equal steps, whatever the tokens
        per_prompt = [stat["samples"] for stat in curve["stats"]]
        if name.startswith("spo_tree"):  # the edges of a full tree at most: siblings that agree (advantage 0) drop
            assert all(0 <= n <= 6 for n in per_prompt) and sum(per_prompt) > 0, (name, per_prompt)
        else:
            assert per_prompt == [6, 6, 6], name
        steps = le.rate_score(curve, args)  # the area under J against steps: the trapezoid over the 3 steps
        assert steps == pytest.approx((curve["J"][0] / 2 + sum(curve["J"][1:3]) + curve["J"][3] / 2) / 3)


def test_the_code_hash_changes_exactly_with_the_code_a_run_imports(tmp_path, monkeypatch):
    before = toy.code_hash(*toy.LEARNING_EXACT_CODE)
    assert before == toy.code_hash(*toy.LEARNING_EXACT_CODE) and len(before) == 16
    assert toy.code_hash("experiments/learning_critical.py") != before  # another experiment file
    copy = tmp_path / "repo"
    for name in (*toy.SHARED_CODE, *toy.LEARNING_EXACT_CODE):
        source = toy.ROOT / name
        target = copy / name
        if source.is_dir():
            for path in source.rglob("*.py"):
                (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                (target / path.relative_to(source)).write_bytes(path.read_bytes())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    monkeypatch.setattr(toy, "ROOT", copy)
    assert toy.code_hash(*toy.LEARNING_EXACT_CODE) == before  # the same contents elsewhere: the same hash
    (copy / "README.md").write_text("a document changes no result")
    assert toy.code_hash(*toy.LEARNING_EXACT_CODE) == before
    training = copy / "plumbing" / "training.py"
    training.write_text(training.read_text() + "\n# an edit\n")
    assert toy.code_hash(*toy.LEARNING_EXACT_CODE) != before


@pytest.mark.slow
def test_the_critical_task_learns_through_every_setting(tmp_path):
    args = dataclasses.replace(
        le.Args(), **{**le.TINY, "prompts": ["011", "100"]}, task="critical", filler=2, out=str(tmp_path / "c.json")
    )
    saved = le.main(args)
    assert saved["settings"]["task"] == "critical" and set(saved["curves"]) == set(toy.SETTINGS)
    assert all(0 <= j <= 1 for runs in saved["curves"].values() for run in runs for j in run["J"])
    for name, runs in saved["curves"].items():  # every setting's updates move the policy (a response can finish)
        assert any(j != run["J"][0] for run in runs for j in run["J"]), name
    assert any(stat["edges"] > 0 for run in saved["curves"]["spo_tree_depth"] for stat in run["stats"])


# ----------------------------------------------------------------------------------------------
# The rate protocol: rates that hold on new seeds, the sweep on the reported seeds, the run cache, whitening


def test_the_rule_takes_the_best_median_among_rates_no_tuning_seed_collapses_at(monkeypatch):
    # final J 0.5 + 0.1 lr / 1e-3, but at 3e-3 one tuning seed in three falls from J 0.5 to 0.1 (below half its start)
    def fake_run_all(jobs, world, args):
        curves = []
        for _, lr, seed in jobs:
            if lr > 2e-3 and seed == args.tuning_seeds[0]:
                curves.append({"J": [0.5, 0.9, 0.1, 0.1]})
            else:
                curves.append({"J": [0.5, 0.55, 0.6, 0.5 + 0.1 * lr / 1e-3]})
        return curves

    monkeypatch.setattr(le, "run_all", fake_run_all)
    args = dataclasses.replace(le.Args(), lrs=[1e-3, 1.73e-3, 3e-3], lr_step=3**0.5, tuning_seeds=[7, 8, 9])
    entry = le.sweep(["grpo"], None, args)["grpo"]
    assert entry["choices"] == {"median-no-collapse": 1.73e-3, "median": 3e-3, "mean": 1.73e-3}
    assert entry["chosen"] == 1.73e-3 and entry["collapses"] == {"0.001": 0, "0.00173": 0, "0.003": 1}
    assert entry["median_final_J"]["0.003"] == pytest.approx(0.8) and not entry["at_edge"]
    # every rate with a collapse: the grid's smallest, and the grid grows downwards from it, rounded on the sqrt(3) grid
    monkeypatch.setattr(le, "run_all", lambda jobs, world, args: [{"J": [0.5, 0.1]} for _ in jobs])
    entry = le.sweep(["grpo"], None, dataclasses.replace(args, max_extensions=2))["grpo"]
    assert entry["grid"] == [3.33e-4, 5.77e-4, 1e-3, 1.73e-3, 3e-3] and entry["chosen"] == 3.33e-4 and entry["at_edge"]


def test_a_scale_only_whitening_never_turns_a_zero_advantage_positive_and_its_counts_are_kept(world):
    args = dataclasses.replace(ARGS, iterations=3)
    for name in ("grpo_mask", "grpo_mask_scale", "spo_chain_int1", "spo_chain_int1_scale", "ppo_lam1"):
        stats = toy_training.train_run(name, 1e-2, 0, world, args)[0]["stats"]
        assert all(s["masked_tokens"] > 0 for s in stats), name
        if name.endswith("_scale"):
            assert all(s["zeros_made_positive"] == 0 for s in stats), name
    assert toy_training.script_args("grpo", toy.SETTINGS["grpo_mask_scale"][1], 4, 1e-3, ARGS).whiten == "scale"


@pytest.mark.slow
def test_the_run_cache_reads_back_every_run_it_made_and_no_other(tmp_path, monkeypatch):
    cache = tmp_path / "runs"
    settings = dict(le.TINY, settings=["grpo", "spo_chain_int1"], run_cache=str(cache))
    first = le.main(dataclasses.replace(le.Args(), **settings, out=str(tmp_path / "a.json")))
    made = sorted(cache.iterdir())
    assert len(made) == 2 * (len(first["sweep"]["grpo"]["grid"]) + 3)  # tuning runs (one seed) + 3 reported seeds

    def no_training(*args, **kwargs):
        raise AssertionError("a cached run was trained again")

    monkeypatch.setattr(toy_training, "train_run", no_training)
    monkeypatch.setattr(le, "time_iteration", lambda name, world, args: 0.1)
    again = le.main(dataclasses.replace(le.Args(), **settings, out=str(tmp_path / "b.json")))
    assert again["curves"] == first["curves"] and again["sweep"] == first["sweep"] and sorted(cache.iterdir()) == made
    # another CPU (or torch, or code, or setting) is another run
    model = toy.make_policy(le.toy_settings(dataclasses.replace(le.Args(), **settings)))[0]
    world = toy_training.World(model, [], {"grpo": 4})
    args = dataclasses.replace(le.Args(), **settings)
    key = toy_training.run_key(("grpo", 1e-3, 0), world, args)
    assert key == toy_training.run_key(("grpo", 1e-3, 0), world, args)
    assert key != toy_training.run_key(("grpo", 1e-3, 1), world, args)
    assert key != toy_training.run_key(("grpo", 1e-3, 0), world, dataclasses.replace(args, clip_eps=0.3))
    monkeypatch.setattr(toy_training.precision, "cpu_description", lambda: "another CPU")
    assert key != toy_training.run_key(("grpo", 1e-3, 0), world, args)


@pytest.mark.slow
def test_the_reported_sweep_scores_every_rate_on_the_reported_seeds(tmp_path):
    names = ["grpo", "grpo_mask", "spo_chain_int1", "spo_chain_int1_scale"]
    args = dataclasses.replace(
        le.Args(), **le.TINY, settings=names, reported_sweep=True, out=str(tmp_path / "r.json"), run_cache="none"
    )
    saved = le.main(args)
    rates = saved["reported_sweep"]
    assert (tmp_path / "r_rates.png").stat().st_size > 10_000
    for name in names:
        by_lr = rates["by_setting"][name]
        assert [float(lr) for lr in by_lr] == saved["sweep"][name]["grid"]
        chosen = [row for row in by_lr.values() if row["chosen"]]
        assert len(chosen) == 1 and chosen[0]["scores"] == [run["J"][-1] for run in saved["curves"][name]]
        for row in by_lr.values():
            assert len(row["scores"]) == 3 and row["mean"][0] == pytest.approx(np.mean(row["scores"]), abs=2e-5)
    common = set.intersection(*(set(rates["by_setting"][name]) for name in names))
    assert set(rates["at_common_rates"]) == common
    for lr in common:
        pairs = rates["at_common_rates"][lr]
        assert set(pairs) == {f"{a} - {b}" for a, b in le.comparison_pairs(names)}
        a = np.array(rates["by_setting"]["spo_chain_int1"][lr]["scores"])
        b = np.array(rates["by_setting"]["grpo_mask"][lr]["scores"])
        assert pairs["spo_chain_int1 - grpo_mask"][0] == pytest.approx(float(np.mean(a - b)), abs=2e-5)
