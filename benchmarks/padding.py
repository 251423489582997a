"""How much of an update's compute goes to padding, with micro-batches in arrival order (before) and grouped by
length (every script's micro_batches, after), on real SmolLM2 rollouts, and what the grouping saves in seconds.

Rollouts: 8 questions x 8 responses of up to 128 tokens (the learning benchmark's GRPO settings); updates:
batches of 32 in a shuffled order, micro-batches of 16, as grpo_baseline.update_policy makes them. The padding
fraction is the share of the padded [rows, prompt + response] positions of all micro-batches that hold no token.
The seconds are one forward/backward pass (grpo_baseline.accumulate_gradients) over the same batch either way,
after one untimed warm-up pass, the two orders alternating which goes first; the gradients agree (the split does
not change them).

  python benchmarks/padding.py                 # writes benchmarks/results/padding.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as ev  # noqa: E402
import grpo_baseline as grpo  # noqa: E402

TASK, QUESTIONS, GROUP, NEW_TOKENS, BATCH, MICRO = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1", 8, 8, 128, 32, 16


def in_arrival_order(samples: list[dict], micro_batch_size: int) -> list[list[int]]:
    """The split before length grouping: consecutive samples."""
    return [list(range(start, min(start + micro_batch_size, len(samples)))) for start in range(0, len(samples), micro_batch_size)]


def padding_fraction(samples: list[dict], groups: list[list[int]]) -> float:
    """Share of the collated positions (prompts left-padded, responses right-padded per micro-batch) that are padding."""
    padded = sum(len(g) * (max(len(samples[i]["prompt_ids"]) for i in g) + max(1, max(len(samples[i]["response_ids"]) for i in g)))
                 for g in groups)
    real = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    return 1 - real / padded


def timed_update(model, batch: list[dict], split, pad_id: int) -> tuple[float, list[torch.Tensor]]:
    real_split = grpo.micro_batches
    grpo.micro_batches = split
    try:
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        grpo.accumulate_gradients(model, batch, micro_batch_size=MICRO, temperature=0.7, clip_eps=0.2, beta=0.0, pad_id=pad_id, on_policy=True)
        seconds = time.perf_counter() - started
    finally:
        grpo.micro_batches = real_split
    return seconds, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def main() -> None:
    model, tokenizer = ev.load_model("smollm2-135m")
    print(ev.set_precision("auto", "cpu"))
    examples = ev.load_task(TASK, "train", limit=QUESTIONS, tokenizer=tokenizer)
    groups = ev.HFSampler(model, tokenizer, seed=0).sample([e.prompt_ids for e in examples], GROUP, temperature=0.7, top_p=1.0,
                                                          max_new_tokens=NEW_TOKENS, progress="rollouts")
    rewards = torch.rand(len(examples) * GROUP, generator=torch.Generator().manual_seed(0)).round()  # any advantages will do
    advantages = grpo.group_advantages(rewards, GROUP)
    samples = [{"prompt_ids": e.prompt_ids, "response_ids": c.ids, "advantages": torch.full((len(c.ids),), float(a)),
                "loss_mask": torch.ones(len(c.ids), dtype=torch.bool)}
               for (e, g), a_group in zip(zip(examples, groups), advantages.view(len(examples), GROUP)) for c, a in zip(g, a_group)]
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [[samples[i] for i in order[start : start + BATCH]] for start in range(0, len(order), BATCH)]
    result = {"model": "smollm2-135m", "task": TASK, "samples": len(samples), "batch_size": BATCH, "micro_batch_size": MICRO,
              "response_tokens": statistics.mean(len(s["response_ids"]) for s in samples),
              "padding_before": statistics.mean(padding_fraction(b, in_arrival_order(b, MICRO)) for b in batches),
              "padding_after": statistics.mean(padding_fraction(b, grpo.micro_batches(b, MICRO)) for b in batches),
              "seconds_before": [], "seconds_after": [], "max_grad_difference": 0.0}
    model.train()
    timed_update(model, batches[0], in_arrival_order, tokenizer.pad_token_id)  # warm-up: first-call allocations are not timed
    for index, batch in enumerate(batches):  # the two orders alternate which goes first
        if index % 2 == 0:
            before, grads_before = timed_update(model, batch, in_arrival_order, tokenizer.pad_token_id)
            after, grads_after = timed_update(model, batch, grpo.micro_batches, tokenizer.pad_token_id)
        else:
            after, grads_after = timed_update(model, batch, grpo.micro_batches, tokenizer.pad_token_id)
            before, grads_before = timed_update(model, batch, in_arrival_order, tokenizer.pad_token_id)
        result["seconds_before"].append(before)
        result["seconds_after"].append(after)
        difference = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-12) for a, b in zip(grads_after, grads_before))
        result["max_grad_difference"] = max(result["max_grad_difference"], difference)
    output = Path(__file__).parent / "results" / "padding.json"
    output.write_text(json.dumps(result, indent=1))
    print(f"\n{len(samples)} samples, mean response {result['response_tokens']:.0f} tokens: padding {result['padding_before']:.1%} -> "
          f"{result['padding_after']:.1%} of the update's positions; forward/backward of a batch of {BATCH}: "
          f"{statistics.mean(result['seconds_before']):.1f} s -> {statistics.mean(result['seconds_after']):.1f} s "
          f"(largest gradient difference {result['max_grad_difference']:.1e} of the largest entry) -> {output}")


if __name__ == "__main__":
    main()
