"""One optimizer step of a script's update on fixed rollouts, in one process or under torchrun (tests/test_distributed.py).

    python tests/distributed_step.py SCRIPT MODEL_DIR OUT                         # world size 1: every rollout
    torchrun --nproc_per_node 2 tests/distributed_step.py SCRIPT MODEL_DIR OUT    # each rank its share

The rollouts (prompts, responses, rewards, values or tree edges) are drawn from a fixed seed, the same in every
process; each rank keeps the share of questions that main() would give it (ev.shard) and runs the script's own
functions in main()'s order. Rank 0 writes OUT/world{N}.pt: the parameters after the step and the step's stats.
The step uses plain SGD (lr 1) without gradient clipping, so the parameter change is the gradient itself: a
gradient averaged instead of summed over ranks, or a statistic taken per rank, shows as a difference (the
first AdamW step, sign(gradient) * lr, would hide a scale factor).
"""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as ev  # noqa: E402

QUESTIONS, GROUP = 4, 4
PROB_THRESHOLD = 0.0094  # about the median p_t of these rollouts under the tiny model at temperature 1: a real mask


def fixed_rollouts(vocab: int, eos: int) -> tuple[list[list[int]], list[list[list[int]]], torch.Tensor]:
    """QUESTIONS prompts, GROUP responses each (some ending in EOS, lengths 1-7) and 0/1 rewards."""
    generator = torch.Generator().manual_seed(0)
    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=generator).tolist()
    prompts = [ids(int(torch.randint(3, 7, (1,), generator=generator))) for _ in range(QUESTIONS)]
    responses = [[ids(int(torch.randint(1, 8, (1,), generator=generator))) for _ in range(GROUP)] for _ in range(QUESTIONS)]
    for group in responses:
        group[0].append(eos)
    rewards = torch.randint(0, 2, (QUESTIONS, GROUP), generator=generator).float()
    return prompts, responses, rewards


def sgd(model, total_steps: int = 1):
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, get_linear_schedule_with_warmup(optimizer, 0, total_steps)


def local_samples(prompts, responses, rewards) -> tuple[list[dict], torch.Tensor, list[int]]:
    """This rank's share: its questions' samples (question-major, as main() builds them), rewards, question ids."""
    mine = ev.shard(list(range(len(prompts))))
    samples = [{"prompt_ids": prompts[q], "response_ids": r} for q in mine for r in responses[q]]
    return samples, rewards[mine].flatten(), mine


def grpo(model_dir: str) -> tuple[list, dict]:
    import grpo_baseline as script

    model, tokenizer = ev.load_model(model_dir, dtype=torch.float32)
    reference, _ = ev.load_model(model_dir, dtype=torch.float32)
    prompts, responses, rewards = fixed_rollouts(len(tokenizer), tokenizer.eos_token_id)
    samples, local_rewards, _ = local_samples(prompts, responses, rewards)
    args = script.Args(model=model_dir, questions=QUESTIONS, group_size=GROUP, batch_size=QUESTIONS * GROUP, micro_batch_size=3,
                       epochs=1, beta=0.1, temperature=1.0, prob_mask=True, prob_threshold=PROB_THRESHOLD, max_grad_norm=1e9)
    advantages = script.group_advantages(local_rewards, GROUP)
    flat_mask = script.attach_targets(samples, advantages, model, reference, args, tokenizer.pad_token_id, on_policy=False)
    optimizer, scheduler = sgd(model)
    steps, _ = script.update_policy(model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, False, 1, [0])
    return [model], {**steps[0], "mask_fraction": ev.gather(flat_mask).float().mean().item()}


def main() -> None:
    script, model_dir, out = sys.argv[1:4]
    ev.init_distributed()
    torch.manual_seed(0)
    random.seed(0)
    models, stats = {"grpo_baseline": grpo}[script](model_dir)
    if ev.rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        parameters = [{name: p.detach().clone() for name, p in m.named_parameters()} for m in models]
        torch.save({"parameters": parameters, "stats": stats}, Path(out) / f"world{ev.world_size()}.pt")


if __name__ == "__main__":
    main()
