"""The final-answer rule: which values of a model's response grading.grade() checks against the reference, in one rule
for every task (numeric and expression answers alike), read from the response's last TAIL_CHARS characters.

1. The answer is the run of values after the last marker: a closed \\boxed{...}, a "####", an "answer is" (or
   "answer:", "answer =", "answer would be"), or a correction: actually, wait, no, nope, oops, sorry, correction,
   hold on, I mean or on second thought at the start of a clause, followed by a value at once or after a few words
   such as "it is" ("Actually, this took 2 steps" corrects nothing). With no marker, the answer is the tail's last run.
2. A run is values joined by alternatives ("or", "vs", "|", "∨", \\lor, \\vee, "/" between words, a range dash "–" or
   "~") or by list separators (",", ";", "and", "&", "\\\\", a line break, a space between two numbers). A value is
   a number ("1,234" is one), an equation's right side ("x = 5" is 5), a $...$ span, a box's content split at the
   same separators, or a number word ("five"; without a marker only when a separator joins it to another
   value); it may carry one word ("5 apples"). "(or 0.5)" and
   "(i.e. 0.5)" continue the run; "not 7", "(not 7, 9)", "rather than 7" and "instead of 7" are dropped. A list item
   that more words follow ("20, 5 more than Tom's 15", "3 and 2 gives") leaves the run; an alternative never does.
   The boxes of the last box's sentence all belong to its run ("\\boxed{3} then \\boxed{5}" is 3 and 5).
3. The answer scores 1 when every value of its run equals the reference (math-verify decides, in the sandboxed
   worker): "1/2 or 0.5" is one value in two forms, "5 and 6" a hedge and "7, 10" a list, which score 0. On math
   tasks a set reference ("1,2", "\\{1,2\\}", "\\pm 2") is answered by its elements in any order ("1 or 2").
4. What hides is read for what it shows: format characters (zero-width space, soft hyphen, bidi marks) are ignored
   and letters from other scripts that look Latin (Cyrillic "о") read as Latin when markers and separators are found,
   but math-verify reads each value as written, and a value with a format character inside ("5<ZWSP>6") scores 0.
5. A \\boxed{ that begins before the graded tail and closes inside it scores 0; one never closed is no box.

    >>> answer_values("The answer is 20, 5 more than Tom's 15.")
    ('20',)
    >>> answer_values("Answer: 1/2 (or 0.5), not 0.4.")  # the worker checks that both equal the reference
    ('1/2', '0.5')
    >>> answer_values(r"so the roots are \\boxed{1} and \\boxed{2}")
    ('\\\\boxed{1}', '\\\\boxed{2}')

This part runs in the training process (grading.grade(), before the sandboxed workers get the values): no timeout
covers it, so it is a few passes of linear-time patterns (none with nested quantifiers) and loops that move one way.
It tokenizes the tail's end first (windows of growing size that start where the whole tail's tokens break too) and
reads further back only when the rule would look before the window (_NeedMore), so the answer is the same as read on
the whole tail, at a fraction of the cost. It imports nothing of the project and no torch.
"""

from __future__ import annotations

import bisect
import re
import unicodedata

TAIL_CHARS = 8000  # only the end of a response is graded

# ----------------------------------------------------------------------------------------------
# Hidden characters: the detection text drops format characters and reads look-alike letters as Latin.

_HIDDEN_RE = re.compile(  # Unicode's format characters (Cf), variation selectors, the combining grapheme joiner
    "[\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f"
    "\ufe00-\ufe0f\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]"
)
# Letters of other scripts that look like the Latin letters of a connective ("or", "and", "vs"); NFKC covers
# full-width and mathematical letters but not these.
_LOOKALIKES = dict(zip("аАеЕоОрРсСуУхХѕЅԁіІјЈոսνοΟαɑ", "aAeEoOpPcCyYxXsSdiIjJnuvoOaa"))
_LOOKALIKES.update({"、": ",", "，": ",", "；": ";", "｜": "|", "\u2212": "-"})


class _Lookalike(dict):
    """str.translate's table for the detection text: one character for one, so positions stay put."""

    def __missing__(self, code: int):
        char = chr(code)
        plain = _LOOKALIKES.get(char) or unicodedata.normalize("NFKC", char)
        self[code] = plain if len(plain) == 1 and plain.isascii() and not plain.isdigit() else char
        return self[code]


_TRANSLATE = _Lookalike()
_NON_ASCII_RE = re.compile(r"[^\x00-\x7f]+")

# ----------------------------------------------------------------------------------------------
# Patterns. Each alternative is a plain sequence or a single repeated class: linear on any text.

_BRACE_RE = re.compile(r"[\\{}]")  # a brace, or a backslash: "\\boxed{" or an escape such as "\\{"
_BOX_OPEN_RE = re.compile(r"\\boxed\s*\{")
_MATH_DELIM_RE = re.compile(r"\\\$|\$\$|\$|\\\[|\\\]|\\\(|\\\)")
_TOKEN_RE = re.compile(  # the kinds the rule reads are named; spaces, markdown and other marks are not
    r"[^\S\n]\s*"  # first, as the commonest: a space (and any line breaks after it, which it hides)
    r"|(?P<abbr>(?i:i\.e\.|e\.g\.|vs\.))"
    r"|(?P<word>[^\W\d_]+(?:['’-][^\W\d_]+)*)"
    r"|(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+(?!\w|[.,]\d))?)"
    r"|(?P<hash>####)"
    r"|(?P<para>\n[ \t]*\n\s*)"
    r"|(?P<nl>\n)"
    r"|(?P<end>[.!?]+(?=\s|$))"
    r"|(?P<sep>\\\\|[,;&|∨⋁–~])"
    r"|(?P<lpar>\()|(?P<rpar>\))|(?P<colon>:)"
    r"|\*\*+|__+"
    r"|(?P<op>[-+*/×÷·^=≈<>≤≥])"
    r"|\\[a-zA-Z]+\*?|\\.|.",
    re.DOTALL,
)
_LATEX_RE = re.compile(  # inside a box or a $...$ span
    r"(?P<open>\\begin\{[^{}]*\}|\\left\W|\\\{|[{(\[])"
    r"|(?P<close>\\end\{[^{}]*\}|\\right\W|\\\}|[})\]])"
    r"|(?P<text>\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{[^{}]*\})"
    r"|(?P<sep>\\\\|\\(?:lor|vee|quad|qquad|mid)(?![a-zA-Z])|[,;&|∨⋁–]|\b[^\W\d_]+\b)"
    r"|(?P<space>\s+)"
    r"|\\[a-zA-Z]+|\\.|.",
    re.DOTALL,
)

_ALTERNATIVES = {"or", "vs", "vs.", "versus", "|", "∨", "⋁", "–", "~", "lor", "vee", "mid", "either", "else"}
_ALTERNATIVES |= {"oder", "ou", "или", "либо", "或", "或者", "还是", "または", "あるいは", "또는", "혹은", "hoặc"}
_ALTERNATIVES |= {"atau", "veya", "eller", "lub", "albo", "nebo", "vagy", "ή", "oppure"}
_LIST_WORDS = {"and", "und", "et", "и", "和", "与", "及", "と", "그리고", "và", "dan", "ve", "og", "és"}
_NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
        " seventeen eighteen nineteen".split()
    )
}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_CUES = {"actually", "wait", "no", "nope", "oops", "sorry", "correction"}
_CUE_PAIRS = {("hold", "on"), ("i", "mean"), ("second", "thought")}  # "on second thought": its last two words
_CUE_PAIR_ENDS = {second for _, second in _CUE_PAIRS}
_CORRECTION_FILLER = {"it", "it's", "its", "is", "that", "that's", "should", "be", "make", "must", "the"}
_HEDGE_FILLER = {"maybe", "perhaps", "possibly", "probably", "even", "also", "alternatively", "equivalently", "just"}
_CORRECTION_FILLER |= {"total", "result", "final", "would", "so", "get", "i", "answer", "then"}
_ANSWER_VERBS = {"is", "are", "was", "be", "would", "should", "will", "must", "comes", "equals"}
_NEGATIONS = {"not", "rather", "instead"}  # "not 7", "rather than 7", "instead of 7"
_SAME_VALUE = {"or", "i.e.", "ie", "that", "equivalently"}  # "18 (or 18.0)", "1/2 (i.e. 0.5)"
_CLAUSE_ENDS = {"end", "para", "nl", "sep", "colon", "rpar", "eof"}
_FILLER_WORDS = 8  # words an "answer is" may skip before its value ("is therefore", "is that she has")


def _braces(text: str, start: int, stop: int):
    """The braces of text[start:stop] as (kind, position, where a box's content starts): "{", "}" or "box" (a
    "\\boxed{"); a backslash escapes the character after it."""
    pos = start
    while found := _BRACE_RE.search(text, pos, stop):
        at = found.start()
        if text[at] != "\\":
            yield text[at], at, 0
            pos = at + 1
        elif box := _BOX_OPEN_RE.match(text, at, stop):
            yield "box", at, box.end()
            pos = box.end()
        else:
            pos = at + 2


def _boxes(text: str, start: int = 0, stop: int | None = None) -> list[tuple[int, int, int]]:
    """The closed \\boxed{...} of text[start:stop] as (start, content start, closing brace); one pass with a stack."""
    found, stack = [], []  # stack: (where its \boxed begins, or -1; where its content starts)
    for kind, at, content in _braces(text, start, len(text) if stop is None else stop):
        if kind == "}":
            if stack:
                box_start, content = stack.pop()
                if box_start >= 0:
                    found.append((box_start, content, at))
        else:
            stack.append((at, content) if kind == "box" else (-1, 0))
    return sorted(found)


def _all_boxes(det: str) -> list[tuple[int, int, int]]:
    """_boxes(det), scanning from the first "\\boxed" (the braces before it close no box and open none that counts)."""
    first = det.find("\\boxed")
    if first < 0:
        return []
    return _boxes(det, first if first == 0 or det[first - 1] != "\\" else 0)  # "\\\\boxed" is no box: scan all


def _math_spans(text: str, boxes: list) -> list[tuple[int, int, int, int]]:
    """The $...$, $$...$$, \\(...\\) and \\[...\\] spans as (start, content start, content end, end). A single "$"
    opens only before a non-space and closes only after one and before no digit, so "$5 and $6" is money."""
    firsts = [i for i in (text.find("$"), text.find("\\("), text.find("\\[")) if i >= 0]
    if not firsts:
        return []
    spans, opened = [], None  # opened: (delimiter, its start, its end)
    closers = {"$$": "$$", "\\[": "\\]", "\\(": "\\)", "$": "$"}
    for delim in _MATH_DELIM_RE.finditer(text, max(0, min(firsts) - 1)):  # from the first delimiter (or its "\\")
        piece, a, b = delim.group(), delim.start(), delim.end()
        if piece == "\\$":
            continue
        if opened is not None and opened[0] == "$" and text.find("\n", opened[2], a) >= 0:
            opened = None  # a line break ends a "$" span that is still open
        if opened is None:
            if piece in closers and (piece != "$" or b < len(text) and not text[b].isspace()):
                opened = (piece, a, b)
        elif piece == closers[opened[0]]:
            closes = piece != "$" or not text[a - 1].isspace() and not (b < len(text) and text[b].isdigit())
            if closes:
                spans.append((opened[1], opened[2], a, b))
                opened = None
            elif b < len(text) and not text[b].isspace():  # "$5 costs ... $\frac12$": this "$" opens instead
                opened = (piece, a, b)
    # a span that holds a box is no atom: its box is the answer, its delimiters are markup
    box_starts = [box[0] for box in boxes]
    return [s for s in spans if bisect.bisect_right(box_starts, s[0]) == bisect.bisect_left(box_starts, s[3])]


def _latex_pieces(det: str, a: int, b: int) -> list[tuple[int, int]]:
    """det[a:b] (a box's or a math span's content) split at its top-level separators; whole if a piece is empty."""
    pieces, depth, last = [], 0, a
    for token in _LATEX_RE.finditer(det, a, b):
        kind = token.lastgroup
        if kind == "open":
            depth += 1
        elif kind == "close":
            depth -= depth > 0
        elif depth == 0 and kind in ("sep", "text", "space"):
            piece = token.group()
            if kind == "text":
                word = piece[piece.index("{") + 1 : -1].strip().lower()
                split = word in _ALTERNATIVES or word in _LIST_WORDS or word in (",", ";", "")
                split = split and word != ""  # "\text{ }" is a space
            elif kind == "space":  # two numbers side by side: "5 6" (math-verify reads 5 + 6)
                split = token.start() > a and det[token.start() - 1].isdigit() and det[token.end() : b][:1].isdigit()
            elif piece == ",":  # "1,000" is one number
                split = not re.match(r"\d{3}(?!\d)", det[token.end() : b]) or not det[token.start() - 1].isdigit()
            elif piece[:1].isalpha():
                split = piece.lower() in _ALTERNATIVES or piece.lower() in _LIST_WORDS
            else:  # \lor, \vee, \quad, \mid, \\, ;, &, |, ∨, –
                split = True
            if split:
                pieces.append((last, token.start()))
                last = token.end()
    pieces.append((last, b))
    if len(pieces) > 1 and not all(re.search(r"\w", det[s:e]) for s, e in pieces):
        return [(a, b)]  # "|x|" is an absolute value, "5, " one value
    return [(s, e) for s, e in pieces]


class _NeedMore(Exception):
    """Raised when a window of the tail does not settle the answer: the reader reads a larger one."""


class _Unread:
    """Stands for a token before the window: reading it means the window is too small."""

    __slots__ = ()

    def __getitem__(self, key):
        raise _NeedMore

    def __iter__(self):
        raise _NeedMore


_UNREAD = [_Unread()] * 4  # a look back reaches at most three tokens before the one it starts from
_WINDOWS = (48, 160, 1000, 4000)  # characters read first (then the whole tail); speed only, the answer is the same
_CUT_RE = re.compile(r"[^\s\\]\s")  # a window starts at the space of this pair
_HINT_WORDS = ("####", "\\boxed", "answer", "actually", "wait", "nope", "oops", "sorry", "correction", "hold", "mean")
_HINT_WORDS += ("thought",)  # with "no": every marker's word (a cue pair's first or last), lowercase
_NO_RE = re.compile(r"no(?![^\W\d_])")


def _may_mark(det: str, stop: int) -> bool:
    """Whether det[:stop] may hold a marker (a superset: a marker's word, "no" after no letter)."""
    low = det[:stop].lower()
    return any(word in low for word in _HINT_WORDS) or any(
        m.start() == 0 or not low[m.start() - 1].isalpha() for m in _NO_RE.finditer(low)
    )


class _Tail:
    """A response's tail: its detection text (hidden characters dropped, look-alikes read as Latin) and the atoms
    (boxes and math spans) that the tokens take whole."""

    def __init__(self, text: str):
        self.text = text
        self.at = None  # det position -> text position, where hidden characters were dropped
        if not text.isascii():  # every hidden character and every look-alike is outside ASCII
            hidden = [m.start() for m in _HIDDEN_RE.finditer(text)]
            if hidden:
                self.at, kept = [], 0
                for position in hidden:
                    self.at += range(kept, position)
                    kept = position + 1
                self.at += range(kept, len(text) + 1)
                text = _HIDDEN_RE.sub("", text)
            text = _NON_ASCII_RE.sub(lambda m: m.group().translate(_TRANSLATE), text)  # ASCII reads as itself
        det = self.det = text
        outer, reach = [], -1
        for box in _all_boxes(det):
            if box[0] >= reach:
                outer.append(box)
                reach = box[2] + 1
        atoms = [("box", s, c, e, e + 1) for s, c, e in outer]
        atoms += [("math", s, c, ce, e) for s, c, ce, e in _math_spans(det, outer)]
        self.atoms, pos = [], 0  # those the tokens take: none overlaps an earlier one
        for atom in sorted(atoms, key=lambda atom: atom[1]):
            if atom[1] >= pos:
                self.atoms.append(atom)
                pos = atom[4]
        self.atom_starts = [atom[1] for atom in self.atoms]
        self.pieces = {}  # an atom's start -> its values (_Reader._value)

    def windows(self):
        """Where the readers of growing windows start, then 0 (the whole tail): after each size in _WINDOWS, the first
        space or line break at which the whole tail's tokens break too (after a character that no space or backslash
        token takes: the token before it ends there) outside every atom."""
        det, last = self.det, len(self.det)
        for size in _WINDOWS:
            cut = self._cut(len(det) - size)
            if 0 < cut < last:
                yield cut
                last = cut
        yield 0

    def _cut(self, at: int) -> int:
        """The first cut at or after `at`, or 0 if there is none."""
        while at > 0:
            found = _CUT_RE.search(self.det, at - 1)
            if found is None:
                return 0
            cut = found.end() - 1
            i = bisect.bisect_left(self.atom_starts, cut)
            if i == 0 or self.atoms[i - 1][4] <= cut:
                return cut
            at = self.atoms[i - 1][4]  # inside an atom: look after it
        return 0


class _Reader:
    """The tokens of a tail from a window's start on, and the runs of values they hold. Before the window stand
    _Unread tokens: the rule reads the same tokens as on the whole tail, or raises _NeedMore."""

    def __init__(self, tail: _Tail, start: int = 0):
        self.text, self.at, self.det, self.pieces = tail.text, tail.at, tail.det, tail.pieces
        self.tokens = [] if start == 0 else list(_UNREAD)  # (kind, start, end, lowercase text or the atom's content)
        self.first, self.start = len(self.tokens), start
        pos = start
        for kind, s, c, ce, e in tail.atoms[bisect.bisect_left(tail.atom_starts, start) :]:
            self._tokenize(pos, s)
            self.tokens.append((kind, s, e, (c, ce)))
            pos = e
        self._tokenize(pos, len(self.det))
        self.tokens.append(("eof", len(self.det), len(self.det), ""))

    def _tokenize(self, a: int, b: int) -> None:
        self.tokens += [
            (m.lastgroup, m.start(), m.end(), m.group().lower())
            for m in _TOKEN_RE.finditer(self.det, a, b)
            if m.lastgroup
        ]

    def original(self, a: int, b: int) -> str:
        """The response's own text of det[a:b] (hidden characters included)."""
        return self.text[a:b] if self.at is None else self.text[self.at[a] : self.at[b - 1] + 1]

    # -- values ---------------------------------------------------------------------------------

    def _is_word(self, i: int, words) -> bool:
        return self.tokens[i][0] in ("word", "abbr") and self.tokens[i][3] in words

    def _value(self, i: int, after_separator: bool) -> tuple[list[str], int] | None:
        """The value that starts at token i: its texts (a box or span may hold several) and the token after it."""
        kind, start, end, body = self.tokens[i]
        if kind in ("box", "math"):
            if start not in self.pieces:  # shared by the windows' readers
                wrap = "\\boxed{%s}" if kind == "box" else "$%s$"
                self.pieces[start] = [wrap % self.original(s, e) for s, e in _latex_pieces(self.det, *body)]
            return self.pieces[start], i + 1
        if kind == "word" and after_separator:
            parts = body.split("-")
            if len(parts) == 1 and body in _NUMBER_WORDS or body in _TENS:
                return [str(_NUMBER_WORDS.get(body, _TENS.get(body)))], i + 1
            if len(parts) == 2 and parts[0] in _TENS and parts[1] in _NUMBER_WORDS and 0 < _NUMBER_WORDS[parts[1]] < 10:
                return [str(_TENS[parts[0]] + _NUMBER_WORDS[parts[1]])], i + 1
        # an expression: operands (numbers, single letters, spans) joined by operators; its value is after the last "="
        j, value_from, operands = i, start, 0
        while True:
            sign = (
                self.tokens[j][0] == "op" and self.tokens[j][3] in "-+" and self.tokens[j + 1][1] == self.tokens[j][2]
            )
            k = j + sign
            kind_k, start_k, _, body_k = self.tokens[k]
            letter = kind_k == "word" and len(body_k) == 1 and self.tokens[k + 1][0] == "op"
            if not (kind_k in ("num", "box", "math") or letter):
                break
            operands += 1
            j = k + 1
            op = self.tokens[j]
            operand = self.tokens[j + 1] if op[0] == "op" else None
            if operand is None or operand[0] not in ("num", "word", "box", "math") and operand[3] not in ("-", "+"):
                break
            if op[3] in "=≈":
                value_from = self.tokens[j + 1][1]
            j += 1
        if not operands or value_from >= self.tokens[j - 1][2]:
            return None
        if self.tokens[j - 1][0] in ("box", "math") and self.tokens[j - 1][1] == value_from:
            return self._value(j - 1, False)[0], j
        return [self.original(value_from, self.tokens[j - 1][2])], j

    def run(self, i: int, negations: bool = True, word: bool = False) -> tuple[list[str], int, list[str]]:
        """The run of values that starts at token i (rule 2; with word=True it may start with a number word); the token
        after the stretch read; and the last item that left the run as an aside ("5" of "20, 5 more than"), if any."""
        first = self._value(i, word)
        if first is None:
            return [], i, []
        items = [(first[0], "first")]  # (texts, how it was joined)
        j = first[1]
        connectives = _ALTERNATIVES | _LIST_WORDS
        while True:
            kind, _, _, body = self.tokens[j]
            if kind == "word" and body not in connectives | _NEGATIONS and self._value(j, True) is None:
                j += 1  # one word that belongs to the value: "5 apples"
            negated = self._negation(j) if negations else None
            if negated is not None:
                j = negated
                break
            joined, k = None, j
            while True:  # the separators between this item and the next: ", and", "(or", "\n"
                kind, _, _, body = self.tokens[k]
                if kind in ("sep", "nl") or kind in ("word", "abbr") and (body in connectives or body == "vs."):
                    alternative = body in _ALTERNATIVES or body == "vs."
                    joined = "alternative" if alternative or joined == "alternative" else "list"
                    k += 1
                elif kind == "op" and body == "/" and self.tokens[k - 1][0] == "word":
                    joined, k = "alternative", k + 1  # "5 apples/6 apples"
                elif kind == "lpar" and (self._is_word(k + 1, _SAME_VALUE) or self.tokens[k + 1][3] == "="):
                    joined, k = "form", k + 2 + self._is_word(k + 2, {"is"})
                else:
                    break
            if joined is None and self.tokens[k][0] == "num" and self.tokens[k - 1][0] == "num":
                if "\n" not in self.det[self.tokens[k - 1][2] : self.tokens[k][1]]:
                    joined = "list"  # "5 6"
            while joined == "alternative" and self._is_word(k, _HEDGE_FILLER):
                k += 1  # "5, or maybe 6"
            value = self._value(k, True) if joined else None
            if value is None:
                break
            items.append((value[0], joined))
            j = value[1] + (joined == "form" and self.tokens[value[1]][0] == "rpar")
        kind, _, _, body = self.tokens[j]
        aside = []
        if kind not in _CLAUSE_ENDS and not (kind == "word" and body in connectives):
            while len(items) > 1 and items[-1][1] == "list":  # "20, 5 more than Tom's 15": an aside, not a list
                aside = aside or items[-1][0]
                items.pop()
        return [text for texts, _ in items for text in texts], j, aside

    def _negation(self, j: int) -> int | None:
        """Past the rejected values that start at token j ("not 7", "(not 7, 9)", "rather than 7"), if any."""
        k = j + (self.tokens[j][0] == "sep" and self.tokens[j][3] == ",")
        paren = self.tokens[k][0] == "lpar"
        k += paren
        k += self._is_word(k, {"and", "but"}) and self._is_word(k + 1, {"not"})  # "(and not 9)"
        if self._is_word(k, {"rather", "instead"}) and self._is_word(k + 1, {"than", "of"}):
            k += 1
        elif not self._is_word(k, {"not"}):
            return None
        values, k, _ = self.run(k + 1, negations=False)
        if not values:
            return None
        while paren and self.tokens[k][0] not in ("rpar", "eof", "end", "para"):
            k += 1
        return k + (paren and self.tokens[k][0] == "rpar")

    # -- markers --------------------------------------------------------------------------------

    def _negated(self, i: int) -> bool:
        return (
            self._is_word(i - 1, {"not", "than"}) or self._is_word(i - 1, {"of"}) and self._is_word(i - 2, {"instead"})
        )

    def _clause_start(self, i: int) -> bool:
        return i == 0 or self.tokens[i - 1][0] in ("end", "para", "nl", "sep", "colon", "lpar")

    def markers(self):
        """(token index, where its run may start) of every marker, last to first."""
        tokens = self.tokens
        for i in range(len(tokens) - 1, self.first - 1, -1):
            kind, _, _, body = tokens[i]
            if kind == "box" and not self._negated(i):
                yield i, i
            elif kind == "hash":
                yield i, i + 1
            elif kind == "word" and body in ("answer", "answers"):
                nxt = tokens[i + 1]
                if (
                    nxt[0] == "colon"
                    or nxt[0] == "op"
                    and nxt[3] == "="
                    or nxt[0] == "word"
                    and nxt[3] in _ANSWER_VERBS
                ):
                    yield i, i + 1
            elif kind == "word" and (body in _CUES and self._clause_start(i) or self._cue_pair(i)):
                yield i, -(i + 1)  # a correction: its value must follow at once

    def _cue_pair(self, i: int) -> bool:
        if self.tokens[i][3] not in _CUE_PAIR_ENDS:  # read no token before i when none can pair with it
            return False
        pair = (self.tokens[i - 1][3], self.tokens[i][3]) if i > 0 else None
        return pair in _CUE_PAIRS and self._clause_start(i - 1 - (pair == ("second", "thought")))

    def value_start(self, i: int, correction: bool) -> int | None:
        """The first token of the value a marker states, starting the search at token i."""
        words = 0
        while True:
            kind, _, _, body = self.tokens[i]
            if self._value(i, True) is not None:
                return i
            if kind in ("colon", "sep") or kind == "op" and body == "=" or kind == "end" and correction and words == 0:
                i += 1
            elif kind in ("nl", "para") and words == 0 and not correction:
                i += 1
            elif kind == "word" and words < (3 if correction else _FILLER_WORDS):
                if correction and body not in _CORRECTION_FILLER:
                    return None
                words += 1
                i += 1
            else:
                return None

    def sentence_boxes(self, i: int) -> list[str]:
        """The values of the boxes before box i in its sentence (not those rejected by "not")."""
        found = []
        for k in range(i - 1, self.first - 1, -1):
            kind, _, _, body = self.tokens[k]
            if kind in ("end", "para", "nl") or kind == "word" and body in _CUES:
                return found
            if kind == "box" and not self._negated(k):
                found = self._value(k, False)[0] + found
        if self.start and self.det.find("\\boxed", 0, self.start) >= 0:
            raise _NeedMore  # the sentence may hold a box before the window
        return found


def _cut_box(response: str, cut: int) -> bool:
    """Whether a \\boxed{ that begins before `cut` closes after it (_boxes' pass, stopped once it is settled)."""
    first = response.find("\\boxed", 0, cut)
    if first < 0:
        return False
    stack, open_before = [], 0  # stack: where each "{" or box begins (-1 for a plain "{"); boxes open from before cut
    for kind, at, _ in _braces(response, first if first == 0 or response[first - 1] != "\\" else 0, len(response)):
        if at >= cut and not open_before:
            return False
        if kind != "}":
            stack.append(at if kind == "box" else -1)
            open_before += 0 <= at < cut and kind == "box"
        elif stack and (box_start := stack.pop()) >= 0:
            if box_start < cut <= at:
                return True
            open_before -= box_start < cut
    return False


def _answer(reader: _Reader) -> list[str]:
    """The values of the answer that the reader's tokens hold (rules 1 and 2)."""
    for marker, start in reader.markers():
        first = reader.value_start(abs(start), correction=start < 0)
        if first is None:
            continue
        values, _, _ = reader.run(first, word=True)
        if values and reader.tokens[marker][0] == "box":
            values = reader.sentence_boxes(marker) + values
        if values:
            return values
    if reader.start and _may_mark(reader.det, reader.start):
        raise _NeedMore  # a marker may stand before the window
    values, tokens, i = [], reader.tokens, reader.first  # no marker states a value: the last run of the tail
    if reader.start:  # a run never spans a sentence end or a paragraph break: there the whole tail's pass is too
        i = next((k for k in range(i, len(tokens)) if tokens[k][0] in ("end", "para")), len(tokens))
    while i < len(tokens):
        kind, _, _, body = tokens[i]
        if not (  # where no value can start (_Reader._value), no run does
            kind in ("num", "box", "math")
            or kind == "op"
            and body in ("-", "+")
            or kind == "word"
            and (len(body) == 1 or body.split("-")[0] in _NUMBER_WORDS or body.split("-")[0] in _TENS)
        ):
            i += 1
            continue
        run, after, aside = reader.run(i)
        if not run and kind == "word":  # "five or 6": a number word that a separator joins
            run, after, aside = reader.run(i, word=True)
            run = run if len(run) > 1 else []
        if run:
            values = aside or run
        i = max(after, i + 1)
    if reader.start and not values:
        raise _NeedMore  # the last run may be before the window
    return values


def answer_values(response: str) -> tuple[str, ...]:
    """The values of the response's final answer under the rule above, as written; () when there is none."""
    if len(response) > TAIL_CHARS and _cut_box(response, len(response) - TAIL_CHARS):
        return ()  # the tail starts inside a box: what is left of it is not the answer
    tail = _Tail(response[-TAIL_CHARS:].replace("\u2212", "-"))
    windows = tail.windows()  # the last marker is mostly near the end: read the end first
    start = next(windows)
    while True:
        try:
            values = _answer(_Reader(tail, start))
            break
        except _NeedMore:
            start = next(windows)
    if any(_HIDDEN_RE.search(value) for value in values):
        return ()  # "5<ZWSP>6" shows 56 and would be read as 5
    return tuple(values)
