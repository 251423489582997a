"""The exact toy: a policy small enough that nothing about it has to be sampled to be known, which credit_exact.py,
learning_exact.py and learning_critical.py measure on.

The tasks. sum: a prompt of two digits a b (0-3); reward 1 for digits that add up to a + b, then EOS. critical
(CRITICAL): a prompt of three bits; reward 1 for the key bit (the prompt's first bit), then exactly --filler bits of
any value, then EOS. A wrong answer, or no EOS within --horizon tokens, scores 0.
The policy (make_policy): a tiny Llama over EOS and the task's digits, pre-trained briefly on a synthetic corpus with
forks and mistakes at particular places (corpus_response, critical_response).
The exact answer (enumerate_exact, Exact): every continuation of every prefix under the sampling distribution
(softmax(logits / temperature), top_p 1), so V(s) of every prefix, A*_t, J (expected_reward) and grad J
(exact_gradient) are exact.
The sampler (ExactSampler): draws from those tables, without a forward pass, through the interface of
plumbing.engines.HFSampler; draw_responses and mc_state_values sample responses and MC values with it.
Besides, what the experiments on the toy share: each estimator's cost on a pilot draw (pilot_costs), --task's checks
and defaults (task_problems, task_defaults), the record of the machine and code (machine), and the settings learning
on the toy compares (SETTINGS, PALETTE).

  python -m doctest experiments/exact_toy.py   # the worked examples (silent when they hold)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import platform
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import spo_chain
import spo_tree
from plumbing import UsageError, runs
from plumbing.engines import Completion
from plumbing.precision import FP32, cpu_description
from plumbing.training import collate, micro_batches, response_logprobs

ROOT = Path(__file__).resolve().parents[1]

EOS, DIGITS = 0, 4  # token 0 ends a response; token d + 1 is the digit d
VOCAB = DIGITS + 1
# The critical-token task: digits 0 and 1 (tokens 1, 2) and EOS; a prompt of three bits; reward 1 for the key bit (the
# prompt's first bit), then exactly --filler bits of any value, then EOS. Only the first token and where EOS falls
# decide the reward; the filler bits do not, so credit given to the whole response spreads over --filler irrelevant
# tokens. A prompt's ids start with EOS as a start marker: without one the 2-layer policy cannot count positions after
# a prompt such as 000 (its length was right 0.55-0.68 of the time on 000 and 111, 0.98-0.99 on the others; with it
# 0.98-1.00 on every prompt at L 3-7). Even so, on one CPU (another float order) 500 steps at L 5 gave a
# policy whose length was nearly always wrong: make_policy trains on until it is right (CRITICAL_LENGTH_RIGHT).
CRITICAL = dict(digits=2, prompts=["000", "001", "010", "011", "100", "101", "110", "111"])
CRITICAL_LENGTH_MISTAKES = 0.1  # share of the critical corpus with one filler bit too many or too few
CRITICAL_LENGTH_RIGHT = 1 - CRITICAL_LENGTH_MISTAKES  # make_policy: every prompt's length right at least this often
PRETRAIN_EXTENSION = 4  # make_policy, --task critical: at most this many times --pretrain-steps
# --filler-kind: the share of 1s among the corpus's filler bits. coin: each a coin flip, so every filler token is a
# low-probability one (p about 0.5); confident: nearly always 0, so at temperature 0.6 the policy gives each filler
# token p > 0.99 and the key bit is the only uncertain token (SPO's regime: a few tokens decide, most are confident).
CRITICAL_FILLER_ONES = {"coin": 0.5, "confident": 0.05}
TASK_DIGITS = {"sum": DIGITS, "critical": CRITICAL["digits"]}
PROMPT_LENGTH = {"sum": 2, "critical": 4}  # tokens of a prompt (the context of a response: this + --horizon)


@dataclass
class ToySettings:
    """What the toy's functions read from a run's settings: the task and its prompts, the policy's pre-training, the
    sampling, and the estimators whose cost pilot_costs measures (each field is the credit_exact.py flag of that name).
    credit_exact's Args has every one of these fields and is passed as it is; learning_exact builds one from its own
    (toy_settings)."""

    task: str
    filler: int
    filler_kind: str
    prompts: list[str]
    horizon: int
    temperature: float
    prob_threshold: float
    policy_seed: int
    hidden_size: int
    pretrain_steps: int
    pretrain_batch: int
    pretrain_lr: float
    mistake_rate: float
    mc_samples: int
    tree_depth: int
    segment_tokens: int
    micro_batch_size: int
    budgets: list[int]
    intervals: list[int]
    lams: list[float]
    critic_batches: int


# ----------------------------------------------------------------------------------------------
# The policy: a tiny Llama pre-trained on a synthetic corpus


def parse_prompt(text: str, task: str = "sum") -> tuple[list[int], int]:
    """Prompt ids and target of a prompt written as two digits (--task critical: three bits after the start marker
    EOS; the target is the key bit, the first of them).

    >>> parse_prompt("23")
    ([3, 4], 5)
    >>> parse_prompt("101", "critical")
    ([0, 2, 1, 2], 1)
    """
    if task == "critical":
        if len(text) != 3 or not all(c in "01" for c in text):
            raise ValueError(f"prompt {text!r}: write three bits, e.g. 011")
        return [EOS] + [int(c) + 1 for c in text], int(text[0])
    if len(text) != 2 or not all(c in "0123" for c in text):
        raise ValueError(f"prompt {text!r}: write two digits 0-3, e.g. 23")
    return [int(c) + 1 for c in text], sum(int(c) for c in text)


def corpus_response(target: int, mistake_rate: float, rng: random.Random) -> list[int]:
    """One corpus response (digits, EOS not included): a first digit 1 or 2 at random, then the largest digit up to 2
    that still fits, until the digits add up to `target`; with probability `mistake_rate` one mistake, at a random
    place: the response stops there, or an extra random digit 0-3 goes there.

    >>> corpus_response(5, 0.0, random.Random(1))
    [1, 2, 2]
    """
    digits = [rng.randint(1, min(2, target))] if target else []
    while sum(digits) < target:
        digits.append(min(2, target - sum(digits)))
    if rng.random() < mistake_rate:
        place = rng.randint(0, len(digits))
        digits = digits[:place] if rng.random() < 0.5 else digits[:place] + [rng.randint(0, 3)] + digits[place:]
    return digits


def critical_response(key: int, filler: int, mistake_rate: float, rng: random.Random, ones: float = 0.5) -> list[int]:
    """One critical-task corpus response (digits, EOS not included): the key bit, wrong with probability
    mistake_rate / 2, then `filler` bits, each 1 with probability `ones` (CRITICAL_FILLER_ONES), one more or one fewer
    in CRITICAL_LENGTH_MISTAKES of the corpus.

    >>> critical_response(1, 3, 0.0, random.Random(0)), critical_response(1, 3, 0.0, random.Random(0), ones=0.0)
    ([1, 1, 1, 0], [1, 0, 0, 0])
    """
    first = key if rng.random() >= mistake_rate / 2 else 1 - key
    length = filler
    if rng.random() < CRITICAL_LENGTH_MISTAKES:
        length += rng.choice([-1, 1])
    return [first] + [int(rng.random() < ones) for _ in range(length)]


def corpus_row(args: ToySettings, rng: random.Random) -> list[int]:
    """One pre-training sequence of the task: a random prompt, its corpus response, EOS."""
    if args.task == "critical":
        prompt, key = parse_prompt("".join(str(rng.randint(0, 1)) for _ in range(3)), "critical")
        digits = critical_response(key, args.filler, args.mistake_rate, rng, CRITICAL_FILLER_ONES[args.filler_kind])
    else:
        prompt, target = parse_prompt(f"{rng.randint(0, 3)}{rng.randint(0, 3)}")
        digits = corpus_response(target, args.mistake_rate, rng)
    return prompt + [d + 1 for d in digits][: args.horizon - 1] + [EOS]


def make_policy(args: ToySettings) -> tuple[LlamaForCausalLM, float, int]:
    """The tiny Llama (built from a config: no download), pre-trained on the corpus of every prompt of the task;
    returns it in eval mode, its last pre-training loss and its pre-training steps. --task critical: one recipe at
    every L and on every machine. After --pretrain-steps, pre-training goes on a tenth of them at a time, up to
    PRETRAIN_EXTENSION times as many, until every prompt's response has the right length (length_right, exact, at the
    sampling temperature) at least CRITICAL_LENGTH_RIGHT of the time, as often as the corpus makes it; a policy that
    still misses it is refused (UsageError), since its reward would turn on the length rather than on the key bit."""
    prompt_length = PROMPT_LENGTH[args.task]
    config = LlamaConfig(
        vocab_size=TASK_DIGITS[args.task] + 1,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=prompt_length + args.horizon + 1,
        pad_token_id=EOS,
        eos_token_id=EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.policy_seed)
    model = LlamaForCausalLM(config)
    rng, optimizer = random.Random(args.policy_seed), torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr)
    loss = torch.tensor(math.nan)

    def pretrain(steps: int) -> None:
        nonlocal loss
        model.train()
        for _ in range(steps):
            rows = [corpus_row(args, rng) for _ in range(args.pretrain_batch)]
            width = max(map(len, rows))
            input_ids = torch.tensor([row + [EOS] * (width - len(row)) for row in rows])  # [batch, width]
            attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])  # [batch, width]
            labels = input_ids.masked_fill(attention == 0, -100)
            labels[:, :prompt_length] = -100  # the prompt is given, not learned
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()

    pretrain(args.pretrain_steps)
    steps = args.pretrain_steps
    if args.task == "critical":
        block = max(1, args.pretrain_steps // 10)
        while True:
            exacts = enumerate_prompts(model, args)
            rights = {text: length_right(exact, args.filler) for text, exact in zip(args.prompts, exacts)}
            worst = min(rights, key=rights.get)
            if rights[worst] >= CRITICAL_LENGTH_RIGHT:
                break
            if steps + block > PRETRAIN_EXTENSION * args.pretrain_steps:
                raise UsageError(
                    f"the pre-trained policy gets the length right on prompt {worst} only {rights[worst]:.3f} of the "
                    f"time after {steps} steps (the critical task needs {CRITICAL_LENGTH_RIGHT:g} on every prompt, "
                    "or its reward turns on the length): pass another --policy-seed, or more --pretrain-steps"
                )
            pretrain(block)
            steps += block
    return model, loss.item(), steps


def length_right(exact: Exact, filler: int) -> float:
    """--task critical: the probability that a response ends with EOS right after the key bit and `filler` bits (the
    length the reward asks for), whatever its bits.

    >>> probs = [np.array([[0.0, 0.5, 0.5]]), np.array([[0.25, 0.5, 0.25]] * 2), np.array([[1.0, 0, 0]] * 4)]
    >>> length_right(Exact([0], 0, probs, [np.ones(1), np.full(2, 0.5), np.array([2, 1, 2, 1]) / 8], [], digits=2), 1)
    0.75
    """
    return float((exact.reach[filler + 1] * exact.probs[filler + 1][:, EOS]).sum())


# ----------------------------------------------------------------------------------------------
# The exact answer: every continuation of every prefix


def digit_sums(length: int, digits: int = DIGITS) -> np.ndarray:
    """[DIGITS**length]: the digit sum of every `length`-digit prefix, prefixes numbered in base DIGITS (first digit
    most significant), as in Exact.

    >>> digit_sums(2).reshape(4, 4)[3].tolist()  # prefixes 3 0, 3 1, 3 2, 3 3
    [3, 4, 5, 6]
    """
    sums = np.zeros(1, dtype=np.int64)
    for _ in range(length):
        sums = (sums[:, None] + np.arange(digits)[None]).reshape(-1)
    return sums


def finish_rewards(task: str, target: int, length: int, filler: int = 0) -> np.ndarray:
    """[digits**length]: the reward of ending (EOS) after each `length`-digit prefix, numbered as digit_sums does.
    sum: 1 where the digits add up to the target; critical: 1 where the prefix is the key bit (the target) and
    `filler` more bits.

    >>> finish_rewards("critical", 1, 3, filler=2).tolist()  # 3 bits: 4 prefixes start with 1
    [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    """
    digits = TASK_DIGITS[task]
    if task == "sum":
        return (digit_sums(length, digits) == target).astype(float)
    if length != filler + 1:
        return np.zeros(digits**length)
    return (np.arange(digits**length) // digits ** (length - 1) == target).astype(float)


@dataclass
class Exact:
    """One prompt's exact answer. A prefix of k digits is numbered i = sum of d_j * D**(k-1-j) (D = digits: 4 for the
    sum task, 2 for the critical one); its child with digit d is i * D + d.
    probs[k]   [DIGITS**k, VOCAB]: next-token distribution after each k-digit prefix (k < horizon)
    reach[k]   [DIGITS**k]: probability that a response starts with each k-digit prefix
    values[k]  [DIGITS**k]: V(prompt + the k digits), the expected reward of its continuations; values[horizon] = 0
               (a response that reached the horizon without EOS is unfinished)"""

    prompt: list[int]
    target: int
    probs: list[np.ndarray]
    reach: list[np.ndarray]
    values: list[np.ndarray]
    digits: int = DIGITS  # the response's digits (the base prefixes are numbered in)
    finish: list[np.ndarray] = field(default_factory=list)  # finish[k]: finish_rewards of the k-digit prefixes

    @property
    def horizon(self) -> int:
        return len(self.probs)

    def value(self, prefix: list[int]) -> float:
        """V(prompt + prefix); a prefix that ends with EOS is a finished response, worth its reward."""
        if prefix and prefix[-1] == EOS:
            return reward(self, prefix, "stop")
        return float(self.values[len(prefix)][self.number(prefix)])

    def number(self, digits: list[int]) -> int:
        """The number of a prefix of digit tokens (first digit most significant, in base self.digits)."""
        index = 0
        for token in digits:
            index = index * self.digits + token - 1
        return index

    def advantages(self, response: list[int]) -> list[float]:
        """A*_t = V(prompt + y_<=t) - V(prompt + y_<t) of every token of a response (they add up to R - V(prompt))."""
        values = [self.value(response[:t]) for t in range(len(response) + 1)]
        return [after - before for before, after in zip(values, values[1:])]

    def token_probs(self, response: list[int]) -> list[float]:
        """p_t of every token of a response, from the table."""
        probs, index = [], 0
        for t, token in enumerate(response):
            probs.append(float(self.probs[t][index, token]))
            index = index * self.digits + token - 1
        return probs

    def expected_length(self) -> float:
        """Expected response length in tokens (EOS included)."""
        return float(sum(reach.sum() for reach in self.reach))

    def position_map(self, threshold: float) -> dict[str, list[float]]:
        """Per response position k (0: the first token), given that a response has a token there: the expected true
        |A*_k| ("abs_advantage": how much credit that position's token carries) and the probability that its token
        has p_t < threshold ("low_probability": a cutpoint of SPO-chain int1, kept by the probability mask).

        >>> table = Exact([1], 1, [np.array([[0.5, 0.5, 0, 0, 0]])], [np.ones(1)], [np.array([0.5]), np.zeros(4)],
        ...               finish=[np.ones(1)])
        >>> table.position_map(0.9)  # V 0.5; EOS now scores 1 (A* +0.5), a digit runs out of horizon (-0.5)
        {'abs_advantage': [0.5], 'low_probability': [1.0]}
        """
        credit, low = [], []
        for k, (reach, probs) in enumerate(zip(self.reach, self.probs)):
            after = np.zeros_like(probs)  # [prefixes, VOCAB]: V after each next token
            after[:, EOS] = self.finish[k] if self.finish else 0.0
            after[:, 1 : self.digits + 1] = self.values[k + 1].reshape(-1, self.digits)
            weights = reach[:, None] * probs  # [prefixes, VOCAB]: P(prefix, next token)
            mass = weights.sum()
            credit.append(float((weights * np.abs(after - self.values[k][:, None])).sum() / mass) if mass else 0.0)
            low.append(float((weights * (probs < threshold)).sum() / mass) if mass else 0.0)
        return {"abs_advantage": credit, "low_probability": low}

    def low_probability_share(self, threshold: float) -> float:
        """Expected share of a response's tokens with p_t < threshold."""
        low = sum((reach[:, None] * probs * (probs < threshold)).sum() for reach, probs in zip(self.reach, self.probs))
        return float(low) / self.expected_length()


def reward(exact: Exact, response: list[int], finish_reason: str) -> float:
    """1 when the response finished (EOS) as its task rewards (sum: its digits add up to the target; critical: the key
    bit, then --filler bits), else 0 (unfinished: 0)."""
    if not exact.finish:  # a table built by hand: the sum task's rule
        return float(finish_reason == "stop" and sum(token - 1 for token in response[:-1]) == exact.target)
    return float(finish_reason == "stop" and exact.finish[len(response) - 1][exact.number(response[:-1])] > 0)


@torch.no_grad()
def enumerate_exact(
    model,
    prompt: list[int],
    target: int,
    horizon: int,
    temperature: float,
    micro_batch_size: int,
    task: str = "sum",
    filler: int = 0,
) -> Exact:
    """The exact answer for one prompt: one forward pass per prefix (the prefixes of a length in batches, no padding),
    then the values from the horizon back to the prompt. Probabilities in float64 from logits / temperature."""
    base = TASK_DIGITS[task]
    probs, reach = [], [np.ones(1)]
    for k in range(horizon):
        index = np.arange(base**k)
        digits = (
            np.stack([index // base ** (k - 1 - j) % base for j in range(k)], axis=1) if k else np.zeros((1, 0), int)
        )
        # [4^k, P + k]
        input_ids = torch.cat([torch.tensor(prompt).expand(len(index), -1), torch.from_numpy(digits + 1)], dim=1)
        logits = torch.cat(
            [model(input_ids=chunk.to(model.device)).logits[:, -1] for chunk in input_ids.split(micro_batch_size * 16)]
        )
        probs.append(torch.softmax(logits.double() / temperature, dim=-1).cpu().numpy())  # [4^k, VOCAB]
        reach.append((reach[-1][:, None] * probs[-1][:, 1:]).reshape(-1))
    finish = [finish_rewards(task, target, k, filler) for k in range(horizon)]
    values = [np.zeros(base**horizon)]
    for k in reversed(range(horizon)):
        finished = probs[k][:, EOS] * finish[k]  # EOS now: its reward
        values.insert(0, finished + (probs[k][:, 1:] * values[0].reshape(-1, base)).sum(-1))
    return Exact(list(prompt), target, probs, reach[:-1], values, digits=base, finish=finish)


def enumerate_prompts(model, args) -> list[Exact]:
    """enumerate_exact for every prompt of `args` (a ToySettings, or credit_exact's or learning_exact's Args): its
    task, --filler, --horizon, --temperature."""
    return [
        enumerate_exact(
            model,
            *parse_prompt(text, args.task),
            args.horizon,
            args.temperature,
            args.micro_batch_size,
            args.task,
            args.filler,
        )
        for text in args.prompts
    ]


def rewarded_responses(exact: Exact) -> tuple[list[list[int]], list[float]]:
    """Every response with reward 1 (its digits, then EOS) and its probability P(y)."""
    responses, weights = [], []
    for k in range(exact.horizon):
        for index in np.flatnonzero(exact.finish[k] > 0):
            digits = [int(index) // exact.digits ** (k - 1 - j) % exact.digits for j in range(k)]
            responses.append([d + 1 for d in digits] + [EOS])
            weights.append(float(exact.reach[k][index] * exact.probs[k][index, EOS]))
    return responses, weights


def exact_gradient(model, exacts: list[Exact], temperature: float, micro_batch_size: int) -> torch.Tensor:
    """grad J, J = mean over prompts of V(prompt) = mean over prompts of sum_y P(y) R(y): the sum of
    P(y) R(y) grad log P(y) over the rewarded responses (P(y) held fixed), log P(y) from the training log-probs
    (plumbing.training.response_logprobs, logits / temperature). Flat, over every parameter."""
    samples, weights = [], []
    for exact in exacts:
        responses, probabilities = rewarded_responses(exact)
        samples += [{"prompt_ids": exact.prompt, "response_ids": response} for response in responses]
        weights += [p / len(exacts) for p in probabilities]
    model.zero_grad(set_to_none=True)
    for indices in micro_batches(samples, micro_batch_size):
        batch = collate([samples[i] for i in indices], EOS, model.device)
        logps = response_logprobs(model, batch, temperature, precision=FP32)  # [rows, R]
        log_probability = (logps * batch["response_mask"]).sum(-1)  # [rows], log P(y)
        (
            torch.tensor([weights[i] for i in indices], dtype=logps.dtype, device=logps.device) @ log_probability
        ).backward()
    gradient = flat_gradient(model)
    model.zero_grad(set_to_none=True)
    return gradient


def expected_reward(exacts: list[Exact]) -> float:
    """J: the mean over prompts of V(prompt)."""
    return float(np.mean([exact.values[0][0] for exact in exacts]))


def flat_gradient(model) -> torch.Tensor:
    """Every parameter's .grad in one flat float64 vector (zeros where a parameter has none)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double().cpu() for p in model.parameters()]
    )


# ----------------------------------------------------------------------------------------------
# Sampling: from the exact tables, through the interface of the project's sampler


class ExactSampler:
    """The sample() of the Sampler contract (plumbing/engines.py), drawn from the enumerated next-token tables: exactly
    the policy's distribution (softmax(logits / temperature), top_p 1, no stop strings), without a forward pass, so
    spo_tree.grow_trees grows its trees with it. A prompt passed in is a table's prompt followed by `generated`
    response tokens (its digits so far). Its draws come from its own numpy generator (`seed`), and it has no sleep /
    wake_up / load_weights: its tables are the policy at one moment, enumerated anew after each update."""

    def __init__(self, exacts: list[Exact], temperature: float, seed: int):
        self.tables, self.temperature = {tuple(exact.prompt): exact for exact in exacts}, temperature
        self.rng = np.random.default_rng(seed)
        self.tokens = 0  # every token sampled so far

    def sample(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int | list[int],
        stop=(),
        context: int | None = None,
        progress: str | None = None,
        generated: int | list[int] = 0,
    ) -> list[list[Completion]]:
        if temperature != self.temperature or top_p != 1.0 or stop:
            raise ValueError(f"the tables hold temperature {self.temperature}, top_p 1, no stop strings")
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        counts = generated if isinstance(generated, list) else [generated] * len(prompts)
        results = []
        for sequence, budget, count in zip(prompts, budgets, counts):
            exact, prefix = (
                self.tables[tuple(sequence[: len(sequence) - count])],
                list(sequence[len(sequence) - count :]),
            )
            limit = min(budget, context - len(sequence)) if context else budget
            if len(prefix) + limit > exact.horizon or EOS in prefix:
                raise ValueError(f"cannot continue {prefix} by {limit} tokens within the horizon {exact.horizon}")
            results.append(self.continuations(exact, prefix, n, limit))
        return results

    def continuations(self, exact: Exact, prefix: list[int], n: int, limit: int) -> list[Completion]:
        """n continuations of prompt + prefix of at most `limit` tokens; all n advance one token per step together."""
        index = np.zeros(n, dtype=np.int64)  # the prefix's number at its length, then each continuation's
        for token in prefix:
            index = index * exact.digits + token - 1
        tokens, alive, finished = np.zeros((n, limit), dtype=np.int64), np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
        lengths = np.zeros(n, dtype=np.int64)
        for step in range(limit):
            rows = np.flatnonzero(alive)
            cdf = exact.probs[len(prefix) + step][index[rows]].cumsum(-1)  # [alive, VOCAB]
            # [alive]: the first token whose cumulative probability passes a uniform draw
            drawn = np.minimum((cdf < self.rng.random(len(rows))[:, None] * cdf[:, -1:]).sum(-1), exact.digits)
            tokens[rows, step], lengths[rows] = drawn, step + 1
            finished[rows[drawn == EOS]] = True
            alive[rows[drawn == EOS]] = False
            index[rows] = index[rows] * exact.digits + drawn - 1  # (rows that drew EOS are not read again)
            if not alive.any():
                break
        self.tokens += int(lengths.sum())
        return [
            Completion(ids=tokens[i, : lengths[i]].tolist(), finish_reason="stop" if finished[i] else "length")
            for i in range(n)
        ]


def draw_responses(
    sampler: ExactSampler, exacts: list[Exact], group_size: int
) -> tuple[list[dict], list[Exact], list[float]]:
    """G responses per prompt, a prompt's responses together (GRPO's groups): the samples (prompt_ids, response_ids),
    each one's Exact and its reward."""
    groups = sampler.sample(
        [exact.prompt for exact in exacts],
        group_size,
        temperature=sampler.temperature,
        top_p=1.0,
        max_new_tokens=exacts[0].horizon,
    )
    samples, owners, rewards = [], [], []
    for exact, group in zip(exacts, groups):
        for completion in group:
            samples.append({"prompt_ids": exact.prompt, "response_ids": completion.ids})
            owners.append(exact)
            rewards.append(reward(exact, completion.ids, completion.finish_reason))
    return samples, owners, rewards


def mc_state_values(sampler: ExactSampler, states: list[tuple[Exact, tuple[int, ...]]], mc_samples: int) -> dict:
    """V-hat of each distinct state (its Exact, response prefix): the mean reward of K continuations sampled from it
    with the rollout's budget (horizon - len(prefix) new tokens), as spo_chain.mc_values estimates a cutpoint state.
    A prefix that is a whole finished response is worth its reward and samples nothing."""
    unique = list(dict.fromkeys((id(exact), prefix) for exact, prefix in states))
    owner = {id(exact): exact for exact, _ in states}
    open_states = [(owner[key], prefix) for key, prefix in unique if EOS not in prefix]
    groups = (
        sampler.sample(
            [exact.prompt + list(prefix) for exact, prefix in open_states],
            mc_samples,
            temperature=sampler.temperature,
            top_p=1.0,
            max_new_tokens=[exact.horizon - len(prefix) for exact, prefix in open_states],
            generated=[len(prefix) for _, prefix in open_states],
        )
        if open_states
        else []
    )
    values = {
        (id(exact), prefix): float(np.mean([reward(exact, list(prefix) + c.ids, c.finish_reason) for c in group]))
        for (exact, prefix), group in zip(open_states, groups)
    }
    values.update({(key, prefix): reward(owner[key], list(prefix), "stop") for key, prefix in unique if EOS in prefix})
    return values


# ----------------------------------------------------------------------------------------------
# Budgets: each estimator's cost from a pilot draw


def tree_branches(branch: int, args: ToySettings, wide: bool = False) -> list[int]:
    """The tree of size `branch`: tree_depth levels of `branch` children, or (wide) 2 * branch at the first level."""
    return [2 * branch if wide else branch] + [branch] * (args.tree_depth - 1)


SIZES = sorted({round(1.25**k) for k in range(40)})  # 1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 18, 23, ... 7,053


def pilot_costs(exacts: list[Exact], args: ToySettings, seed: int = 10**6, repeats: int = 3) -> dict[str, object]:
    """Tokens per prompt each family spends at each size (the mean of `repeats` draws), up to the first size over the
    largest budget. GRPO's, exact_advantage's and PPO's are G times the exact expected response length (PPO: times its
    critic's batches + 1). SPO-chain's and the per-token MC's grow more slowly than G, since identical cutpoint states
    are estimated once: they are drawn (p_t from the tables here; the runs take them from the model), as are the
    trees."""
    sampler, mean_length = (
        ExactSampler(exacts, args.temperature, seed),
        float(np.mean([e.expected_length() for e in exacts])),
    )
    costs: dict[str, object] = {"grpo": mean_length, "exact_advantage": mean_length}
    costs.update({f"ppo_lam{lam:g}": (args.critic_batches + 1) * mean_length for lam in args.lams})

    def measured(draw, sizes) -> dict[int, float]:
        out = {}
        for size in sizes:
            sampler.tokens = 0
            for _ in range(repeats):
                draw(size)
            out[size] = sampler.tokens / (repeats * len(exacts))
            if out[size] > max(args.budgets):
                break
        return out

    def chain_draw(group_size: int, interval: int | None) -> None:
        samples, owners, _ = draw_responses(sampler, exacts, group_size)
        states = []
        for s, exact in zip(samples, owners):
            probs = exact.token_probs(s["response_ids"])
            cuts = (
                list(range(-1, len(probs) - 1))
                if interval is None
                else spo_chain.find_cutpoints(probs, args.prob_threshold, interval)
            )
            states += [(exact, tuple(s["response_ids"][: c + 1])) for c in cuts]
        mc_state_values(sampler, states, args.mc_samples)

    for name, interval in [(f"spo_chain_int{i}", i) for i in args.intervals] + [("mc_token", None)]:
        costs[name] = measured(lambda size, interval=interval: chain_draw(size, interval), SIZES)
    for name, wide in (("spo_tree", False), ("spo_tree_wide", True)):
        costs[name] = measured(
            lambda branch, wide=wide: spo_tree.grow_trees(
                sampler,
                [e.prompt for e in exacts],
                tree_branches(branch, args, wide),
                segment_tokens=args.segment_tokens,
                max_new_tokens=args.horizon,
                context=PROMPT_LENGTH[args.task] + args.horizon,
                temperature=args.temperature,
                top_p=1.0,
                stop=[],
            ),
            range(2, 100),
        )
    return costs


# ----------------------------------------------------------------------------------------------
# Settings: --task's checks and defaults, and the run's record


def task_problems(args) -> list[str]:
    """What is wrong with --task, --prompts, --filler and --horizon together (`args`: credit_exact's Args or
    learning_exact's)."""
    problems = []
    try:
        [parse_prompt(text, args.task) for text in args.prompts]
    except ValueError as error:
        problems.append(f"--prompts: {error}")
    if not args.prompts:
        problems.append("--prompts needs at least one value")
    if args.task == "critical" and args.horizon != args.filler + 2:
        problems.append(
            f"--horizon {args.horizon}: --task critical needs --filler + 2 ({args.filler + 2}: the key bit, the "
            "filler, EOS)"
        )
    elif args.task == "critical" and args.horizon > 16:
        problems.append(f"--filler {args.filler}: at most 14 (the enumeration holds 2^horizon responses per prompt)")
    elif args.task == "sum" and not 2 <= args.horizon <= 9:
        problems.append(
            f"--horizon {args.horizon}: 2 to 9 (the enumeration holds 4^horizon unfinished responses per prompt)"
        )
    return problems


def task_defaults(args):
    """--task critical with the sum task's default prompts: the eight three-bit prompts instead (`args`: credit_exact's
    Args or learning_exact's)."""
    if args.task == "critical" and args.prompts == type(args)().prompts:
        return dataclasses.replace(args, prompts=list(CRITICAL["prompts"]))
    return args


# The code every experiment on the toy runs besides its own file: the scripts whose functions it calls, plumbing, and
# the shared modules of experiments/.
SHARED_CODE = (
    "grpo_baseline.py",
    "ppo_baseline.py",
    "spo_chain.py",
    "spo_tree.py",
    "plumbing",
    "experiments/exact_toy.py",
    "experiments/measures.py",
)
# The code of a learning_exact.py run besides SHARED_CODE: learning_exact.py records its hash, and learning_critical.py
# reuses a case whose recorded hash is the current one
LEARNING_EXACT_CODE = ("experiments/learning_exact.py", "experiments/toy_training.py")


def code_hash(*experiment: str) -> str:
    """A hash of the code a run computes with: the contents of every .py file of SHARED_CODE and the `experiment`
    files, by path. Unlike the commit, it changes exactly when that code does (a commit of a README changes nothing;
    an uncommitted edit does), so a results file is reused only by the code that would compute it again."""
    digest = hashlib.sha256()
    for name in (*SHARED_CODE, *experiment):
        path = ROOT / name
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f"{source.relative_to(ROOT)}\n".encode() + source.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def machine(*experiment: str) -> dict:
    """Where and from what code the run was made: the CPU, the commit, whether the checkout, and the code the run
    imports (SHARED_CODE and the `experiment` files), differed from that commit (uncommitted changes), and that
    code's hash (code_hash)."""

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "cpu": cpu_description(),
        "processor": platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **runs.code_state(),  # commit, tree_modified
        "imported_code_modified": bool(git("status", "--porcelain", "--", *SHARED_CODE, *experiment)),
        "code_hash": code_hash(*experiment),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------------------------
# The settings learning on the toy compares: learning_exact.py trains each, learning_critical.py sweeps them

# Each setting: its script's family and the options that make it. Names are the keys of the results.
SETTINGS = {
    "grpo": ("grpo", {"prob_mask": False}),
    "grpo_mask": ("grpo", {"prob_mask": True}),
    "grpo_mask_scale": ("grpo", {"prob_mask": True, "whiten": "scale"}),
    "spo_chain_int1": ("spo_chain", {"interval": 1}),
    "spo_chain_int1_scale": ("spo_chain", {"interval": 1, "whiten": "scale"}),
    "spo_chain_int5": ("spo_chain", {"interval": 5}),
    "spo_tree_uniform": ("spo_tree", {"edge_weight": "uniform"}),
    "spo_tree_depth": ("spo_tree", {"edge_weight": "depth"}),
    "ppo_lam1": ("ppo", {"lam": 1.0}),
    "ppo_lam0.96": ("ppo", {"lam": 0.96}),
}

# Each setting's colour and line style in the figures
PALETTE = {
    "grpo": ("tab:blue", "-"),
    "grpo_mask": ("tab:blue", ":"),
    "grpo_mask_scale": ("tab:cyan", ":"),
    "spo_chain_int1": ("tab:red", "-"),
    "spo_chain_int1_scale": ("tab:pink", "-"),
    "spo_chain_int5": ("tab:orange", "-"),
    "spo_tree_uniform": ("tab:green", "-"),
    "spo_tree_depth": ("tab:green", "--"),
    "ppo_lam1": ("tab:purple", "-"),
    "ppo_lam0.96": ("tab:brown", "-"),
}
