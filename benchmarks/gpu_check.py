"""GPU check: the four scripts' CUDA code paths (bf16 autocast, reference model parked on the CPU, critic,
HF sampler on the GPU) on a small randomly initialised Llama, with seconds per iteration, peak GPU memory
and sampler throughput. No hub model, no network: the model and a GSM8K-format task are built here.

  python benchmarks/gpu_check.py                      # writes benchmarks/results/gpu_check.json
"""

import json
import math
import string
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import eval as ev  # noqa: E402
from plumbing import engines, models  # noqa: E402
import grpo_baseline  # noqa: E402
import ppo_baseline  # noqa: E402
import spo_chain  # noqa: E402
import spo_tree  # noqa: E402
from conftest import make_tokenizer  # noqa: E402


def build_model(directory: Path, alphabet: str) -> Path:
    """A ~25M-parameter Llama with a character tokenizer: big enough that the GPU, not Python, sets the pace."""
    tokenizer = make_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_task(path: Path) -> Path:
    """Every answer is 7: a random digits-only model ends on the number 7 about one time in ten, so rewards
    vary within groups and trees and every update path runs."""
    rows = [{"question": f"{a} {b}", "answer": "7"} for a in range(12) for b in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_script(module, name: str, model: Path, task: Path, out: Path, **specific) -> dict:
    settings = dict(
        model=str(model), task=str(task), backend="hf", iterations=2, questions=8, max_new_tokens=128, context=512,
        batch_size=32, micro_batch_size=16, epochs=1, lr=1e-5, eval_every=1000, eval_limit=32, eval_samples=1,
        eval_temperature=0.0, save_every=1000, output_dir=str(out / name), seed=1,
    )
    settings.update(specific)
    torch.cuda.reset_peak_memory_stats()
    started = time.time()
    summary = module.main(module.Args(**settings))
    lines = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for m in lines for v in m.values())
    return {
        "iterations": len(train), "finite_metrics": finite, "wall_seconds": time.time() - started,
        "seconds_per_iteration": [m["time/iteration_seconds"] for m in train],
        "generated_tokens_per_iteration": [m["charts/generated_tokens"] for m in train],
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9, "kl": [m.get("losses/kl") for m in train],
    }


def sampler_throughput(model_dir: Path) -> dict:
    model, tokenizer = models.load_model(str(model_dir))
    prompts = [ev.encode_prompt(f"Problem: what is {i} + {i + 1}?\n", tokenizer) for i in range(16)]
    sampler = engines.HFSampler(model, tokenizer, seed=0, batch_size=256)
    sampler.sample(prompts[:2], 2, temperature=1.0, top_p=1.0, max_new_tokens=8)  # warm-up
    torch.cuda.synchronize()
    started = time.time()
    groups = sampler.sample(prompts, 16, temperature=1.0, top_p=1.0, max_new_tokens=256)
    torch.cuda.synchronize()
    seconds = time.time() - started
    tokens = sum(len(c.ids) for group in groups for c in group)
    return {"sequences": 256, "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "dtype": str(model.dtype)}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: this check is for a GPU machine (the CPU paths are covered by pytest)")
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "gpu_check.json"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, task = build_model(tmp / "digits", "0123456789 "), build_task(tmp / "sevens.jsonl")
        sampler = sampler_throughput(build_model(tmp / "printable", string.printable))
        results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sampler": sampler}
        print(json.dumps(results["sampler"]), flush=True)
        for module, name, specific in [
            (grpo_baseline, "grpo", dict(group_size=8)),
            (spo_chain, "spo_chain", dict(group_size=8, mc_samples=9)),
            (spo_tree, "spo_tree", dict(tree="6,6", segment_tokens=30, samples_per_iteration=64)),
            (ppo_baseline, "ppo", dict(group_size=8)),
        ]:
            results[name] = run_script(module, name, model, task, tmp / "runs", **specific)
            print(name, json.dumps(results[name]), flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    print(f"-> {out_path}")


if __name__ == "__main__":
    main()
