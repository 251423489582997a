"""What an update computes, on real SmolLM2 rollouts: the positions of three ways to run the same batch, their
padding, and the seconds of a forward/backward pass.

- arrival order: consecutive samples in a micro-batch, every row runs its own prompt (the first version);
- by length: micro-batches of similar response length, every row runs its own prompt (until shared prompts);
- micro_batches: every script's split and response_logprobs now: each distinct prompt of a micro-batch runs
  once and its rows' responses continue its KV cache; the split is the cheaper of by length and by prompt.

Rollouts: 8 questions x 8 responses of up to 128 tokens (the learning benchmark's GRPO settings); updates:
batches of 32 in a shuffled order (a prompt has about 4 rows in a batch), micro-batches of 16, as
grpo_baseline.update_policy makes them. A micro-batch computes (prompts run x longest prompt) + (rows x longest
response) positions; padding is the share of them that hold no token. The seconds are one forward/backward pass
(plumbing.training.response_logprobs under grpo_baseline's on-policy loss) over the same batch each way, after one
untimed warm-up pass, the order of the three rotating from batch to batch; the gradients agree (neither split nor
sharing changes them).

  python -m benchmarks.padding                 # writes benchmarks/results/padding.json (--out elsewhere)
"""

import json
import statistics
import time
from pathlib import Path

import torch
import tyro

import grpo_baseline as grpo
from plumbing import engines, models, runs, tasks, training
from plumbing.precision import FP32, choose_precision, cpu_description

TASK, QUESTIONS, GROUP, NEW_TOKENS, BATCH, MICRO = (
    "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1",
    8,
    8,
    128,
    32,
    16,
)


def in_arrival_order(samples: list[dict], micro_batch_size: int) -> list[list[int]]:
    """Consecutive samples."""
    return [
        list(range(start, min(start + micro_batch_size, len(samples))))
        for start in range(0, len(samples), micro_batch_size)
    ]


def by_length(samples: list[dict], micro_batch_size: int) -> list[list[int]]:
    """Similar response length (then prompt length) together."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]["response_ids"]), len(samples[i]["prompt_ids"])))
    return [order[start : start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]


def collate_per_row(samples: list[dict], pad_id: int, device, collate=training.collate) -> dict:
    """The scripts' collate (plumbing.training) with every row running its own prompt, even when rows share it."""
    batch = collate(samples, pad_id, device)
    prompt_len = batch["prompt_ids"].shape[1]
    batch.update(
        prompt_ids=batch["input_ids"][:, :prompt_len],
        prompt_mask=batch["attention_mask"][:, :prompt_len],
        prompt_positions=batch["positions"][:, :prompt_len],
        prompt_of_row=torch.arange(len(samples), device=device),
    )
    return batch


WAYS = {  # name -> (split, collate)
    "arrival_order": (in_arrival_order, collate_per_row),
    "by_length": (by_length, collate_per_row),
    "micro_batches": (training.micro_batches, training.collate),
}


def positions(samples: list[dict], split: list[list[int]], shared: bool) -> tuple[int, int]:
    """(positions computed, tokens among them) over the micro-batches of `split`."""
    computed = tokens = 0
    for micro in split:
        prompts = [tuple(samples[i]["prompt_ids"]) for i in micro]
        run = set(prompts) if shared else prompts  # the prompts that run
        responses = [len(samples[i]["response_ids"]) for i in micro]
        computed += len(run) * max(map(len, run)) + len(micro) * max(1, max(responses))
        tokens += sum(map(len, run)) + sum(responses)
    return computed, tokens


def timed_update(model, batch: list[dict], way: str, pad_id: int, precision=FP32) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one forward/backward pass of the batch's loss in the micro-batches and with the collate of `way`,
    and the gradient. The loss is grpo_baseline's on-policy loss with beta 0 (ratio 1, nothing clipped), whose
    gradient is that of -sum(A_t log pi(y_t)) / tokens."""
    split, collate = WAYS[way]
    tokens = sum(int(s["loss_mask"].sum()) for s in batch)
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    for indices in split(batch, MICRO):
        micro = collate([batch[i] for i in indices], pad_id, model.device)
        logps = training.response_logprobs(model, micro, 0.7, precision=precision)  # [rows, R]
        (-(logps * micro["advantages"] * micro["loss_mask"]).sum() / tokens).backward()
    seconds = time.perf_counter() - started
    return seconds, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def main(out: Path = Path(__file__).parent / "results" / "padding.json") -> None:
    """Run the same batches the three ways, compare their gradients and write the figures to `out`."""
    model, tokenizer = models.load_model("smollm2-135m")
    precision = choose_precision("auto", "cpu")
    print(precision.line)
    examples = tasks.load_task(TASK, "train", limit=QUESTIONS, tokenizer=tokenizer)
    groups = engines.HFSampler(model, tokenizer, seed=0).sample(
        [e.prompt_ids for e in examples],
        GROUP,
        temperature=0.7,
        top_p=1.0,
        max_new_tokens=NEW_TOKENS,
        progress="rollouts",
    )
    # any advantages will do
    rewards = torch.rand(len(examples) * GROUP, generator=torch.Generator().manual_seed(0)).round()
    advantages = grpo.group_advantages(rewards, GROUP)
    samples = [
        {
            "prompt_ids": e.prompt_ids,
            "response_ids": c.ids,
            "advantages": torch.full((len(c.ids),), float(a)),
            "loss_mask": torch.ones(len(c.ids), dtype=torch.bool),
        }
        for (e, g), a_group in zip(zip(examples, groups), advantages.view(len(examples), GROUP))
        for c, a in zip(g, a_group)
    ]
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [[samples[i] for i in order[start : start + BATCH]] for start in range(0, len(order), BATCH)]
    result = {
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "precision": precision.line,
        "model": "smollm2-135m",
        "task": TASK,
        "samples": len(samples),
        "batch_size": BATCH,
        "micro_batch_size": MICRO,
        "prompt_tokens": statistics.mean(len(s["prompt_ids"]) for s in samples),
        "response_tokens": statistics.mean(len(s["response_ids"]) for s in samples),
        "ways": {},
        "max_grad_difference": 0.0,
    }
    for way, (split, collate) in WAYS.items():
        counts = [positions(b, split(b, MICRO), shared=collate is training.collate) for b in batches]
        computed, tokens = sum(c for c, _ in counts), sum(t for _, t in counts)
        result["ways"][way] = {"positions": computed, "padding": 1 - tokens / computed, "seconds": []}
    model.train()
    # warm-up: first-call allocations are not timed
    timed_update(model, batches[0], "micro_batches", tokenizer.pad_token_id, precision)
    names = list(WAYS)
    for index, batch in enumerate(batches):
        grads = {}
        for way in names[index % len(names) :] + names[: index % len(names)]:  # the first to run rotates
            seconds, grads[way] = timed_update(model, batch, way, tokenizer.pad_token_id, precision)
            result["ways"][way]["seconds"].append(seconds)
        for way in names[1:]:
            difference = max(
                (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
                for a, b in zip(grads[way], grads[names[0]])
            )
            result["max_grad_difference"] = max(result["max_grad_difference"], difference)
    output = out
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(
        f"\n{len(samples)} samples, prompts {result['prompt_tokens']:.0f} and "
        f"responses {result['response_tokens']:.0f} tokens on "
        f"average, batches of {BATCH}, micro-batches of {MICRO}:"
    )
    for way, figures in result["ways"].items():
        print(
            f"  {way:14s} {figures['positions']:6d} positions ({figures['padding']:.1%} padding), "
            f"forward/backward of a batch {statistics.mean(figures['seconds']):.1f} s"
        )
    print(f"largest gradient difference {result['max_grad_difference']:.1e} of the largest entry -> {output}")


if __name__ == "__main__":
    tyro.cli(main)
