#!/usr/bin/env bash
# The lease command: the project's GPU steps, each in its own process with its own time limit, a timing line per
# step, and a report of two files: gpu_lease.json (every step's status, seconds and figures) and gpu_lease.log (every
# step's command and output), in $OUT when it is set, else in --out (default runs/gpu_lease).
#
# Two machines:
#   lent (default)  the lent GPU machine as it is: no network, its own Python 3.12, torch 2.11 and transformers 5.17,
#                   no tyro, no math-verify, no vllm. The wheels carried in .whl/ (python -m benchmarks.gpu_lease_wheels
#                   downloads them here) go into a scratch path first; then each script's CUDA path on a small random
#                   model (--backend hf), the update at the real DeepSeek-R1-Distill-Qwen-1.5B shape at the memory
#                   plan's micro-batch, the no-grad passes, the HF sampler. The steps share a budget of 540 s (one
#                   command may run 600 s); a step that would start past it is recorded as skipped.
#   --host          your own GPU host (network, root or not): the apt prerequisites, RUNNING.md's GPU install exactly
#                   (into .venv), then the same steps and the vLLM ones (level-2 sleep against itself, start-up
#                   seconds, rollout tokens per second, spo_tree.py --backend vllm), each engine in its own process:
#                   vLLM 0.30 allows one sleep-mode engine per process.
# --device cpu runs every step's real command at toy sizes on the CPU, and --dry-run prints the host's install instead
# of running it: CI rehearses both machines so (tests/benchmarks/test_gpu_lease.py), so a renamed flag fails there, not here.
#
#   bash benchmarks/gpu_lease.sh                                     # on the lent machine (carry .whl)
#   bash benchmarks/gpu_lease.sh --host                              # on your own GPU host
#   bash benchmarks/gpu_lease.sh --host --device cpu --dry-run --out /tmp/lease    # the rehearsal
# Options: --budget SECONDS (all steps; lent 540, host 7200), --step-limit SECONDS (caps each step's own limit),
# --steps a,b,c (only these), --no-install (--host: use the environment as it is). $PYTHON: the interpreter.
set -uo pipefail  # no -e: a failing step must not stop the next
cd "$(dirname "$0")/.."

mode=lent device=cuda dry_run=0 install=1 budget="" step_limit="" only="" out_dir="${OUT:-runs/gpu_lease}"
while [ $# -gt 0 ]; do
  case "$1" in
    --host) mode=host ;;
    --lent) mode=lent ;;
    --device) device="$2"; shift ;;
    --dry-run) dry_run=1 ;;
    --no-install) install=0 ;;
    --budget) budget="$2"; shift ;;
    --step-limit) step_limit="$2"; shift ;;
    --steps) only=",$2," ; shift ;;
    --out) out_dir="$2"; shift ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_lease.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$device" in cuda | cpu) ;; *) echo "gpu_lease.sh: --device is cuda or cpu" >&2; exit 2 ;; esac
if [ "$dry_run" = 1 ] && [ "$mode" != host ]; then echo "gpu_lease.sh: --dry-run is for --host" >&2; exit 2; fi
budget=${budget:-$([ "$mode" = lent ] && echo 540 || echo 7200)}

# Nothing is downloaded: the models are random, built from configs in code; the task is a local file.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHON=${PYTHON:-python3}
scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu_lease.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
steps_dir="$scratch/steps" work="$scratch/work"
mkdir -p "$steps_dir" "$work" "$out_dir"
log="$out_dir/gpu_lease.log"
: >"$log"
: >"$steps_dir/order"
clock() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }
started=$(clock)
deadline=$(( ${started%.*} + budget ))
echo "[lease] $mode machine, --device $device$([ "$dry_run" = 1 ] && echo ', --dry-run'), budget ${budget} s; \
report in $out_dir" | tee -a "$log"

wanted() { [ -z "$only" ] || [[ "$only" == *",$1,"* ]]; }

report() {  # gpu_lease.json from the steps so far (rewritten after each: a lease cut short keeps its report)
  python3 - "$steps_dir" "$out_dir/gpu_lease.json" "$mode" "$device" "$dry_run" "$budget" "$started" "$log" "$@" <<'EOF'
import json, os, platform, subprocess, sys, time
steps_dir, path, mode, device, dry_run, budget, started, log = sys.argv[1:9]
steps = []
for name in open(os.path.join(steps_dir, "order")).read().split():
    meta = dict(line.rstrip("\n").split("\t", 1) for line in open(os.path.join(steps_dir, name + ".meta")))
    step = {"name": name, "status": meta["status"], "rc": int(meta["rc"]), "seconds": float(meta["seconds"]),
            "limit_s": int(meta["limit"]), "command": meta["command"]}
    try:
        with open(os.path.join(steps_dir, name + ".json")) as file:
            step["result"] = json.load(file).get(name)
    except (OSError, ValueError):
        step["result"] = None
    if step["status"] != "ok" or step["result"] is None:
        try:
            with open(os.path.join(steps_dir, name + ".out"), errors="replace") as file:
                step["output_tail"] = file.read()[-2000:]
        except OSError:
            step["output_tail"] = meta.get("message", "")
    steps.append(step)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
report = {
    "mode": mode, "device": device, "dry_run": dry_run == "1", "budget_s": int(budget),
    "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started))),
    "elapsed_s": round(time.time() - float(started), 1), "host": platform.node(),
    "commit": commit.stdout.strip() or None,
    "summary": {status: [s["name"] for s in steps if s["status"] == status]
                for status in ("ok", "failed", "timed out", "skipped")},
    "steps": steps,
}
with open(path + ".tmp", "w") as file:
    json.dump(report, file, indent=1)
os.replace(path + ".tmp", path)
if sys.argv[9:] == ["final"]:
    summary = report["summary"]
    others = "".join(f"; {status}: {', '.join(names)}" for status, names in summary.items() if status != "ok" and names)
    line = f"[lease] {len(summary['ok'])} ok{others}"
    print(f"{line} -> {path}, {log}")
    with open(log, "a") as file:
        print(line, file=file)
    sys.exit(1 if summary["failed"] or summary["timed out"] else 0)
EOF
}

record() {  # record NAME STATUS RC SECONDS LIMIT MESSAGE COMMAND...: a step's outcome, its timing line, its log
  local name=$1 status=$2 rc=$3 seconds=$4 limit=$5 message=$6; shift 6
  printf 'status\t%s\nrc\t%s\nseconds\t%s\nlimit\t%s\nmessage\t%s\ncommand\t%s\n' "$status" "$rc" "$seconds" \
    "$limit" "$message" "$(printf '%q ' "$@")" >"$steps_dir/$name.meta"
  echo "$name" >>"$steps_dir/order"
  local output="$steps_dir/$name.out" detail=$message
  { echo "===== $name: $status (exit $rc) in $seconds s, limit $limit s"; echo "\$ $*"; } >>"$log"
  if [ -f "$output" ]; then
    if [ "$(wc -c <"$output")" -gt 2000000 ]; then  # a runaway step's output must not crowd out the others'
      head -c 200000 "$output" >>"$log"; echo "[... cut ...]" >>"$log"; tail -c 1800000 "$output" >>"$log"
    else
      cat "$output" >>"$log"
    fi
    # the step's own summary line (gpu_check prints "STEP {json}" last); the last lines when it did not end well
    if [ "$status" = ok ]; then detail=$(grep "^$name " "$output" | tail -n 1 | cut -c $((${#name} + 2))-); fi
    [ -n "$detail" ] || detail=$(tail -n 3 "$output" | tr '\n' ' ')
  fi
  printf '[lease] %-26s %-9s %7s s (limit %s s)  %s\n' "$name" "$status" "$seconds" "$limit" "${detail:0:400}"
  report
}

run_step() {  # run_step NAME LIMIT COMMAND...: the command in its own process, killed at min(LIMIT, budget left)
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local now; now=$(clock); local left=$(( deadline - ${now%.*} - 5 ))  # 5 s for the report
  [ -n "$step_limit" ] && [ "$step_limit" -lt "$limit" ] && limit=$step_limit
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    record "$name" skipped 0 0 0 "the lease's budget of $budget s is spent" "$@"; return 0
  fi
  local begin; begin=$(clock)
  timeout --kill-after=10 "$limit" "$@" >"$steps_dir/$name.out" 2>&1 </dev/null
  local rc=$? end; end=$(clock)
  local seconds; seconds=$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  local status=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status="timed out"; elif [ "$rc" != 0 ]; then status=failed
  elif grep -qs '"skipped"' "$steps_dir/$name.json"; then status=skipped; fi  # e.g. no vllm installed here
  record "$name" "$status" "$rc" "$seconds" "$limit" "" "$@"
}

check() {  # check STEP LIMIT: one step of benchmarks/gpu_check.py
  run_step "$1" "$2" "$PYTHON" -m benchmarks.gpu_check --step "$1" --device "$device" --work "$work" \
    --out "$steps_dir/$1.json"
}

guide_block() {  # the lines of the ```bash block after the line of RUNNING.md that holds $1
  awk -v marker="$1" 'index($0, marker) { found = 1; next } found && /^```bash/ { inside = 1; next }
    inside && /^```/ { exit } inside' RUNNING.md
}

# ----------------------------------------------------------------------------- what each machine needs first
if [ "$mode" = lent ]; then
  # The carried wheels (pure Python) into a scratch path ahead of the machine's own packages, whatever --steps names:
  # every step needs them. --device cpu: a path of this run's own, so the rehearsal installs the same files alike.
  site=$([ "$device" = cuda ] && echo /tmp/site || echo "$scratch/site")
  wheels=(.whl/*.whl)
  only_asked=$only only=""  # the install is no step to leave out
  if [ -e "${wheels[0]}" ]; then
    run_step wheels 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}"
    if [ "$(awk -F '\t' '$1 == "status" { print $2 }' "$steps_dir/wheels.meta")" = ok ]; then
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" GPU_LEASE_SITE="$site"
    fi
  else
    # on the lent machine the scripts cannot import tyro without them; a rehearsal without them runs as it is
    status=$([ "$device" = cuda ] && echo failed || echo skipped)
    record wheels "$status" "$([ "$status" = failed ] && echo 1 || echo 0)" 0 0 \
      "no .whl folder: run python -m benchmarks.gpu_lease_wheels here and carry .whl" ls .whl
  fi
  only=$only_asked
elif [ "$install" = 1 ]; then
  # The apt prerequisites (RUNNING.md, GPU install): python3 -m venv needs python3-venv on Debian and Ubuntu; Triton compiles its
  # launchers with gcc against Python.h (python3-dev).
  apt_packages="python3-venv python3-dev gcc"
  missing=""
  python3 -c "import ensurepip, venv" 2>/dev/null || missing+=" python3-venv"
  python3 -c "import pathlib, sysconfig; assert pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').is_file()" \
    2>/dev/null || missing+=" python3-dev"
  command -v gcc >/dev/null || missing+=" gcc"
  apt="apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_packages"
  if [ "$dry_run" = 1 ]; then  # RUNNING.md's line
    run_step prerequisites 30 printf 'would run: %s\nmissing here:%s\n' \
      "sudo apt-get update && sudo apt-get install -y $apt_packages" "${missing:- nothing}"
  elif [ -z "$missing" ]; then
    run_step prerequisites 30 echo "already there: $apt_packages"
  elif [ "$(id -u)" = 0 ]; then
    run_step prerequisites 900 bash -c "$apt"
  elif sudo -n true 2>/dev/null; then
    run_step prerequisites 900 sudo -n bash -c "$apt"
  elif wanted prerequisites; then
    record prerequisites failed 1 0 0 "not root and no sudo without a password: ask for sudo apt-get install -y \
$apt_packages (missing:$missing)" apt-get install -y $apt_packages
  fi
  # RUNNING.md's GPU install, exactly, into .venv (--dry-run: a venv of this run's own, and the install printed).
  mapfile -t install_lines < <(guide_block "<!-- gpu-install")
  if [ "$dry_run" = 1 ]; then
    run_step venv 300 python3 -m venv "$scratch/venv"
    run_step install 30 printf 'would run: %s\n' "${install_lines[@]}"
  else
    run_step venv 300 python3 -m venv .venv
    joined=$(printf '%s && ' "${install_lines[@]}")
    run_step install 3600 bash -euo pipefail -c ". .venv/bin/activate && ${joined% && }"
    PYTHON=.venv/bin/python
  fi
elif [ -x .venv/bin/python ] && [ "$PYTHON" = python3 ]; then
  PYTHON=.venv/bin/python
fi

# ----------------------------------------------------------------------------- the steps, most telling first
check environment 120
check models 120
check script_spo_tree 180   # two iterations of spo_tree.py --backend hf, memory at auto, the reference parked
check real_shape_update 180
check lora_update 150       # the update with --lora-rank 16: its peak beside the plan's, the vLLM sync's merge
check spo_tree_old_logprob_pass 180
check hf_sampler 120
check script_grpo 150
check script_spo_chain 180
check script_ppo 150
check reference_round_trip 120
if [ "$mode" = host ]; then  # each engine in a process of its own
  check vllm_sleep 900
  check vllm_rollout 1200
  check script_spo_tree_vllm 1200
fi

# ----------------------------------------------------------------------------- the report
report final  # the summary line; exit 1 when a step failed or timed out
