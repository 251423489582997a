"""The machinery the four algorithm scripts share, written once. The algorithms' own steps live in the scripts;
three pieces of the paper live here because every script computes them the same way: the reward (grading.py, with
final_answer.py's rule), the token probabilities p_t (training.py: response_logprobs, logits / the sampling temperature)
and, beyond the paper, the rollout correction's weights (rollout_correction.py). Each names its part of the paper in
its docstring (README, "From the paper to the code").

  bookkeeping.py     what every main() does around the algorithm: the run's start, the iterations' bar, clock and
                     time budget, the metrics log, sample files, evaluation, the non-finite guard, the closing line
  settings.py        TrainArgs (the settings every script shares), their checks (the task and backend checks passed
                     in), what a resume may change
  ranges.py          each numeric setting's valid range, declared on its field, shown in --help, checked once
  cli.py             the command line: tyro, one-line errors, Ctrl-C and SIGTERM
  paper.py           the paper's two setups, --dry-run against PAPER_SETTINGS, the README's settings table
  runs.py            the run directory: found or created, args.json and starts.jsonl, metrics, samples (the records
                     the viewer reads; it runs no model); run_lock.py: its lock and the run this process works in
  checkpoints.py     atomic checkpoints and finding the newest whole one
  files.py           reading files so that damage is one line; atomic writes; append-only logs with torn tails
  models.py          aliases, the offline SmolLM2, loading the policy and the frozen reference model
  model_dirs.py      what a model directory may ask: no custom code, weights for all its config declares
  chat_templates.py  chat templates rendered in a bounded worker process (time, memory, size)
  memory.py          the `auto` memory settings, from the device's free memory and the model's shape
  precision.py       the bf16 / fp32 choice, as a value passed to what computes
  training.py        log-probs of responses, micro-batching and collate, reseeding, the optimizer
  rollout_correction.py  --rollout-correction's weights on the loss; the sampler against the trainer per
                     token (sampler/*); the policy's entropy
  lora.py            LoRA adapters (peft): frozen base, adapter checkpoints, the base as the reference, the merge
  engines.py         the Sampler protocol every rollout engine keeps, choosing the engine; completions.py: what
                     every engine returns
  hf_engine.py       the HF rollout engine (transformers, any device)
  vllm_engine.py     the vLLM rollout engine (GPU); vllm_preflight.py: what would stop it, checked before it starts
  distributed.py     torchrun: collectives over ranks, FSDP2
  grading.py         math-verify in sandboxed worker processes (imports no torch); final_answer.py: which part of a
                     response it grades (the last stated answer; hedges, lists and cut boxes score 0)
  tasks.py           the task registry (per task: loader, splits, prompt format and stops, answer kind), loading a
                     task's questions, the early task check, grading by task name (the answer kind passed to grading)

Floors (the floor-plan test holds at most 6; a module importing no other plumbing module is floor 1):
  1  precision, ranges, files, completions, distributed, chat_templates, final_answer, run_lock
  2  model_dirs, lora, grading, rollout_correction, vllm_preflight, settings
  3  models, tasks
  4  hf_engine, checkpoints, memory, paper
  5  vllm_engine, training, runs, cli
  6  engines, bookkeeping
No module here defines a critic, a tree or a cutpoint: each algorithm's pieces are in its script.

This file imports nothing, so that grading.py's worker processes load only what grading needs.
"""


class UsageError(Exception):
    """Bad input from the user (model, task, data, configuration); scripts print it as one line."""


# Characters that change what a terminal shows rather than print: C0 and C1 controls (escape sequences, carriage
# return, newline, backspace, bell), the line and paragraph separators, and the bidirectional overrides.
_UNPRINTABLE = {*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F)}
_UNPRINTABLE |= set(range(0x2066, 0x206A))


def shown(text: object) -> str:
    """`text` as it may reach a terminal: each character in _UNPRINTABLE written as its Python escape (\\x1b, \\n,
    \\u202e), so that a string from a run directory, a task file or a model (a run name, a path, a question) cannot
    recolour the screen, set the window title, move the cursor or forge a line. Every message that quotes such a
    string passes it through here."""
    return "".join(
        (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") if ord(c) in _UNPRINTABLE else c
        for c in str(text)
    )
