"""What vLLM would sample from with LoRA if it held merged weights: the gap between the policy the trainer computes
(bf16 base + fp32 adapters, bf16 autocast) and the same model with W + alpha / R B A merged and rounded to bf16
(vLLM's weights), after a few LoRA updates. CPU, SmolLM2-135M: the README's quickstart (spo_chain.py, 4 iterations)
with --lora-rank 16 --lr 1e-3, the start RUNNING.md recommends; then rollouts of the adapted model (16 training
prompts x 4 samples, 64 tokens, temperature 0.6) scored four ways by the training code (training.sample_logprobs):

  trainer       bf16 base + fp32 adapters under bf16 autocast: what the update's ratio takes as pi_old
  merged bf16   the merged weights cast to bf16 (lora.merged_parameters, what the engine's sync sends), bf16 autocast
  merged fp32   the same merge kept in fp32, under bf16 autocast: how full fine-tuning's trainer rounds its weights
  exact         bf16 base + adapters, every pass in fp32 (no autocast): the policy the numbers round

For each pair: mean and max |delta log p| over response tokens and the per-token k3 KL (rollout_correction's), and how
much of the update the bf16 grid drops (adapted weight entries whose merged bf16 value equals the base's though the
update is nonzero).

  python -m experiments.lora_merge_gap     # writes experiments/results/lora_merge_gap.json
"""

import json
import tempfile
import time
from pathlib import Path

import torch
import tyro

from experiments.quickstart_runs import TASK, measured_run
from plumbing import engines, lora, models, rollout_correction, runs, tasks, training
from plumbing.precision import FP32, choose_precision, cpu_description

ROOT = Path(__file__).resolve().parents[1]

PROMPTS, SAMPLES, NEW_TOKENS, TEMPERATURE = 16, 4, 64, 0.6


def gap(sampler: torch.Tensor, trainer: torch.Tensor) -> dict:
    """The run's sampler metrics (rollout_correction.rollout_metrics) had `sampler` sampled the tokens `trainer` scores:
    |delta log p| mean and max, and the per-token k3 KL."""
    metrics = rollout_correction.rollout_metrics([{"old_logps": trainer, "sampler_logps": sampler}])
    return {
        "mean_abs_delta_logp": metrics["sampler/logp_gap_mean"],
        "max_abs_delta_logp": metrics["sampler/logp_gap_max"],
        "kl_per_token": metrics["sampler/kl_per_token"],
    }


def rounded_away(model) -> dict:
    """Of the adapted layers' weight entries with a nonzero update, the fraction the bf16 grid drops (bf16(W +
    delta) == W, W already bf16), and the update's size relative to W (Frobenius norms, over all adapted layers)."""
    from peft.tuners.lora import LoraLayer

    dropped = nonzero = 0
    delta_sq = weight_sq = 0.0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach().float()
            delta = module.get_delta_weight("default").detach().float()
            moved = delta != 0
            dropped += ((weight + delta).bfloat16().float() == weight)[moved].sum().item()
            nonzero += moved.sum().item()
            delta_sq += delta.square().sum().item()
            weight_sq += weight.square().sum().item()
    return {"fraction_rounded_away": dropped / max(nonzero, 1), "relative_update": (delta_sq / weight_sq) ** 0.5}


def main(out: Path = ROOT / "experiments/results/lora_merge_gap.json", rank: int = 16, lr: float = 1e-3) -> None:
    """Train the quickstart with adapters, then measure the gaps and write them to `out`."""
    started, code = time.perf_counter(), runs.code_state()  # the tree as the run starts
    with tempfile.TemporaryDirectory() as directory:
        run = measured_run(["--lora-rank", str(rank), "--lr", f"{lr:g}"], Path(directory))
        checkpoint = next(p for p in Path(directory).iterdir() if p.is_dir()) / "checkpoint"
        trainer, tokenizer = models.load_model(str(checkpoint), device="cpu")
    bf16 = choose_precision("bf16", "cpu")
    for p in trainer.parameters():  # as the run holds it: the frozen base in bf16, the adapters in fp32
        p.data = p.data.float() if p.requires_grad else p.data.bfloat16()
    examples = tasks.load_task(TASK, "train", limit=PROMPTS, tokenizer=tokenizer)
    groups = engines.HFSampler(trainer, tokenizer, seed=0, precision=bf16).sample(
        [e.prompt_ids for e in examples], SAMPLES, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=NEW_TOKENS
    )
    samples = [
        {"prompt_ids": e.prompt_ids, "response_ids": c.ids} for e, g in zip(examples, groups) for c in g if c.ids
    ]

    def score(model, precision) -> torch.Tensor:
        return torch.cat(training.sample_logprobs(model, samples, 8, TEMPERATURE, tokenizer.pad_token_id, precision))

    logps = {"trainer": score(trainer, bf16), "exact": score(trainer, FP32)}
    merged = dict(lora.merged_parameters(trainer))
    plain, _ = models.load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    for dtype, key in ((torch.float32, "merged fp32"), (torch.bfloat16, "merged bf16")):
        with torch.no_grad():  # copied into the model's own tensors: a tied LM head stays tied
            for name, parameter in plain.to(dtype).named_parameters():
                parameter.copy_(merged[name])
        logps[key] = score(plain, bf16)
    result = {
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_description(),
        "code": code,
        "run": {
            "flags": run["flags"],
            "accuracy_before": run["accuracy_before"],
            "accuracy_after": run["accuracy_after"],
        },
        "rollouts": len(samples),
        "response_tokens": len(logps["trainer"]),
        **rounded_away(trainer),
        "gaps": {
            "merged bf16 vs trainer": gap(logps["merged bf16"], logps["trainer"]),
            "merged fp32 vs trainer": gap(logps["merged fp32"], logps["trainer"]),
            "trainer vs exact": gap(logps["trainer"], logps["exact"]),
            "merged bf16 vs exact": gap(logps["merged bf16"], logps["exact"]),
        },
        "seconds": round(time.perf_counter() - started),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("fraction_rounded_away", "relative_update", "gaps")}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    tyro.cli(main)
