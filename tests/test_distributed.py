"""Many processes (torchrun, gloo on CPU): N ranks make the update one process makes from the union of their samples;
a torchrun run trains, checkpoints and resumes like a single-process one; a failing rank ends the whole job."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import SMOKE_SETTINGS, cli_flags, read_metrics
from plumbing import models

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "helpers" / "distributed_step.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_process_steps(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """Each script's step in one process on every rollout, made once for both shardings (lazily, by script)."""
    made: dict[str, Path] = {}

    def step(script: str) -> Path:
        if script not in made:
            made[script] = tmp_path_factory.mktemp(f"one-{script}")
            run([sys.executable, str(DRIVER), script, str(tiny_model_dir), str(made[script])])
        return made[script] / "world1.pt"

    return step


@pytest.mark.parametrize("sharding", ["replicas", "fsdp"])
@pytest.mark.parametrize("script", ["grpo_baseline", "ppo_baseline", "spo_chain", "spo_tree"])
def test_two_ranks_make_the_update_of_one_process_on_the_union_of_their_samples(
    script, sharding, one_process_steps, tiny_model_dir, tmp_path
):
    run(
        TORCHRUN
        + [str(DRIVER), script, str(tiny_model_dir), str(tmp_path)]
        + (["--fsdp"] if sharding == "fsdp" else [])
    )
    one, two = (
        torch.load(one_process_steps(script), weights_only=True),
        torch.load(tmp_path / ("world2_fsdp.pt" if sharding == "fsdp" else "world2.pt"), weights_only=True),
    )
    initial = dict(models.load_model(str(tiny_model_dir), dtype=torch.float32)[0].named_parameters())
    # the step moved
    assert max((one["parameters"][0][name] - p).abs().max().item() for name, p in initial.items()) > 1e-3
    if "mask_fraction" in one["stats"]:
        assert 0 < one["stats"]["mask_fraction"] < 1  # the probability mask is in play
    for key in one["stats"]:
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    for single, ranks in zip(one["parameters"], two["parameters"]):
        for name in single:
            assert torch.allclose(ranks[name], single[name], rtol=1e-5, atol=1e-7), name


def test_two_ranks_with_lora_agree_and_make_the_update_of_one_process(tiny_model_dir, tmp_path):
    run([sys.executable, str(DRIVER), "grpo_baseline", str(tiny_model_dir), str(tmp_path), "--lora"])
    run(TORCHRUN + [str(DRIVER), "grpo_baseline", str(tiny_model_dir), str(tmp_path), "--lora"])
    one, *ranks = (
        torch.load(tmp_path / name, weights_only=True)
        for name in ("world1_lora_rank0.pt", "world2_lora_rank0.pt", "world2_lora_rank1.pt")
    )
    initial = dict(models.load_model(str(tiny_model_dir), dtype=torch.float32)[0].named_parameters())
    moved = [name for name in one["parameters"][0] if "lora_" in name]
    for name, p in one["parameters"][0].items():  # the base is frozen: every weight as it was loaded
        if "lora_" not in name:
            assert torch.equal(p, initial[name.replace(".base_layer", "")]), name
    assert max(one["parameters"][0][name].abs().max().item() for name in moved if "lora_B" in name) > 1e-4
    for rank in ranks:
        for key in one["stats"]:
            assert rank["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
        for name, single in one["parameters"][0].items():
            assert torch.allclose(rank["parameters"][0][name], single, rtol=1e-5, atol=1e-7), name
    for name, tensor in ranks[0]["parameters"][0].items():
        assert torch.equal(tensor, ranks[1]["parameters"][0][name]), name  # the ranks agree, bit for bit


SMOKE = {  # torchrun settings: SMOKE_SETTINGS with 4 questions (a multiple of 2 ranks) and batches of 8
    "grpo_baseline": dict(questions=4, batch_size=8, micro_batch_size=4),
    "ppo_baseline": dict(questions=4, batch_size=8, micro_batch_size=4),
    "spo_chain": dict(questions=4, batch_size=8, micro_batch_size=4),
    "spo_tree": dict(questions=4, batch_size=8, micro_batch_size=4),
}


def torchrun_script(script: str, model_dir, data, out, **overrides) -> list[str]:
    settings = {
        **SMOKE_SETTINGS[script],
        **SMOKE[script],
        "model": str(model_dir),
        "task": str(data),
        "output_dir": str(out),
        **overrides,
    }
    return TORCHRUN + [str(ROOT / f"{script}.py")] + cli_flags(settings)


def only_run(out) -> Path:
    (run_dir,) = [p for p in Path(out).iterdir() if p.is_dir()]
    return run_dir


# The two with state beyond the policy's (the critic, the replay buffer): their resume under torchrun is checked
# with --fsdp below (the same main(), the optimizer state gathered), which keeps CI short.
RESUMED = ("ppo_baseline", "spo_tree")


@pytest.mark.parametrize("script", ["grpo_baseline", "ppo_baseline", "spo_chain", "spo_tree"])
def test_torchrun_trains_and_writes_one_checkpoint_that_reloads(script, tiny_model_dir, gsm8k_jsonl, tmp_path):
    run(torchrun_script(script, tiny_model_dir, gsm8k_jsonl, tmp_path / "full"))
    full = only_run(tmp_path / "full")
    metrics = read_metrics(full)
    train = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1, 2] and all(math.isfinite(v) for m in metrics for v in m.values())
    assert [m for m in metrics if "eval/accuracy" in m], "evaluated"
    assert json.loads((full / "summary.json").read_text())["checkpoint"] == str(full / "checkpoint")
    model, _ = models.load_model(str(full / "checkpoint"))  # one save_pretrained directory that eval.py loads
    assert torch.load(full / "checkpoint" / "trainer_state.pt", weights_only=True)["world_size"] == 2
    assert len((full / "starts.jsonl").read_text().splitlines()) == 1  # rank 0 alone records the start


@pytest.mark.parametrize("script", RESUMED)
def test_fsdp_trains_saves_one_whole_checkpoint_and_resumes_like_the_uninterrupted_run(
    script, tiny_model_dir, gsm8k_jsonl, tmp_path
):
    # SPO-tree: equal shares
    sharded = dict(fsdp=True, **({"samples_per_iteration": 8} if script == "spo_tree" else {}))
    run(torchrun_script(script, tiny_model_dir, gsm8k_jsonl, tmp_path / "full", **sharded))
    full = only_run(tmp_path / "full")
    metrics = read_metrics(full)
    assert [m["iteration"] for m in metrics if "charts/reward" in m] == [1, 2] and all(
        math.isfinite(v) for m in metrics for v in m.values()
    )
    assert [m for m in metrics if "eval/accuracy" in m], "evaluated"
    # The checkpoint is the whole model, gathered from the shards: every weight at its full shape, under the model's
    # own class (the gathered values are checked against one process's by the equal-update test, through the same
    # distributed.full_state_dict).
    config = json.loads((full / "checkpoint" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    trained = models.load_model(str(full / "checkpoint"))[0].state_dict()
    initial = models.load_model(str(tiny_model_dir))[0].state_dict()
    assert trained.keys() == initial.keys() and all(trained[k].shape == initial[k].shape for k in initial)
    if script == "ppo_baseline":
        critic = torch.load(full / "checkpoint" / "critic.pt", weights_only=True)
        assert critic["backbone.embed_tokens.weight"].shape == initial["model.embed_tokens.weight"].shape

    # Stopped after its first iteration by the time limit (the schedule still plans 2), then resumed without one.
    run(torchrun_script(script, tiny_model_dir, gsm8k_jsonl, tmp_path / "part", **sharded, max_minutes=1e-6))
    part = only_run(tmp_path / "part")
    assert torch.load(part / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 1
    run(TORCHRUN + [str(ROOT / f"{script}.py"), "--resume", str(part), "--max-minutes", "None"])
    assert read_metrics(part) == metrics  # the sharded optimizer state (and the critic's, the buffer) came back


def test_torchrun_converts_smollm2_into_an_empty_cache_on_every_rank(tmp_path):
    """transformers' save_pretrained writes only on rank 0 under a process group: a rank that converted SmolLM2 in
    process would leave a cache without weights. Every rank must find a whole, loadable model."""
    script = tmp_path / "convert.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\nfrom plumbing import distributed, models\n"
        "distributed.init_distributed()\n"
        "path = models.smollm2_dir()\n"
        "assert (path / 'config.json').exists() and (path / 'model.safetensors').exists()\n"
    )
    environment = {**os.environ, "SPO_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(TORCHRUN + [str(script)], capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cache" / "smollm2-135m-instruct")
    assert sum(p.numel() for p in model.parameters()) > 100_000_000


def test_fsdp_at_world_size_1_is_refused_with_the_launch_command(tiny_model_dir, gsm8k_jsonl, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "grpo_baseline.py"),
            "--model",
            str(tiny_model_dir),
            "--task",
            str(gsm8k_jsonl),
            "--output-dir",
            str(tmp_path),
            "--fsdp",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        result.returncode != 0
        and "error: --fsdp shards the model over processes: launch with torchrun" in result.stderr
    )
    assert not list(tmp_path.iterdir())  # refused before a run directory exists


def test_resume_at_another_world_size_is_refused_with_the_command_that_fits(tiny_model_dir, gsm8k_jsonl, tmp_path):
    run(torchrun_script("grpo_baseline", tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1))
    result = subprocess.run(
        [sys.executable, str(ROOT / "grpo_baseline.py"), "--resume", str(only_run(tmp_path)), "--iterations", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "trained by 2 process(es), this is 1" in result.stderr and "torchrun --nproc_per_node 2" in result.stderr
    assert len((only_run(tmp_path) / "starts.jsonl").read_text().splitlines()) == 1  # refused before it is recorded


def test_settings_that_do_not_split_over_the_ranks_fail_on_every_rank_with_one_line(
    tiny_model_dir, gsm8k_jsonl, tmp_path
):
    result = subprocess.run(
        torchrun_script("grpo_baseline", tiny_model_dir, gsm8k_jsonl, tmp_path, questions=3),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "error: --questions (3) must be a multiple of the number of processes (2) under torchrun" in result.stderr
    # one line, no traceback of ours
    assert "UsageError" not in result.stderr and 'grpo_baseline.py", line' not in result.stderr
    assert "exitcode" in result.stderr  # torchrun's own summary of the failed ranks follows


def rank_pids(agent: int) -> dict[int, int]:
    """The worker processes torchrun's agent started, by their RANK."""
    pids = {}
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        for entry in environ:
            if entry.startswith(b"RANK="):
                pids[int(entry[5:])] = int(child)
    return pids


def rank_logs(logs: Path) -> dict[int, str]:
    """Each rank's stderr, as torchrun --log-dir ... --redirects 3 keeps it."""
    return {int(path.parent.name): path.read_text() for path in logs.glob("*/attempt_*/*/stderr.log")}


def start_job(tmp_path: Path, **overrides) -> tuple[subprocess.Popen, Path]:
    """grpo_baseline.py under torchrun on 2 ranks, each rank's output kept in its own file, once training has saved
    its first checkpoint."""
    logs = tmp_path / "logs"
    command = torchrun_script("grpo_baseline", *overrides.pop("inputs"), tmp_path / "runs", **overrides)
    command[command.index("--nproc_per_node") : command.index("--nproc_per_node")] = ["--log-dir", str(logs)]
    command[command.index("--nproc_per_node") : command.index("--nproc_per_node")] = ["--redirects", "3"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not list((tmp_path / "runs").glob("*/checkpoint/trainer_state.pt")):
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.5)
    return job, logs


def last_line(log: str) -> str:
    return log.strip().splitlines()[-1]


RESUME = "continue with: torchrun --nproc-per-node 2 grpo_baseline.py --resume "


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_a_killed_rank_ends_the_other_with_one_line_and_the_torchrun_resume(tiny_model_dir, gsm8k_jsonl, tmp_path):
    job, logs = start_job(tmp_path, inputs=(tiny_model_dir, gsm8k_jsonl), iterations=1000, eval_every=1000)
    try:
        pids = rank_pids(job.pid)
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        output, _ = job.communicate(timeout=120)  # no hang until a collective's timeout
    finally:
        job.kill()
    assert job.returncode != 0
    assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-2000:]
    survivor = rank_logs(logs)[0]
    assert "Traceback" not in survivor, survivor[-3000:]
    line = last_line(survivor)
    # Which comes first is a race the run does not control: rank 0 finds its peer gone at its next collective, or
    # torchrun, which saw the death too, stops it with SIGTERM before that (seen under load). Either way: one line.
    assert line.startswith(("rank 0: another process of this run died or stopped answering (", "interrupted: ")), line
    assert RESUME in line and "keeps its checkpoint of iteration" in line, line


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_a_hung_rank_ends_the_other_at_the_timeout_and_both_name_the_checkpoint(tiny_model_dir, gsm8k_jsonl, tmp_path):
    job, logs = start_job(
        tmp_path, inputs=(tiny_model_dir, gsm8k_jsonl), iterations=1000, eval_every=1000, collective_timeout_minutes=0.1
    )
    try:
        pids = rank_pids(job.pid)
        os.kill(pids[1], signal.SIGSTOP)  # hung: alive, answering nothing
        deadline = time.time() + 120
        while time.time() < deadline and "died or stopped answering" not in rank_logs(logs).get(0, ""):
            time.sleep(0.5)
        os.kill(pids[1], signal.SIGCONT)  # torchrun's SIGTERM, sent as rank 0 ended, is then delivered
        job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0
    ranks = rank_logs(logs)
    assert "Traceback" not in ranks[0], ranks[0][-3000:]
    assert last_line(ranks[0]).startswith("rank 0: another process of this run died or stopped answering (")
    for rank in (0, 1):
        assert "keeps its checkpoint of iteration" in last_line(ranks[rank]), (rank, ranks[rank][-2000:])
        assert RESUME in last_line(ranks[rank]) and "nothing was kept" not in ranks[rank]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_sigterm_to_torchrun_ends_every_rank_with_the_torchrun_resume(tiny_model_dir, gsm8k_jsonl, tmp_path):
    job, logs = start_job(tmp_path, inputs=(tiny_model_dir, gsm8k_jsonl), iterations=1000, eval_every=1000)
    try:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=120)
    finally:
        job.kill()
    [run_dir] = (tmp_path / "runs").iterdir()
    for rank, log in rank_logs(logs).items():
        assert "Traceback" not in log, log[-3000:]
        assert last_line(log).startswith(f"interrupted: {run_dir} keeps its checkpoint of iteration"), last_line(log)
        assert last_line(log).endswith(RESUME + str(run_dir))
    assert not (run_dir / "lock").exists()


def test_eval_under_torchrun_gives_one_process_records_in_order(tiny_model_dir, gsm8k_jsonl, tmp_path):
    command = [
        str(ROOT / "eval.py"),
        "--model",
        str(tiny_model_dir),
        "--task",
        str(gsm8k_jsonl),
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        "--samples",
        "2",
    ]
    run([sys.executable] + command + ["--output", str(tmp_path / "one.json")])
    run(TORCHRUN + command + ["--output", str(tmp_path / "two.json")])  # --backend auto: the HF sampler per rank
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["examples"] == one["examples"] == 8
    # greedy: the same, in order
    assert [r["responses"] for r in two["records"]] == [r["responses"] for r in one["records"]]
    for key in ("accuracy", "pass@2", "majority_accuracy", "truncation_rate", "response_tokens"):
        assert two[key] == one[key], key


def two_nodes(command: list[str], tmp_path: Path, timeout: float = 600) -> None:
    """Run `command` as two torchrun "nodes" of one process each on this machine: --nnodes 2, c10d rendezvous on
    localhost, gloo. Both must succeed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"spo-{port}",
    ]
    nodes = [
        subprocess.Popen(
            launch + ["--node-rank", str(rank)] + command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]


def test_two_nodes_make_the_update_of_one_process(one_process_steps, tiny_model_dir, tmp_path):
    two_nodes([str(DRIVER), "grpo_baseline", str(tiny_model_dir), str(tmp_path)], tmp_path)
    one = torch.load(one_process_steps("grpo_baseline"), weights_only=True)
    two = torch.load(tmp_path / "world2.pt", weights_only=True)
    for key in one["stats"]:
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    for single, ranks in zip(one["parameters"], two["parameters"]):
        for name in single:
            assert torch.allclose(ranks[name], single[name], rtol=1e-5, atol=1e-7), name


def test_two_nodes_write_one_run_directory_whose_checkpoint_reloads_and_resumes(tiny_model_dir, gsm8k_jsonl, tmp_path):
    # one shared filesystem (as a multi-node job needs for its run directory): global rank 0 alone writes
    command = torchrun_script("grpo_baseline", tiny_model_dir, gsm8k_jsonl, tmp_path / "runs", max_minutes=1e-6)[
        len(TORCHRUN) :
    ]
    two_nodes(command, tmp_path)
    run_dir = only_run(tmp_path / "runs")
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["world_size"] == 2
    models.load_model(str(run_dir / "checkpoint"))
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 1 and starts[0]["world_size"] == 2 and starts[0]["device"] == "cpu"
    two_nodes([str(ROOT / "grpo_baseline.py"), "--resume", str(run_dir), "--max-minutes", "None"], tmp_path)
    assert [m["iteration"] for m in read_metrics(run_dir) if "charts/reward" in m] == [1, 2]
    assert not (run_dir / "lock").exists()  # released when the run ended
