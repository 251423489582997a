"""The floor plan: main() shows every setting it changes (no plumbing call mutates `args`), plumbing/ has no import
cycle, is a low floor of machinery (at most MAX_FLOORS modules deep, no algorithm in it), each module states its
concern, and each script's own flags come first in --help."""

import ast
import copy
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import smoke_args
from plumbing import settings

ROOT = Path(__file__).resolve().parents[2]
PLUMBING = ROOT / "plumbing"
SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]
# The longest chain of plumbing modules importing one another (a module importing none is floor 1): a change near the
# bottom reaches at most this many floors above it.
MAX_FLOORS = 6


def plumbing_imports() -> dict[str, set[str]]:
    """Each plumbing module's imports of other plumbing modules, at any depth of the file (imports inside functions
    hide a cycle, they do not remove it). `from plumbing import X` names module X where plumbing/X.py exists."""
    modules = {path.stem for path in PLUMBING.glob("*.py") if path.stem != "__init__"}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((PLUMBING / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "plumbing":
                found |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plumbing."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("plumbing.")}
        graph[name] = found - {name}
    return graph


def test_plumbing_has_no_import_cycle():
    graph, state, cycle = plumbing_imports(), {}, []

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycle.append(path[path.index(imported) :] + [imported] if imported in path else [module, imported])
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycle, f"import cycles in plumbing/: {cycle}"


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """The walk above is what catches the cycle memory.py once hid in a function body."""
    source = "def f():\n    from plumbing.training import no_grad_pass_bytes\n"
    found = {
        node.module.split(".")[1]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plumbing.")
    }
    assert found == {"training"}


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for a module that imports no other plumbing module, else 1 + its highest import's."""
    found: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in found:
            found[module] = 1 + max((floor(imported) for imported in graph[module]), default=0)
        return found[module]

    for module in graph:
        floor(module)
    return found


def test_plumbing_is_a_low_floor():
    found = floors(plumbing_imports())
    top = max(found.values())
    chain = sorted(found, key=found.get, reverse=True)[0]
    assert top <= MAX_FLOORS, f"plumbing/ is {top} floors deep (at most {MAX_FLOORS}): {chain} is on floor {top}"


def test_the_package_docstring_shows_each_modules_floor():
    """plumbing/__init__.py's "Floors" lines name each module on the floor it is on."""
    docstring = ast.get_docstring(ast.parse((PLUMBING / "__init__.py").read_text()))
    shown = {}
    for line in docstring.split("Floors")[1].splitlines()[1:]:
        if not re.match(r"\s+\d+\s", line):
            break
        number, names = line.split(maxsplit=1)
        shown |= {name.strip(): int(number) for name in names.split(",")}
    assert shown == floors(plumbing_imports())


def test_the_floor_count_sees_a_chain():
    assert floors({"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}) == {"a": 3, "b": 2, "c": 1, "d": 1}


def test_every_plumbing_module_states_its_concern():
    """A module is split along a seam a reader can name, never to stay under a count: what holds it is its docstring."""
    for path in sorted(PLUMBING.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and len(docstring) > 40, f"{path.name} has no docstring stating its concern"


# Words of one algorithm: a plumbing function, class or constant named with one of them is that algorithm's code,
# which belongs in its script (PPO's critic and values in ppo_baseline.py, SPO-tree's trees in spo_tree.py).
ALGORITHM_WORDS = ("critic", "value_model", "tree", "cutpoint", "gae")


def test_no_plumbing_module_defines_an_algorithms_piece():
    for path in sorted(PLUMBING.glob("*.py")):
        tree = ast.parse(path.read_text())
        defined = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))] + [
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
        pieces = [name for name in defined if any(word in name.lower() for word in ALGORITHM_WORDS)]
        assert not pieces, f"plumbing/{path.name} defines {pieces}: an algorithm's code belongs in its script"
        # a setting only one script declares (PPO's --critic-lr, SPO-tree's --tree) is looked for in no plumbing code
        strings = [
            node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        looked_for = [value for value in strings if value in ("critic_lr", "tree", "segment_tokens", "lam")]
        assert not looked_for, f"plumbing/{path.name} looks for {looked_for} in a script's settings"


# What each script takes from plumbing: machinery modules, and from training.py / lora.py / precision.py /
# rollout_correction.py the shared steps every script computes the same way. A new name here is a decision: is it
# machinery (then add it), or a piece of one algorithm (then it belongs in that script)?
MODULES = {
    "UsageError",
    "bookkeeping",
    "checkpoints",
    "cli",
    "distributed",
    "engines",
    "models",
    "paper",
    "ranges",
    "tasks",
}
SHARED = {
    "settings",
    "plumbing.precision.FP32",
    "plumbing.precision.Precision",
    "plumbing.rollout_correction.correct_rollouts",
    "plumbing.rollout_correction.rollout_metrics",
    "plumbing.training.attach_old_logprobs",
    "plumbing.training.collate",
    "plumbing.training.make_optimizer",
    "plumbing.training.micro_batches",
    "plumbing.training.new_sample",
    "plumbing.training.reseed",
    "plumbing.training.response_logprobs",
    "plumbing.training.sample_logprobs",
}
PLUMBING_OF_SCRIPT = {
    "spo_chain": MODULES | SHARED | {"runs"},
    "spo_tree": MODULES | SHARED,
    "grpo_baseline": MODULES | SHARED | {"runs"},
    "ppo_baseline": MODULES | SHARED | {"runs", "plumbing.lora.plain_copy", "plumbing.training.no_grad_batches"},
}


def plumbing_names(source: str) -> set[str]:
    """What a file imports from plumbing: a module or class by its name, anything else as plumbing.<module>.<name>."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "plumbing":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plumbing."):
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_each_script_takes_only_machinery_from_plumbing(script):
    taken = plumbing_names(Path(script.__file__).read_text())
    allowed = PLUMBING_OF_SCRIPT[script.__name__]
    assert taken <= allowed, f"{script.__name__} takes {sorted(taken - allowed)} from plumbing, which this test pins"


def test_the_pin_sees_a_name_taken_from_plumbing():
    assert plumbing_names("from plumbing.training import ValueModel\nfrom plumbing import runs\n") == {
        "plumbing.training.ValueModel",
        "runs",
    }


def test_each_constant_of_the_memory_formula_is_defined_once():
    """LOGIT_CHUNK and KEPT_LOGITS live in memory.py; training.py takes them from there, not as literals."""
    from plumbing import memory, training

    parameters = inspect.signature(training.response_logprobs).parameters
    assert parameters["chunk_tokens"].default == memory.LOGIT_CHUNK
    assert parameters["recompute_above"].default == memory.KEPT_LOGITS
    source = (PLUMBING / "training.py").read_text()
    assert "= 512" not in source and "2**28" not in source.replace("(KEPT_LOGITS, 2**28: 1 GiB)", "")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_a_scripts_own_flags_come_first_and_shared_ones_are_declared_once(script):
    names = [f.name for f in dataclasses.fields(script.Args)]
    own = [f.name for f in dataclasses.fields(script.Args) if f.name not in settings.TrainArgs.__dataclass_fields__]
    assert own and names[: len(own)] == own, f"{script.__name__}: its own flags {own} are not first in {names[:8]}"
    shared = settings.TrainArgs()
    body = script.Args.__dict__.get("__annotations__", {})  # the shared fields Args redeclares
    for name in body:
        assert getattr(script.Args(), name) != getattr(shared, name), (
            f"{script.__name__}.Args redeclares --{name.replace('_', '-')} with the shared default"
        )


def watch_args(monkeypatch, touched: list[str]):
    """Wrap every function of every plumbing module and eval.py (and every plumbing class's methods) so that each
    call checks that no TrainArgs passed to it differs after the call from before (deep-equal, however it was
    changed: setattr, vars(args).update, object.__setattr__ ...)."""
    modules = [importlib.import_module(f"plumbing.{p.stem}") for p in PLUMBING.glob("*.py") if p.stem != "__init__"]
    modules.append(importlib.import_module("eval"))

    def guarded(function, where):
        def call(*a, **k):
            watched = [x for x in [*a, *k.values()] if isinstance(x, settings.TrainArgs)]
            before = [copy.deepcopy(vars(x)) for x in watched]
            result = function(*a, **k)
            for x, snapshot in zip(watched, before):
                assert vars(x) == snapshot, f"{where} changed args: {snapshot} -> {vars(x)}"
            if watched:
                touched.append(where)
            return result

        return call

    for module in modules:
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                monkeypatch.setattr(module, name, guarded(value, f"{module.__name__}.{name}"))
            elif inspect.isclass(value) and value.__module__ == module.__name__ and not dataclasses.is_dataclass(value):
                for attribute, method in list(vars(value).items()):
                    if inspect.isfunction(method):
                        monkeypatch.setattr(value, attribute, guarded(method, f"{value.__name__}.{attribute}"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_no_plumbing_call_changes_args(script, tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch):
    """main() takes the `auto` memory settings as a visible step (args = replace(args, **plan.settings())); below
    main() nothing mutates the settings it is given. A wrapped call that mutated args would fail here."""
    touched = []
    watch_args(monkeypatch, touched)
    # The scripts imported these names before the wrapping: point them at the wrapped ones too.
    for name in ("collate", "micro_batches", "reseed", "response_logprobs", "sample_logprobs"):
        if hasattr(script, name):
            monkeypatch.setattr(script, name, getattr(importlib.import_module("plumbing.training"), name))
    args = smoke_args(script, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1)
    given = copy.deepcopy(vars(args))
    script.main(args)
    assert vars(args) == given
    for step in ("memory.size_run", "runs.locate_run", "runs.open_run", "eval.evaluate_policy"):
        assert f"plumbing.{step}" in touched or step in touched, f"{step} was not watched: {sorted(set(touched))}"


def test_the_watch_catches_a_mutation(tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch):
    """The guard itself: a plumbing function that changes args in place fails the run."""
    from plumbing import memory

    real = memory.size_run

    def mutating(args, *rest, **kw):
        vars(args)["micro_batch_size"] = 1
        return real(args, *rest, **kw)

    mutating.__module__ = "plumbing.memory"  # a function of that module, as the watch sees it
    monkeypatch.setattr(memory, "size_run", mutating)
    touched = []
    watch_args(monkeypatch, touched)
    with pytest.raises(AssertionError, match="memory.size_run changed args"):
        grpo_baseline.main(smoke_args(grpo_baseline, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1))


def test_the_package_docstring_maps_every_module():
    """plumbing/__init__.py's docstring is the floor plan: it names each module there is, and none that is gone."""
    docstring = ast.get_docstring(ast.parse((PLUMBING / "__init__.py").read_text()))
    named = set(module_names(docstring))
    present = {path.name for path in PLUMBING.glob("*.py") if path.name != "__init__.py"}
    assert named == present, f"missing from the map: {sorted(present - named)}; gone: {sorted(named - present)}"


def module_names(text: str) -> list[str]:
    return re.findall(r"\b(\w+\.py)\b", text)
