"""benchmarks/gpu_lease.sh, the lease command, rehearsed on the CPU: every step's real command line runs (--device cpu,
--dry-run for the host's install), a failing or hanging step loses no other, each vLLM engine gets a process of its
own (a fake vLLM that refuses a second sleep-mode engine per process, as vLLM 0.30 does), and the wheels carried to
the lent machine cover what the project imports there (no download: the lent machine's package list is in the
repository, benchmarks/gpu_lease_packages.txt). The vLLM steps on the real engine (vLLM's CPU build, in an environment
of its own): tests/test_vllm_cpu_engine.py."""

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from benchmarks import gpu_check, gpu_lease_wheels

ROOT = Path(__file__).resolve().parents[2]

LEASE = ROOT / "benchmarks" / "gpu_lease.sh"
# The lent machine's interpreter, for the wheels' environment markers.
LENT_MARKERS = {
    "extra": "",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "os_name": "posix",
}

# A fake `vllm` package for the rehearsal's own processes: tests/test_vllm_glue.py's fake (vLLM 0.30's signatures, its
# memory tags, samples that follow the weights it holds), whose engine starts with the weights of the model directory
# it loads (so greedy before a level-2 sleep and after the reload can be equal), and which refuses a second sleep-mode
# engine in one process with vLLM 0.30's message (its worker asserts one CuMem allocator user per process).
FAKE_VLLM = """
import hashlib

import test_vllm_glue as glue
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__version__ = "0.30.0"
SamplingParams, TokensPrompt = glue.FakeSamplingParams, glue.FakeTokensPrompt
ENGINES = []  # the engines built in this process
_digest_of = glue.weights_digest


def _digest(weights):  # independent of order: the engine's own load and a reload name the same tensors
    digest = hashlib.sha256()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        digest.update(_digest_of([(name, tensor)]).encode())
    return digest.hexdigest()[:16]


glue.weights_digest = _digest


def LLM(model, **kwargs):  # noqa: N802 (vllm.LLM)
    if kwargs.get("enable_sleep_mode") and any(engine.enable_sleep_mode for engine in ENGINES):
        raise AssertionError("Sleep mode can only be used for one instance per process.")
    llm = glue.make_fake_vllm(glue.FakeEngine(), AutoTokenizer.from_pretrained(model)).LLM(model, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    llm.worker.weights_state = _digest([(n, p.detach().to(llm.worker.dtype)) for n, p in loaded.named_parameters()])
    ENGINES.append(llm)
    return llm
"""


@pytest.fixture(scope="session")
def fake_vllm(tmp_path_factory) -> Path:
    """A folder holding the fake `vllm` package (put it first on PYTHONPATH, with tests/ for test_vllm_glue)."""
    folder = tmp_path_factory.mktemp("fake_vllm")
    (folder / "vllm").mkdir()
    (folder / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return folder


def lease(out: Path, *options: str, env: dict | None = None, timeout: int = 900) -> tuple[int, dict, str]:
    """Run the lease command with `options`; its exit code, its report and its printed lines."""
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment['PATH']}"  # python3: this one
    done = subprocess.run(
        ["bash", str(LEASE), "--out", str(out), *options],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = json.loads((out / "gpu_lease.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["gpu_lease.json", "gpu_lease.log"]  # few files come back
    return done.returncode, report, done.stdout + done.stderr


def steps(report: dict) -> dict:
    return {step["name"]: step for step in report["steps"]}


def with_fake_vllm(fake_vllm: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(fake_vllm), str(ROOT / "tests")])}


def guide_gpu_section() -> str:
    guide = (ROOT / "RUNNING.md").read_text()
    return guide.split("\n## GPU install\n", 1)[1].split("\n## ", 1)[0]


# ----------------------------------------------------------------------------- both machines, every step


def assert_hf_steps(by_name: dict) -> None:
    """What each HF step's result must hold at toy sizes (the figures, not only the exit code)."""
    for name in ("grpo", "spo_chain", "spo_tree", "ppo"):
        result = by_name[f"script_{name}"]["result"]
        assert result["iterations"] == 2 and result["finite_metrics"] and result["problems"] == []
        assert result["memory"].startswith("memory: ")  # what `auto` chose, recorded per script
    assert by_name["script_spo_tree"]["result"]["command"].startswith("python spo_tree.py --model ")
    update = by_name["real_shape_update"]["result"]
    assert set(update) >= {"mb8", "mb4", "mb8_ckpt", "no_grad_logprob_tokens_per_second", "plan"}
    assert update["mb8"]["plan_picked_it"] and update["mb8"]["estimated_gib"] is not None
    adapted = by_name["lora_update"]["result"]
    assert adapted["trainable_parameters"] == adapted["planned_adapters"] and adapted["merge"]["parameters"] > 0
    tree_pass = by_name["spo_tree_old_logprob_pass"]["result"]
    assert tree_pass["edges"] == 2 * (3 + 9) and tree_pass["logprob_max_difference"] == 0  # 2 toy trees 3,3; a CPU
    for name in ("micro_batch_8", "sized_to_memory"):
        assert tree_pass[name]["passes"] >= 1 and 0 < tree_pass[name]["share_of_pass_and_update"] < 1
    assert by_name["hf_sampler"]["result"]["rows240"]["tokens"] == 240 * 16  # ignore_eos: every row its full budget
    round_trip = by_name["reference_round_trip"]["result"]
    assert round_trip["logprobs_equal_resident_and_parked"] and round_trip["parked_after_its_pass"] == ["cpu"]
    environment = by_name["environment"]["result"]
    assert environment["transformers"]["lacks"] == [] and environment["vllm_preflight"].startswith("vLLM pre-flight:")


@pytest.mark.slow
def test_the_lent_machines_rehearsal_runs_every_step(tmp_path):
    code, report, printed = lease(tmp_path, "--device", "cpu", "--budget", "1500")
    by_name = steps(report)
    assert code == 0, printed
    assert report["summary"]["failed"] == report["summary"]["timed out"] == [], printed
    expected = ["wheels", "environment", "models", "script_spo_tree", "real_shape_update", "lora_update"]
    expected += ["spo_tree_old_logprob_pass"]
    expected += ["hf_sampler", "script_grpo", "script_spo_chain", "script_ppo", "reference_round_trip"]
    assert list(by_name) == expected  # no vLLM step on the lent machine: it has no vllm
    # the wheels: installed into a scratch path and used by every later step where they were downloaded (here); CI
    # has none (PyPI is the preparation step's), and says so
    assert by_name["wheels"]["status"] == ("ok" if list((ROOT / ".whl").glob("*.whl")) else "skipped")
    if by_name["wheels"]["status"] == "ok":
        assert by_name["environment"]["result"]["carried_unmet"] == []
    assert_hf_steps(by_name)
    for name, step in by_name.items():  # a timing line per step, as it ends
        assert re.search(rf"^\[lease\] {name} +{step['status']} +[\d.]+ s \(limit \d+ s\)", printed, re.M), name
    log = (tmp_path / "gpu_lease.log").read_text()
    assert all(f"===== {name}: " in log for name in by_name)


@pytest.mark.slow
def test_the_hosts_rehearsal_runs_every_step_and_the_vllm_ones(tmp_path, fake_vllm):
    code, report, printed = lease(
        tmp_path, "--host", "--device", "cpu", "--dry-run", "--budget", "1500", env=with_fake_vllm(fake_vllm)
    )
    by_name = steps(report)
    assert code == 0 and report["summary"]["ok"] == list(by_name), printed
    assert list(by_name)[:3] == ["prerequisites", "venv", "install"]
    assert list(by_name)[-3:] == ["vllm_sleep", "vllm_rollout", "script_spo_tree_vllm"]
    assert_hf_steps(by_name)
    assert by_name["vllm_sleep"]["result"]["greedy_after_reload_equal"] == "8 of 8"


# ----------------------------------------------------------------------------- the host's install


def test_the_hosts_install_is_the_running_guides(tmp_path):
    code, report, printed = lease(
        tmp_path, "--host", "--device", "cpu", "--dry-run", "--steps", "prerequisites,venv,install"
    )
    by_name = steps(report)
    assert code == 0 and list(by_name) == ["prerequisites", "venv", "install"], printed
    section = guide_gpu_section()
    lease_text = LEASE.read_text()
    packages = re.search(r'apt_packages="([^"]+)"', lease_text).group(1)
    apt = f"sudo apt-get update && sudo apt-get install -y {packages}"
    venv = "python3 -m venv .venv && . .venv/bin/activate"
    # the guide names the apt line and the venv before the install block, as a fresh Debian or Ubuntu host needs them
    assert section.index(apt) < section.index(venv) < section.index("<!-- gpu-install")
    log = (tmp_path / "gpu_lease.log").read_text()
    assert f"would run: {apt}" in log
    install = re.search(r"```bash\n(.*?)```", section.split("<!-- gpu-install", 1)[1], re.S).group(1).splitlines()
    printed_install = [
        line.removeprefix("would run: ") for line in log.splitlines() if line.startswith("would run: pip")
    ]
    assert printed_install == install  # exactly the guide's lines, in its order


# ----------------------------------------------------------------------------- one step's failure, one engine a process


def wrapper(tmp_path: Path) -> Path:
    """An interpreter for the lease's steps that breaks the environment step and hangs in the models step."""
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in\n'
        '  *" --step environment "*) echo "environment broken on purpose" >&2; exit 3 ;;\n'
        '  *" --step models "*) exec sleep 300 ;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


def test_a_failing_and_a_hanging_step_do_not_stop_the_next(tmp_path):
    out = tmp_path / "out"
    code, report, printed = lease(
        out,
        "--device",
        "cpu",
        "--steps",
        "environment,models,reference_round_trip",
        "--step-limit",
        "15",
        env={"PYTHON": str(wrapper(tmp_path))},
    )
    by_name = steps(report)
    assert code == 1  # the lease says something failed
    assert by_name["environment"]["status"] == "failed" and by_name["environment"]["rc"] == 3
    assert "environment broken on purpose" in by_name["environment"]["output_tail"]
    assert by_name["models"]["status"] == "timed out" and 14 <= by_name["models"]["seconds"] < 40
    assert by_name["reference_round_trip"]["status"] == "ok"  # the next step ran, and built the models it needs
    assert by_name["reference_round_trip"]["result"]["logprobs_equal_resident_and_parked"]
    summary = {status: [n for n in names if n != "wheels"] for status, names in report["summary"].items()}
    assert summary == {
        "ok": ["reference_round_trip"],
        "failed": ["environment"],
        "timed out": ["models"],
        "skipped": [],
    }


def test_a_step_past_the_budget_is_skipped_and_reported(tmp_path):
    out = tmp_path / "out"
    code, report, _ = lease(
        out, "--device", "cpu", "--steps", "models,hf_sampler", "--budget", "25", env={"PYTHON": str(wrapper(tmp_path))}
    )
    by_name = steps(report)
    assert by_name["models"]["status"] == "timed out" and by_name["models"]["limit_s"] <= 20  # 25 s, 5 for the report
    assert by_name["hf_sampler"]["status"] == "skipped" and "budget" in by_name["hf_sampler"]["output_tail"]


def test_each_vllm_engine_runs_in_a_process_of_its_own(tmp_path, fake_vllm):
    code, report, printed = lease(
        tmp_path,
        "--host",
        "--device",
        "cpu",
        "--no-install",
        "--steps",
        "vllm_sleep,vllm_rollout,script_spo_tree_vllm",
        env=with_fake_vllm(fake_vllm),
    )
    by_name = steps(report)
    assert code == 0 and report["summary"]["ok"] == ["vllm_sleep", "vllm_rollout", "script_spo_tree_vllm"], printed
    sleep = by_name["vllm_sleep"]["result"]
    assert sleep["problems"] == [] and sleep["greedy_after_reload_equal"] == "8 of 8"
    assert sleep["seeded_repeat_equal"] == sleep["seeded_after_reload_equal"] == "8 of 8"
    rollout = by_name["vllm_rollout"]["result"]
    assert rollout["rows"] == 4 * 6 and rollout["tokens"] > 0  # the toy level 1: 4 prompts x 6 segments
    tree = by_name["script_spo_tree_vllm"]["result"]
    assert "--backend vllm" in tree["command"] and "parsed_only" in tree  # no CPU build of vLLM: parsed, not run


@pytest.fixture
def fake_vllm_here(fake_vllm, monkeypatch):
    """The fake installed in this process, as the old gpu_check ran every vLLM step: in one process."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    import test_vllm_glue

    monkeypatch.setattr(test_vllm_glue, "weights_digest", test_vllm_glue.weights_digest)  # the fake replaces it
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):  # VLLMSampler sets them
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    spec = importlib.util.spec_from_file_location("vllm", fake_vllm / "vllm" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "vllm", module)
    spec.loader.exec_module(module)
    return module


def test_two_engines_in_one_process_are_refused(tmp_path, fake_vllm_here):
    args = gpu_check.Args(step="vllm_sleep", device="cpu", work=str(tmp_path))
    assert gpu_check.vllm_sleep(args)["problems"] == []
    with pytest.raises(AssertionError, match="one instance per process"):  # what the lease's processes avoid
        gpu_check.vllm_rollout(gpu_check.Args(step="vllm_rollout", device="cpu", work=str(tmp_path)))


def test_the_sleep_check_sees_weights_that_did_not_come_back(tmp_path, fake_vllm_here, monkeypatch):
    """Level 2 discards the weights: a reload of other values (here, the training model moved by an update) shows in
    greedy after the wake, so the check is not vacuous."""
    from plumbing import engines

    load = engines.VLLMSampler.load_weights

    def load_moved(self, model):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.5)
        load(self, model)

    monkeypatch.setattr(engines.VLLMSampler, "load_weights", load_moved)
    result = gpu_check.vllm_sleep(gpu_check.Args(step="vllm_sleep", device="cpu", work=str(tmp_path)))
    assert "greedy_after_reload_equal" in result["problems"] and result["greedy_after_reload_equal"] != "8 of 8"


# ----------------------------------------------------------------------------- the wheels the lent machine lacks


def normalize(name: str) -> str:
    return gpu_lease_wheels.normalize(name)


def lent_packages() -> dict[str, str | None]:
    """name -> version (None: not known) of benchmarks/gpu_lease_packages.txt."""
    lines = (ROOT / "benchmarks" / "gpu_lease_packages.txt").read_text().splitlines()
    entries = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return {normalize(e.split("==")[0]): (e.split("==", 1)[1] if "==" in e else None) for e in entries}


PACKAGES = ("plumbing", "tests", "benchmarks", "experiments", "tools")  # the project's folders imported as packages


def first_party(module: str) -> Path | None:
    """The project's file for a module name (plumbing.x, tests.x, benchmarks.x, a script, a tests/ module), else
    None."""
    parts = module.split(".")
    if parts[0] in PACKAGES:
        return ROOT / parts[0] / (f"{parts[1]}.py" if len(parts) > 1 else "__init__.py")
    for folder in (ROOT, ROOT / "tests"):
        if (folder / f"{parts[0]}.py").is_file():
            return folder / f"{parts[0]}.py"
    return None


def top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported: import statements at module level and in module-level if/try
    blocks, not inside functions (those are optional: vllm, datasets, matplotlib)."""
    found = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                if node.module in PACKAGES:
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                handlers = [statement for handler in getattr(node, "handlers", []) for statement in handler.body]
                visit(node.body + node.orelse + getattr(node, "finalbody", []) + handlers)

    visit(ast.parse(path.read_text()).body)
    return found


def third_party_imports(start: Path) -> set[str]:
    """The third-party top-level modules imported, at any depth of the project's own modules, from `start`."""
    seen, todo, third = set(), [start], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in top_level_imports(path):
            top = module.split(".")[0]
            if (own := first_party(module)) is not None and own.is_file():
                todo.append(own)
            elif top not in sys.stdlib_module_names and first_party(top) is None:
                third.add(top)
    return third


def missing_on_the_lent_machine(distributions: set[str]) -> list[str]:
    """The distributions neither on the lent machine's list nor carried."""
    return sorted(d for d in distributions if d not in lent_packages() and d not in gpu_lease_wheels.CARRIED)


def lease_distributions() -> set[str]:
    """The distributions of every third-party module the lease's steps import (benchmarks/gpu_check.py and the
    project's modules it imports), as this environment's metadata maps modules to distributions."""
    owners = metadata.packages_distributions()
    modules = third_party_imports(ROOT / "benchmarks" / "gpu_check.py")
    unknown = sorted(m for m in modules if m not in owners)
    assert not unknown, f"modules no installed distribution provides: {unknown}"
    return {normalize(owners[m][0]) for m in modules}


def test_the_carried_wheels_cover_the_project_imports_the_lent_machine_lacks():
    needed = lease_distributions()
    assert {"torch", "transformers", "tyro", "math-verify", "tqdm"} <= needed  # the walk reaches plumbing and scripts
    assert missing_on_the_lent_machine(needed) == []
    carried = {normalize(r.split("==")[0]): r.split("==")[1] for r in gpu_lease_wheels.requirements()}
    lent = lent_packages()
    # what the carried wheels require: on the machine (in a version that satisfies it, where the version is known),
    # or carried too (the carried version satisfying it)
    for name, version in carried.items():
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(LENT_MARKERS):
                continue
            wanted = normalize(requirement.name)
            assert wanted in lent or wanted in carried, f"{name} {version} requires {requirement}: carry it"
            have = carried.get(wanted) or lent.get(wanted)
            assert have is None or requirement.specifier.contains(have, prereleases=True), (
                f"{name} {version} requires {requirement}; the lease would have {wanted} {have}"
            )


def test_nothing_is_carried_that_the_lent_machine_has_in_that_version():
    lent, pinned = lent_packages(), gpu_lease_wheels.pins()
    for requirement in gpu_lease_wheels.requirements():
        name, version = requirement.split("==")
        assert lent.get(name) != version, f"{name} {version} is on the lent machine already: do not carry it"
        if name in pinned:
            assert version == pinned[name]  # the project's own pin, what CI tests
    assert lent["transformers"] == "5.17.0" and lent["python"] == "3.12.3"  # the list is the machine's, as read
    assert "vllm" not in lent and "tyro" not in lent and "math-verify" not in lent


def test_the_import_walk_would_catch_a_new_dependency(tmp_path, monkeypatch):
    script = tmp_path / "uses_tyro_and_yaml.py"
    script.write_text(
        "import os\nimport tyro\ntry:\n    import yaml\nexcept ImportError:\n    pass\n\n\ndef f():\n    import vllm\n"
    )
    assert third_party_imports(script) == {"tyro", "yaml"}  # module level and module-level try; not in a function
    monkeypatch.setattr(gpu_lease_wheels, "CARRIED", {k: v for k, v in gpu_lease_wheels.CARRIED.items() if k != "tyro"})
    assert missing_on_the_lent_machine({"tyro", "pyyaml", "torch"}) == ["tyro"]
