"""Writes tests/grading_cases.jsonl, the labelled set of the final-answer rule (issue 77) for tests/test_grading.py.

Each case: task, response, reference, expected (what a careful human grader gives), shape (a short tag), choice (True
for a "documented choice": a case a careful grader could score either way, labelled by plumbing/final_answer.py's
rule), math_verify (math-verify alone on the whole response, for comparison; filled in by --math-verify).

    .venv/bin/python tests/grading_cases.py            # rewrite the set (math_verify column kept from the file)
    .venv/bin/python tests/grading_cases.py --math-verify   # and recompute math-verify alone
"""

import json
import sys
from pathlib import Path

PATH = Path(__file__).with_name("grading_cases.jsonl")
ZWSP, SHY, ZWJ, WJ, BOM, LRM = "\u200b", "\u00ad", "\u200d", "\u2060", "\ufeff", "\u200e"
CYR_O, GREEK_O, FW_O, FW_R = "\u043e", "\u03bf", "\uff4f", "\uff52"

# The paper's models' shapes around a final sentence.


def rho(final: str) -> str:  # RhoMath SFT on GSM8K after "[MATH_TASK] Problem:"
    return (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n" + final
    )


def r1(final: str, steps: int = 40) -> str:  # DeepSeek-R1-Distill: a long chain, then its answer
    chain = "".join(
        f"Step {k}: we have {k} + {k + 1} = {2 * k + 1}, and {k} * 2 = {2 * k}. Wait, let me double-check that. "
        f"Yes, {2 * k + 1} is right.\n"
        for k in range(1, steps)
    )
    return "<think>\nOkay, so I need to find the value. Let me think.\n" + chain + "</think>\n\n" + final


def chat(final: str) -> str:  # a chat model asked to "put your final answer within \boxed{}"
    return (
        "To solve this, we proceed step by step.\n\n1. First, the total is $3 \\times 4 = 12$.\n"
        "2. Next, we subtract $4$ to get $8$.\n\n" + final
    )


def smol(final: str) -> str:  # base SmolLM2's short prose on reasoning-gym
    return final


def cases() -> list[dict]:
    out = []

    def add(task, response, reference, expected, shape, choice=False):
        out.append(
            {
                "task": task,
                "response": response,
                "reference": reference,
                "expected": float(expected),
                "shape": shape,
                "choice": choice,
            }
        )

    # -- right answers in the plain forms each model writes --------------------------------------------------
    for final in ("#### 72", "#### 72\n", "#### $72", "#### 72.0", "#### 72 clips", "The answer is 72.\n#### 72"):
        add("gsm8k", rho(final), "72", 1, "rho:####")
    for final in ("#### 73", "#### 7", "#### 720", "#### -72", "The answer is 72.\n#### 27"):
        add("gsm8k", rho(final), "72", 0, "rho:wrong")
    for final in (
        "Therefore, the final answer is $\\boxed{8}$.",
        "**Final Answer**\n\\[\n\\boxed{8}\n\\]",
        "The answer is \\(\\boxed{8}\\).",
        "So there are \\boxed{8} left.",
        "\\boxed{8.0}",
        "Final answer: $\\boxed{\\dfrac{16}{2}}$",
    ):
        add("math", chat(final), "8", 1, "chat:boxed")
        add("gsm8k", chat(final), "8", 1, "chat:boxed")
    for final in ("Therefore, the final answer is $\\boxed{9}$.", "\\boxed{-8}", "\\boxed{80}"):
        add("math", chat(final), "8", 0, "chat:wrong")
    for final in ("The answer is \\boxed{\\frac{1}{2}}.", "\\boxed{0.5}", "So $x = \\boxed{\\tfrac12}$."):
        add("math", r1(final), "\\frac{1}{2}", 1, "r1:boxed")
    add("math", r1("\\boxed{\\frac{1}{3}}"), "\\frac{1}{2}", 0, "r1:wrong")
    add("aime24", r1("Thus the answer is \\boxed{033}."), "33", 1, "r1:boxed")
    add("aime24", r1("Thus the answer is \\boxed{133}.", steps=200), "33", 0, "r1:wrong")
    add("math500", r1("Thus the answer is \\boxed{2\\sqrt{2}}.", steps=200), "\\sqrt{8}", 1, "r1:long")
    for final, ref, exp in (
        ("Adding 5, 3 and 2 gives 10.", "10", 1),
        ("The sum of 5, 3 is 8.", "8", 1),
        ("The sum of 5, 3 and 2 is 10.", "10", 1),
        ("We add 3 and 2, and get 5", "5", 1),
        ("5 + 3 + 2 = 10", "10", 1),
        ("-3 + 7 - 1 = 3", "3", 1),
        ("First 12 - 4 = 8, then 8 + 6 = 14.", "14", 1),
        ("The result is 14.", "14", 1),
        ("14", "14", 1),
        ("Adding 5, 3 and 2 gives 11.", "10", 0),
        ("The sum of 5, 3 is 8.", "5", 0),
        ("The sum of 5, 3 is 8.", "3", 0),
        ("Adding 5, 3 and 2 gives 10.", "2", 0),
        ("We add 3 and 2, and get 5", "2", 0),
        ("5 + 3 + 2 = 10", "2", 0),
    ):
        add("rg:chain_sum", smol(final), ref, exp, "smol:prose")

    # -- the right answers that the old rule scored 0, and neighbours ------------------------------------
    for final, ref in (
        ("The answer is 20, 5 more than Tom's 15.", "20"),
        ("The answer is 20, 5 fewer than last year's 25.", "20"),
        ("The answer is 20, which is 5 more than 15.", "20"),
        ("The answer is 20 and 5 of them are red.", "20"),
        ("Answer: 36, 4 times Sam's 9.", "36"),
        ("So the answer is 7, 2 less than 9.", "7"),
    ):
        for wrap, task, shape in (
            (rho, "gsm8k", "rho:aside"),
            (chat, "gsm8k", "chat:aside"),
            (smol, "rg:chain_sum", "smol:aside"),
        ):
            add(task, wrap(final), ref, 1, shape)
    add("gsm8k", rho("The answer is 20, 5 more than Tom's 15."), "5", 0, "rho:aside")
    add("gsm8k", rho("The answer is 20, 5 more than Tom's 15."), "15", 0, "rho:aside")
    for final, ref in (
        ("Answer: 8 (not 7, 9).", "8"),
        ("Answer: 8 (not 7 or 9).", "8"),
        ("The answer is 8, not 7.", "8"),
        ("The answer is 8 rather than 7.", "8"),
        ("The answer is 8 instead of 7 or 9.", "8"),
        ("The answer is \\boxed{8}, not \\boxed{7}.", "8"),
        ("It is 8 (and not 9).", "8"),
    ):
        add("gsm8k", rho(final), ref, 1, "rho:rejected")
        add("math", chat(final), ref, 1, "chat:rejected")
    add("gsm8k", rho("Answer: 8 (not 7, 9)."), "7", 0, "rho:rejected")
    add("gsm8k", rho("Answer: 8 (not 7, 9)."), "9", 0, "rho:rejected")
    for final in (
        "The answer is 18. Actually, this took only 2 steps.",
        "The answer is 18. Actually, the problem needed 2 steps.",
        "#### 18\nWait, let me verify: 3 * 6 = 18. Correct.",
        "\\boxed{18}. Wait, I should check with 2 other ways.",
        "So the answer is 18. Hmm, that was 3 steps.",
        "The answer is 18. No other value works, since 2 * 9 = 18.",
    ):
        add("gsm8k", rho(final), "18", 1, "rho:cue-no-correction")
        add("math", r1(final), "18", 1, "r1:cue-no-correction")
    for final, ref, exp in (
        ("The answer is 72. Actually 73.", "73", 1),
        ("The answer is 72. Actually, it is 73.", "73", 1),
        ("The answer is 72. Actually, it is 73.", "72", 0),
        ("#### 72\nWait, no, 73.", "73", 1),
        ("\\boxed{72}. Oops, it should be \\boxed{73}.", "73", 1),
        ("\\boxed{72}. Oops, it should be \\boxed{73}.", "72", 0),
        ("The answer is 72. Hold on, 73.", "73", 1),
        ("The answer is 72. On second thought, 73.", "73", 1),
        ("The answer is 72. Sorry, it's 73.", "73", 1),
        ("The answer is 72. Actually, 72 or 73.", "72", 0),
    ):
        add("gsm8k", rho(final), ref, exp, "rho:correction")
    for final, ref in (
        ("The answer is 1/2 or 0.5.", "0.5"),
        ("The answer is 1/2 or 0.5.", "1/2"),
        ("The answer is 18 (or 18.0).", "18"),
        ("The answer is 0.25 (i.e. 1/4).", "0.25"),
        ("The answer is 3/4 (= 0.75).", "0.75"),
        ("The answer is 18 (or eighteen).", "18"),
        ("#### 1,200 (or 1200)", "1200"),
        ("\\boxed{\\frac{1}{2}} or equivalently 0.5", "0.5"),
        ("Answer: 50, or 50.0", "50"),
        ("$\\frac{3}{4}$ or $0.75$", "0.75"),
    ):
        add("gsm8k", rho(final), ref, 1, "rho:two-forms")
        add("math", chat(final), ref, 1, "chat:two-forms")
    add("gsm8k", rho("The answer is 1/2 or 0.6."), "0.5", 0, "rho:two-forms-differ")
    add("gsm8k", rho("The answer is 18 (or 19)."), "18", 0, "rho:two-forms-differ")
    add("math", chat("$\\frac{3}{4}$ or $0.7$"), "0.75", 0, "chat:two-forms-differ")
    long_open = "We try \\boxed{" + " then we reconsider the setup." * 10 + "\n"
    for ref, exp in (("8", 1), ("7", 0)):
        add("math", r1(long_open + "So the answer is \\boxed{8}."), ref, exp, "r1:abandoned-box")
        add("math", long_open * 3 + r1("\\boxed{8}", steps=150), ref, exp, "r1:abandoned-box")
        add(
            "gsm8k",
            chat("Let me write \\boxed{\n" + "Actually I'll compute first. 3 * 4 = 12.\n" * 5 + "\\boxed{8}"),
            ref,
            exp,
            "chat:abandoned-box",
        )
    add("math", "\\boxed{" + "1 " * 4500 + "8}", "8", 0, "r1:tail-cuts-box")
    add("math", "\\boxed{3} " + "x " * 5000 + "\\boxed{8}", "8", 1, "r1:box-before-tail")
    for final, ref, exp in (
        ("The roots are \\boxed{1} and \\boxed{2}.", "1,2", 1),
        ("The roots are \\boxed{1} and \\boxed{2}.", "\\{1,2\\}", 1),
        ("So $x = 1$ or $x = 2$, i.e. the solutions are 1 or 2.", "1,2", 1),
        ("The solutions are 1 or 2.", "1, 2", 1),
        ("The solutions are 2 or 1.", "1,2", 1),
        ("The primes are 2, 3, and 5.", "2,3,5", 1),
        ("The primes are \\boxed{2, 3, 5}.", "2,3,5", 1),
        ("The primes are \\boxed{5, 3, 2}.", "2,3,5", 1),
        ("\\boxed{1 \\text{ or } 2}", "1,2", 1),
        ("\\boxed{x=1 \\text{ or } x=2}", "1 \\text{ or } 2", 1),
        ("\\boxed{-2} and \\boxed{2}", "\\pm 2", 1),
        ("The roots are \\boxed{1} and \\boxed{3}.", "1,2", 0),
        ("The solutions are 1 or 2 or 3.", "1,2", 0),
        ("The solution is 1.", "1,2", 0),
        ("The primes are 2, 3.", "2,3,5", 0),
        ("\\boxed{2}", "\\pm 2", 0),
    ):
        add("math", chat(final), ref, exp, "chat:set")
    for final, ref in (("The roots are \\boxed{1} and \\boxed{2}.", "1"), ("The solutions are 1 or 2.", "2")):
        add("math", chat(final), ref, 0, "chat:set-scalar")
    add("gsm8k", rho("The answer is 2, 3, and 5."), "2", 0, "rho:list")
    add("gsm8k", rho("#### 1 or 2"), "1", 0, "rho:hedge-or")

    # -- hedges in every form, with neighbours: they must score 0 ----------------------------------------------
    joins = {
        "and": " and ",
        "space": " ",
        "newline": "\n",
        "or": " or ",
        "comma": ", ",
        "semicolon": "; ",
        "ampersand": " & ",
        "fullwidth-comma": "\uff0c",
        "ideographic-comma": "\u3001",
        "pipe": " | ",
        "fullwidth-pipe": " \uff5c ",
        "vs": " vs ",
        "vs.": " vs. ",
        "versus": " versus ",
        "logical-or": " \u2228 ",
        "range-dash": "\u2013",
        "tilde": "~",
        "or-zwsp": f" o{ZWSP}r ",
        "or-soft-hyphen": f" o{SHY}r ",
        "or-zwj": f" o{ZWJ}r ",
        "or-word-joiner": f" {WJ}or{WJ} ",
        "or-bom": f" o{BOM}r ",
        "or-cyrillic-o": f" {CYR_O}r ",
        "or-greek-omicron": f" {GREEK_O}r ",
        "or-fullwidth": f" {FW_O}{FW_R} ",
        "and-cyrillic-a": " \u0430nd ",
        "oder": " oder ",
        "ou": " ou ",
        "или": " \u0438\u043b\u0438 ",
        "或": " \u6216 ",
        "または": " \u307e\u305f\u306f ",
        "und": " und ",
        "и": " \u0438 ",
    }
    for name, join in joins.items():
        add("gsm8k", rho(f"The answer is 5{join}6."), "5", 0, f"rho:hedge-{name}")
        add("rg:chain_sum", smol(f"The answer is 5{join}6"), "6", 0, f"smol:hedge-{name}")
    for name in ("and", "space", "newline", "or", "comma", "pipe", "vs", "logical-or", "or-zwsp", "or-cyrillic-o"):
        add("gsm8k", rho(f"#### 5{joins[name]}6"), "5", 0, f"rho:####-hedge-{name}")
        add("rg:chain_sum", smol(f"5{joins[name]}6"), "5", 0, f"smol:bare-hedge-{name}")
    for final in ("The answer is:\n5\n6", "Answer:\n5\n6\n", "The answer is:\n\n5\n6", "The answer is 5\n6"):
        add("gsm8k", rho(final), "5", 0, "rho:hedge-lines")
        add("gsm8k", rho(final), "6", 0, "rho:hedge-lines")
    for box in (
        "5 \\lor 6",
        "5 \\vee 6",
        "5 \\text{ or } 6",
        "5 \\text{or} 6",
        "5 \\textrm{ or } 6",
        "5 \\mbox{ or } 6",
        "5 \\text{ and } 6",
        "5, 6",
        "5; 6",
        "5 \\quad 6",
        "5 \\mid 6",
        "5 | 6",
        "5 \u2228 6",
        "5 or 6",
        "5 \\\\ 6",
        "5 & 6",
        "5 6",
        f"5 \\text{{o{ZWSP}r}} 6",
        f"5 \\text{{ {CYR_O}r }} 6",
    ):
        add("math", chat(f"The final answer is $\\boxed{{{box}}}$."), "5", 0, "chat:box-hedge")
        add("gsm8k", r1(f"\\boxed{{{box}}}"), "6", 0, "r1:box-hedge")
    for final in (
        "\\boxed{5} or \\boxed{6}",
        "\\boxed{5}, \\boxed{6}",
        "\\boxed{5} \\boxed{6}",
        "\\boxed{5} and \\boxed{6}",
        "\\boxed{5} then \\boxed{6}",
        "$\\boxed{5}$ vs $\\boxed{6}$",
        "\\boxed{5} or 6",
        "\\boxed{5}, or maybe 6.",
    ):
        add("math", chat(final), "5", 0, "chat:two-boxes")
        add("math", chat(final), "6", 0, "chat:two-boxes")
    for final, ref in (
        ("The answer is 5 or six.", "5"),
        ("The answer is five or 6.", "6"),
        ("The answer is 5 or twenty-one.", "5"),
        ("The answer is 5, or maybe six.", "5"),
        ("The answer is 5 apples/6 apples.", "6"),
        ("The answer is either 5 or 6.", "5"),
        ("The answer is probably 5 or 6.", "6"),
        ("The answer is 5 (or 6).", "5"),
        ("The answer is 5 (or 6 if we count Tom).", "5"),
        ("The answer is 5, or 6 if we count Tom.", "5"),
        ("The answer is 5 and 6 apples.", "5"),
        ("The answer is 5-6.", "5"),
        ("The answer is between 5 and 6.", "5"),
        ("It could be 5 or 6.", "5"),
        ("$5$ or $6$", "5"),
        ("$\\frac{1}{2}$ or $\\frac{1}{3}$", "1/2"),
        ("The answer is 5 or 6 or 7.", "7"),
        ("#### 5\n#### 6 or 5", "5"),
    ):
        add("gsm8k", rho(final), ref, 0, "rho:hedge-words")
    for final, ref in (
        (f"The answer is 5{ZWSP}6.", "5"),
        (f"The answer is 5{ZWSP}6.", "6"),
        (f"#### 5{SHY}6", "5"),
        (f"\\boxed{{5{ZWSP}6}}", "6"),
        (f"The answer is 5{LRM}6.", "5"),
        (f"The answer is 5 {CYR_O}r 6.", "5"),
        (f"The answer is 5 o{ZWSP}r 6.", "6"),
    ):
        add("gsm8k", rho(final), ref, 0, "rho:hidden")
    # hidden characters that hide nothing: outside a value, a right answer stays right
    for final in (f"The answer is 72.{ZWSP}", f"{ZWSP}#### 72", f"The an{SHY}swer is 72.", f"The answer is{ZWSP} 72."):
        add("gsm8k", rho(final), "72", 1, "rho:hidden-harmless")

    # -- what was right before stays right ----------------------------------------------------------------------
    for final, ref in (
        ("The answer is 72 or so.", "72"),
        ("It is 3 or 4 boxes of 2, so 8 in all.\n#### 8", "8"),
        ("Since x = 3 or x = 5 and x > 4, the answer is \\boxed{5}.", "5"),
        ("The answer is 1,000.", "1000"),
        ("It costs $12,345,678 in all.", "12345678"),
        ("The answer is 7, since 3 + 4 = 7.", "7"),
        ("x = 3, y = 4, and the answer is 7", "7"),
        ("The answer is \\boxed{33} = \\boxed{ 33 }.", "33"),
        ("The answer is 73.\n#### 72", "72"),
        ("#### 72\nThe answer is 73.", "73"),
        ("Total is $1,234.", "1234"),
        ("The answer is:\n\n**72**", "72"),
        ("**Final Answer:** **72**", "72"),
        ("The answer is 3/4.", "0.75"),
        ("The answer is 2.5e3.", "2500"),
        ("She has 5 apples and 3 pears, so 8 fruits.", "8"),
        ("The answer is 8 dollars.", "8"),
        ("The answer is $8.", "8"),
        ("The answer is 8%.", "8"),
        ("The answer is six.", "6"),
        ("The answer is twenty-one apples.", "21"),
    ):
        add("gsm8k", rho(final), ref, 1, "rho:kept")
    for final, ref in (
        ("\\boxed{(1,2)}", "(1,2)"),
        ("The answer is $[1, 2]$.", "[1,2]"),
        ("\\boxed{\\{3,1,2\\}}", "\\{1,2,3\\}"),
    ):
        add("math", chat(final), ref, 1, "chat:kept-collection")
    add(
        "math",
        chat("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}"),
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        1,
        "chat:kept-collection",
    )
    add("math", chat("\\boxed{|x-1|}"), "|x-1|", 1, "chat:kept-abs")
    add("math", chat("\\boxed{(-\\infty,3)}"), "(-\\infty,3]", 0, "chat:kept-collection")
    add("gsm8k", rho("The answer is 7, 10."), "7", 0, "rho:list")
    add("gsm8k", rho("7&10&2&5&8"), "7", 0, "rho:list")
    add("math", chat("\\boxed{7, 10}"), "7", 0, "chat:list")

    # -- responses whose reward the rule changed in tools/identical_outputs.sh's spo_chain run (smollm2-135m,
    #    rg:chain_sum, seed 3: Monte-Carlo continuations of "2 - 1"): none states an answer; the previous rule read
    #    the last number, which happened to be the reference ----------------------------------------------------
    for response in (
        (
            "To solve this arithmetic problem, let's break it down step by step. We have two numbers, "
            "2 and 1, which we want to find their"
        ),
        "Step 1: 2 - 1 = 1\nThe initial answer 1 is the result of the subtraction operation.\n\nStep 2:",
        "Step 1: 2 - 1 = 1\nThe answer is a simple subtraction of two numbers.\n\nStep 2: 1 +",
        (
            "To solve this arithmetic problem, let's break it down step by step. We have two numbers, "
            "2 and 1, and we want to find their"
        ),
        (
            "To solve this arithmetic problem, let's break it down step by step. We have two numbers, "
            "2 and 1. We want to find out how"
        ),
        "To solve this arithmetic problem, let's break it down step by step. We have 2 and 1. So we can add 2 and 1",
        (
            "To solve this arithmetic problem, let's break it down step by step.\n\nWe have two numbers: "
            "2 and 1. We want to find"
        ),
        "Let's break down the problem:\n2 - 1 = 2\n1 = 1\n\nThis is the final answer.",
        (
            "Let's break down the problem:\n\nWe are given an equation with two variables:\n2 - 1 = \nTo "
            "solve for the variable "
        ),
        (
            "Let's break down the problem:\n\nWe are given an equation with two variables:\n2 - 1 = \nTo "
            "solve this equation, we"
        ),
    ):
        add("rg:chain_sum", response, "1", 0, "smol:no-answer")

    # -- documented choices: a careful grader could score these either way; labelled by the rule -----------------
    for task, response, ref, exp in (
        ("gsm8k", rho("The answer is 5 apples or 6 apples."), "5", 0),  # two values: a hedge
        ("math", chat("x = 1 or x = 2"), "1", 0),  # a scalar reference: two values
        ("gsm8k", rho("The answer is 10 000."), "10000", 0),  # a space never groups digits: two values
        ("gsm8k", rho("The answer is 0,5."), "0.5", 0),  # a decimal comma reads as a list
        ("gsm8k", rho(f"The answer is 5{ZWSP}6."), "56", 0),  # a format character inside a value
        ("math", chat("\\boxed{5 6}"), "56", 0),  # two numbers side by side in a box
        ("math", chat("\\boxed{3} then \\boxed{5}"), "5", 0),  # the boxes of one sentence are one run
        ("gsm8k", rho("The answer is 8 hours and 30 minutes."), "8.5", 0),  # two values joined by "and"
        ("gsm8k", rho("The answer is 20, 5 more."), "20", 0),  # a list item that no words follow stays in the run
        ("gsm8k", rho("The answer is 5 and 6 more than Tom."), "5", 1),  # a list item that words follow is an aside
        ("gsm8k", rho("#### 5\n3 steps were needed."), "5", 1),  # after a line break, words make it an aside
        ("gsm8k", rho("The answer is \uff15."), "5", 0),  # a full-width digit: math-verify reads no number
    ):
        add(task, response, ref, exp, "choice", choice=True)
    return out


def math_verify_alone(rows: list[dict]) -> list[float]:
    """math-verify on each whole response (the same parse and verify the workers run, no final-answer rule)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plumbing import grading, tasks

    scores = []
    for row in rows:
        numeric = tasks.answer_kind(row["task"]) == "numeric"
        try:
            scores.append(grading._grade_item((row["response"],), row["reference"], numeric))
        except Exception:
            scores.append(0.0)
    return scores


if __name__ == "__main__":
    rows = cases()
    old = {}
    if PATH.exists():
        old = {(r["task"], r["response"], r["reference"]): r.get("math_verify") for r in map(json.loads, PATH.open())}
    if "--math-verify" in sys.argv:
        for row, score in zip(rows, math_verify_alone(rows)):
            row["math_verify"] = score
    else:
        for row in rows:
            row["math_verify"] = old.get((row["task"], row["response"], row["reference"]))
    with PATH.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} cases, {sum(r['choice'] for r in rows)} documented choices -> {PATH}")
