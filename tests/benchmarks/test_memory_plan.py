"""benchmarks/memory_plan.py's work of one SPO-tree iteration: every edge is a row of its ancestors' segments and its
own, so the passes read more than the segments sampled (tests/test_memory.py checks RUNNING.md's table)."""

import doctest

import pytest


@pytest.fixture(scope="module")
def memory_plan():
    from benchmarks import memory_plan

    return memory_plan


def test_the_worked_example(memory_plan):
    assert doctest.testmod(memory_plan).failed == 0


def test_each_edge_pays_its_ancestors(memory_plan):
    # 6,6,6 trees with 600-token segments in 2,048 positions: the levels' segments are 600, 600 and 848 tokens; their
    # parents' queries 0 (the root), 600 (6 parents) and 1,200 (36 parents) tokens.
    work = memory_plan.tree_work([6, 6, 6], segment=600, context=2048, questions=32, trained_edges=512)
    assert work["edges"] == 32 * (6 + 36 + 216)
    assert work["tokens"] == 32 * (6 * 600 + 36 * 600 + 216 * 848)  # 6.7M: what the count was before
    assert work["pass_positions"] == work["tokens"] + 32 * (6 * 600 + 36 * 1200)  # each parent's query once
    # a trained edge is its whole row: a last-level one 1,200 ancestors + 848 = the context, 2.4 times its segment
    assert work["trained_positions"] == 512 * 2048 and work["trained_positions"] / (512 * 848) > 2


def test_one_level_has_no_ancestors(memory_plan):
    work = memory_plan.tree_work([4], segment=10, context=50, questions=3, trained_edges=5)
    assert work == {"edges": 12, "tokens": 12 * 50, "pass_positions": 12 * 50, "trained_positions": 5 * 50}
