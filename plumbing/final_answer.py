"""The final-answer rule: which part of a model's response grading.grade() checks against the reference, in one rule
for every task (gsm8k, rg:*, .jsonl, math, math500, aime24), read from the response's last TAIL_CHARS characters.

1. The last stated answer counts. An answer is stated by a \\boxed{...}, a "####", an "answer is" or
   "answer:", or a correction: a sentence or clause that opens with actually, wait, no, nope, oops,
   sorry, correction, hold on, I mean or on second thought and holds a value. "The answer is 72.
   Actually 73." and "The answer is 72, wait, 73" answer 73; "The answer is 73.\\n#### 72" answers 72.
   With no stated answer, math-verify reads the whole tail (its last number or expression).
2. The statement runs from its marker to the end of its sentence (".", "!" or "?" before a space, or
   a line break). Its boxes must agree: "\\boxed{72} or \\boxed{73}" and "\\boxed{3} then \\boxed{5}"
   score 0, while "\\boxed{3}. Then \\boxed{5}" answers 5 (rule 1).
3. A hedge scores 0: "or" between two values (numbers, boxes, fractions, roots) in the statement or
   in its box, e.g. "72 or 73", "#### either 72 or 73", "\\boxed{72 \\text{ or } 73}"; with no stated
   answer, in the last sentence that holds a value. Not applied when the reference itself contains
   "or". "3/4" is a fraction, never a hedge.
4. A rejected value is dropped: "The answer is 72, not 73" answers 72 (also "rather than 73",
   "instead of 73").
5. A list of values scores 0 unless the reference is one (a tuple, set, interval or matrix): two numbers joined
   by "&" or "\\\\" (a matrix's), ";" or a "," that is no thousands separator, in the statement or its box; with
   no stated answer, in the last sentence that holds a value. "7&10&2" and "The answer is 7, 10" do not answer
   7 (math-verify would read their first entry); "1,000" is 1000.
6. A \\boxed{...} that begins before the graded tail and ends inside it scores 0: what is left of it is no answer.

    >>> answer_text("The answer is 72. Actually 73.")  # math-verify then reads 73
    'Actually 73.'
    >>> answer_text("The answer is 7, 10.", reference="7")  # a list: nothing to grade, 0
    ''

This part runs in the training process (grading.grade(), before the sandboxed workers get the text): no timeout covers
it, so every pattern is linear-time on any text. It imports nothing of the project and no torch.
"""

from __future__ import annotations

import re

TAIL_CHARS = 8000  # only the end of a response is graded
# Boxes are first swapped for placeholders "\x01<i>\x02", so that dots, braces and "or" inside a box neither split
# nor hedge the text around it.
_BOX_RE = re.compile(r"\\boxed\s*\{")
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)|\n")
_CUE_RE = re.compile(  # a correction word that opens a sentence or a clause
    r"(?:^|(?<=[.!?,;:\n\u2013\u2014]))[ \t*_\"'(]*+"
    r"(?P<cue>actually|wait|no|nope|oops|sorry|correction|hold on|i mean|on second thought)\b",
    re.IGNORECASE,
)
_MARKER_RE = re.compile(r"\x01|####|\banswer\b(?:\s++is\b|\s*+[:=])", re.IGNORECASE)
_VALUE_RE = re.compile(r"[\d\x01$]|\\[a-zA-Z(\[]")  # where a stated value can begin
_ALTERNATIVE_RE = re.compile(r"\d|\x01|\\(?:d?frac|sqrt|pi|infty)\b")  # what a hedge is between
_OR_RE = re.compile(r"\bor\b", re.IGNORECASE)
# A list of values: two numbers (or boxes) joined by a matrix's & or \\, a ";" or a "," that is no thousands separator
# ("7, 10", "7,10", "7&10", "7 \\ 10"; not "1,000"). math-verify would grade its first entry.
_LIST_RE = re.compile(r"[\d\x02]\s*+(?:&|\\\\|;|,(?!\d{3}(?!\d)))\s*+-?\s*+[\d\x01]")
_BOX_TOKEN_RE = re.compile(r"\\boxed\s*\{|\\.|[{}]", re.DOTALL)
_NEGATED_RE = re.compile(  # "72, not 73": the rejected value is dropped
    r"\b(?:not|rather than|instead of)\s[\s*(]*+"
    r"(?:\x01\d+\x02|\$[^$\n]{0,200}\$|-?\d[\d,]*(?:\.\d+)?(?:[eE][+-]?\d+|/\d+)?)",
    re.IGNORECASE,
)


def _hedges(text: str) -> bool:
    """Whether "or" stands between two values (numbers, boxes, fractions, roots) of the text."""
    values = [m.start() for m in _ALTERNATIVE_RE.finditer(text)]
    return len(values) > 1 and _OR_RE.search(text, values[0] + 1, values[-1]) is not None


def _box_cut(response: str, cut: int) -> bool:
    """Whether a \boxed{ opened before `cut` is still open there (one pass over response[:cut])."""
    depth, boxes = 0, []  # the brace depth, and the depth inside each box still open
    for token in _BOX_TOKEN_RE.finditer(response, 0, cut):
        text = token.group()
        if text == "}":
            depth -= depth > 0
            while boxes and boxes[-1] > depth:
                boxes.pop()
        elif text == "{" or text.startswith("\\boxed"):
            depth += 1
            if text != "{":
                boxes.append(depth)
    return bool(boxes)


def _lists(text: str) -> bool:
    return _LIST_RE.search(text) is not None


def answer_text(response: str, reference: str = "") -> str:
    """The final answer statement of a response under the rule above ("" when it hedges, lists values or is cut)."""
    if len(response) > TAIL_CHARS and _box_cut(response, len(response) - TAIL_CHARS):
        return ""  # the tail starts inside a box: what is left of it is not the answer
    text = response[-TAIL_CHARS:].replace("\u2212", "-").replace("\x01", " ").replace("\x02", " ")
    boxes, parts, pos = [], [], 0
    while box := _BOX_RE.search(text, pos):
        depth, i = 1, box.end()
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 2
                continue
            depth += (text[i] == "{") - (text[i] == "}")
            i += 1
        boxes.append(text[box.end() : i - 1] if depth == 0 else text[box.end() :])  # unclosed: to the end
        parts += [text[pos : box.start()], f"\x01{len(boxes) - 1}\x02"]
        pos = i
    work = "".join(parts) + text[pos:]
    # Clauses: sentences, also split where a correction word opens a clause.
    cues = {m.start("cue") for m in _CUE_RE.finditer(work)}
    cuts = sorted({0, len(work), *cues, *(m.end() for m in _SENTENCE_END_RE.finditer(work))})
    clauses = [(a, b) for a, b in zip(cuts, cuts[1:]) if not work[a:b].isspace()]
    statement = None
    for k in range(len(clauses) - 1, -1, -1):  # the last clause that states an answer
        a, b = clauses[k]
        marker = _MARKER_RE.search(work, a, b)
        if marker:
            value_from = marker.start() if marker.group() == "\x01" else marker.end()
            if not _VALUE_RE.search(work, value_from, b) and k + 1 < len(clauses):
                b = clauses[k + 1][1]  # "The answer is:\n72": the value is on the next line
            if _VALUE_RE.search(work, value_from, b):
                statement = work[marker.start() : b]
                break
        elif a in cues and _VALUE_RE.search(work, a, b):
            statement = work[a:b]
            break
    check_or = not _OR_RE.search(reference)  # a reference may itself be "1 \text{ or } 2"
    # a reference that is itself a list, tuple, set, interval or matrix: "(1,2)", "\{1,2\}", "1 & 2"
    check_list = not (_lists(reference) or "," in reference and re.search(r"[(\[]|\\\{", reference))
    if statement is None:  # no stated answer: math-verify reads the tail; its last sentence must not hedge or list
        last = next((work[a:b] for a, b in reversed(clauses) if _VALUE_RE.search(work, a, b)), "")
        return "" if check_or and _hedges(last) or check_list and _lists(last) else text
    statement = _NEGATED_RE.sub("", statement)
    stated_boxes = [boxes[int(i)] for i in re.findall(r"\x01(\d+)\x02", statement)]
    if len({"".join(b.split()) for b in stated_boxes}) > 1:
        return ""  # two different boxed answers in one statement
    if check_or and (_hedges(statement) or (stated_boxes and _hedges(stated_boxes[-1]))):
        return ""
    if check_list and (_lists(statement) or (stated_boxes and _lists(stated_boxes[-1]))):
        return ""
    return f"\\boxed{{{stated_boxes[-1]}}}" if stated_boxes else statement
