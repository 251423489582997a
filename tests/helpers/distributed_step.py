"""One optimizer step of a script's update on fixed rollouts, in one process or under torchrun
(tests/test_distributed.py).

    python tests/helpers/distributed_step.py SCRIPT MODEL_DIR OUT                         # world size 1: every rollout
    torchrun --nproc_per_node 2 tests/helpers/distributed_step.py SCRIPT MODEL_DIR OUT    # each rank its share
    torchrun --nproc_per_node 2 tests/helpers/distributed_step.py SCRIPT MODEL_DIR OUT --fsdp   # FSDP2
    ... --lora     # rank-4 LoRA adapters on the policy, the reference its adapters off; each rank writes a file

The rollouts (prompts, responses, rewards, values or tree edges) are drawn from a fixed seed, the same in every
process; each rank keeps the share of questions that main() would give it (distributed.shard) and runs the script's own
functions in main()'s order. Rank 0 writes OUT/world{N}.pt: the parameters after the step and the step's stats.
The step uses plain SGD (lr 1) without gradient clipping, so the parameter change is the gradient itself: a
gradient averaged instead of summed over ranks, or a statistic taken per rank, shows as a difference (the
first AdamW step, sign(gradient) * lr, would hide a scale factor).
"""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plumbing import distributed, models  # noqa: E402
from plumbing.bookkeeping import NonFiniteGuard  # noqa: E402

QUESTIONS, GROUP = 4, 4
FSDP = "--fsdp" in sys.argv
LORA = "--lora" in sys.argv
PROB_THRESHOLD = 0.0094  # about the median p_t of these rollouts under the tiny model at temperature 1: a real mask


def fixed_rollouts(vocab: int, eos: int) -> tuple[list[list[int]], list[list[list[int]]], torch.Tensor]:
    """QUESTIONS prompts, GROUP responses each (some ending in EOS, lengths 1-7) and 0/1 rewards."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=generator).tolist()

    prompts = [ids(int(torch.randint(3, 7, (1,), generator=generator))) for _ in range(QUESTIONS)]
    responses = [
        [ids(int(torch.randint(1, 8, (1,), generator=generator))) for _ in range(GROUP)] for _ in range(QUESTIONS)
    ]
    for group in responses:
        group[0].append(eos)
    rewards = torch.randint(0, 2, (QUESTIONS, GROUP), generator=generator).float()
    return prompts, responses, rewards


def sgd(model, total_steps: int = 1):
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, get_linear_schedule_with_warmup(optimizer, 0, total_steps)


def models_and_rollouts(model_dir: str):
    """The policy, a reference model (the same weights), the tokenizer and the fixed rollouts."""
    model, tokenizer = models.load_model(model_dir, dtype=torch.float32)
    reference, _ = models.load_model(model_dir, dtype=torch.float32)
    if LORA:
        from plumbing import lora

        torch.manual_seed(0)  # the adapters' A, the same on every rank
        lora.add_adapters(model, lora.lora_config(4, None, 0.0, lora.DEFAULT_TARGET))
        reference = lora.AdaptersOff(model)
    return model, reference, tokenizer, *fixed_rollouts(len(tokenizer), tokenizer.eos_token_id)


# Settings every script's step shares: a real KL term and probability mask; no clipping (see the docstring).
COMMON = dict(
    micro_batch_size=3,
    epochs=1,
    beta=0.1,
    temperature=1.0,
    prob_mask=True,
    prob_threshold=PROB_THRESHOLD,
    max_grad_norm=1e9,
)


def fsdp(*models) -> None:
    """With --fsdp: shard the models as load_models does, and gather the policy (the first) for the no-grad passes,
    as main()'s awake sampler holds it; release() gives back the shards for the update, as the sampler's sleep()."""
    if FSDP:
        for model in models:
            distributed.fully_shard_model(model)
        distributed.gather_parameters(models[0], True)


def release(*models) -> None:
    """Back to the shards before the optimizer is made: it must hold the sharded parameters (a root unit stays
    gathered after a no-grad forward, the critic's included)."""
    if FSDP:
        for model in models:
            distributed.gather_parameters(model, False)


def local_samples(prompts, responses, rewards) -> tuple[list[dict], torch.Tensor, list[int]]:
    """This rank's share: its questions' samples (question-major, as main() builds them), rewards, question ids."""
    mine = distributed.shard(list(range(len(prompts))))
    samples = [{"prompt_ids": prompts[q], "response_ids": r} for q in mine for r in responses[q]]
    return samples, rewards[mine].flatten(), mine


def grpo(model_dir: str) -> tuple[list, dict]:
    import grpo_baseline as script

    model, reference, tokenizer, prompts, responses, rewards = models_and_rollouts(model_dir)
    fsdp(model)
    samples, local_rewards, _ = local_samples(prompts, responses, rewards)
    args = script.Args(model=model_dir, questions=QUESTIONS, group_size=GROUP, batch_size=QUESTIONS * GROUP, **COMMON)
    advantages = script.group_advantages(local_rewards, GROUP)
    flat_mask, _ = script.attach_targets(samples, advantages, model, reference, args, tokenizer.pad_token_id)
    release(model)
    optimizer, scheduler = sgd(model)
    steps = script.update_policy(
        model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 1, NonFiniteGuard()
    )
    return [model], {**steps[0], "mask_fraction": distributed.gather(flat_mask).float().mean().item()}


def ppo(model_dir: str) -> tuple[list, dict]:
    import ppo_baseline as script

    model, reference, tokenizer, prompts, responses, rewards = models_and_rollouts(model_dir)
    critic = script.make_critic(model)
    # A non-zero head (the same on every rank): with main's zero head the critic's backbone gets no gradient
    # in the first step, and the values would all be 0.
    torch.nn.init.normal_(critic.value_head.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    fsdp(model, critic)
    samples, local_rewards, _ = local_samples(prompts, responses, rewards)
    args = script.Args(model=model_dir, questions=QUESTIONS, group_size=GROUP, batch_size=QUESTIONS * GROUP, **COMMON)
    script.add_old_logprobs_and_values(
        samples,
        model,
        reference,
        critic,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        pad_id=tokenizer.pad_token_id,
    )
    script.add_advantages_and_returns(
        samples,
        local_rewards,
        gamma=args.gamma,
        lam=args.lam,
        prob_threshold=args.prob_threshold,
        prob_mask=args.prob_mask,
    )
    release(model, critic)
    (optimizer, scheduler), (critic_optimizer, critic_scheduler) = sgd(model), sgd(critic)
    steps = script.update_policy(
        model,
        critic,
        optimizer,
        scheduler,
        critic_optimizer,
        critic_scheduler,
        samples,
        args,
        tokenizer.pad_token_id,
        1,
        NonFiniteGuard(),
    )
    flat_mask = torch.cat([s["loss_mask"] for s in samples])
    return [model, critic], {**steps[0], "mask_fraction": distributed.gather(flat_mask).float().mean().item()}


def spo_chain(model_dir: str) -> tuple[list, dict]:
    import spo_chain as script

    model, reference, tokenizer, prompts, responses, rewards = models_and_rollouts(model_dir)
    fsdp(model)
    samples, local_rewards, mine = local_samples(prompts, responses, rewards)
    args = script.Args(
        model=model_dir, questions=QUESTIONS, group_size=GROUP, batch_size=QUESTIONS * GROUP, interval=2, **COMMON
    )
    old_logps, ref_logps = script.old_and_reference_logprobs(
        model, reference, samples, args.micro_batch_size, args.temperature, tokenizer.pad_token_id
    )
    for s, old, ref in zip(samples, old_logps, ref_logps):
        s["old_logps"], s["ref_logps"] = old, ref
    flat_probs = torch.cat(old_logps).exp()
    probs = [logps.exp().tolist() for logps in old_logps]
    cutpoints = [script.find_cutpoints(p, args.prob_threshold, args.interval) for p in probs]
    # Fixed stand-ins for the MC values V(s_c): a function of (question, response, cutpoint), whichever rank has it.
    responses_of = [(q, j) for q in mine for j in range(GROUP)]
    values = [
        [((3 * q + 5 * j + 7 * k) % 5) / 4 for k in range(len(cuts))] for (q, j), cuts in zip(responses_of, cutpoints)
    ]
    advantages = [
        script.chain_advantages(p, cuts, v, reward, args.prob_threshold, args.prob_mask)
        for p, cuts, v, reward in zip(probs, cutpoints, values, local_rewards.tolist())
    ]
    flat_mask, _ = script.attach_advantages(samples, advantages, flat_probs, args.prob_threshold, args.prob_mask)
    release(model)
    optimizer, scheduler = sgd(model)
    steps = script.update_policy(
        model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 1, NonFiniteGuard()
    )
    assert sum(map(len, distributed.gather(cutpoints))) > 0
    return [model], {**steps[0], "mask_fraction": distributed.gather(flat_mask).float().mean().item()}


def spo_tree(model_dir: str) -> tuple[list, dict]:
    """Each rank's questions make edges (a response of the fixed rollouts, advantage reward - 0.5); the buffer
    step draws 3 per question and then 14 samples, so two edges appear twice."""
    import spo_tree as script

    model, reference, tokenizer, prompts, responses, rewards = models_and_rollouts(model_dir)
    fsdp(model)
    args = script.Args(
        model=model_dir,
        questions=QUESTIONS,
        tree="4",
        batch_size=16,
        edges_per_question=3,
        samples_per_iteration=14,
        **COMMON,
    )
    new_edges = [
        {
            "question": q,
            "born": 1,
            "prompt_ids": prompts[q],
            "response_ids": responses[q][j],
            "advantage": rewards[q, j].item() - 0.5,
        }
        for q in distributed.shard(list(range(QUESTIONS)))
        for j in range(GROUP)
    ]
    for edge, logps in zip(
        new_edges,
        script.sample_logprobs(model, new_edges, args.micro_batch_size, args.temperature, tokenizer.pad_token_id),
    ):
        edge["old_logps"] = logps
    rng = random.Random(5)  # main's per-iteration generator: the same on every rank
    taken, buffer = script.sample_buffer(
        distributed.gather(new_edges), 1, args.buffer_max_age, args.edges_per_question, rng
    )
    samples, buffer = script.fill_samples(taken, buffer, args.samples_per_iteration, rng)
    rank_samples = distributed.shard(samples)
    script.attach_targets(
        rank_samples,
        reference,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        pad_id=tokenizer.pad_token_id,
        prob_threshold=args.prob_threshold,
        prob_mask=args.prob_mask,
    )
    release(model)
    optimizer, scheduler = sgd(model)
    steps = script.update_policy(
        model, optimizer, scheduler, rank_samples, args, tokenizer.pad_token_id, 1, NonFiniteGuard()
    )
    assert len(samples) == 14 and len({id(s) for s in samples}) == 12
    flat_mask = torch.cat([s["loss_mask"] for s in rank_samples])
    return [model], {**steps[0], "mask_fraction": distributed.gather(flat_mask).float().mean().item()}


def main() -> None:
    script, model_dir, out = sys.argv[1:4]
    distributed.init_distributed()
    torch.manual_seed(0)
    random.seed(0)
    models, stats = {"grpo_baseline": grpo, "ppo_baseline": ppo, "spo_chain": spo_chain, "spo_tree": spo_tree}[script](
        model_dir
    )
    # every rank
    parameters = [{name: t.detach().clone() for name, t in distributed.full_state_dict(m).items()} for m in models]
    if distributed.rank() == 0 or LORA:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = f"world{distributed.world_size()}{'_fsdp' if FSDP else ''}"
        name += f"_lora_rank{distributed.rank()}.pt" if LORA else ".pt"
        torch.save({"parameters": parameters, "stats": stats}, Path(out) / name)


if __name__ == "__main__":
    main()
