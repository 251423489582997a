"""The paper's settings: every script's PAPER_SETTINGS against the run's settings (--dry-run), and the README's table
(tools/paper_settings.py).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from plumbing import models, shown

# The paper's two setups as every script runs them (Guo et al. 2025, section 5 and appendix; the authors' released
# configs): the model, task, sampling and evaluation of each, and the policy optimization all four scripts share.
# Each script's PAPER_SETTINGS adds what its algorithm sets.
# fmt: off
OPTIMIZATION = dict(lr=1e-6, warmup_ratio=0.03, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, beta=1e-4,
                    rollout_correction="none", lora_rank=0, whiten="centre-scale")
GSM8K_RUN = dict(model="rho-1b-sft-gsm8k", task="gsm8k", eval_task="gsm8k", temperature=0.6, top_p=0.9,
                 max_new_tokens=1024, context=2047, eval_samples=16, eval_temperature=0.35, eval_top_p=0.9,
                 **OPTIMIZATION)
MATH_RUN = dict(model="deepseek-r1-distill-qwen-1.5b", task="math", eval_task="math500", temperature=0.6, top_p=1.0,
                context=2048, eval_samples=1, eval_temperature=0.6, eval_top_p=0.95, **OPTIMIZATION)
# fmt: on


def paper_run(model: str, task: str, paper_settings: dict[str, dict]) -> tuple[str, str]:
    """The paper's run (a key of the script's PAPER_SETTINGS) that a run of `model` on `task` is compared with, and
    why that one: the run of the same task, else the run of the same model, else the script's first (default) run."""
    if task in paper_settings:
        return task, f"the paper's {task} run"
    model_id = models.ALIASES.get(model, model)
    for name, paper in paper_settings.items():
        if models.ALIASES.get(paper["model"], paper["model"]) == model_id:
            return name, f"the paper's {name} run (same model; the paper has no run on --task {task})"
    name = next(iter(paper_settings))
    return name, f"the paper's {name} run (the paper has no run on --task {task})"


def format_setting(value) -> str:
    """A setting as the command line writes it: 1e-06 -> 1e-6, 0.0001 -> 1e-4, True -> true, None -> -."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value and abs(value) < 1e-3:
        mantissa, exponent = f"{value:.6e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return str(value)


def dry_run(args, paper_settings: dict[str, dict], eval_task: str, **resolved) -> dict:
    """--dry-run: print every setting beside the paper's value for the matching run and mark each difference;
    nothing is loaded. The eval task a missing --eval-task means, the model's hub id (aliases expanded by name) and
    `resolved`, what else the script derives from the settings without loading anything, are shown too (a value
    replaces a same-named setting in the comparison). Returns {"paper_run", "settings", "paper", "differences",
    "resolved"}."""
    resolved = {"eval_task": eval_task, "model_id": models.ALIASES.get(args.model, args.model), **resolved}
    run, why = paper_run(args.model, args.task, paper_settings)
    paper, settings = paper_settings[run], {**asdict(args), **{k: v for k, v in resolved.items() if k in asdict(args)}}
    same = lambda name: (  # noqa: E731  model aliases and hub ids name the same model
        models.ALIASES.get(settings[name], settings[name]) == models.ALIASES.get(paper[name], paper[name])
        if name == "model"
        else settings[name] == paper[name]
    )
    differences = [name for name in settings if name in paper and not same(name)]
    print(
        f"{Path(sys.argv[0]).name} settings beside {why}; * marks a difference, - a setting the paper does not state:"
    )
    width = max(len(name) for name in settings) + 3
    for name, value in settings.items():
        mark = "*" if name in differences else " "
        paper_value = format_setting(paper[name]) if name in paper else "-"
        # a received run's args.json: its strings reach the terminal escaped
        print(shown(f"{mark} --{name.replace('_', '-'):<{width}} {format_setting(value):<32} paper: {paper_value}"))
    extra = {k: v for k, v in resolved.items() if k not in settings}
    if extra:
        print(shown("resolved: " + ", ".join(f"{k} {format_setting(v)}" for k, v in extra.items())))
    print(f"{len(differences)} difference(s) from the paper; nothing was loaded (--dry-run)")
    return {"paper_run": run, "settings": settings, "paper": paper, "differences": differences, "resolved": resolved}
