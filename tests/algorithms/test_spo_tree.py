"""spo_tree.py's algorithm functions: tree parsing, value backup, segment advantages against a brute-force reference,
the tree rollout on a scripted sampler, the replay buffer and samples per iteration, the probability mask."""

import doctest
import math
import random
import statistics
import string

import pytest
import torch

import spo_tree as spo
from conftest import make_tokenizer
from plumbing import UsageError, engines, tasks


def test_docstring_examples():
    assert doctest.testmod(spo).failed == 0


@pytest.mark.parametrize(
    "spec, expected", [("6,6,6", [6, 6, 6]), (" 6 , 6,6 ", [6, 6, 6]), ("3", [3]), ("2,1,4", [2, 1, 4])]
)
def test_parse_tree_accepts_positive_branch_factors(spec, expected):
    assert spo.parse_tree(spec) == expected


@pytest.mark.parametrize("spec", ["", " ", "6,0,6", "a,b", "6,,6", "-1,2", "1.5,2", "6,6,", "+6"])
def test_parse_tree_rejects_bad_specs_with_a_readable_message(spec):
    with pytest.raises(ValueError, match="positive integer|no branch factors") as error:
        spo.parse_tree(spec)
    assert repr(spec) in str(error.value) and "e.g. 6,6,6" in str(error.value)


def irregular_tree() -> spo.Node:
    """Prompt [1, 2]; A is a leaf at depth 1 (finished early), B has three leaf children, C two."""
    return spo.Node(
        [1, 2],
        [
            spo.Node([3], reward=1.0),  # A
            spo.Node([4], [spo.Node([5], reward=0.0), spo.Node([6], reward=1.0), spo.Node([7], reward=0.0)]),  # B
            spo.Node([8], [spo.Node([9], reward=0.0), spo.Node([10], reward=0.0)]),  # C
        ],
    )


def test_backup_values_is_recursive_mean_not_leaf_weighted():
    root = irregular_tree()
    assert spo.backup_values(root) == pytest.approx(4 / 9)  # (1 + 1/3 + 0) / 3; the leaf mean would be 2/6
    a, b, c = root.children
    assert (a.value, c.value) == (1.0, 0.0) and b.value == pytest.approx(1 / 3)
    assert [leaf.value for leaf in b.children] == [0.0, 1.0, 0.0]
    assert root.value == pytest.approx(4 / 9)


def test_tree_segments_rloo_on_an_irregular_tree():
    segments = spo.tree_segments(irregular_tree())  # depth-first pre-order; C's children agree (both 0): dropped
    expected = [
        ([1, 2], [3], 5 / 9),
        ([1, 2], [4], -1 / 9),
        ([1, 2, 4], [5], -1 / 3),
        ([1, 2, 4], [6], 2 / 3),
        ([1, 2, 4], [7], -1 / 3),
        ([1, 2], [8], -4 / 9),
    ]
    assert [(q, s) for q, s, _, _ in segments] == [(q, s) for q, s, _ in expected]
    assert [a for _, _, a, _ in segments] == pytest.approx([a for _, _, a in expected])
    assert [depth for *_, depth in segments] == [1, 1, 2, 2, 2, 1]  # the root's children are depth 1


def test_tree_segments_grpo_divides_by_the_siblings_population_std():
    segments = spo.tree_segments(irregular_tree(), advantage="grpo")
    top = statistics.pstdev([1.0, 1 / 3, 0.0])
    b_children = statistics.pstdev([0.0, 1.0, 0.0])
    expected = [
        5 / 9 / (top + 1e-8),
        -1 / 9 / (top + 1e-8),
        -1 / 3 / (b_children + 1e-8),
        2 / 3 / (b_children + 1e-8),
        -1 / 3 / (b_children + 1e-8),
        -4 / 9 / (top + 1e-8),
    ]
    assert [a for _, _, a, _ in segments] == pytest.approx(expected)


def test_query_ids_concatenate_the_prompt_and_every_ancestor_segment():
    root = spo.Node(
        [100],
        [
            spo.Node(
                [1, 2],
                [spo.Node([3], [spo.Node([4, 5], reward=1.0), spo.Node([6], reward=0.0)]), spo.Node([7], reward=0.0)],
            ),
            spo.Node([8], reward=0.0),
        ],
    )
    by_segment = {tuple(s): q for q, s, _, _ in spo.tree_segments(root)}
    assert by_segment[(4, 5)] == [100, 1, 2, 3] and by_segment[(6,)] == [100, 1, 2, 3]
    assert by_segment[(3,)] == [100, 1, 2] and by_segment[(1, 2)] == [100]


def test_siblings_that_agree_give_no_segments():
    def subtree(token):  # value 0.5: one right answer out of two
        return spo.Node([token], [spo.Node([token * 10 + i], reward=float(i == 0)) for i in range(2)])

    root = spo.Node([0], [subtree(1), subtree(2), subtree(3)])
    segments = spo.tree_segments(root)
    assert root.value == 0.5 and all(child.value == 0.5 for child in root.children)
    assert len(segments) == 6 and all(len(q) == 2 for q, *_ in segments)  # only the leaves' edges remain
    assert spo.tree_segments(spo.Node([0], [spo.Node([1], reward=1.0), spo.Node([2], reward=1.0)]), "grpo") == []
    assert spo.tree_segments(spo.Node([0], [spo.Node([1], reward=0.0)])) == []


def test_bad_advantage_name_and_leaf_without_reward_raise():
    with pytest.raises(ValueError, match="rloo or grpo"):
        spo.tree_segments(irregular_tree(), advantage="gae")
    with pytest.raises(ValueError, match="no reward"):
        spo.backup_values(spo.Node([0], [spo.Node([1])]))


def random_tree(rng: random.Random) -> spo.Node:
    depth, branching = rng.randint(1, 3), rng.randint(1, 5)

    def build(level: int) -> spo.Node:
        tokens = [rng.randrange(50) for _ in range(rng.randint(1, 3))]
        if level == depth or (level > 0 and rng.random() < 0.25):  # early leaves above the last level
            # 0/1 as in training, sometimes quarters: exact in binary, so the exact reference below is the SPEC's
            return spo.Node(tokens, reward=rng.choice([0.0, 1.0, 1.0, 0.0, rng.randint(0, 4) / 4]))
        return spo.Node(tokens, [build(level + 1) for _ in range(rng.randint(1, branching))])

    return build(0)


def reference_segments(root: spo.Node, advantage: str) -> tuple[float, list]:
    """SPEC.md's definitions, brute force: each edge looks its parent and siblings up again."""

    def value(node):
        return node.reward if not node.children else sum(map(value, node.children)) / len(node.children)

    edges = []

    def visit(node, query):
        for child in node.children:
            difference = value(child) - value(node)
            siblings = [value(c) for c in node.children]
            mean = sum(siblings) / len(siblings)
            std = math.sqrt(sum((v - mean) ** 2 for v in siblings) / len(siblings))
            if difference != 0:
                edges.append((query, child.tokens, difference if advantage == "rloo" else difference / (std + 1e-8)))
            visit(child, query + child.tokens)

    visit(root, root.tokens)
    return value(root), edges


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_random_trees_match_a_brute_force_reference(advantage):
    rng = random.Random(7)
    for _ in range(300):
        root = random_tree(rng)
        root_value, expected = reference_segments(root, advantage)
        segments = spo.tree_segments(root, advantage)
        assert root.value == root_value
        assert [(q, s) for q, s, _, _ in segments] == [(q, s) for q, s, _ in expected]
        assert [a for _, _, a, _ in segments] == pytest.approx([a for _, _, a in expected], rel=1e-9, abs=1e-12)


class ScriptedSampler:
    """A fake rollout engine: `script(prefix, max_new_tokens)` returns the n completions (ids, finish reason)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def sample(
        self, prompts, n, *, temperature, top_p, max_new_tokens, stop=(), context=None, progress=None, generated=0
    ):
        self.calls.append(
            {"prompts": prompts, "n": n, "max_new_tokens": max_new_tokens, "context": context, "generated": generated}
        )
        groups = [
            [engines.Completion(list(ids), finish) for ids, finish in self.script(p, max_new_tokens)] for p in prompts
        ]
        assert all(len(group) == n for group in groups)
        return groups


EOS = 1


def test_scripted_rollout_early_leaves_context_limits_and_unfinished_last_level():
    script = {
        (50, 51): [([10, 11, EOS], "stop"), ([12, 13, 14], "length")],  # an early leaf, an open node
        # last level: one unfinished
        (50, 51, 12, 13, 14): [([15, EOS], "stop"), ([16, 17, 18, 19, 20, 21, 22], "length")],
        (60,) * 8: [([30, 31], "length"), ([32, EOS], "stop")],  # context 10: cut after 2 tokens, cannot be expanded
        # full M tokens, but no room left in the context
        (70,) * 7: [([40, 41, 42], "length"), ([43, 44, 45], "length")],
    }
    sampler = ScriptedSampler(lambda prefix, budget: script[tuple(prefix)])
    prompts = [[50, 51], [60] * 8, [70] * 7]
    trees, _ = spo.grow_trees(
        sampler,
        prompts,
        [2, 2],
        segment_tokens=3,
        max_new_tokens=10,
        context=10,
        temperature=0.6,
        top_p=1.0,
        stop=[],
    )
    first, second, third = trees
    assert [(c.tokens, c.finish_reason, len(c.children)) for c in first.children] == [
        ([10, 11, EOS], "stop", 0),
        ([12, 13, 14], "length", 2),
    ]
    assert [(c.tokens, c.finish_reason, c.depth) for c in first.children[1].children] == [
        ([15, EOS], "stop", 2),
        ([16, 17, 18, 19, 20, 21, 22], "length", 2),
    ]
    assert all(not c.children for c in second.children + third.children)
    # One call per level across all trees: level 0 has M = 3 new tokens, the last level the rest of the budget.
    assert [(c["prompts"], c["n"], c["max_new_tokens"], c["context"]) for c in sampler.calls] == [
        (prompts, 2, 3, 10),
        ([[50, 51, 12, 13, 14]], 2, 7, 10),
    ]


def test_grade_trees_scores_full_paths_and_zero_for_unfinished_leaves():
    tokenizer = make_tokenizer(string.printable)
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    right = spo.Node(ids("2"), finish_reason="stop")  # full response "4" + "2" = 42
    wrong = spo.Node(ids("3") + [eos], finish_reason="stop")
    unfinished = spo.Node(ids("2 and"), finish_reason="length")  # would be right, but never finished
    early = spo.Node(ids("42") + [eos], finish_reason="stop", depth=1)
    tree = spo.Node(ids("Q:"), [spo.Node(ids("4"), [right, wrong, unfinished], finish_reason="length", depth=1), early])
    spo.grade_trees([tree], ["42"], tokenizer, "data.jsonl")
    assert [right.reward, wrong.reward, unfinished.reward, early.reward] == [1.0, 0.0, 0.0, 1.0]
    assert spo.backup_values(tree) == pytest.approx((1 / 3 + 1) / 2)


def test_stop_string_straddling_a_segment_boundary_ends_the_response():
    tokenizer = make_tokenizer(string.printable)
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    stop = [tasks.RHO_STOP]  # "\n\n\nProblem:"
    script = {  # the samplers cut a stop string that begins in the path to nothing (tests/test_eval.py)
        "Q": [(ids("1 + 1 = 2\n\n"), "length"), (ids("1 + 1 is 2."), "length")],
        "Q1 + 1 = 2\n\n": [([], "stop"), (ids("#### 2"), "length")],
        "Q1 + 1 is 2.": [(ids("\n\n"), "length"), (ids("... 3\n\n\n"), "length")],
    }
    sampler = ScriptedSampler(lambda prefix, budget: script[tokenizer.decode(prefix)])
    (tree,), _ = spo.grow_trees(
        sampler,
        [ids("Q")],
        [2, 2],
        segment_tokens=len(ids("1 + 1 = 2\n\n")),
        max_new_tokens=40,
        context=100,
        temperature=0.6,
        top_p=1.0,
        stop=stop,
    )
    straddled, unfinished = tree.children[0].children
    assert sampler.calls[0]["generated"] == [0]
    assert sampler.calls[1]["generated"] == [len(ids("1 + 1 = 2\n\n")), len(ids("1 + 1 is 2."))]  # the path so far
    assert (straddled.tokens, straddled.finish_reason) == ([], "stop")  # the stop string began in the parent's segment
    assert unfinished.finish_reason == "length"
    assert [c.finish_reason for c in tree.children[1].children] == ["length", "length"]
    spo.grade_trees([tree], ["2"], tokenizer, "data.jsonl")
    assert straddled.reward == 1.0  # graded on "1 + 1 = 2\n\n", without the next problem


def test_sample_buffer_ages_edges_out_and_caps_each_question():
    buffer = [
        {"question": q, "born": born, "id": i}
        for i, (q, born) in enumerate(
            [("a", 7), ("a", 8), ("a", 9), ("a", 10), ("a", 10), ("a", 10), ("b", 7), ("b", 10), ("c", 8)]
        )
    ]
    taken, remaining = spo.sample_buffer(buffer, iteration=10, max_age=3, per_question=2, rng=random.Random(0))
    ids = lambda edges: [e["id"] for e in edges]  # noqa: E731
    assert 0 not in ids(taken + remaining) and 6 not in ids(taken + remaining)  # born 7: age 3 = max_age, gone
    assert sorted(ids(taken + remaining)) == [1, 2, 3, 4, 5, 7, 8]
    assert [e["question"] for e in taken].count("a") == 2 and ids(taken).count(7) == 1 and 8 in ids(taken)
    assert ids(taken) == sorted(ids(taken)) and ids(remaining) == sorted(ids(remaining))  # buffer order kept
    again, _ = spo.sample_buffer(buffer, iteration=10, max_age=3, per_question=2, rng=random.Random(0))
    assert ids(again) == ids(taken)  # same seed, same draw


def test_buffer_loop_trains_each_edge_at_most_once_and_never_too_old():
    rng, buffer, seen = random.Random(1), [], []
    for iteration in range(1, 30):
        new = [
            {"question": (iteration + k) % 5, "born": iteration, "id": (iteration, k)}
            for k in range(rng.randint(0, 12))
        ]
        taken, buffer = spo.sample_buffer(buffer + new, iteration, max_age=4, per_question=3, rng=rng)
        assert all(iteration - e["born"] < 4 for e in taken + buffer)
        assert all(sum(e["question"] == q for e in taken) <= 3 for q in range(5))
        seen += [e["id"] for e in taken]
    assert len(seen) == len(set(seen)) > 0


def edges(*specs):
    """Edges named by (id, born)."""
    return [{"id": i, "born": born} for i, born in specs]


def ids(edge_list):
    return [e["id"] for e in edge_list]


def test_fill_samples_takes_a_random_subset_and_returns_the_rest_to_the_buffer():
    taken = edges((1, 3), (4, 4), (5, 5), (7, 5), (8, 5))
    remaining = edges((0, 3), (2, 4), (3, 4), (6, 5))
    samples, buffer = spo.fill_samples(taken, remaining, 3, random.Random(0))
    chosen = sorted(random.Random(0).sample(range(5), 3))  # one rng.sample of the taken positions
    assert ids(samples) == [ids(taken)[i] for i in chosen]  # the buffer's order kept
    returned = [e for e in taken if e not in samples]
    assert len(returned) == 2 and all(e in buffer for e in returned)  # nothing is lost
    assert sorted(ids(buffer)) == sorted(ids(remaining) + ids(returned)) and len(buffer) == 6
    assert [e["born"] for e in buffer] == sorted(e["born"] for e in buffer)  # still oldest first, ages kept
    again, _ = spo.fill_samples(taken, remaining, 3, random.Random(0))
    assert ids(again) == ids(samples)


def test_fill_samples_by_hand():
    taken = edges((10, 2), (11, 2), (12, 2))
    remaining = edges((1, 1), (13, 2))

    # Choose positions {0, 2}: 11 goes back, behind 13 (same iteration), after the older 1.
    class Fixed(random.Random):
        def sample(self, population, k):
            return [2, 0]

    samples, buffer = spo.fill_samples(taken, remaining, 2, Fixed())
    assert ids(samples) == [10, 12] and ids(buffer) == [1, 13, 11]
    assert buffer[2] is taken[1] and buffer[2]["born"] == 2  # the same edge, its age unchanged


def test_fill_samples_repeats_edges_when_the_buffer_offers_fewer():
    taken = edges((1, 3), (2, 4))
    remaining = edges((0, 3))
    samples, buffer = spo.fill_samples(taken, remaining, 7, random.Random(5))
    reference_rng = random.Random(5)
    assert ids(samples) == [1, 2] + [reference_rng.choice([1, 2]) for _ in range(5)]  # every edge once, then draws
    # repeats are the edges themselves
    assert samples[0] is taken[0] and all(s is taken[0] or s is taken[1] for s in samples)
    assert buffer is remaining  # nothing goes back: all taken edges are trained


@pytest.mark.parametrize("taken, n", [(edges((1, 1), (2, 1)), 2), (edges((1, 1), (2, 1)), 0), ([], 4), ([], 0)])
def test_fill_samples_leaves_equal_empty_and_n_0_unchanged(taken, n):
    remaining = edges((0, 1))
    rng = random.Random(3)
    state = rng.getstate()
    samples, buffer = spo.fill_samples(taken, remaining, n, rng)
    assert samples is taken and buffer is remaining
    assert rng.getstate() == state  # no draw: the rest of the iteration samples what it would without the step


def test_buffer_loop_with_fill_trains_exactly_n_per_iteration_and_each_edge_in_one_iteration():
    rng, buffer, trained_in = random.Random(2), [], {}
    for iteration in range(1, 40):
        new = [
            {"question": (iteration + k) % 4, "born": iteration, "id": (iteration, k)}
            for k in range(rng.randint(0, 14))
        ]
        taken, buffer = spo.sample_buffer(buffer + new, iteration, max_age=3, per_question=3, rng=rng)
        samples, buffer = spo.fill_samples(taken, buffer, 6, rng)
        assert len(samples) == (6 if taken else 0)
        assert all(iteration - e["born"] < 3 for e in samples + buffer)
        assert not {id(e) for e in samples} & {id(e) for e in buffer}  # a trained edge leaves the buffer
        for e in samples:
            assert trained_in.setdefault(e["id"], iteration) == iteration  # copies only within one iteration
    assert len(trained_in) > 0


def test_repeats_count_once_per_copy_in_the_whitening_and_the_reference_runs_once_per_edge(monkeypatch):
    a = {"prompt_ids": [5], "response_ids": [6], "advantage": 1.0, "old_logps": torch.log(torch.tensor([0.5]))}
    b = {"prompt_ids": [5], "response_ids": [7], "advantage": -1.0, "old_logps": torch.log(torch.tensor([0.5]))}
    calls = []

    def fake_logprobs(model, samples, micro_batch_size, temperature, pad_id, precision=None):
        calls.append(len(samples))
        return [torch.full((len(s["response_ids"]),), -2.0) for s in samples]

    monkeypatch.setattr(spo, "sample_logprobs", fake_logprobs)
    spo.attach_targets(
        [a, b, a, a], object(), micro_batch_size=4, temperature=1.0, pad_id=0, prob_threshold=0.9, prob_mask=True
    )
    assert calls == [2]  # two edges, not four samples
    # Token advantages [1, -1, 1, 1]: mean 0.5, std sqrt(0.75) (the copies of a count three times).
    assert a["advantages"].tolist() == pytest.approx([0.5 / math.sqrt(0.75)], rel=1e-6)
    assert b["advantages"].tolist() == pytest.approx([-1.5 / math.sqrt(0.75)], rel=1e-6)
    assert a["ref_logps"].tolist() == [-2.0] and a["loss_mask"].tolist() == [True]


def test_prob_mask_and_fallback():
    response = torch.tensor([True, True, True, False])
    probs = torch.tensor([0.95, 0.5, 0.89, 0.1])
    assert spo.loss_mask(response, probs, 0.9, prob_mask=False).tolist() == [True, True, True, False]
    assert spo.loss_mask(response, probs, 0.9, prob_mask=True).tolist() == [False, True, True, False]
    assert spo.loss_mask(response, torch.tensor([0.95, 0.99, 0.91, 0.1]), 0.9, prob_mask=True).tolist() == [
        True,
        True,
        True,
        False,
    ]


def test_impossible_configurations_are_one_clear_error():
    with pytest.raises(UsageError, match="multiple of --micro-batch-size"):
        spo.validate(spo.Args(batch_size=6, micro_batch_size=4))
    with pytest.raises(UsageError, match="leaving no room within --max-new-tokens"):
        spo.validate(spo.Args(tree="2,2,2", segment_tokens=600, max_new_tokens=1024))
    with pytest.raises(UsageError, match="--advantage"):
        spo.validate(spo.Args(advantage="ppo"))
    with pytest.raises(UsageError, match=r"--samples-per-iteration \(-1\) must be at least 0"):
        spo.validate(spo.Args(samples_per_iteration=-1))
    spo.validate(spo.Args(samples_per_iteration=0))  # 0: every edge the buffer offers
    with pytest.warns(UserWarning, match="--tree 20,20,20 grows up to 256,000 leaves and 225,152,000 generated tokens"):
        spo.validate(spo.Args(tree="20,20,20"))  # 32 x 8,000 leaves: allowed, with its estimate
