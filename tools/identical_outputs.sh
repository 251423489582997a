#!/usr/bin/env bash
# Does a code change leave every training output identical? Runs the four training scripts (grpo_baseline.py,
# ppo_baseline.py, spo_chain.py, spo_tree.py) at the same small fp32 CPU settings on two versions of the code and
# compares what they wrote, per script:
#   metrics.jsonl  every key BASE logged, per iteration, present in OTHER (under its new name where RENAMED) with the
#                  same value (floats exactly: fp32 on a CPU repeats bit for bit), except time/* and
#                  charts/tokens_per_second; keys only OTHER logs: info
#   samples/       every samples/iter_*.jsonl byte for byte (and the same set of files)
#   summary.json   the accuracies (accuracy_*)
#   args.json      the settings both sides have (output_dir aside: each side writes its own); keys on one side: info
# It also shows, as information only, a unified diff of each script's --help and --dry-run output.
#
#   bash tools/identical_outputs.sh BASE [OTHER]
#   IDENTICAL_WORK=runs/identical bash tools/identical_outputs.sh main     # re-check while editing
#
# BASE and OTHER are commits (anything git rev-parse takes); without OTHER the other side is this checkout as it is
# now, uncommitted edits and untracked files included (ignored ones not). Each side runs in its own copy (a detached
# git worktree for a commit, a copy of the files for the checkout), in the work dir ${IDENTICAL_WORK:-a new temporary
# one}, which keeps each side's outputs (checkpoints deleted: they are not compared), logs, --help and --dry-run text.
# IDENTICAL_WORK must be a new or empty folder, or one this tool made (it holds the file .identical_outputs_work): the
# tool replaces the folders it makes there (base/, other/, models/), never a folder of someone else's.
# With IDENTICAL_WORK, a script's BASE run is reused when the work dir already holds a complete one for the same
# BASE commit, settings and environment (the marker file base/<script>.complete), so only OTHER runs again.
# The runs, two per script: smollm2-135m (converted into $SPO_CACHE on first use) on rg:chain_sum, seed 3, 2
# iterations of 2 questions, groups of 4 (spo_tree.py: a 3,3 tree of 16-token segments), 32 new tokens, 8 held-out
# questions; and <script>-digits, a small random digits-only Llama on a task whose every answer is 7 (both built by
# python -m benchmarks.gpu_check --step models into the work dir), 3 new tokens, where rewards vary within some groups,
# so every script takes a real update step (at 32 tokens smollm2 earns no reward: GRPO's and PPO's updates are zero)
# and the next iteration samples from the updated weights. On the CPU
# (CUDA_VISIBLE_DEVICES empty) on one thread (OMP_NUM_THREADS=1: with two, the same commit's update losses already
# differ in their last digits from run to run), PYTHONHASHSEED=0 and HF_HUB_OFFLINE=1. About 6 minutes a side.
# $PYTHON: the interpreter (default python). Exit 0: ALL EQUAL; 1: DIFFERENCES FOUND; 2: a usage error.
set -uo pipefail  # no -e: a failing run is reported, and the other scripts still run

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,32p' "$0"
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && git rev-parse --show-toplevel) || exit 2
PYTHON=${PYTHON:-python}
export PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 COLUMNS=120

base_sha=$(git -C "$repo" rev-parse --verify --quiet "$1^{commit}") || { echo "BASE $1: not a commit"; exit 2; }
other_sha=""
if [ $# -eq 2 ]; then
  other_sha=$(git -C "$repo" rev-parse --verify --quiet "$2^{commit}") || { echo "OTHER $2: not a commit"; exit 2; }
fi
mark=.identical_outputs_work  # in each work dir this tool made: the only folders whose contents it replaces
work=${IDENTICAL_WORK:-$(mktemp -d)}
if [ -e "$work" ] && [ ! -f "$work/$mark" ] && [ -n "$(ls -A -- "$work" 2>&1)" ]; then
  echo "error: IDENTICAL_WORK=$work was not made by this tool (no $mark in it) and is not empty: its base/, other/" \
    "and models/ would be replaced; give a new or empty folder" >&2
  exit 2
fi
mkdir -p "$work" && touch "$work/$mark" && work=$(cd "$work" && pwd) || exit 2

scripts=(grpo_baseline.py ppo_baseline.py spo_chain.py spo_tree.py)
runs=()  # <script> and <script>-digits for each script
for script in "${scripts[@]}"; do runs+=("${script%.py}" "${script%.py}-digits"); done
common=(
  --backend hf --precision fp32 --seed 3 --iterations 2 --save-samples 1 --eval-samples 2 --exp-name identical
)
run_args() {  # what each run adds to the common settings, one argument a line (the work dir's path may hold spaces)
  case "$1" in
    *-digits)
      printf '%s\n' --model "$work/models/digits" --task "$work/models/sevens.jsonl" --questions 4 --batch-size 16 \
        --micro-batch-size 8 --max-new-tokens 3 --eval-limit 16
      ;;
    *) printf '%s\n' --model smollm2-135m --task rg:chain_sum --questions 2 --batch-size 8 --micro-batch-size 4 \
      --max-new-tokens 32 --eval-limit 8 ;;
  esac
  case "$1" in
    spo_tree-digits) printf '%s\n' --tree 4,4 --segment-tokens 1 --samples-per-iteration 16 ;;
    spo_tree) printf '%s\n' --tree 3,3 --segment-tokens 16 --samples-per-iteration 16 ;;
    *) printf '%s\n' --group-size 4 ;;
  esac
}
# What else decides the outputs: a reused BASE run must have had the same.
environment=$("$PYTHON" -c 'import platform, torch, transformers
print(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
      f"threads {torch.get_num_threads()}")') || { echo "$PYTHON cannot import torch and transformers"; exit 2; }

started=$(date +%s)
trees=()
declare -A reused=()
cleanup() {
  for tree in "${trees[@]}"; do
    git -C "$repo" worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
  done
  git -C "$repo" worktree prune
}
trap cleanup EXIT

# make_tree SIDE_DIR SHA: the side's copy of the code in SIDE_DIR/tree, a worktree of SHA, or (no SHA) the checkout's
# tracked and untracked, not ignored files as they are now.
make_tree() {
  local tree=$1/tree
  git -C "$repo" worktree remove --force "$tree" 2>/dev/null
  rm -rf "$tree"
  git -C "$repo" worktree prune
  trees+=("$tree")
  if [ -n "$2" ]; then
    git -C "$repo" worktree add --quiet --detach "$tree" "$2"
  else
    mkdir -p "$tree" &&
      (cd "$repo" && git ls-files -z -co --exclude-standard --deduplicate |
        while IFS= read -r -d '' path; do  # files deleted in the checkout, and the work dir itself, left out
          case "$repo/$path" in "$work"/*) continue ;; esac
          [ -e "$path" ] && printf '%s\0' "$path"
        done |
        tar -cf - --null --no-recursion -T - | tar -xf - -C "$tree")
  fi
}

# run_side SIDE SHA: each run, and each script's --help and --dry-run, on one side; BASE reuses complete runs it finds.
run_side() {
  local side=$1 sha=$2 dir=$work/$1 script name args marker expected seconds rc tree_made=0
  mkdir -p "$dir"
  for name in "${runs[@]}"; do
    script=${name%-digits}.py
    mapfile -t args < <(run_args "$name")
    args=("${common[@]}" "${args[@]}")
    expected=$(printf 'commit %s\nargs %s\nenvironment %s\n' "${sha:-working tree}" "${args[*]}" "$environment")
    marker=$dir/$name.complete
    if [ "$side" = base ] && [ -f "$marker" ] && [ "$(head -n 3 "$marker")" = "$expected" ]; then
      echo "$side $name: reusing the run in $dir/out/$name ($(sed -n 's/^seconds //p' "$marker") s when it ran)"
      reused[$name]=1
      continue
    fi
    rm -f "$marker"
    if [ $tree_made = 0 ]; then
      make_tree "$dir" "$sha" || { echo "$side: could not make the copy of the code in $dir/tree"; return 1; }
      tree_made=1
    fi
    rm -rf "${dir:?}/out/$name"
    mkdir -p "$dir/out/$name" "$dir/logs" "$dir/help" "$dir/dry-run"
    echo "$side $name: running (log $dir/logs/$name.log)"
    local t0
    t0=$(date +%s)
    (cd "$dir/tree" && "$PYTHON" "$script" "${args[@]}" --output-dir "$dir/out/$name") >"$dir/logs/$name.log" 2>&1
    rc=$?
    seconds=$(($(date +%s) - t0))
    rm -rf "$dir/out/$name"/*/checkpoint
    if [ "$name.py" = "$script" ]; then
      (cd "$dir/tree" && "$PYTHON" "$script" --help) >"$dir/help/$name.txt" 2>&1
      (cd "$dir/tree" && "$PYTHON" "$script" --dry-run) >"$dir/dry-run/$name.txt" 2>&1
    fi
    echo "$seconds" >"$dir/$name.seconds"
    if [ $rc -ne 0 ]; then
      echo "$rc" >"$dir/$name.failed"
      echo "$side $name: FAILED (exit $rc) after $seconds s; the end of its log:"
      tail -n 15 "$dir/logs/$name.log" | tr '\r' '\n' | tail -n 15 | sed 's/^/    /'
      continue
    fi
    rm -f "$dir/$name.failed"
    echo "$side $name: $seconds s"
    if [ "$side" = base ]; then
      printf '%s\nseconds %s\n' "$expected" "$seconds" >"$marker"
    fi
  done
}

# compare_runs BASE_OUT OTHER_OUT: the detail lines, then one last line, EQUAL or DIFFERENT: <what>.
compare_runs() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json
import math
import sys
from pathlib import Path

IGNORED_ARGS = {"output_dir"}  # each side writes under its own work dir
RENAMED = {"losses/kl": "losses/kl_per_sequence"}  # a metric BASE may log under its earlier name: compared as renamed


def ignored_metric(key):
    return key.startswith("time/") or key == "charts/tokens_per_second"


def run_dir(out):
    runs = [p for p in Path(out).iterdir() if p.is_dir()]
    if len(runs) != 1:
        sys.exit(f"DIFFERENT: {out} holds {len(runs)} run directories, not 1")
    return runs[0]


def same(a, b):
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or (type(a) is type(b) and a == b)


def metrics_by_iteration(path):
    """{iteration: {key: [values in the order logged]}}: an iteration has a training and an evaluation record."""
    merged = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        keys = merged.setdefault(record.get("iteration"), {})
        for key, value in record.items():
            keys.setdefault(key, []).append(value)
    return merged


base, other = run_dir(sys.argv[1]), run_dir(sys.argv[2])
different, details = [], []

# (a) metrics.jsonl
base_metrics, other_metrics = metrics_by_iteration(base / "metrics.jsonl"), metrics_by_iteration(other / "metrics.jsonl")
bad_keys, new_keys, renamed_keys = {}, set(), set()
for iteration, keys in base_metrics.items():
    theirs = other_metrics.get(iteration, {})
    for key, values in keys.items():
        if ignored_metric(key):
            continue
        name = RENAMED[key] if key not in theirs and RENAMED.get(key) in theirs else key  # OTHER's name for it
        if name != key:
            renamed_keys.add((key, name))
        if name not in theirs:
            bad_keys.setdefault(key, []).append(f"iteration {iteration}: missing in OTHER")
        elif len(values) != len(theirs[name]) or not all(map(same, values, theirs[name])):
            bad_keys.setdefault(key, []).append(f"iteration {iteration}: {values} != {theirs[name]}")
    new_keys |= {key for key in theirs if key not in keys and not ignored_metric(key)}
new_keys -= {name for _, name in renamed_keys}
details += [f"  info: metrics {key}: compared with OTHER's {name} (renamed)" for key, name in sorted(renamed_keys)]
for iteration in other_metrics.keys() - base_metrics.keys():
    details.append(f"  info: metrics: OTHER logs iteration {iteration}, BASE does not")
for key, problems in sorted(bad_keys.items()):
    details += [f"  metrics {key}, {problem}" for problem in problems]
if new_keys:
    details.append(f"  info: metrics only OTHER logs: {', '.join(sorted(new_keys))}")
if bad_keys:
    different.append("metrics " + ", ".join(sorted(bad_keys)))

# (b) samples/iter_*.jsonl, byte for byte
base_samples = {p.name: p for p in (base / "samples").glob("iter_*.jsonl")}
other_samples = {p.name: p for p in (other / "samples").glob("iter_*.jsonl")}
bad_files = []
for name in sorted(base_samples.keys() | other_samples.keys()):
    if name not in other_samples or name not in base_samples:
        bad_files.append(name)
        details.append(f"  samples/{name}: only in {'BASE' if name in base_samples else 'OTHER'}")
    elif base_samples[name].read_bytes() != other_samples[name].read_bytes():
        bad_files.append(name)
        ours, theirs = base_samples[name].read_text().splitlines(), other_samples[name].read_text().splitlines()
        line = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if line < min(len(ours), len(theirs)):
            a, b = json.loads(ours[line]), json.loads(theirs[line])
            fields = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k]))
            where = f"line {line + 1} first differs, in {', '.join(fields) or 'its formatting'}"
        else:
            where = f"{len(ours)} lines against {len(theirs)}"
        details.append(f"  samples/{name}: {where}")
if not base_samples:
    details.append("  info: BASE wrote no samples/iter_*.jsonl")
if bad_files:
    different.append("samples " + ", ".join(bad_files))

# (c) summary.json accuracies
base_summary = json.loads((base / "summary.json").read_text())
other_summary = json.loads((other / "summary.json").read_text())
accuracies = sorted(k for k in base_summary.keys() | other_summary.keys() if k.startswith("accuracy"))
bad_accuracies = [k for k in accuracies if not same(base_summary.get(k, "missing"), other_summary.get(k, "missing"))]
details += [f"  summary {k}: {base_summary.get(k, 'missing')} != {other_summary.get(k, 'missing')}" for k in bad_accuracies]
if bad_accuracies:
    different.append("summary " + ", ".join(bad_accuracies))

# (d) args.json: the settings both sides have
base_args, other_args = json.loads((base / "args.json").read_text()), json.loads((other / "args.json").read_text())
common = sorted((base_args.keys() & other_args.keys()) - IGNORED_ARGS)
bad_args = [k for k in common if not same(base_args[k], other_args[k])]
details += [f"  args {k}: {base_args[k]!r} != {other_args[k]!r}" for k in bad_args]
for side, mine, theirs in (("BASE", base_args, other_args), ("OTHER", other_args, base_args)):
    if only := sorted(mine.keys() - theirs.keys()):
        details.append(f"  info: args only {side} has: " + ", ".join(f"{k}={mine[k]!r}" for k in only))
if bad_args:
    different.append("args " + ", ".join(bad_args))

if details:
    print("\n".join(details))
print("DIFFERENT: " + "; ".join(different) if different else "EQUAL")
PY
}

echo "BASE:  $1 = $base_sha"
if [ -n "$other_sha" ]; then
  echo "OTHER: $2 = $other_sha"
else
  echo "OTHER: the checkout $repo as it is now (HEAD $(git -C "$repo" rev-parse --short HEAD)," \
    "$(git -C "$repo" status --porcelain | wc -l) changed or untracked paths)"
fi
echo "work dir: $work; environment: $environment"
echo "settings: ${common[*]}, and per run:"
for name in "${runs[@]}"; do printf '  %-22s %s\n' "$name" "$(run_args "$name" | tr '\n' ' ')"; done
# the digits model and its task, built once by this checkout's code (data both sides read)
if [ ! -f "$work/models/sevens.jsonl" ]; then
  (cd "$repo" && "$PYTHON" -m benchmarks.gpu_check --step models --device cpu --work "$work/models" \
    --out "$work/models/built.json") >"$work/models.log" 2>&1 || { echo "could not build the digits model: $work/models.log"; exit 2; }
fi

if [ -f "$work/base/commit" ] && [ "$(cat "$work/base/commit")" != "$base_sha" ]; then
  echo "the work dir's BASE runs are of commit $(cat "$work/base/commit"): running BASE again"
fi
mkdir -p "$work/base" && echo "$base_sha" >"$work/base/commit"
rm -rf "$work/other"
run_side base "$base_sha"
run_side other "$other_sha"
cleanup
trees=()

verdicts=() found=0
for name in "${runs[@]}"; do
  script=${name%-digits}.py
  echo
  echo "=== $name"
  for kind in help dry-run; do
    [ "$name.py" = "$script" ] || continue
    if diff -q "$work/base/$kind/$name.txt" "$work/other/$kind/$name.txt" >/dev/null 2>&1; then
      echo "--$kind: the same"
    else
      echo "--$kind (information only):"
      diff -u --label "BASE --$kind" --label "OTHER --$kind" "$work/base/$kind/$name.txt" "$work/other/$kind/$name.txt"
    fi
  done
  failed=""
  for side in base other; do
    [ -f "$work/$side/$name.failed" ] && failed+="${failed:+, }${side^^} run failed (exit $(cat "$work/$side/$name.failed"), log $work/$side/logs/$name.log)"
  done
  if [ -n "$failed" ]; then
    verdict="DIFFERENT: $failed"
  else
    report=$(compare_runs "$work/base/out/$name" "$work/other/out/$name" 2>&1)
    verdict=$(tail -n 1 <<<"$report")
    case "$verdict" in EQUAL | DIFFERENT:*) ;; *) verdict="DIFFERENT: the comparison failed" ;; esac
    sed '$d' <<<"$report"  # the detail lines
  fi
  [ "$verdict" = EQUAL ] || found=1
  verdicts+=("$name: $verdict")
done

echo
echo "runtimes (s):"
for name in "${runs[@]}"; do
  printf '  %-22s BASE %5s%-9s   OTHER %5s\n' "$name" "$(cat "$work/base/$name.seconds" 2>/dev/null || echo -)" \
    "${reused[$name]:+ (reused)}" "$(cat "$work/other/$name.seconds" 2>/dev/null || echo -)"
done
echo "whole check: $(($(date +%s) - started)) s; outputs in $work"
echo
printf '%s\n' "${verdicts[@]}"
if [ $found = 0 ]; then
  echo "ALL EQUAL"
  exit 0
fi
echo "DIFFERENCES FOUND"
exit 1
