"""What every rollout engine returns: token ids, a finish reason and the ids' log-probs (Completion), and the stop
rule the engines share.

Generation stops at EOS or at a stop string; a response cut by a stop string counts as finished, and its ids end
where the stop string begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class Completion:
    ids: list[int]  # sampled token ids; ends with EOS when the model stopped itself; cut where a stop string begins
    finish_reason: str  # "stop" (EOS or stop string) or "length" (token or context limit: scores 0)
    # Per id, the log-prob the engine sampled it with: log softmax(logits / temperature) over the whole vocabulary
    # (logprobs_top_p 1: what the trainer computes), or renormalised over the top-p nucleus the engine drew it from
    # (logprobs_top_p < 1: vLLM at top_p < 1); None where the engine did not report it (greedy decoding)
    logprobs: list[float] | None = None
    # The nucleus `logprobs` are renormalised over: 1.0 for the whole vocabulary (the HF sampler at any top_p)
    logprobs_top_p: float = 1.0


def cut_at_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[list[int], bool]:
    """Token ids up to where the first stop string begins (in decoded text), and whether one was found.

    For the ids of "5\\n\\n\\nProblem: x" and stop ["\\n\\n\\nProblem:"] it returns (the ids of "5", True).
    """
    text = tokenizer.decode(ids)
    hits = [text.find(s) for s in stop if s and s in text]
    if not hits:
        return ids, False
    end = min(hits)
    keep = 0  # the longest prefix of tokens whose text ends at or before the stop string
    while keep < len(ids) and len(tokenizer.decode(ids[: keep + 1])) <= end:
        keep += 1
    return ids[:keep], True


def stop_histories(prompts: list[list[int]], generated: int | Sequence[int], stop: Sequence[str]) -> list[list[int]]:
    """Per prompt, its last generated tokens that a stop string could begin in (at most its longest length + 2:
    a token spells at least one character)."""
    counts = [generated] * len(prompts) if isinstance(generated, int) else list(generated)
    tail = max((len(s) for s in stop), default=0) + 2 if stop else 0
    return [list(p[len(p) - min(c, tail, len(p)) :]) if c and tail else [] for p, c in zip(prompts, counts)]


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, so that "".join(pieces) == decode(ids) (byte-level BPE splits a
    character across tokens: its piece goes to the token that completes it). For viewers and sample files."""
    pieces = []
    for i in range(len(ids)):
        start = max(0, i - 8)  # a few tokens of left context are enough to complete any character
        pieces.append(tokenizer.decode(ids[start : i + 1])[len(tokenizer.decode(ids[start:i])) :])
    return pieces
