"""Each script's main() reads like the paper's algorithm box: short, and the four diff cleanly, the shared steps under
the same names in the same order, so that `diff grpo_baseline.py spo_chain.py` shows the algorithms' differences."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["spo_chain.py", "spo_tree.py", "grpo_baseline.py", "ppo_baseline.py"]
MAX_MAIN_LINES = 110

# The steps every main() shares, in the order each main() takes them.
SHARED_STEPS = [
    "device = distributed.init_distributed(args)",
    "validate(args)",
    "eval_task = args.eval_task or tasks.default_eval_task(args.task)",
    "if args.dry_run:",
    "return paper.dry_run(args, PAPER_SETTINGS, eval_task",
    "run = bookkeeping.start_run(args, device",
    "if run.finished:",
    "args = replace(args, **run.plan.settings())",
    "models.load_run_models(args, run.checkpoint, device",
    "train_examples, eval_examples = tasks.load_examples(",
    "sampler = engines.run_sampler(args, model, tokenizer, run.checkpoint, run.precision)",
    "sampling = engines.sampling_settings(args, tasks.stop_strings(args.task, tokenizer))",
    "pad_id = tokenizer.pad_token_id",
    "optimizer, scheduler = make_optimizer(",
    "evaluate = lambda: ev.evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args)",
    "book = bookkeeping.Loop(run, args, eval_task, evaluate)",
    "for iteration in book.iterations():",
    "rng = reseed(args.seed, iteration, sampler)",
    "# 1. Rollout",
    'with book.timed("rollout"):',
    "# 2. Rewards",
    "sampler.sleep()",
    'with book.timed("update"):',
    "update_policy(",
    "sampler.wake_up()",
    "sampler.load_weights(model)",
    "seconds, last = book.end_iteration()",
    "metrics = iteration_metrics(",
    "book.log(iteration, metrics, progress_line(iteration, metrics",
    "if book.saves_samples(iteration):",
    "book.write_samples(iteration, ",
    "if book.due(iteration, args.eval_every, last):",
    "book.evaluate(iteration)",
    "if book.due(iteration, args.save_every, last):",
    "trainer_state = {",
    "checkpoints.save_checkpoint(run.dir, model, tokenizer, ",
    "return book.finish()",
]
# What the four name alike (the update's statistics, the timings, the checkpoint) and the names they once spelled
# differently for those.
SHARED_NAMES = ["update_stats", "seconds", "run.checkpoint", "questions", "samples", "lr"]
DRIFTED_NAMES = ["checkpoint_dir", "eval_metrics", "model_stats", "step_stats", "iteration_started", "time.time()"]


def main_source(script: str) -> tuple[str, int]:
    """main()'s source and its length in lines."""
    source = (ROOT / script).read_text()
    [main] = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    return ast.get_source_segment(source, main), main.end_lineno - main.lineno + 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_is_the_loop_and_short(script):
    _, lines = main_source(script)
    assert lines <= MAX_MAIN_LINES, f"{script}: main() has {lines} lines (at most {MAX_MAIN_LINES})"


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_takes_the_shared_steps_under_one_name_in_one_order(script):
    source, _ = main_source(script)
    position = 0
    for step in SHARED_STEPS:
        assert step in source, f"{script}: main() lacks the shared step {step!r}"
        found = source.find(step, position)
        assert found >= 0, f"{script}: main() takes {step!r} before the steps that come before it elsewhere"
        position = found + len(step)
    for name in SHARED_NAMES:
        assert name in source, f"{script}: main() does not name {name!r}"
    for name in DRIFTED_NAMES:
        assert name not in source, f"{script}: main() says {name!r}, which the other scripts name otherwise"
