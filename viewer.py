"""viewer.py — see the credit assignment: saved rollouts as one static HTML page, learning curves as a PNG.

With --save-samples N the training scripts write runs/<run>/samples/iter_<k>.jsonl every N iterations:
one record per response (grpo, ppo, spo_chain) or per question tree (spo_tree), holding every token's
p_t, advantage (before whitening) and loss mask, SPO-chain's cutpoints with their Monte-Carlo values
V(s_c), PPO's critic values. `html` turns one or more runs into a single self-contained page (inline
CSS and JS, the data embedded as JSON; it opens from disk, no server, no network):
- tokens coloured by advantage (red < 0 < blue, legend with the scale), p_t < threshold underlined,
  tokens outside the loss mask faded, hover a token for p_t, advantage and PPO's critic value;
- SPO-chain cutpoints as bars between tokens labelled with V(s_c); SPO-tree as a collapsible tree,
  each node with its value V and its edge's advantage, leaves with their reward;
- runs side by side, an iteration selector (also `view.html#iteration=3`).
`curves` plots metrics.jsonl of one or more runs (reward, eval accuracy, KL, response length, seconds
per iteration) against iterations, training seconds or generated tokens.

  python viewer.py html runs/<spo_chain run> runs/<grpo run> -o view.html
  python viewer.py curves runs/<run a> runs/<run b> -o curves.png --x seconds

The viewer only reads files: it imports neither torch nor eval.py, so it starts instantly anywhere.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from plumbing import UsageError, files, ranges, shown  # torch-free: the viewer starts instantly

# ----------------------------------------------------------------------------------------------
# Reading runs

REPAIR = (
    "the file is cut short or was not written by the training scripts: delete that line (or the file) and run again"
)
RESPONSE_KEYS = (
    "question",
    "reference",
    "reward",
    "finish_reason",
    "token_ids",
    "tokens",
    "probs",
    "advantages",
    "loss_mask",
)
# lists as long as token_ids (values may be null)
PER_TOKEN_KEYS = ("tokens", "probs", "advantages", "loss_mask", "values")
NODE_KEYS = ("token_ids", "tokens", "value", "children")
SETTINGS = (
    "model",
    "task",
    "seed",
    "questions",
    "group_size",
    "temperature",
    "max_new_tokens",
    "lr",
    "epochs",
    "beta",
    "interval",
    "mc_samples",
    "tree",
    "segment_tokens",
    "advantage",
    "lam",
    "prob_mask",
    "prob_threshold",
)


def read_jsonl(path: Path, what: str = "file") -> list[tuple[int, dict]]:
    """(line number, record) of every non-empty line of a JSONL file, lines ending at "\\n" alone (files.read_lines: a
    JSON string may hold U+2028 or U+0085 raw); a file that cannot be read (missing, a directory, not UTF-8) or a
    malformed line is a UsageError naming it."""
    rows = []
    for number, line in files.read_lines(path, what):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path} line {number} is not valid JSON ({error.msg}); {REPAIR}") from None
        except RecursionError:  # json.loads recurses once per level: e.g. a saved tree thousands of levels deep
            raise UsageError(
                f"{path} line {number} nests deeper than the JSON reader allows ({sys.getrecursionlimit()} levels, "
                f"about {sys.getrecursionlimit() // 2} of a saved tree); {REPAIR}"
            ) from None
        except ValueError as error:  # e.g. an integer of over 4,300 digits
            raise UsageError(f"{path} line {number} is not valid JSON ({str(error).split(':')[0]}); {REPAIR}") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path} line {number} is not a JSON object; {REPAIR}")
        rows.append((number, record))
    return rows


def check_response(record: dict, where: str) -> None:
    """Every key the page needs is there and every per-token list has one entry per token."""
    missing = [key for key in RESPONSE_KEYS if key not in record]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(missing)}; {REPAIR}")
    length = len(record["token_ids"])
    for key in PER_TOKEN_KEYS:
        if record.get(key) is not None and len(record[key]) != length:
            raise UsageError(f"{where}: {key} has {len(record[key])} entries for {length} tokens; {REPAIR}")
    cutpoints, values = record.get("cutpoints"), record.get("cutpoint_values")
    if cutpoints is not None and (values is None or len(values) != len(cutpoints)):
        raise UsageError(f"{where}: cutpoint_values must have one value per cutpoint; {REPAIR}")
    if cutpoints is not None and any(not -1 <= c < length for c in cutpoints):
        raise UsageError(f"{where}: a cutpoint lies outside -1..{length - 1}; {REPAIR}")


def check_node(tree: dict, where: str) -> None:
    """The same checks for an SPO-tree node and every node below it, walked with an explicit stack (a saved tree may be
    deeper than Python's recursion limit)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or any(key not in node for key in NODE_KEYS):
            raise UsageError(f"{where}: a tree node lacks one of {', '.join(NODE_KEYS)}; {REPAIR}")
        for key in ("tokens", "probs", "loss_mask"):
            if node.get(key) is not None and len(node[key]) != len(node["token_ids"]):
                raise UsageError(
                    f"{where}: a tree node's {key} has {len(node[key])} entries for {len(node['token_ids'])} tokens; "
                    f"{REPAIR}"
                )
        stack.extend(reversed(node["children"]))  # reversed: children are checked in order, as a recursion would


def finite(value):
    """A copy with NaN and infinities as None (JSON.parse in the page rejects them), built with an explicit stack of
    (source, copy) containers: a saved tree may nest deeper than Python's recursion limit."""

    def empty_copy(item):
        if isinstance(item, float):
            return item if math.isfinite(item) else None
        return [] if isinstance(item, list) else {} if isinstance(item, dict) else item

    result = empty_copy(value)
    stack = [(value, result)] if isinstance(value, (list, dict)) else []
    while stack:
        source, copy = stack.pop()
        for key, item in enumerate(source) if isinstance(source, list) else source.items():
            item_copy = empty_copy(item)
            if isinstance(copy, list):
                copy.append(item_copy)
            else:
                copy[key] = item_copy
            if isinstance(item, (list, dict)):
                stack.append((item, item_copy))
    return result


def load_samples(run_dir: Path, iterations: tuple[int, ...] | None = None, questions: int | None = None) -> dict:
    """A run's saved rollouts for the page: {name, algorithm, settings, args, iterations: {k: [question group]}}.

    A question group is {question_index, question, reference, prompt, responses: [...]} for
    response records, or {..., tree: node} for SPO-tree records.
    """
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; pass run directories such as runs/<run_name>")
    files.refuse_links(run_dir)  # a run from someone else: what the page shows is what the run holds
    saved, doubles = {}, {}
    for path in sorted((run_dir / "samples").glob("iter_*.jsonl")):
        match = re.fullmatch(r"iter_(\d+)\.jsonl", path.name)
        if match:
            doubles.setdefault(int(match[1]), []).append(path.name)
            saved[int(match[1])] = path
    if not saved:
        raise UsageError(
            f"{run_dir} has no samples/iter_<k>.jsonl; "
            "train with --save-samples N to save the rollouts of every N-th iteration"
        )
    chosen = {k: path for k, path in saved.items() if iterations is None or k in iterations}
    if not chosen:
        raise UsageError(
            f"{run_dir} has no samples for iterations {', '.join(map(str, iterations))}; "
            f"it has iterations {', '.join(map(str, sorted(saved)))}"
        )
    for iteration in sorted(chosen):  # iter_1.jsonl and iter_01.jsonl: which one is the run's is not for us to guess
        if len(doubles[iteration]) > 1:
            raise UsageError(
                f"{run_dir / 'samples'} holds {' and '.join(doubles[iteration])}, which are both iteration "
                f"{iteration}: keep the one the run wrote (the training scripts write iter_{iteration}.jsonl) and move "
                "the other away"
            )
    args_path = run_dir / "args.json"
    args = files.read_json(args_path, "the run's settings") if args_path.exists() else {}

    algorithm, by_iteration = None, {}
    for iteration in sorted(chosen):
        groups: dict = {}
        for number, record in read_jsonl(chosen[iteration], "samples file"):
            where = f"{chosen[iteration]} line {number}"
            algorithm = algorithm or record.get("algorithm")
            index = record.get("question_index", len(groups))
            if not isinstance(index, (int, str)):  # a list would not even serve as a key
                raise UsageError(f"{where}: question_index is a {type(index).__name__}, not a number; {REPAIR}")
            if index not in groups:
                if questions is not None and len(groups) >= questions:
                    continue
                groups[index] = {key: record.get(key) for key in ("question_index", "question", "reference", "prompt")}
            try:
                if "tree" in record:
                    check_node(record["tree"], where)
                else:
                    check_response(record, where)
            except (TypeError, AttributeError) as error:  # a list where a number belongs, or the like
                raise UsageError(f"{where} does not follow the samples format ({error}); {REPAIR}") from None
            if "tree" in record:
                groups[index].update(tree=record["tree"], prob_threshold=record.get("prob_threshold"))
            else:
                groups[index].setdefault("responses", []).append(
                    {
                        key: record.get(key)
                        for key in (
                            "reward",
                            "finish_reason",
                            "token_ids",
                            "tokens",
                            "probs",
                            "advantages",
                            "loss_mask",
                            "prob_threshold",
                            "cutpoints",
                            "cutpoint_values",
                            "values",
                        )
                    }
                )
        by_iteration[iteration] = list(groups.values())
    return {
        "name": run_dir.name,
        "path": str(run_dir),
        "algorithm": algorithm or args.get("exp_name", "?"),
        "prob_mask": args.get("prob_mask", True),
        "settings": {key: args[key] for key in SETTINGS if key in args},
        "args": args,
        "iterations": finite(by_iteration),
    }


def load_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {iteration: value}} (a later line for the same iteration wins)."""
    if run_dir.is_dir():
        files.refuse_links(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UsageError(
            f"{run_dir} has no metrics.jsonl; pass a run directory the training scripts wrote (runs/<run_name>)"
        )
    series: dict[str, dict[int, float]] = {}
    for number, row in read_jsonl(path, "metrics log"):
        if not isinstance(row.get("iteration"), int):
            raise UsageError(f"{path} line {number} has no integer iteration; {REPAIR}")
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if isinstance(value, int) and abs(value) > sys.float_info.max:
                    raise UsageError(f"{path} line {number}: {shown(key)} is an integer too large to plot; {REPAIR}")
                series.setdefault(key, {})[row["iteration"]] = float(value)
    return series


# ----------------------------------------------------------------------------------------------
# html: one static page; the data is embedded as JSON and drawn by plain JS
# (text set with textContent, never parsed as HTML)

PAGE_CSS = r"""
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d1d1f;
       background: #f4f4f2; }
header { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ddd; padding: 8px 14px;
         display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; }
header h1 { font-size: 16px; margin: 0; }
header label { display: inline-flex; gap: 5px; align-items: center; }
header input[type=number] { width: 72px; }
button { font: inherit; padding: 1px 8px; }
#runs { display: flex; gap: 12px; padding: 12px; align-items: flex-start; }
.run { flex: 1 1 0; min-width: 300px; background: #fff; border: 1px solid #ddd; border-radius: 6px;
       padding: 10px 12px; }
.run h2 { font-size: 15px; margin: 0 0 4px; word-break: break-all; }
.algo { display: inline-block; font-size: 12px; font-weight: 600; padding: 0 6px; border-radius: 3px; background: #333;
        color: #fff; margin-right: 6px; }
.muted { color: #6b6b6b; font-size: 12px; }
.settings { font-size: 12px; color: #555; margin: 2px 0 6px; word-break: break-word; }
details > summary { cursor: pointer; }
pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; font-size: 12px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; font-size: 12px; margin: 6px 0 10px; }
.ramp { display: inline-flex; align-items: center; gap: 4px; }
.ramp i { display: inline-block; width: 120px; height: 12px; border: 1px solid #bbb; }
.q { border-top: 1px solid #e3e3e3; padding-top: 8px; margin-top: 8px; }
.qtext { white-space: pre-wrap; font-weight: 600; margin: 0 0 2px; }
.resp { margin: 8px 0 10px; }
.rhead, .nmeta { display: flex; flex-wrap: wrap; gap: 4px 8px; align-items: baseline; font-size: 12px; }
.badge { padding: 0 5px; border-radius: 3px; background: #eee; white-space: nowrap; }
.good { background: #d9f2dc; } .bad { background: #f7dcdc; } .warn { background: #fde7c4; }
.toks { font: 13px/1.75 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; white-space: pre-wrap;
        word-break: break-word; border-left: 3px solid #ddd; padding: 2px 0 2px 8px; margin-top: 2px; }
.tok { border-radius: 2px; box-shadow: inset -1px 0 rgba(0, 0, 0, 0.07); }
.low { text-decoration: underline 2px #111; text-underline-offset: 3px; }
.off { opacity: 0.38; }
.tok:hover { outline: 1px solid #000; }
.cut { border-left: 2px solid #222; margin: 0 1px 0 3px; padding: 0 1px; cursor: help; }
.cut:empty { padding: 0; }
.cv { font: 600 9px/1 system-ui, sans-serif; color: #222; vertical-align: super; white-space: nowrap; }
.kids { margin-left: 9px; padding-left: 10px; border-left: 1px solid #ccc; }
.nline { display: flex; gap: 4px; align-items: flex-start; padding: 3px 0; }
.nbody { flex: 1; min-width: 0; }
.nbody .toks { margin-top: 3px; }
.tg { flex: 0 0 auto; width: 20px; padding: 0; border: 0; background: none; cursor: pointer; color: #555; }
.tg:disabled { cursor: default; }
#tip { position: fixed; z-index: 3; pointer-events: none; background: #222; color: #fff; padding: 5px 8px;
       border-radius: 4px; font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", monospace; white-space: pre;
       max-width: 480px; }
#js-error { position: fixed; bottom: 0; left: 0; right: 0; margin: 0; padding: 8px; background: #b00020; color: #fff;
            z-index: 4; }
"""

PAGE_JS = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("viewer-data").textContent);
const NEGATIVE = [202, 0, 32], POSITIVE = [5, 113, 176];  // the two ends of a red-white-blue diverging scale
const state = { iteration: null, hidden: new Set(), scale: null, showValues: true };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}
function num(x, digits) { return x === null || x === undefined ? "n/a" : String(Number(Number(x).toFixed(digits))); }
function signed(x, digits) { return x === null || x === undefined ? "n/a" : (x > 0 ? "+" : "") + num(x, digits); }
function shade(a, scale) {  // white at 0, deeper red/blue up to |a| = scale (capped so black text stays legible)
  if (a === null || a === undefined || !(scale > 0)) return "";
  const t = Math.max(-1, Math.min(1, a / scale)), end = t < 0 ? NEGATIVE : POSITIVE, w = 0.72 * Math.abs(t);
  return "rgb(" + end.map(c => Math.round(255 + (c - 255) * w)).join(",") + ")";
}
const shades = new Map();  // many tokens share an advantage (a segment, a GRPO response): compute each colour once
function shadeCached(a, scale) {
  const key = a + "/" + scale;
  if (!shades.has(key)) shades.set(key, shade(a, scale));
  return shades.get(key);
}
function shown(text) { return text === "" ? "\u2205" : text.replace(/\n/g, "\u21b5\n"); }
function badge(text, kind) { return el("span", "badge" + (kind ? " " + kind : ""), text); }

// ---- tokens: one span per token, a bar after every cutpoint
function cutBar(c, value) {
  const bar = el("span", "cut");
  bar.dataset.tip = (c < 0 ? "cutpoint c = -1: the prompt" : "cutpoint c = " + c + ": the state after token " + c) +
    "\nV(s_c) = " + num(value, 4) + "  (mean reward of the MC continuations)";
  if (state.showValues) bar.appendChild(el("span", "cv", num(value, 2)));
  return bar;
}
function isLow(seg, i) {
  return Boolean(seg.probs) && seg.probs[i] !== null && seg.threshold != null && seg.probs[i] < seg.threshold;
}
function inLoss(seg, i) { return seg.mask ? Boolean(seg.mask[i]) : true; }
function tokenTip(seg, i) {  // built on hover only: a page can hold 1e5+ tokens
  const a = seg.advantages ? seg.advantages[i] : seg.advantage;
  const tip = ["token " + i + (seg.ids ? "   id " + seg.ids[i] : "") + "   " + JSON.stringify(seg.tokens[i]),
               "p_t        " + num(seg.probs ? seg.probs[i] : null, 4) + (isLow(seg, i) ? "   < " + seg.threshold : ""),
               "advantage  " + signed(a, 4)];
  if (seg.values) tip.push("critic V   " + num(seg.values[i], 4));
  if (!inLoss(seg, i)) tip.push(seg.offReason || "not in the loss mask");
  return tip.join("\n");
}
function drawTokens(box, seg, scale) {
  const cuts = seg.cuts || new Map(), out = document.createDocumentFragment();
  if (cuts.has(-1)) out.appendChild(cutBar(-1, cuts.get(-1)));
  for (let i = 0; i < seg.tokens.length; i++) {
    const span = document.createElement("span");
    span.className = "tok" + (isLow(seg, i) ? " low" : "") + (inLoss(seg, i) ? "" : " off");
    span.textContent = shown(seg.tokens[i]);
    span.style.background = shadeCached(seg.advantages ? seg.advantages[i] : seg.advantage, scale);
    span.seg = seg;
    span.index = i;
    out.appendChild(span);
    if (cuts.has(i)) out.appendChild(cutBar(i, cuts.get(i)));
  }
  box.appendChild(out);
}

// ---- one response (grpo, ppo, spo_chain)
function responseView(r, index, scale) {
  const box = el("div", "resp");
  const head = el("div", "rhead");
  const inLoss = r.loss_mask ? r.loss_mask.filter(Boolean).length : r.tokens.length;
  head.append(el("span", "muted", "#" + index), badge("reward " + num(r.reward, 3), r.reward > 0 ? "good" : "bad"),
              badge(r.finish_reason || "?", r.finish_reason === "length" ? "warn" : ""),
              el("span", "muted", r.tokens.length + " tokens, " + inLoss + " in loss"));
  const cuts = new Map();
  if (r.cutpoints) {
    r.cutpoints.forEach((c, k) => cuts.set(c, r.cutpoint_values ? r.cutpoint_values[k] : null));
    head.append(el("span", "muted", r.cutpoints.length + (r.cutpoints.length === 1 ? " cutpoint" : " cutpoints")));
  }
  const body = el("div", "toks");
  drawTokens(body, { tokens: r.tokens, ids: r.token_ids, probs: r.probs, advantages: r.advantages, mask: r.loss_mask,
                     threshold: r.prob_threshold, values: r.values, cuts: cuts }, scale);
  box.append(head, body);
  return box;
}

// ---- one SPO-tree: a node per segment, its value V and its edge's advantage A = V(node) - V(parent) (rloo)
// Subtrees below openDepth start collapsed and are drawn on their first expansion
// (a 6-6-6 tree of 600-token segments is 1e5 tokens).
function nodeView(node, depth, scale, threshold, probMask, openDepth) {
  const wrap = el("div", "node"), line = el("div", "nline"), kids = el("div", "kids");
  const toggle = el("button", "tg", node.children.length ? "\u25be" : "\u2022");
  toggle.disabled = !node.children.length;
  toggle.title = node.children.length + " children";
  const expand = () => {
    if (!kids.hasChildNodes()) node.children.forEach(child => kids.append(nodeView(child, depth + 1, scale, threshold,
                                                                                   probMask, openDepth)));
    kids.hidden = false;
    toggle.textContent = "\u25be";
  };
  toggle.addEventListener("click", () => {
    if (kids.hidden || !kids.hasChildNodes()) expand();
    else { kids.hidden = true; toggle.textContent = "\u25b8"; }
  });
  const meta = el("div", "nmeta");
  if (depth === 0) meta.append(badge("root (prompt)"));
  else {
    const edge = badge("A " + signed(node.advantage, 3));
    edge.style.background = shade(node.advantage, scale);
    meta.append(edge);
  }
  meta.append(badge("V " + num(node.value, 3)));
  if (node.reward !== null && node.reward !== undefined) {
    meta.append(badge("reward " + num(node.reward, 3), node.reward > 0 ? "good" : "bad"));
    if (node.finish_reason) meta.append(badge(node.finish_reason, node.finish_reason === "length" ? "warn" : ""));
  }
  const body = el("div", "nbody");
  body.append(meta);
  line.append(toggle, body);
  if (depth > 0) {
    // The page marks what the loss counts: nothing on an edge dropped for a zero advantage,
    // else p_t < threshold under the mask.
    let mask = node.loss_mask || null, offReason = "not in the loss mask (p_t >= threshold)";
    if (node.advantage === 0) { mask = node.tokens.map(() => false); offReason = "edge dropped: advantage 0"; }
    else if (!mask && probMask && node.probs && threshold !== null) mask = node.probs.map(p => p < threshold);
    const segment = el("div", "toks");
    drawTokens(segment, { tokens: node.tokens, ids: node.token_ids, probs: node.probs, advantage: node.advantage,
                          mask: mask, threshold: threshold, offReason: offReason }, scale);
    body.append(segment);
  } else {
    meta.append(el("span", "muted", node.children.length + " children, prompt above"));
  }
  wrap.append(line);
  if (node.children.length) {
    wrap.append(kids);
    if (depth < openDepth) expand();
    else { kids.hidden = true; toggle.textContent = "\u25b8"; }
  }
  return wrap;
}

// ---- a run's column for the selected iteration
function advantagesOf(groups) {
  const all = [];
  const walk = node => {
    if (node.advantage !== null && node.advantage !== undefined) all.push(node.advantage);
    node.children.forEach(walk);
  };
  for (const g of groups) {
    if (g.tree) walk(g.tree);
    for (const r of g.responses || []) for (const a of r.advantages) if (a !== null) all.push(a);
  }
  return all;
}
function treeTokens(node) { return node.children.reduce((sum, child) => sum + treeTokens(child), node.tokens.length); }
function legend(scale, run) {
  const box = el("div", "legend"), ramp = el("span", "ramp"), bar = el("i");
  bar.style.background = "linear-gradient(to right, " + shade(-scale, scale) + ", #fff, " + shade(scale, scale) + ")";
  ramp.append(el("span", null, "advantage " + signed(-scale, 3)), bar, el("span", null, signed(scale, 3)));
  const low = el("span", "low", "low p_t"), off = el("span", "off", "not in loss");
  box.append(ramp, low, off);
  if (run.algorithm === "spo_chain") {
    const key = el("span"), bar2 = el("span", "cut");
    key.append(bar2, document.createTextNode(" cutpoint, V(s_c)"));
    box.append(key);
  }
  return box;
}
function runView(run, iteration) {
  const column = el("section", "run");
  const title = el("h2");
  title.append(el("span", "algo", run.algorithm), document.createTextNode(run.name));
  const settings = Object.entries(run.settings).map(
    ([k, v]) => k + "=" + (typeof v === "string" ? v : JSON.stringify(v))).join("  ");
  const all = el("details");
  all.append(el("summary", "muted", "all settings (args.json)"), el("pre", null, JSON.stringify(run.args, null, 1)));
  column.append(title, el("div", "settings", settings), all);
  const groups = run.iterations[iteration];
  if (!groups) {
    column.append(el("p", "muted", "no samples saved at iteration " + iteration +
                      " (saved: " + Object.keys(run.iterations).join(", ") + ")"));
    return column;
  }
  const advantages = advantagesOf(groups);
  // no Math.max(...spread): 1e5+ tokens overflow it
  const largest = advantages.reduce((m, a) => Math.max(m, Math.abs(a)), 0);
  const scale = state.scale || largest || 1;
  const responses = groups.flatMap(g => g.responses || []);
  const rewards = responses.length ? responses.map(r => r.reward) : groups.map(g => g.tree.value);
  const mean = xs => xs.length ? xs.reduce((s, x) => s + x, 0) / xs.length : null;
  column.append(el("div", "muted", "iteration " + iteration + ": " + groups.length + " questions, " +
                   (responses.length ? responses.length + " responses, mean reward " + num(mean(rewards), 3) +
                    ", mean length " + num(mean(responses.map(r => r.tokens.length)), 1) + " tokens"
                                     : "mean root value " + num(mean(rewards), 3))));
  column.append(legend(scale, run));
  for (const g of groups) {
    const q = el("div", "q");
    const ref = el("div", "muted", "question " + g.question_index + " \u00b7 reference ");
    ref.append(el("b", null, g.reference));
    q.append(ref,
             el("p", "qtext", g.question));
    const prompt = el("details");
    prompt.append(el("summary", "muted", "prompt"), el("pre", null, g.prompt));
    q.append(prompt);
    if (g.tree) q.append(nodeView(g.tree, 0, scale, g.prob_threshold, run.prob_mask,
                                  treeTokens(g.tree) > 5000 ? 1 : Infinity));
    (g.responses || []).forEach((r, k) => q.append(responseView(r, k, scale)));
    column.append(q);
  }
  return column;
}

// ---- controls, tooltip, rendering
const iterations = [...new Set(
  DATA.runs.flatMap(run => Object.keys(run.iterations).map(Number)))].sort((a, b) => a - b);
const select = document.getElementById("iteration");
for (const k of iterations) select.append(new Option("iteration " + k, String(k)));
const toggles = document.getElementById("run-toggles");
DATA.runs.forEach((run, i) => {
  const label = el("label"), box = el("input");
  box.type = "checkbox"; box.checked = true;
  box.addEventListener("change", () => {
    if (box.checked) state.hidden.delete(i);
    else state.hidden.add(i);
    render();
  });
  label.append(box, document.createTextNode(run.name));
  toggles.append(label);
});
function step(delta) {
  const at = iterations.indexOf(state.iteration) + delta;
  if (at >= 0 && at < iterations.length) { state.iteration = iterations[at]; render(); }
}
document.getElementById("prev").addEventListener("click", () => step(-1));
document.getElementById("next").addEventListener("click", () => step(1));
select.addEventListener("change", () => { state.iteration = Number(select.value); render(); });
document.getElementById("scale").addEventListener("input", e => {
  const v = Number(e.target.value);
  state.scale = v > 0 ? v : null;
  render();
});
document.getElementById("show-values").addEventListener("change", e => {
  state.showValues = e.target.checked;
  render();
});
document.addEventListener("keydown", e => {
  if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
  if (e.key === "ArrowLeft") step(-1);
  if (e.key === "ArrowRight") step(1);
});
const tip = document.getElementById("tip");
document.addEventListener("mouseover", e => {
  const target = e.target.closest ? e.target.closest(".tok, [data-tip]") : null;
  tip.hidden = !target;
  if (target) tip.textContent = target.seg ? tokenTip(target.seg, target.index) : target.dataset.tip || "";
});
document.addEventListener("mousemove", e => {
  if (tip.hidden) return;
  const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 4);
  const y = e.clientY + 18 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 10 : e.clientY + 18;
  tip.style.left = Math.max(0, x) + "px"; tip.style.top = Math.max(0, y) + "px";
});

function render() {
  const started = performance.now();
  select.value = String(state.iteration);
  history.replaceState(null, "", "#iteration=" + state.iteration);
  const main = document.getElementById("runs");
  main.replaceChildren(...DATA.runs.filter((run, i) => !state.hidden.has(i)).map(run => runView(run, state.iteration)));
  document.body.dataset.rendered = String(state.iteration);
  document.body.dataset.renderMs = String(Math.round(performance.now() - started));
}
const wanted = Number((location.hash.match(/iteration=(\d+)/) || [])[1]);
state.iteration = iterations.includes(wanted) ? wanted : iterations[iterations.length - 1];
render();
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>__CSS__</style>
<script>
// an error shows on the page (and in --dump-dom), not only in the console
window.onerror = function (message, source, line) {
  var box = document.createElement("pre");
  box.id = "js-error";
  box.textContent = "viewer error: " + message + " (line " + line + ")";
  (document.body || document.documentElement).appendChild(box);
};
</script>
</head>
<body>
<header>
  <h1>SPO viewer</h1>
  <span><button id="prev" title="previous iteration (left arrow)">&larr;</button>
    <select id="iteration"></select>
    <button id="next" title="next iteration (right arrow)">&rarr;</button></span>
  <span id="run-toggles"></span>
  <label title="advantage that gets the deepest colour; empty: the largest |advantage| of each run at this iteration">
    colour scale &plusmn;<input id="scale" type="number" min="0" step="0.1" placeholder="auto"></label>
  <label><input id="show-values" type="checkbox" checked>V(s_c) at cutpoints</label>
  <span class="muted">hover a token for p_t and its advantage</span>
</header>
<main id="runs"><noscript>This page draws the rollouts with JavaScript; enable it to see them.</noscript></main>
<div id="tip" hidden></div>
<script type="application/json" id="viewer-data">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""


def page_json(data) -> str:
    """JSON that is safe inside <script>: no "</script>" or "<!--" can appear, JSON.parse reads it unchanged."""
    try:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except RecursionError:  # json.dumps recurses once per level; the page wraps each tree in a few more
        levels = sys.getrecursionlimit() // 2
        raise UsageError(
            f"the runs' data nests too deep to embed in the page (a saved tree over about {levels} levels?); "
            "leave that run or iteration out (--iterations)"
        ) from None
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def build_page(runs: list[dict]) -> str:
    """The whole HTML page for runs loaded by load_samples."""
    names = [run["name"] for run in runs]
    for run in runs:  # two runs with the same directory name are told apart by their full path
        if names.count(run["name"]) > 1:
            run["name"] = run["path"]
    title = "SPO viewer: " + ", ".join(run["name"] for run in runs)
    return (
        PAGE.replace("__TITLE__", html.escape(title))
        .replace("__CSS__", PAGE_CSS)
        .replace("__JS__", PAGE_JS)
        .replace("__DATA__", page_json({"runs": runs}))
    )


# ----------------------------------------------------------------------------------------------
# curves: metrics.jsonl of several runs, one panel per metric

PANELS = {
    "charts/reward": "train reward",
    "eval/accuracy": "eval accuracy",
    "losses/kl_per_token": "KL to the reference, per token",
    "losses/kl_per_sequence": "KL to the reference, per sequence (the loss's)",
    "policy/entropy": "entropy per token (nats)",
    "sampler/kl_per_token": "KL sampler || trainer, per token",
    "charts/response_tokens": "response tokens",
    "time/iteration_seconds": "seconds per iteration",
}


def x_positions(series: dict[str, dict[int, float]], x: str, run_dir: Path) -> dict[int, float]:
    """Iteration -> x: the iteration, cumulative training seconds or cumulative generated tokens."""
    iterations = sorted({i for values in series.values() for i in values})
    if x == "iteration":
        return {i: float(i) for i in iterations}
    if x == "seconds" and "time/train_seconds" in series:
        cumulative = series["time/train_seconds"]  # already cumulative (and carried over a resume)
    else:
        key = "time/iteration_seconds" if x == "seconds" else "charts/generated_tokens"
        if key not in series:
            need = "time/train_seconds or time/iteration_seconds" if x == "seconds" else key
            raise UsageError(f"--x {x} needs {need} in {run_dir / 'metrics.jsonl'}; use --x iteration")
        total, cumulative = 0.0, {}
        for i in sorted(series[key]):
            total += series[key][i]
            cumulative[i] = total
    positions, last = {}, 0.0  # an eval line before any training (iteration 0) sits at 0
    for i in iterations:
        last = cumulative.get(i, last)
        positions[i] = last
    return positions


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard-style exponential moving average (weight 0: the values unchanged)."""
    smoothed, last = [], None
    for value in values:
        last = value if last is None else weight * last + (1 - weight) * value
        smoothed.append(last)
    return smoothed


def run_label(run_dir: Path) -> str:
    """A short legend label, "<exp_name> seed <seed>" from the run's args.json; the directory name without one (or
    without those settings). A damaged args.json is a UsageError naming it, as it is for `html`."""
    path = run_dir / "args.json"
    args = files.read_json(path, "the run's settings") if path.exists() else {}
    if "exp_name" in args and "seed" in args:
        return f"{args['exp_name']} seed {args['seed']}"
    return run_dir.name


PLOT_FORMATS = (".png", ".pdf", ".svg")  # what --output of `curves` may end in (matplotlib writes each)


def plot_curves(
    run_dirs: list[Path], output: Path, x: str = "iteration", keys: tuple[str, ...] = tuple(PANELS), smooth: float = 0.0
) -> list[str]:
    """Write a grid of panels, one line per run; returns the keys plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = [(run_dir, load_metrics(run_dir)) for run_dir in run_dirs]
    positions = [x_positions(series, x, run_dir) for run_dir, series in runs]
    present = [key for key in keys if any(key in series for _, series in runs)]
    if not present:
        raise UsageError(
            f"none of {', '.join(keys)} is in the metrics.jsonl of {', '.join(map(str, run_dirs))}; "
            "choose metrics that are there with --keys"
        )
    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.3 * columns, 3.0 * rows + 0.6), squeeze=False, layout="constrained"
    )
    labels = [run_label(run_dir) for run_dir, _ in runs]
    labels = [
        f"{label} ({run_dir.name})" if labels.count(label) > 1 else label for label, (run_dir, _) in zip(labels, runs)
    ]
    for ax, key in zip(axes.flat, present):
        for index, ((_, series), where) in enumerate(zip(runs, positions)):
            if key not in series:
                continue
            points = sorted((where[i], value) for i, value in series[key].items())
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            color = f"C{index % 10}"
            marker = "o" if len(xs) <= 30 else None
            if smooth > 0 and not key.startswith("eval/"):  # evaluations are few and far between: shown raw
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
                ys = ema(ys, smooth)
            ax.plot(xs, ys, color=color, marker=marker, markersize=3, linewidth=1.5)
        ax.set_title(PANELS.get(key, key), fontsize=10)
        ax.set_xlabel(
            {"iteration": "iteration", "seconds": "training seconds", "tokens": "generated tokens"}[x], fontsize=9
        )
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(present) :]:
        ax.axis("off")
    # One legend entry per run, from proxies: matplotlib hides labels that start with "_"
    # (a run on a local ./_data.jsonl task).
    handles = [
        Line2D([], [], color=f"C{index % 10}", marker="o", markersize=3, linewidth=1.5) for index in range(len(runs))
    ]
    fig.legend(handles, labels, loc="outside upper center", ncol=min(4, len(labels)), fontsize=9, frameon=False)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=output.suffix[1:].lower())
    plt.close(fig)
    files.write_atomic(output, image.getvalue(), "the plot")
    return present


# ----------------------------------------------------------------------------------------------
# CLI


@dataclass
class Html:
    """Write one self-contained HTML page (no server, no network) of the rollouts saved with --save-samples."""

    runs: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """run directories (runs/<run_name>) holding samples/iter_<k>.jsonl"""
    output: Annotated[Path, tyro.conf.arg(aliases=("-o",))] = Path("view.html")
    """the HTML file to write"""
    iterations: ranges.bounded(int, 0, many=True, optional=True) = None
    """only these iterations (None: every saved one)"""
    questions: ranges.OptionalPositiveInt = None
    """at most this many questions per run and iteration (None: all saved)"""


@dataclass
class Curves:
    """Plot metrics.jsonl of one or more runs into a PNG: one panel per metric, one line per run."""

    runs: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """run directories (runs/<run_name>) holding metrics.jsonl"""
    output: Annotated[Path, tyro.conf.arg(aliases=("-o",))] = Path("curves.png")
    """the PNG file to write"""
    x: Literal["iteration", "seconds", "tokens"] = "iteration"
    """x axis: iteration, cumulative training seconds (time/train_seconds) or cumulative generated tokens"""
    keys: tuple[str, ...] = tuple(PANELS)
    """metrics to plot, one panel each (those no run logged are left out)"""
    smooth: ranges.bounded(float, 0, 1, high_open=True) = 0.0
    """exponential moving average weight, 0 <= smooth < 1 (the raw curve stays, faint)"""


def main(command: Html | Curves) -> None:
    problems = ranges.problems(command)
    allowed = (".html", ".htm") if isinstance(command, Html) else PLOT_FORMATS
    if command.output.suffix.lower() not in allowed:
        problems.append(f"-o {command.output}: give a file name ending in {', '.join(allowed)}")
    if problems:
        raise UsageError("; ".join(problems))
    if not command.runs:
        raise UsageError("give at least one run directory, e.g. python viewer.py html runs/<run_name>")
    if isinstance(command, Html):
        runs = [load_samples(run_dir, command.iterations, command.questions) for run_dir in command.runs]
        files.write_atomic(command.output, build_page(runs), "the page")
        iterations = sorted({k for run in runs for k in run["iterations"]})
        print(
            f"wrote {shown(command.output)} ({command.output.stat().st_size / 1e6:.1f} MB): {len(runs)} run(s), "
            f"iterations {', '.join(map(str, iterations))}; open it in a browser"
        )
    else:
        plotted = plot_curves(list(command.runs), command.output, command.x, command.keys, command.smooth)
        print(f"wrote {shown(command.output)}: {shown(', '.join(plotted))} for {len(command.runs)} run(s)")


if __name__ == "__main__":
    command = tyro.cli(
        Annotated[Html, tyro.conf.subcommand("html")] | Annotated[Curves, tyro.conf.subcommand("curves")]
    )
    try:
        main(command)
    except UsageError as error:
        sys.exit(f"error: {shown(error)}")  # a path or a link's target from the run may hold terminal escapes
