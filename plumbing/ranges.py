"""Valid ranges of numeric settings, declared on the field itself and checked once, before anything loads.

    lr: ranges.PositiveFloat = 1e-6
    \"\"\"AdamW learning rate\"\"\"

A field's type carries its range (typing.Annotated), so --help shows it (`--lr FLOAT>0`) and `problems(args)`,
called by every script's validation, finds it. A float must also be finite: --lr inf or --temperature nan would
otherwise run and write a checkpoint of NaNs. A list field's range applies to each element, and the list may not
be empty. tests/inputs/test_bad_input.py walks every numeric field of every command line and fails on one without a
range.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from typing import Annotated, Literal

import tyro


@dataclasses.dataclass(frozen=True)
class Range:
    """low <= value <= high (either end may be open, i.e. excluded, or None: unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self, kind: type) -> str:
        """The range in words, as an error message ends: 'positive', 'at least 1', 'in (0, 1]'."""
        if self.high is None:
            if self.low_open:
                return "positive" if self.low == 0 else f"greater than {self.low}"
            return "0 or positive" if self.low == 0 and kind is float else f"at least {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def metavar(self, kind: type) -> str:
        """The range as --help shows it after the flag: FLOAT>0, INT>=1, FLOAT in (0,1]."""
        name = kind.__name__.upper()
        if self.high is None:
            return f"{name}{'>' if self.low_open else '>='}{self.low}"
        return f"{name} in {'(' if self.low_open else '['}{self.low},{self.high}{')' if self.high_open else ']'}"

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below


def bounded(
    kind: type,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    many: bool = False,
    auto: bool = False,
):
    """The type of a field whose values lie in a range: Annotated[kind (| None | "auto") (list of), Range, its --help
    metavar]. auto: the value may also be "auto", which the program replaces with a value it chooses."""
    valid = Range(low, high, low_open, high_open)
    base = list[kind] if many else kind
    base = base | None if optional else base | Literal["auto"] if auto else base
    metavar = valid.metavar(kind) + ("..." if many else "")
    metavar = "{None}|" + metavar if optional else "auto|" + metavar if auto else metavar
    return Annotated[base, valid, tyro.conf.arg(metavar=metavar)]


# The ranges the project's settings use. An Optional one also accepts None (the flag's "not set" value).
PositiveInt = bounded(int, 1)  # counts: iterations, questions, samples, tokens
NonNegativeInt = bounded(int, 0)  # cadences where 0 means never
Seed = bounded(int, 0, 2**32 - 1)  # what every seeded generator accepts (numpy's limit)
PositiveFloat = bounded(float, 0, low_open=True)  # learning rates, clip ranges, temperatures that divide logits
NonNegativeFloat = bounded(float, 0)  # penalties and weights where 0 switches the term off; greedy temperature
Probability = bounded(float, 0, 1, low_open=True)  # top_p, probability thresholds, memory shares: (0, 1]
Fraction = bounded(float, 0, 1)  # gamma, lambda: [0, 1]
WarmupFraction = bounded(float, 0, 1, high_open=True)  # a warmup of the whole run would never decay: [0, 1)
OptionalPositiveInt = bounded(int, 1, optional=True)
OptionalPositiveFloat = bounded(float, 0, low_open=True, optional=True)
PositiveInts = bounded(int, 1, many=True)
PositiveFloats = bounded(float, 0, low_open=True, many=True)  # learning-rate grids
Seeds = bounded(int, 0, 2**32 - 1, many=True)
AutoPositiveInt = bounded(int, 1, auto=True)  # memory knobs that plumbing.memory sizes to the device
AutoProbability = bounded(float, 0, 1, low_open=True, auto=True)
# LoRA's alpha: the adapters' update is alpha / rank x B A. Real settings are 1-1,024; a scale past this bound
# overflows the logits of a trained adapter (inf x 0 = NaN), so --lora-alpha and an adapter_config.json stay below it.
MAX_LORA_ALPHA = 1e6
LoraAlpha = bounded(float, 0, MAX_LORA_ALPHA, low_open=True, optional=True)


def field_range(args_class, name: str) -> tuple[Range, type] | None:
    """The Range declared on a field of a dataclass and the kind of number it bounds, or None."""
    hint = typing.get_type_hints(args_class, include_extras=True)[name]
    # `X | None` puts the Annotated inside a Union
    hint = next((h for h in (hint, *typing.get_args(hint)) if typing.get_origin(h) is Annotated), None)
    if hint is None:
        return None
    valid = next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
    kind = number_kind(typing.get_args(hint)[0])
    return (valid, kind) if valid is not None and kind is not None else None


def number_kind(hint) -> type | None:
    """int or float when a type holds a number or a sequence of numbers, perhaps | None (bool is not a number)."""
    for part in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(part) in (list, tuple):
            part = typing.get_args(part)[0]
        if part in (int, float):
            return part
    return None


def is_numeric(args_class, name: str) -> bool:
    """Whether a field of a dataclass holds a number or a sequence of numbers."""
    return number_kind(typing.get_type_hints(args_class)[name]) is not None


def problems(args) -> list[str]:
    """Every numeric setting of `args` (a dataclass) outside its declared range, as one message per flag."""
    found = []
    for field in dataclasses.fields(args):
        declared = field_range(type(args), field.name)
        value = getattr(args, field.name)
        if declared is None or value is None or value == "auto":
            continue
        valid, kind = declared
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(value, (list, tuple)):
            if not value:
                found.append(f"{flag} needs at least one value")
            bad = [v for v in value if not (math.isfinite(v) and valid.contains(v))]
            if bad:
                found.append(f"{flag} ({' '.join(map(str, bad))}): each value must be {valid.describe(kind)}")
        elif not math.isfinite(value):
            found.append(f"{flag} ({value}) must be a finite number, {valid.describe(kind)}")
        elif not valid.contains(value):
            found.append(f"{flag} ({value}) must be {valid.describe(kind)}")
    return found


def cli(args_class):
    """tyro.cli(args_class), then one `error:` line (exit 2) if a setting lies outside its range: for command lines
    that have no other validation (the benchmarks)."""
    args = tyro.cli(args_class)
    found = problems(args)
    if found:
        print(f"error: {'; '.join(found)}", file=sys.stderr)
        sys.exit(2)
    return args
