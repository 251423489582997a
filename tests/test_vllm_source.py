"""Hold plumbing/vllm_engine.py's VLLMSampler and the fake `vllm` of test_vllm_glue.py to the real vLLM source.

test_vllm_glue.py runs the glue against a hand-written fake, because vLLM needs a GPU and cannot be
installed here. Nothing there ties the fake to the real package: a keyword vLLM renamed, or one the fake
accepts and vLLM does not, passes there and breaks only on a GPU machine. This file reads the source of
the version pinned in requirements-vllm.txt from its wheel with `ast` (vllm is never imported) and checks:
  - the wheel is the pinned version; vllm exports LLM, SamplingParams and TokensPrompt (followed through
    vllm/__init__.py's lazy export map and re-exports to the file that defines each);
  - every call VLLMSampler makes (found by parsing plumbing/vllm_engine.py) fits the real signature: LLM(...)
    keywords are parameters of LLM.__init__ or, through its **kwargs, EngineArgs fields;
    collective_rpc("reload_weights", kwargs=...) names a Worker method whose GPUModelRunner counterpart takes those
    keywords;
  - the rest the glue relies on: parameter order of collective_rpc, reset_prefix_cache() -> bool, the
    fields it sets and reads, and the VLLM_ENABLE_V1_MULTIPROCESSING switch in vllm/envs.py;
  - sleep level 2 as the glue uses it: nothing offloaded to the host, the "weights" and "kv_cache" tags woken
    one at a time, buffers kept by the worker (reload_weights does not restore them), a second sleep ignored;
  - one engine per torchrun rank: the executor backend the glue names is one 0.30 knows and maps to
    ExecutorWithExternalLauncher (RANK, LOCAL_RANK, env://, in-process core, cuda:LOCAL_RANK), which joins the
    torch.distributed world the training made, with each rank an engine of its own at tensor and data
    parallel size 1 (their defaults), not stepped together with the other ranks;
  - every parameter or field of the fake exists in the real counterpart, at the same position when
    positional, and with the same default where both defaults are literals; the fake's __version__ is the pin;
  - the CUDA of RUNNING.md's torch index (cuXYZ) is the CUDA the wheel's compiled ops link (libcudart.so.N, read
    from their ELF headers) and its metadata's extras name (e.g. nvidia-cutlass-dsl[cu13]), and
    plumbing/vllm_preflight.py suggests that index: a bump of torch's index or of vllm that breaks the pair fails here.

The wheel is ~315 MB, so this runs only with SPO_VLLM_SOURCE_CHECK=1 (CI sets it). With
SPO_VLLM_WHEEL=/path/to/vllm-<pin>-*.whl a local wheel is read instead of downloading one.
"""

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_vllm_glue import (
    FakeCompletionOutput,
    FakeEngine,
    FakeRequestOutput,
    FakeSamplingParams,
    FakeTokensPrompt,
    FakeWorker,
    make_fake_vllm,
)

from plumbing import vllm_engine, vllm_preflight

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    os.environ.get("SPO_VLLM_SOURCE_CHECK") != "1",
    reason="reads the pinned vllm wheel (~315 MB download): set SPO_VLLM_SOURCE_CHECK=1 to run, "
    "and SPO_VLLM_WHEEL=/path/to/vllm-<pin>-*.whl to use a local wheel instead",
)


def pinned_version() -> str:
    match = re.search(r"^\s*vllm\s*==\s*([^\s;#]+)", (ROOT / "requirements-vllm.txt").read_text(), re.M)
    assert match, "requirements-vllm.txt has no 'vllm==<version>' line"
    return match.group(1)


PIN = pinned_version()


class Source:
    """The wheel's Python files, parsed on demand. A failed download fails each test that reads them."""

    def __init__(self, wheel: Path | None = None, error: str | None = None):
        self.wheel, self.error, self.trees = wheel, error, {}
        self.zip = zipfile.ZipFile(wheel) if wheel else None

    def names(self) -> dict:
        if self.error:
            pytest.fail(self.error, pytrace=False)
        return self.zip.NameToInfo

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            assert path in self.names(), f"the vllm {PIN} wheel has no {path}"
            self.trees[path] = ast.parse(self.zip.read(path), path)
        return self.trees[path]

    def find_class(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        """(file, class) for class `name` of `module`, following `from ... import name` re-exports."""
        base = module.replace(".", "/")
        path = next((p for p in (base + ".py", base + "/__init__.py") if p in self.names()), None)
        assert path, f"the vllm {PIN} wheel has no module {module}"
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in self.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return path, node
            for alias in node.names if isinstance(node, ast.ImportFrom) else ():
                if (alias.asname or alias.name) == name:
                    source = package if node.level else node.module
                    for _ in range(node.level - 1):
                        source = source.rpartition(".")[0]
                    if node.level and node.module:
                        source += "." + node.module
                    return self.find_class(source, alias.name)
        raise AssertionError(f"{path}: class {name} is neither defined nor imported there")

    def export(self, name: str) -> tuple[str, ast.ClassDef]:
        """Class `name` as `from vllm import name` gets it: the lazy export map, else a direct import."""
        for node in self.tree("vllm/__init__.py").body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for key, value in zip(node.value.keys, node.value.values):
                    if getattr(key, "value", None) == name and ":" in str(getattr(value, "value", "")):
                        module, _, attr = value.value.partition(":")  # e.g. ".inputs:TokensPrompt"
                        return self.find_class("vllm" + module if module.startswith(".") else module, attr)
        return self.find_class("vllm", name)


def method(where: tuple[str, ast.ClassDef], name: str) -> ast.FunctionDef:
    path, cls = where
    defs = [
        n
        for n in cls.body
        if isinstance(n, ast.FunctionDef)
        and n.name == name
        and not any("overload" in ast.unparse(d) for d in n.decorator_list)
    ]
    assert defs, f"{path}: class {cls.name} has no method {name}"
    return defs[-1]


def signature(fn: ast.FunctionDef) -> tuple[list[str], dict[str, ast.expr | None], bool]:
    """(positional parameter names, {parameter: default node or None}, takes **kwargs), without self."""
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    named = dict(zip(positional, [None] * (len(positional) - len(a.defaults)) + a.defaults))
    named |= {p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults)}
    if positional[:1] in (["self"], ["cls"]):
        named.pop(positional.pop(0))
    return positional, named, a.kwarg is not None


def fields(src: Source, where: tuple[str, ast.ClassDef]) -> dict[str, ast.expr | None]:
    """Annotated class attributes (dataclass, msgspec.Struct, TypedDict; with same-file bases), plus the
    parameters of __init__ and the `self.x` it assigns, each with its default node (or None)."""
    path, cls = where
    out = {}
    for base in cls.bases:
        for node in src.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == ast.unparse(base):
                out |= fields(src, (path, node))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node.value
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            out |= signature(node)[1]
            for n in ast.walk(node):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) == "self":
                    out.setdefault(n.attr, None)
    return out


def llm_init(src: Source) -> tuple[list[str], dict[str, ast.expr | None], bool]:
    """LLM.__init__'s signature; its **kwargs go to EngineArgs, so those fields count as parameters."""
    positional, named, kwargs = signature(method(src.export("LLM"), "__init__"))
    if kwargs:
        named = fields(src, src.find_class("vllm.entrypoints.llm", "EngineArgs")) | named
    return positional, named, kwargs


def glue_calls() -> list[tuple[str, ast.Call]]:
    """('LLM' | 'SamplingParams' | 'TokensPrompt' | 'LLM.<method>', call) for each such call in VLLMSampler."""
    tree = ast.parse((ROOT / "plumbing" / "vllm_engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VLLMSampler")
    out = []
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("LLM", "SamplingParams", "TokensPrompt")
        ):
            out.append((node.func.id, node))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "self.llm"
        ):
            out.append(("LLM." + node.func.attr, node))
    return out


def literal(node: ast.expr):
    """The value of a literal default, or inspect.Parameter.empty for anything else."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return inspect.Parameter.empty  # not a literal (e.g. ModelConfig.max_model_len): not compared


def assert_fake_fits(fake, real: tuple[list[str], dict[str, ast.expr | None], bool], where: str):
    """Every parameter of `fake` (a function, self dropped) exists in `real`, in place if positional, with
    the same default where both are literals; a fake default for a parameter vLLM requires is an error."""
    params = [
        p
        for p in inspect.signature(fake).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    real_positional, real_named, _ = real
    for i, p in enumerate(q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)):
        assert real_positional[i : i + 1] == [p.name], (
            f"{where}: the fake takes {p.name!r} as positional parameter {i}, "
            f"vllm {PIN} has {real_positional[i : i + 1]}"
        )
    for p in params:
        assert p.name in real_named, f"{where}: the fake accepts {p.name!r}, vllm {PIN} has no such parameter"
        if p.default is not p.empty:
            assert real_named[p.name] is not None, f"{where}: the fake defaults {p.name!r}, vllm {PIN} requires it"
            real_default = literal(real_named[p.name])
            assert real_default is p.empty or real_default == p.default, (
                f"{where}: {p.name!r} defaults to {real_default!r} in vllm {PIN}, to {p.default!r} in the fake"
            )


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Source:
    if local := os.environ.get("SPO_VLLM_WHEEL"):
        return Source(Path(local)) if Path(local).is_file() else Source(error=f"SPO_VLLM_WHEEL={local}: no such file")
    directory = tmp_path_factory.mktemp("vllm_wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"vllm=={PIN}",
        "-d",
        str(directory),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(directory.glob("vllm-*.whl"))
    if done.returncode or not wheels:
        return Source(
            error=f"could not download the vllm {PIN} wheel ({' '.join(cmd)} exited {done.returncode}); "
            f"offline? point SPO_VLLM_WHEEL at a local wheel.\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
        )
    return Source(wheels[0])


def test_wheel_is_the_pinned_version(src):
    names = src.names()
    assert src.wheel.name.split("-")[1] == PIN, f"{src.wheel.name} is not vllm {PIN} (requirements-vllm.txt)"
    metadata = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
    assert metadata, f"{src.wheel.name} has no .dist-info/METADATA"
    assert f"\nVersion: {PIN}\n" in src.zip.read(metadata).decode(), f"{metadata}: Version is not {PIN}"


@pytest.mark.parametrize("name", ["LLM", "SamplingParams", "TokensPrompt"])
def test_top_level_export(src, name):
    path, cls = src.export(name)
    assert cls.name == name, f"vllm.{name} resolves to class {cls.name} in {path}"


def test_glue_calls_fit_the_real_signatures(src):
    calls = glue_calls()
    assert {"LLM", "SamplingParams", "TokensPrompt"} <= {kind for kind, _ in calls}, (
        "VLLMSampler calls not found in plumbing/vllm_engine.py"
    )
    for kind, call in calls:
        if kind == "LLM":
            where, (positional, named, _) = f"{src.export('LLM')[0]}: LLM.__init__ (or EngineArgs)", llm_init(src)
        elif kind.startswith("LLM."):
            where, (positional, named, _) = (
                f"{src.export('LLM')[0]}: {kind}",
                signature(method(src.export("LLM"), kind[4:])),
            )
        else:
            path, cls = src.export(kind)
            where, positional, named = f"{path}: {kind}", [], fields(src, (path, cls))
        assert len(call.args) <= len(positional), (
            f"{where}: plumbing/vllm_engine.py line {call.lineno} passes {len(call.args)} positional arguments"
        )
        for kw in call.keywords:
            assert kw.arg in named, f"{where} has no parameter {kw.arg!r} (plumbing/vllm_engine.py line {call.lineno})"


def test_llm_api_the_glue_relies_on(src):
    llm = src.export("LLM")
    assert llm_init(src)[0][:1] == ["model"], f"{llm[0]}: LLM.__init__'s first parameter is not 'model'"
    for name, wanted in {
        "generate": ["prompts", "sampling_params", "use_tqdm"],
        "get_tokenizer": [],
        "collective_rpc": ["method", "timeout", "args", "kwargs"],
        "reset_prefix_cache": [],
        "sleep": ["level"],
        "wake_up": ["tags"],
    }.items():
        named = signature(method(llm, name))[1]
        assert [n for n in named if n in wanted] == wanted, (
            f"{llm[0]}: LLM.{name}{tuple(named)} lacks {wanted} in this order"
        )
    returns = method(llm, "reset_prefix_cache").returns
    assert returns is not None and ast.unparse(returns) == "bool", (
        f"{llm[0]}: LLM.reset_prefix_cache no longer returns bool"
    )


def test_fields_the_glue_sets_and_reads(src):
    for name, wanted in {
        "SamplingParams": ["n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs"],
        "TokensPrompt": ["prompt_token_ids"],
        "CompletionOutput": ["token_ids", "finish_reason", "logprobs"],
        "RequestOutput": ["outputs"],
    }.items():
        path, cls = src.export(name)
        missing = set(wanted) - set(fields(src, (path, cls)))
        assert not missing, f"{path}: {name} has no {sorted(missing)}"


def test_processed_logprobs_are_after_temperature_and_top_p(src):
    # The glue asks for logprobs_mode="processed_logprobs" and holds them against the trainer's log softmax(logits /
    # temperature), over the nucleus at top_p < 1 (plumbing/rollout_correction.py); each sampled token's comes back
    # as a Logprob with a .logprob.
    modes = next(
        node.value
        for node in src.tree("vllm/config/model.py").body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["LogprobsMode"]
    )
    assert "processed_logprobs" in ast.literal_eval(modes.slice), "vllm/config/model.py: LogprobsMode changed"
    sample = ast.unparse(method(src.find_class("vllm.v1.sample.sampler", "Sampler"), "sample"))
    temperature, nucleus = sample.find("self.apply_temperature("), sample.find("self.topk_topp_sampler(")
    assert 0 <= temperature < nucleus, (
        "vllm/v1/sample/sampler.py: Sampler.sample no longer applies the temperature before top-k/top-p, where the "
        "processed log-probs are taken"
    )
    assert "logprob" in fields(src, src.find_class("vllm.logprobs", "Logprob")), "vllm/logprobs.py: Logprob.logprob"
    # At top_p < 1 they are the log_softmax of the logits cut to the nucleus, by the rule training.nucleus_logprobs
    # rebuilds for the trainer's side of the sampler metrics: sort ascending, cut while the cumulative probability is
    # at most 1 - p, keep the last (likeliest) token.
    path, sampler = src.find_class("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler")
    for name in ("forward_native", "forward_cpu"):
        body = ast.unparse(method((path, sampler), name))
        cut, processed = body.find("apply_top_k_top_p(logits"), body.find("logits.log_softmax(")
        assert 0 <= cut < processed, f"{path}: TopKTopPSampler.{name} no longer log-softmaxes the top-p cut logits"
    [rule] = [
        ast.unparse(node)
        for node in src.tree(path).body
        if isinstance(node, ast.FunctionDef) and node.name == "apply_top_k_top_p_pytorch"
    ]
    for step in ("logits.sort(dim=-1, descending=False)", "<= 1 - p.unsqueeze(dim=1)", "top_p_mask[:, -1] = False"):
        assert step in rule, f"{path}: apply_top_k_top_p_pytorch's top-p rule changed ({step!r} is gone)"


def test_reload_weights_reaches_the_model_runner(src):
    worker = src.find_class("vllm.v1.worker.gpu_worker", "Worker")
    runner = src.find_class("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    method(worker, "reload_weights")
    missing = {"weights_iterator", "is_checkpoint_format"} - set(signature(method(runner, "reload_weights"))[1])
    assert not missing, f"{runner[0]}: GPUModelRunner.reload_weights has no {sorted(missing)}"
    for kind, call in glue_calls():
        # a callable (the CPU build's tied-head repack) runs in the worker as it is; a name must be a Worker method
        if kind == "LLM.collective_rpc" and isinstance(call.args[0], ast.Constant):
            rpc = ast.literal_eval(call.args[0])
            where = worker
            if signature(method(worker, rpc))[2]:  # Worker.<rpc>(*args, **kwargs) forwards to the model runner
                assert f"self.model_runner.{rpc}(" in ast.unparse(method(worker, rpc)), (
                    f"{worker[0]}: Worker.{rpc} takes **kwargs but does not call self.model_runner.{rpc}"
                )
                where = runner
            named = signature(method(where, rpc))[1]
            for kw in (k for k in call.keywords if k.arg == "kwargs"):
                assert isinstance(kw.value, ast.Dict), (
                    f"plumbing/vllm_engine.py line {call.lineno}: collective_rpc kwargs is not a dict literal"
                )
                for key in map(ast.literal_eval, kw.value.keys):
                    assert key in named, (
                        f"{where[0]}: {where[1].name}.{rpc} takes no {key!r} "
                        f"(plumbing/vllm_engine.py line {call.lineno})"
                    )


def test_environment_switches(src):
    keys = {
        k.value
        for d in ast.walk(src.tree("vllm/envs.py"))
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant)
    }
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):  # in-process engine; no nvcc JIT
        assert name in keys, f"vllm/envs.py no longer reads {name}"


def test_child_requests_get_distinct_seeds(src):
    # VLLMSampler sends one seed per prompt with n samples; the samples differ only because each child gets seed + i.
    body = ast.unparse(
        method(src.find_class("vllm.v1.engine.parallel_sampling", "ParentRequest"), "_get_child_sampling_params")
    )
    assert "seed + index" in body, "vllm/v1/engine/parallel_sampling.py no longer seeds child i with seed + i"


def body(src: Source, module: str, name: str, function: str | None = None) -> str:
    """The source of class `name`'s method `function` in `module` (or of the module-level function `name`), as
    ast.unparse writes it (quotes normalised to '...')."""
    if function:
        return ast.unparse(method(src.find_class(module, name), function))
    path = module.replace(".", "/") + ".py"
    defs = [n for n in src.tree(path).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert defs, f"{path} has no function {name}"
    return ast.unparse(defs[-1])


def test_sleep_level_2_discards_the_weights_and_wakes_by_tag(src):
    # VLLMSampler.sleep uses level 2 because nothing is copied to the host there (level 1 offloads the weights).
    suspend = body(src, "vllm.device_allocator.sleep_mode_backend", "CuMemBackend", "suspend")
    assert "offload_tags=('weights',) if level == 1 else tuple()" in suspend, (
        "vllm/device_allocator/sleep_mode_backend.py: CuMemBackend.suspend no longer offloads nothing at level 2"
    )
    # wake_up(tags=["weights"]), load, wake_up(tags=["kv_cache"]): the executor tracks the two tags, wakes each one
    # alone, and ignores a sleep while any sleeps (VLLMSampler.sleep wakes the KV cache first then).
    executor = src.find_class("vllm.v1.executor.abstract", "Executor")
    sleep, wake_up = ast.unparse(method(executor, "sleep")), ast.unparse(method(executor, "wake_up"))
    assert "self.sleeping_tags = {'weights', 'kv_cache'}" in sleep, (
        "Executor.sleep: the tags are not weights and kv_cache"
    )
    assert "if self.is_sleeping:" in sleep and "return" in sleep, "Executor.sleep no longer ignores a second sleep"
    assert "self.sleeping_tags.remove(tag)" in wake_up, "Executor.wake_up no longer wakes tags one at a time"
    worker = ast.unparse(src.find_class("vllm.v1.worker.gpu_worker", "Worker")[1])
    for tag in ("weights", "kv_cache"):
        assert f"_maybe_get_memory_pool_context(tag='{tag}')" in worker, (
            f"gpu_worker.py allocates no memory under tag {tag!r}"
        )
    assert "resume_scheduler" in body(src, "vllm.v1.engine.core", "EngineCore", "wake_up"), (
        "EngineCore.wake_up no longer resumes scheduling once every tag is awake"
    )


def test_buffers_survive_level_2_through_the_worker_not_the_reload(src):
    # Level 2 discards the "weights" pool, buffers (RoPE caches) included: the worker keeps them on the host and
    # puts them back when "weights" wakes; the in-place reload rewrites parameters and skips such buffers.
    sleep = body(src, "vllm.v1.worker.gpu_worker", "Worker", "sleep")
    wake_up = body(src, "vllm.v1.worker.gpu_worker", "Worker", "wake_up")
    assert "if level == 2:" in sleep and "model.named_buffers()" in sleep, (
        "Worker.sleep(level=2) no longer saves the buffers"
    )
    assert "wake_weights = tags is None or 'weights' in tags" in wake_up and "_sleep_saved_buffers" in wake_up, (
        "Worker.wake_up no longer restores the buffers when 'weights' wakes"
    )
    restore = body(src, "vllm.model_executor.model_loader.reload.layerwise", "_copy_and_restore_kernel_tensors")
    assert "if name in non_persistent and name not in loaded_tensor_names:" in restore, (
        "layerwise.py: _copy_and_restore_kernel_tensors may now overwrite buffers the reload did not load"
    )
    assert "finalize_layerwise_reload(model" in body(
        src, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights"
    ), "GPUModelRunner.reload_weights no longer goes through model_loader/reload/layerwise.py"


def test_what_the_in_process_engine_sets_for_the_trainers_process(src):
    # VLLMSampler puts back what the engine's worker sets for the whole process (plumbing/vllm_engine.py, the comment
    # above the class), releases the heap EngineCore froze at exit, and leaves a reload's known warnings out of the log.
    init = body(src, "vllm.v1.worker.gpu_worker", "Worker", "__init__")
    assert "torch.set_float32_matmul_precision(precision)" in init, (
        "Worker.__init__ no longer sets the matmul precision"
    )
    assert "set_torch_threads_for_runtime()" in body(
        src, "vllm.v1.worker.gpu_worker", "Worker", "compile_or_warm_up_model"
    ), "Worker.compile_or_warm_up_model no longer sets torch's threads for serving"
    runtime = body(src, "vllm.utils.torch_utils", "set_torch_threads_for_runtime")
    assert "torch.set_num_threads(1)" in runtime and "OMP_NUM_THREADS" in runtime, (
        "set_torch_threads_for_runtime no longer drops torch to one thread unless OMP_NUM_THREADS is set"
    )
    assert "freeze_gc_heap()" in body(src, "vllm.v1.engine.core", "EngineCore", "__init__")
    assert "gc.unfreeze()" in body(src, "vllm.v1.engine.core", "EngineCore", "shutdown")
    finalize = body(src, "vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_processing")
    warning = f"logger.warning({vllm_engine.RELOAD_WARNING!r}, layer.__class__.__name__)"
    assert warning in finalize, f"layerwise.py no longer logs {warning}: plumbing/vllm_engine.py's filter misses it"
    assert "logger = init_logger(__name__)" in ast.unparse(
        src.tree(vllm_engine.RELOAD_LOGGER.replace(".", "/") + ".py")
    ), f"{vllm_engine.RELOAD_LOGGER} no longer logs under its module's name"


def glue_executor_backends() -> set:
    """The distributed_executor_backend values VLLMSampler's LLM(...) call can pass (string constants)."""
    for kind, call in glue_calls():
        for kw in call.keywords if kind == "LLM" else ():
            if kw.arg == "distributed_executor_backend":
                return {n.value for n in ast.walk(kw.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    raise AssertionError("VLLMSampler's LLM(...) passes no distributed_executor_backend")


def test_torchrun_engines_use_the_external_launcher(src):
    backends = glue_executor_backends()
    assert backends == {"external_launcher"}, (
        f"plumbing/vllm_engine.py passes distributed_executor_backend {sorted(backends)}"
    )
    tree = src.tree("vllm/config/parallel.py")
    literal = next(
        ast.unparse(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "DistributedExecutorBackend"
    )
    assert "'external_launcher'" in literal, f"vllm/config/parallel.py: DistributedExecutorBackend = {literal}"
    get_class = body(src, "vllm.v1.executor.abstract", "Executor", "get_class")
    assert (
        "distributed_executor_backend == 'external_launcher':\n        executor_class = ExecutorWithExternalLauncher"
        in get_class
    ), (
        "vllm/v1/executor/abstract.py: Executor.get_class no longer maps external_launcher to "
        "ExecutorWithExternalLauncher"
    )
    launcher = src.find_class("vllm.v1.executor.uniproc_executor", "ExecutorWithExternalLauncher")
    args = ast.unparse(method(launcher, "_distributed_args"))
    for needed in ("'env://'", "os.environ['RANK']", "os.environ['LOCAL_RANK']"):
        assert needed in args, f"{launcher[0]}: ExecutorWithExternalLauncher._distributed_args no longer uses {needed}"
    assert "not envs.VLLM_ENABLE_V1_MULTIPROCESSING" in ast.unparse(method(launcher, "_init_executor"))
    # collective: the fake joins one too
    assert "ReduceOp.MIN" in ast.unparse(method(launcher, "determine_available_memory"))
    # The engine's GPU is the rank's own: no data-parallel offset to LOCAL_RANK for this backend.
    assert "not in ('ray', 'external_launcher')" in body(src, "vllm.v1.worker.gpu_worker", "Worker", "init_device")


def test_external_launcher_engines_are_independent_in_the_training_world(src):
    # The world the training's init_distributed made is reused (not a new one of size 1 at rank RANK).
    init = body(src, "vllm.distributed.parallel_state", "init_distributed_environment")
    assert (
        "if not torch.distributed.is_initialized():" in init
        and "ranks = list(range(torch.distributed.get_world_size()))" in init
    ), "vllm/distributed/parallel_state.py: init_distributed_environment no longer reuses an initialised world"
    # Ranks are laid out ExternalDP x DP x PP x PCP x TP: at TP = DP = PP = PCP = 1 every rank is its own engine.
    layout = body(src, "vllm.distributed.parallel_state", "initialize_model_parallel")
    assert (
        "torch.arange(world_size).reshape(-1, data_parallel_size, pipeline_model_parallel_size, "
        "prefill_context_model_parallel_size, tensor_model_parallel_size)"
    ) in layout, "initialize_model_parallel no longer puts the external data-parallel dimension first"
    # Sizes the glue relies on: tensor_parallel_size is passed (1); data, pipeline and prefill-context parallel sizes
    # keep their defaults of 1. Data parallel > 1 would step the ranks' engines together.
    parallel = src.find_class("vllm.config.parallel", "ParallelConfig")
    for name in (
        "tensor_parallel_size",
        "data_parallel_size",
        "pipeline_parallel_size",
        "prefill_context_parallel_size",
    ):
        default = fields(src, parallel)[name]
        assert default is not None and "default=1" in ast.unparse(default), (
            f"{parallel[0]}: ParallelConfig.{name} = {ast.unparse(default)}"
        )
    engine = body(src, "vllm.v1.engine.llm_engine", "LLMEngine", "__init__")
    assert (
        "self.external_launcher_dp = parallel_config.data_parallel_size > 1 and executor_backend == 'external_launcher'"
        in engine
    )
    assert "has_unfinished_requests_dp" in body(
        src, "vllm.v1.engine.llm_engine", "LLMEngine", "has_unfinished_requests"
    )


def readme_torch_index() -> str:
    """The --index-url of RUNNING.md's GPU install of torch (the block .ci/gpu_resolve.py reads)."""
    spec = importlib.util.spec_from_file_location("gpu_resolve", ROOT / ".ci" / "gpu_resolve.py")
    gpu_resolve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_resolve)
    commands = gpu_resolve.gpu_install((ROOT / "RUNNING.md").read_text())
    assert commands, "RUNNING.md has no ```bash block after a <!-- gpu-install comment"
    torch_install = commands[0]
    assert "--index-url" in torch_install[:-1], (
        f"RUNNING.md's torch install names no --index-url: {' '.join(torch_install)}"
    )
    return torch_install[torch_install.index("--index-url") + 1]


def test_readme_torch_index_is_the_cuda_of_the_wheel(src):
    index = readme_torch_index()
    tag = re.search(r"/(cu\d+)/?$", index)
    assert tag, f"RUNNING.md's torch index {index} names no CUDA build (cuXYZ)"
    readme_major = vllm_preflight.cuda_major(tag.group(1))
    linked = {}
    for name in (n for n in src.names() if re.fullmatch(r"vllm/[^/]+\.so", n)):  # the compiled ops vllm loads
        with src.zip.open(name) as so:
            linked[name] = vllm_preflight.linked_cuda_majors(vllm_preflight.elf_needed(so))
    assert any(linked.values()), f"no top-level .so of the vllm {PIN} wheel links libcudart"
    wrong = {name: sorted(majors) for name, majors in linked.items() if majors and majors != {readme_major}}
    assert not wrong, (
        f"RUNNING.md installs torch for CUDA {readme_major} ({index}); vllm {PIN}'s ops link libcudart.so.N: {wrong}"
    )
    metadata = src.zip.read(next(n for n in src.names() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    extras = vllm_preflight.extra_cuda_majors([r for r in requires if "extra ==" not in r])
    assert extras == {readme_major}, (
        f"vllm {PIN}'s requirements name CUDA {sorted(extras)} extras; RUNNING.md's torch is CUDA {readme_major}"
    )
    assert vllm_preflight.TORCH_INDEX.get(readme_major) == index, (
        f"plumbing/vllm_preflight.py suggests {vllm_preflight.TORCH_INDEX.get(readme_major)} for CUDA {readme_major}; "
        f"RUNNING.md uses {index}"
    )


FAKE_LLM = make_fake_vllm(FakeEngine()).LLM


@pytest.mark.parametrize(
    "name", ["__init__", "generate", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up", "get_tokenizer"]
)
def test_fake_llm_method_matches_the_real_one(src, name):
    real = llm_init(src) if name == "__init__" else signature(method(src.export("LLM"), name))
    assert_fake_fits(getattr(FAKE_LLM, name), real, f"vllm/entrypoints/llm.py: LLM.{name}")


def test_fake_sampling_params_match_the_real_ones(src):
    path, cls = src.export("SamplingParams")
    assert_fake_fits(FakeSamplingParams.__init__, ([], fields(src, (path, cls)), False), f"{path}: SamplingParams")


def test_fake_worker_matches_the_model_runner(src):
    runner = src.find_class("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    assert_fake_fits(
        FakeWorker.reload_weights,
        signature(method(runner, "reload_weights")),
        "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.reload_weights",
    )


@pytest.mark.parametrize(
    "name, fake_fields",
    [
        ("TokensPrompt", list(FakeTokensPrompt.__annotations__)),
        ("CompletionOutput", [f.name for f in dataclasses.fields(FakeCompletionOutput)]),
        ("RequestOutput", [f.name for f in dataclasses.fields(FakeRequestOutput)]),
    ],
)
def test_fake_prompt_and_outputs_have_real_fields(src, name, fake_fields):
    path, cls = src.export(name)
    missing = set(fake_fields) - set(fields(src, (path, cls)))
    assert not missing, f"{path}: {name} has no {sorted(missing)}, which the fake has"


def test_fake_version_is_the_pin():
    version = make_fake_vllm(FakeEngine()).__version__
    assert version == PIN, f"tests/test_vllm_glue.py: the fake's __version__ is {version}, the pin is {PIN}"
