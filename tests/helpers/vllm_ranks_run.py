"""Under torchrun, with the fake `vllm` of test_vllm_glue.py: what each rank's engine is built with, sent and loaded
(tests/test_vllm_ranks.py).

    torchrun --nproc_per_node 2 tests/helpers/vllm_ranks_run.py OUT script SCRIPT.py --model DIR ...   # its CLI
    torchrun --nproc_per_node 2 tests/helpers/vllm_ranks_run.py OUT sharded-sync MODEL_DIR   # load_weights of shards

Each rank puts the fake in sys.modules and lets the vLLM glue see a CUDA GPU where plumbing.engines asks (the
training itself runs on the CPU over gloo), then writes OUT/rank{RANK}.json: how its engine was built, the prompts
and seeds it was sent, the order of its sleep / wake / reload calls, and a digest per weight of every sync.
In "script" mode the fake answers this project's GSM8K-style test questions ("Tom has 3 apples and buys 4 more")
right in its even samples and wrong in its odd ones: the rewards of a group differ, so every update moves the
weights. "sharded-sync" shards the model with FSDP2, leaves it on its shards and syncs it: the weights reach the
engine whole through DTensor.full_tensor, with the digests of distributed.full_state_dict (in "reference").
"""

import hashlib
import json
import os
import re
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from test_vllm_glue import FakeEngine, calls, make_fake_vllm  # noqa: E402

from plumbing import distributed, engines, models, runs, vllm_engine, vllm_preflight  # noqa: E402


def digests(weights) -> dict[str, str]:
    """{name: digest of shape, dtype and values} of named tensors, as an engine in bfloat16 holds them."""
    out = {}
    for name, tensor in weights:
        tensor = tensor.detach().to(torch.bfloat16)
        digest = hashlib.sha256(f"{tuple(tensor.shape)}".encode() + tensor.float().contiguous().numpy().tobytes())
        out[name] = digest.hexdigest()[:16]
    return out


def seeing_a_gpu(function):
    """`function` with torch.cuda.is_available() true while it runs: the glue's checks see a GPU, nothing else does."""

    def wrapped(*args, **kwargs):
        with mock.patch.object(torch.cuda, "is_available", lambda: True):
            return function(*args, **kwargs)

    return wrapped


def install_fake(tokenizer, script=None) -> FakeEngine:
    engine = FakeEngine(script=script)
    sys.modules["vllm"] = make_fake_vllm(engine, tokenizer)
    # --backend auto (the engine, its log line, the memory plan, starts.jsonl's record): each module holding the name
    resolve_backend = seeing_a_gpu(vllm_preflight.resolve_backend)
    for module in (vllm_preflight, engines, runs):
        module.resolve_backend = resolve_backend
    engines.backend_problems = seeing_a_gpu(engines.backend_problems)  # --backend vllm needs a GPU
    vllm_engine.engine_dtype = lambda: "bfloat16"  # as on a GPU with bf16
    vllm_preflight.vllm_build = lambda: None  # the fake is no installed distribution (no CUDA build to compare)
    return engine


def record(engine: FakeEngine, **extra) -> dict:
    events = [
        entry[0] if entry[0] != "wake_up" else f"wake_up {entry[1]}"
        for entry in engine.log
        if entry[0] in ("sleep", "sleep ignored", "wake_up", "wake_up ignored", "reload_weights", "reset_prefix_cache")
    ]
    return {
        "llm": calls(engine, "LLM")[0][2],
        "model": calls(engine, "LLM")[0][1],  # the model directory the engine was built from
        "world": calls(engine, "world")[0][1],
        "events": events,
        "generate": [
            {"prompts": [p["prompt_token_ids"] for p in prompts], "seeds": [sp.seed for sp in params], "n": params[0].n}
            for _, prompts, params, _ in calls(engine, "generate")
        ],
        "syncs": [digests(received) for _, received, _, _ in calls(engine, "reload_weights")],
        **extra,
    }


def run_script(out: Path, script: str, flags: list[str]) -> None:
    from transformers import AutoTokenizer

    if "--model" in flags:
        model = flags[flags.index("--model") + 1]
    else:  # --resume RUN: the run's own model
        model = json.loads((Path(flags[flags.index("--resume") + 1]) / "args.json").read_text())["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)

    def answer(prompt_ids: list[int], index: int):
        a, b = map(int, re.findall(r"has (\d+) apples and buys (\d+) more", tokenizer.decode(prompt_ids))[-1])
        text = f"#### {a + b if index % 2 == 0 else a + b + 1}"
        return iter(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])

    engine = install_fake(tokenizer, answer)
    sys.argv = [script] + flags
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise
    write(out, record(engine))


def sharded_sync(out: Path, model_dir: str) -> None:
    distributed.init_distributed()
    model, tokenizer = models.load_model(model_dir, dtype=torch.float32)
    with torch.no_grad():  # weights no process has loaded from the directory
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    distributed.fully_shard_model(model)
    engine = install_fake(tokenizer)
    sampler = engines.VLLMSampler(model_dir, max_model_len=64)  # no model given: nothing gathers it
    sharded = sorted(name for name, p in model.named_parameters() if type(p).__name__ == "DTensor")
    sampler.load_weights(model)
    whole = distributed.full_state_dict(model)  # a collective; rank 0 receives the weights
    write(out, record(engine, sharded=sharded, reference=digests(whole.items())))


def write(out: Path, result: dict) -> None:
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))  # one process: rank0


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "script":
        run_script(out, sys.argv[3], sys.argv[4:])
    else:
        sharded_sync(out, sys.argv[3])
