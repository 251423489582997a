"""The machinery the four algorithm scripts share, written once. None of it is an algorithm.

  models.py       aliases, the offline SmolLM2, loading the policy and the frozen reference model
  engines.py      rollout engines: HFSampler (transformers decode loop) and VLLMSampler; token ids in and out
  training.py     log-probs of responses under a model, micro-batching and collate, reseeding, the non-finite guard
  runs.py         command line, one-line errors, resume, Ctrl-C, run directory, metrics log, sample files,
                  the paper's settings and --dry-run
  checkpoints.py  atomic checkpoints, finding the newest whole one, the optimizer and its schedule
  files.py        reading files so that damage is one line; atomic writes; append-only logs with torn tails
  ranges.py       each numeric setting's valid range, declared on its field, shown in --help, checked once
  precision.py    the bf16 / fp32 choice, as a value passed to what computes
  distributed.py  torchrun: collectives over ranks, FSDP2
  gpu.py          pre-flight of the vLLM engine: torch's CUDA against vllm's, the toolchain, FlashInfer's sampler off
  grading.py      the final-answer rule and math-verify in sandboxed worker processes (imports no torch)

This file imports nothing, so that grading.py's worker processes load only what grading needs.
"""


class UsageError(Exception):
    """Bad input from the user (model, task, data, configuration); scripts print it as one line."""
