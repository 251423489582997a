"""Run the pinned vLLM's real tokenizer and prompt path against this project's transformers and torch, on CPU.

Why: vllm 0.30.0 (requirements-vllm.txt) declares transformers>=5.10.4 with no upper bound, so pip accepts it with
our transformers 5.24.0, but upstream never tested that pair: 0.31 caps transformers below 5.18. test_vllm_source.py
reads the wheel's source with `ast` and never imports it, so a break between vLLM's tokenizer code and transformers'
(a renamed class such as TokenizersBackend, a changed from_pretrained keyword, a decode that differs) would show
only on a GPU machine. This file imports the real vllm from its wheel and drives, on a tiny Qwen2 tokenizer built
here (byte-level BPE trained in code, wrapped as transformers' Qwen2Tokenizer, Qwen2's special tokens and chat
template, a tiny Qwen2 config.json; the Hub is never asked):
  - vllm.tokenizers.get_tokenizer (vLLM's loader: CachedHfTokenizer -> AutoTokenizer, get_cached_tokenizer):
    its class, length, special ids, eos, vocab, max_token_id, encode (with and without special tokens) and decode
    (with and without skipping special tokens) all equal to transformers' own AutoTokenizer's;
  - incremental detokenization of token ids (prompt + output, with characters split across byte-level tokens):
    IncrementalDetokenizer.from_new_request (the FastIncrementalDetokenizer on tokenizers' DecodeStream, the one
    the engine picks for this tokenizer) and SlowIncrementalDetokenizer (detokenize_incrementally), both equal
    to transformers' decode; their stop-string handling (update() and check_stop_strings) against the same text;
  - SamplingParams built with exactly the keywords VLLMSampler.sample passes (read from plumbing/vllm_engine.py),
    and TokensPrompt;
  - the whole of LLM.generate except the engine core, through plumbing/vllm_engine.py's own VLLMSampler: the real
    LLM(...) with the glue's keywords (EngineArgs, VllmConfig, renderer with its chat-template warm-up,
    InputProcessor, OutputProcessor, the n-sample fan-out) and, in place of the GPU engine core, a scripted core
    that emits fixed token ids and stops requests with vLLM's own scheduler rule (vllm.v1.core.sched.utils
    .check_stop on a vllm.v1.request.Request). Checked: the prompt ids reach the core unchanged (no re-tokenizing,
    no BOS, no truncation), max_tokens and the per-sample seeds (seed + j) as the glue's docstring says, eos and
    generation_config's extra eos as stop ids, vLLM's own stop-string finish (stop_reason, text, the request
    aborted in the core), and VLLMSampler.sample's completions equal to what transformers' tokenizer gives.
What cannot run here, and what is checked instead: the engine core (scheduler, KV cache, model runner) needs the
wheel's CUDA ops (vllm._C, which links libcudart.so.13) and a GPU, so the scripted core stands in for it; vLLM's
CUDA platform needs a GPU, so VLLM_TARGET_DEVICE=cpu selects vLLM's own CpuPlatform for the config; sleep mode is
refused by that platform ("Sleep mode is not supported on current platform"), and it only concerns the CUDA
allocator, so the glue is built with enable_sleep_mode=False and dtype float32. The project applies chat
templates itself with transformers (eval.py) and hands vLLM token ids only, so no vLLM chat API is driven beyond
the renderer's warm-up in LLM.__init__; a chat-formatted prompt made by transformers goes through the token path.

How: vllm is installed with `pip install --no-deps --target` into a session temp dir, with the few packages its
imports need that requirements.txt does not give (EXTRA below, each pinned, each checked against the wheel's
Requires-Dist), so torch and transformers are this environment's (the subprocess asserts they are the
requirements.txt pins and not loaded from the target). The vLLM part runs in a subprocess (this file, run as a
script, with the target on PYTHONPATH) so that vllm's imports, env variables and patches stay out of the test
process; each check reports separately, with its traceback and the subprocess's output on failure.

Like test_vllm_source.py it runs only with SPO_VLLM_SOURCE_CHECK=1 (CI sets it); SPO_VLLM_WHEEL=/path/to/vllm-<pin>
-*.whl uses a local wheel, else the pinned wheel is downloaded (~315 MB) with pip. The install takes seconds with a
local wheel; the subprocess about half a minute (vllm's import and its model-architecture inspection).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import traceback
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    os.environ.get("SPO_VLLM_SOURCE_CHECK") != "1",
    reason="imports the pinned vllm from its wheel (~315 MB download): set SPO_VLLM_SOURCE_CHECK=1 to run, "
    "and SPO_VLLM_WHEEL=/path/to/vllm-<pin>-*.whl to use a local wheel instead",
)


def pin(file: str, name: str) -> str:
    match = re.search(rf"^\s*{re.escape(name)}\s*==\s*([^\s;#]+)", (ROOT / file).read_text(), re.M | re.I)
    assert match, f"{file} has no '{name}==<version>' line"
    return match.group(1)


PIN = pin("requirements-vllm.txt", "vllm")
TORCH_PIN = pin("requirements.txt", "torch")
TRANSFORMERS_PIN = pin("requirements.txt", "transformers")

# What `import vllm.entrypoints.llm` and the config/renderer/input/output path need on top of requirements.txt
# (found by importing until nothing was missing; each is a Requires-Dist of the wheel, or a dependency of one:
# aiohttp's, openai's). Installed with --no-deps, so nothing here can pull in or replace torch or transformers.
# Versions: the newest that satisfy the wheel's specifiers when this was written; checked against them below.
EXTRA = {
    "msgspec": "0.23.0",  # EngineCoreRequest/Output, SamplingParams
    "cbor2": "6.3.0",  # vllm.utils.hashing (renderers, arg_utils)
    "cloudpickle": "3.1.3",  # vllm.entrypoints.llm
    "pyzmq": "27.3.0",  # vllm.utils.network_utils, imported by vllm.config
    "aiohttp": "3.14.5",  # vllm.connections, imported by vllm.config
    "aiohappyeyeballs": "2.7.1",  # aiohttp's
    "aiosignal": "1.4.0",  # aiohttp's
    "attrs": "26.1.0",  # aiohttp's
    "frozenlist": "1.8.0",  # aiohttp's
    "multidict": "7.2.1",  # aiohttp's
    "propcache": "0.5.4",  # aiohttp's
    "yarl": "1.25.1",  # aiohttp's
    "openai": "3.60.0",  # vllm.entrypoints protocol types
    "sniffio": "1.3.1",  # openai's
    "openai-harmony": "0.0.8",  # vllm.parser.harmony
    "pybase64": "1.5.1",  # vllm.multimodal
    "cachetools": "8.0.2",  # vllm.transformers_utils
    "uvloop": "0.23.0",  # vllm.utils.async_utils
    "py-cpuinfo": "9.0.0",  # vllm.platforms.cpu
    "prometheus-client": "0.26.0",  # vllm.v1.metrics
    "fastapi": "0.136.3",  # vllm.entrypoints.serve (imported by the parser)
    "starlette": "1.10.0",  # fastapi's
    "opentelemetry-api": "1.45.2",  # vllm.tracing
    "partial-json-parser": "0.2.1.1.post7",  # vllm.parser
    "xgrammar": "0.2.9",  # vllm.parser.harmony -> structured outputs
    "apache-tvm-ffi": "0.1.11",  # xgrammar's
    "llguidance": "1.7.6",  # vllm.v1.structured_output
    "einops": "0.8.2",  # model inspection (vllm.model_executor.models)
}
NEVER_IN_TARGET = ("torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy")


# ---------------------------------------------------------------------------------------------------------------
# The test process: install, build the tokenizer, run this file as a script, report each check.


def run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert done.returncode == 0, (
        f"{what} failed ({' '.join(map(str, cmd))} exited {done.returncode}):\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="session")
def wheel_path(tmp_path_factory) -> Path:
    """The pinned vllm wheel: SPO_VLLM_WHEEL's, else downloaded once for the session."""
    if local := os.environ.get("SPO_VLLM_WHEEL"):
        assert Path(local).is_file(), f"SPO_VLLM_WHEEL={local}: no such file"
        return Path(local)
    directory = tmp_path_factory.mktemp("vllm_wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={PIN}"]
    run(cmd + ["-d", str(directory)], f"downloading the vllm {PIN} wheel (offline? set SPO_VLLM_WHEEL)")
    return sorted(directory.glob("vllm-*.whl"))[0]


def requires_dist(wheel: Path) -> dict[str, str]:
    """{normalized name: specifier} from the wheel's METADATA (markers and extras dropped)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    assert f"\nVersion: {PIN}\n" in text, f"{wheel.name}: METADATA's Version is not {PIN}"
    out = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        req, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue
        name, spec = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)", req).groups()
        out[re.sub(r"[-_.]+", "-", name).lower()] = spec.strip()
    return out


@pytest.fixture(scope="session")
def vllm_target(wheel_path, tmp_path_factory) -> Path:
    wheel = wheel_path
    target = tmp_path_factory.mktemp("vllm_target")
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet", "--target", str(target)]
    run(pip + [str(wheel)], f"installing {wheel.name}")
    run(pip + [f"{name}=={version}" for name, version in EXTRA.items()], "installing vllm's import dependencies")
    present = [n for n in NEVER_IN_TARGET if (target / n).exists()]
    assert not present, f"the vllm target dir holds {present}: torch/transformers must be requirements.txt's"
    return target


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def report(vllm_target, tiny_qwen2, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm_report") / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(vllm_target), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",  # vLLM's CpuPlatform; the CUDA one needs a GPU (module docstring)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm_cache")),
    }
    cmd = [sys.executable, __file__, str(tiny_qwen2), str(out), str(vllm_target)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = f"--- subprocess output (exit {done.returncode}) ---\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    assert out.exists(), f"the vllm subprocess wrote no report:\n{log}"
    return {"checks": json.loads(out.read_text()), "log": log}


def test_pinned_extras_fit_the_wheels_requirements(wheel_path):
    from packaging.requirements import Requirement

    wanted = requires_dist(wheel_path)
    bad = [
        f"{name}=={version} (vllm {PIN} requires {name}{wanted[key]})"
        for name, version in EXTRA.items()
        if (key := re.sub(r"[-_.]+", "-", name).lower()) in wanted
        and not Requirement(f"{key}{wanted[key]}").specifier.contains(version, prereleases=True)
    ]
    assert not bad, f"EXTRA pins outside the vllm {PIN} wheel's Requires-Dist: {bad}"
    for name in ("torch", "transformers"):
        mine = TORCH_PIN if name == "torch" else TRANSFORMERS_PIN
        spec = Requirement(f"{name}{wanted[name]}").specifier
        assert spec.contains(mine), f"vllm {PIN} requires {name}{wanted[name]}; requirements.txt pins {mine}"


def checks_in_file() -> list[str]:
    """The check functions below, in file order, parsed from this file (so collection never imports vllm)."""
    tree = ast.parse(Path(__file__).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


@pytest.mark.parametrize("name", checks_in_file())
def test_vllm(report, name):
    result = report["checks"].get(name)
    if result is None:
        pytest.fail(f"{name} did not run in the vllm subprocess (an earlier step crashed?)\n{report['log']}")
    if result != "ok":
        pytest.fail(f"vllm {PIN} with transformers {TRANSFORMERS_PIN}: {name} failed:\n{result}\n{report['log']}")


# ---------------------------------------------------------------------------------------------------------------
# The tiny Qwen2 tokenizer (built with requirements.txt's tokenizers and transformers; shared by both processes).

CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "He has 3 + 4 = 7 apples.\n#### 7\n\n\nProblem: Sam has 12 pears.",
    "Question: what is 10 + 5?\nAnswer: 15",
]
# Non-ASCII text outside the corpus: byte-level BPE spells each character with several tokens, so a detokenizer
# that emits text per token must hold back incomplete UTF-8.
UNICODE = "héllo wörld 日本語 🙂"
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_qwen2(directory: Path) -> Path:
    """A Qwen2 tokenizer (Qwen2's pre-tokenizer regex, byte-level BPE of ~330 tokens trained on CORPUS, Qwen2's
    <|endoftext|>/<|im_start|>/<|im_end|> and chat template, eos <|im_end|> as in Qwen2-Instruct), a tiny Qwen2
    config.json and a generation_config.json with both eos ids, as a Qwen2-Instruct checkpoint has them."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import GenerationConfig, Qwen2Config, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 10, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(directory)
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------------------------
# The subprocess: `python tests/test_vllm_tokenizer.py MODEL_DIR REPORT.json TARGET`, vllm importable from TARGET.
# Each check_* gets the shared context and raises AssertionError with what broke.


class Ctx:
    def __init__(self, model_dir: str, target: str):
        from transformers import AutoTokenizer

        self.model_dir, self.target = model_dir, target
        self.hf = AutoTokenizer.from_pretrained(model_dir)  # transformers' own, the reference
        self.texts = [*CORPUS, UNICODE, "<|im_start|>user\nhi 🙂<|im_end|>\n", "  two  spaces\tand\ttabs\n\n"]


def check_versions(ctx: Ctx) -> None:
    import torch
    import transformers
    import vllm

    assert vllm.__version__ == PIN, f"imported vllm {vllm.__version__}, the pin is {PIN}"
    assert Path(vllm.__file__).is_relative_to(ctx.target), f"vllm imported from {vllm.__file__}, not the target"
    for module, want in ((torch, TORCH_PIN), (transformers, TRANSFORMERS_PIN)):
        got = module.__version__.split("+")[0]
        assert got == want, f"{module.__name__} {module.__version__} in the vllm subprocess; requirements.txt: {want}"
        where = Path(module.__file__)
        assert not where.is_relative_to(ctx.target), f"{module.__name__} was loaded from the vllm target: {where}"


def check_get_tokenizer(ctx: Ctx) -> None:
    from transformers import TokenizersBackend
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(ctx.model_dir)
    hf = ctx.hf
    ctx.vllm_tok = tok
    name = f"vllm.tokenizers.get_tokenizer -> {type(tok).__name__}"
    assert isinstance(tok, type(hf)) and isinstance(tok, TokenizersBackend), (
        f"{name} is not a {type(hf).__name__} (transformers' TokenizersBackend): vLLM picks its fast detokenizer "
        "by that class"
    )
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "all_special_ids", "all_special_tokens"):
        assert getattr(tok, attr) == getattr(hf, attr), f"{name}.{attr} {getattr(tok, attr)} != {getattr(hf, attr)}"
    assert len(tok) == len(hf), f"len({name}) {len(tok)} != transformers' {len(hf)}"
    assert tok.get_vocab() == hf.get_vocab(), f"{name}.get_vocab() differs from transformers'"
    assert tok.max_token_id == len(hf) - 1, f"{name}.max_token_id {tok.max_token_id}, vocab has {len(hf)} tokens"
    assert tok.truncation_side == "left", f"{name}.truncation_side {tok.truncation_side!r}: vLLM passes 'left'"
    for text in ctx.texts:
        for special in (True, False):
            ids, want = tok(text, add_special_tokens=special)["input_ids"], hf(text, add_special_tokens=special)
            assert ids == want["input_ids"], f"{name}({text!r}, add_special_tokens={special}) != transformers'"
            assert tok.encode(text, add_special_tokens=special) == ids, f"{name}.encode({text!r}) != its __call__"
        for skip in (False, True):
            got, want = tok.decode(ids, skip_special_tokens=skip), hf.decode(ids, skip_special_tokens=skip)
            assert got == want, f"{name}.decode(skip_special_tokens={skip}): {got!r} != transformers' {want!r}"
        assert hf.decode(ids) == text, f"transformers' own round trip of {text!r} gives {hf.decode(ids)!r}"
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids), f"{name}.convert_ids_to_tokens"
    chat = [{"role": "user", "content": "hi 🙂"}]
    got = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert got == want, f"{name}.apply_chat_template: {got!r} != transformers' {want!r}"


def engine_request(prompt: list[int], **params):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(**params),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def detokenizers(ctx: Ctx, prompt: list[int], **params):
    """(name, detokenizer) for the one the engine picks for this tokenizer and the slow Python one."""
    from vllm.v1.engine.detokenizer import (
        FastIncrementalDetokenizer,
        IncrementalDetokenizer,
        SlowIncrementalDetokenizer,
    )

    picked = IncrementalDetokenizer.from_new_request(ctx.vllm_tok, engine_request(prompt, **params))
    assert isinstance(picked, FastIncrementalDetokenizer), (
        f"IncrementalDetokenizer.from_new_request picked {type(picked).__name__}, not FastIncrementalDetokenizer "
        "(tokenizers' DecodeStream), for a transformers TokenizersBackend tokenizer"
    )
    slow = SlowIncrementalDetokenizer(ctx.vllm_tok, engine_request(prompt, **params))
    return [("FastIncrementalDetokenizer", picked), ("SlowIncrementalDetokenizer", slow)]


def check_incremental_detokenization(ctx: Ctx) -> None:
    hf = ctx.hf
    prompt = hf("Question: what is 10 + 5?\nAnswer:")["input_ids"]
    for text in ctx.texts:
        out = hf(text)["input_ids"]
        for skip in (True, False):
            want = hf.decode(prompt + out, skip_special_tokens=skip)[len(hf.decode(prompt, skip_special_tokens=skip)) :]
            for name, detok in detokenizers(ctx, prompt, skip_special_tokens=skip, spaces_between_special_tokens=True):
                pieces = []
                for token in out:  # one token per engine step, as the engine core sends them
                    assert detok.update([token], False) is None, f"{name}.update found a stop string without stop"
                    pieces.append(detok.get_next_output_text(finished=False, delta=True))
                pieces.append(detok.get_next_output_text(finished=True, delta=True))
                got = detok.get_next_output_text(finished=True, delta=False)
                assert got == want, f"{name} (skip_special_tokens={skip}) of {text!r}: {got!r} != decode's {want!r}"
                assert "".join(pieces) == want, f"{name}'s deltas of {text!r} join to {''.join(pieces)!r}"
                assert detok.output_token_ids == out, f"{name}.output_token_ids != the ids fed"


def check_stop_strings(ctx: Ctx) -> None:
    from vllm.v1.engine.detokenizer import check_stop_strings as vllm_check_stop_strings

    hf = ctx.hf
    stop = "\n\n\nProblem:"
    prompt = hf("Tom has 3 apples and buys 4 more.")["input_ids"]
    out = hf(" He has 3 + 4 = 7 apples.\n#### 7\n\n\nProblem: Sam has 12 pears.")["input_ids"]
    # The first prefix of the output whose decoded text holds the stop string: where the engine must stop.
    first = next(k for k in range(1, len(out) + 1) if stop in hf.decode(out[:k]))
    text = hf.decode(out[:first])
    for include in (False, True):
        want = text[: text.index(stop) + (len(stop) if include else 0)]
        for name, detok in detokenizers(ctx, prompt, stop=[stop], include_stop_str_in_output=include):
            for k, token in enumerate(out, 1):
                found = detok.update([token], False)
                if found is not None:
                    break
            assert found == stop and k == first, (
                f"{name}.update: stop string {stop!r} reported at token {k} ({found!r}); it completes at token {first}"
            )
            got = detok.get_next_output_text(finished=True, delta=False)
            assert got == want, f"{name} with include_stop_str_in_output={include}: text {got!r} != {want!r}"
        got = vllm_check_stop_strings(text, len(text), [stop], include)
        assert got == (stop, len(want) if include and len(want) < len(text) else (-1 if include else len(want))), (
            f"check_stop_strings({text!r}, include_in_output={include}) = {got}"
        )


def glue_sampling_params_keywords() -> list[str]:
    """The keywords of VLLMSampler.sample's SamplingParams(...) call, from plumbing/vllm_engine.py."""
    tree = ast.parse((ROOT / "plumbing" / "vllm_engine.py").read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "SamplingParams"
    ]
    assert len(calls) == 1, f"plumbing/vllm_engine.py makes {len(calls)} SamplingParams(...) calls, expected 1"
    return [k.arg for k in calls[0].keywords]


def check_sampling_params_and_tokens_prompt(ctx: Ctx) -> None:
    from vllm import SamplingParams, TokensPrompt

    values = dict(n=3, temperature=0.7, top_p=0.9, max_tokens=17, stop=["\n\n\nProblem:"], seed=2**62 - 1, logprobs=0)
    keywords = glue_sampling_params_keywords()
    assert set(keywords) <= set(values), f"VLLMSampler passes {sorted(set(keywords) - set(values))}: add values here"
    params = SamplingParams(**{k: values[k] for k in keywords})
    for key in keywords:
        assert getattr(params, key) == values[key], f"SamplingParams.{key} = {getattr(params, key)!r}"
    assert params.detokenize and params.skip_special_tokens, "SamplingParams no longer detokenizes by default"
    prompt = TokensPrompt(prompt_token_ids=[1, 2, 3])
    assert prompt == {"prompt_token_ids": [1, 2, 3]}, f"TokensPrompt(prompt_token_ids=[1, 2, 3]) = {prompt!r}"


class ScriptedCore:
    """Stands in for vLLM's EngineCoreClient (the GPU engine): emits each request's scripted token ids, one a step,
    and stops a request with vLLM's own scheduler rule (check_stop on a v1 Request)."""

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], max_model_len: int):
        from types import SimpleNamespace

        self.scripts, self.max_model_len = scripts, max_model_len
        self.live, self.added, self.aborted = {}, [], set()
        self.engine_core = SimpleNamespace(model_executor=None)  # LLMEngine reads it in-process

    def get_supported_tasks(self):
        return ("generate",)

    def add_request(self, request) -> None:
        from vllm.v1.request import Request

        self.added.append(request)
        key = tuple(request.prompt_token_ids)
        assert key in self.scripts, f"the engine core got prompt ids {list(key)}, which no prompt had"
        self.live[request.request_id] = Request.from_engine_core_request(request, block_hasher=None)

    def get_output(self):
        from vllm.v1.core.sched.utils import check_stop
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        outputs = []
        for rid, request in list(self.live.items()):
            script = self.scripts[tuple(request.prompt_token_ids)]
            request.append_output_token_ids(script[request.num_output_tokens])
            finished = check_stop(request, self.max_model_len)
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[request.output_token_ids[-1]],
                    finish_reason=request.get_finished_reason() if finished else None,
                    stop_reason=request.stop_reason if finished else None,
                )
            )
            if finished:
                del self.live[rid]
        return EngineCoreOutputs(outputs=outputs)

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            self.aborted.add(rid)
            self.live.pop(rid, None)

    def dp_engines_running(self) -> bool:
        return False

    def reset_mm_cache(self) -> None:
        pass

    def shutdown(self, *args, **kwargs) -> None:
        pass


def check_llm_generate_through_the_glue(ctx: Ctx) -> None:
    import torch
    import vllm.v1.engine.llm_engine as llm_engine
    from vllm import SamplingParams, TokensPrompt

    from plumbing import vllm_engine
    from plumbing.completions import cut_at_stop

    hf = ctx.hf
    eos, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    stop = ["\n\n\nProblem:"]
    plain = hf("Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:")["input_ids"]
    # A chat prompt as eval.py makes one: transformers applies the template, vLLM only sees ids.
    chat = hf.apply_chat_template([{"role": "user", "content": "How many apples? 🙂"}], add_generation_prompt=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    other = hf("Question: what is 10 + 5?\nAnswer:")["input_ids"]
    scripts = {
        tuple(plain): hf(" He has 3 + 4 = 7 apples.\n#### 7\n\n\nProblem: Sam has 12 pears. 日本語")["input_ids"],
        tuple(chat): hf("He has 7 apples 🙂 日本語")["input_ids"] + [eos] + hf(" and more")["input_ids"],
        tuple(other): hf(" 15 🙂")["input_ids"] + [eot] + hf(" Sam has 12 pears.")["input_ids"] * 3,
    }
    core = ScriptedCore(scripts, max_model_len=256)
    llm_engine.EngineCoreClient.make_client = staticmethod(lambda **kwargs: core)
    vllm_engine.vllm_preflight.prepare_vllm = lambda enforce_eager=False: None  # the CUDA pre-flight; no GPU here

    # enable_sleep_mode=False and float32: vLLM's CpuPlatform refuses sleep mode (module docstring).
    sampler = vllm_engine.VLLMSampler(
        ctx.model_dir, seed=5, max_model_len=256, dtype="float32", enable_sleep_mode=False
    )
    tok = sampler.tokenizer
    # The engine wraps vLLM's cached tokenizer in a thread pool (vllm.tokenizers.maybe_make_thread_pool): still
    # transformers' class, which cut_at_stop decodes with.
    assert isinstance(tok, type(hf)), f"LLM.get_tokenizer() is a {type(tok).__name__}, not a {type(hf).__name__}"
    for text in ctx.texts:
        ids = hf(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, f"LLM.get_tokenizer()({text!r}) != transformers'"
        assert tok.decode(ids) == hf.decode(ids), f"LLM.get_tokenizer().decode of {text!r} != transformers'"

    # vLLM's own view first: LLM.generate, text, finish and stop reasons (the glue keeps only ids and finish).
    outs = sampler.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in (plain, chat, other)],
        sampling_params=SamplingParams(max_tokens=40, stop=stop, seed=1),
        use_tqdm=False,
    )
    script = scripts[tuple(plain)]
    first = next(k for k in range(1, len(script) + 1) if stop[0] in hf.decode(script[:k]))
    text = hf.decode(script[:first])
    got = outs[0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop[0]), (
        f"stop string: {got.finish_reason=} {got.stop_reason=}"
    )
    assert list(got.token_ids) == script[:first], f"stop string: token_ids {list(got.token_ids)} != {script[:first]}"
    assert got.text == text[: text.index(stop[0])], f"stop string: text {got.text!r}"
    script = scripts[tuple(chat)]
    got = outs[1].outputs[0]
    upto = script.index(eos) + 1
    assert (got.finish_reason, got.stop_reason) == ("stop", None), f"eos: {got.finish_reason=} {got.stop_reason=}"
    assert list(got.token_ids) == script[:upto], f"eos: token_ids {list(got.token_ids)} != {script[:upto]}"
    assert got.text == hf.decode(script[:upto], skip_special_tokens=True), f"eos: text {got.text!r}"
    script = scripts[tuple(other)]
    got = outs[2].outputs[0]
    upto = script.index(eot) + 1
    assert (got.finish_reason, got.stop_reason) == ("stop", eot), (
        f"generation_config's second eos ({eot}): {got.finish_reason=} {got.stop_reason=}"
    )
    assert list(got.token_ids) == script[:upto], f"second eos: token_ids {list(got.token_ids)}"
    for out, prompt in zip(outs, (plain, chat, other)):
        assert list(out.prompt_token_ids) == prompt, "RequestOutput.prompt_token_ids != the TokensPrompt's ids"
    assert core.aborted == {core.added[0].request_id}, (
        f"the core was told to abort {sorted(core.aborted)}; only the stop-string request should be"
    )

    # Then the glue: VLLMSampler.sample, n=2 per prompt, a per-prompt budget, seeds from its generator.
    core.added.clear()
    copy = torch.Generator()
    copy.set_state(sampler.generator.get_state())
    expected_seeds = torch.randint(0, 2**62, (2,), generator=copy).tolist()
    budgets = [40, 4]
    result = sampler.sample(
        [plain, other], n=2, temperature=1.0, top_p=0.95, max_new_tokens=budgets, stop=stop, context=256
    )
    assert [len(r) for r in result] == [2, 2], f"VLLMSampler.sample returned {[len(r) for r in result]} completions"
    cut, found = cut_at_stop(hf, scripts[tuple(plain)], stop)
    assert found
    for c in result[0]:
        assert (c.ids, c.finish_reason) == (cut, "stop"), f"stop string through the glue: {c} != ({cut}, 'stop')"
    for c in result[1]:
        want = scripts[tuple(other)][: budgets[1]]
        assert (c.ids, c.finish_reason) == (want, "length"), f"length through the glue: {c} != ({want}, 'length')"
    assert len(core.added) == 4, f"the core got {len(core.added)} requests for 2 prompts x n=2"
    for i, (prompt, budget) in enumerate(zip([plain, other], budgets)):
        for j, request in enumerate(core.added[2 * i : 2 * i + 2]):
            sp = request.sampling_params
            assert request.prompt_token_ids == prompt, f"prompt {i}: the core got {request.prompt_token_ids}"
            assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p) == (1, budget, 1.0, 0.95), f"prompt {i}: {sp}"
            assert sp.seed == expected_seeds[i] + j, (
                f"prompt {i} sample {j}: seed {sp.seed}, the glue's docstring says seed + j = {expected_seeds[i] + j}"
            )
            assert sp.stop == stop and sp.eos_token_id == eos and eot in sp.stop_token_ids, (
                f"prompt {i}: stop {sp.stop}, eos {sp.eos_token_id}, stop ids {sp.stop_token_ids}"
            )

    # The chat prompt through the glue, without stop strings (eval.py uses none with a chat template).
    (chat_result,) = sampler.sample([chat], n=1, temperature=1.0, top_p=1.0, max_new_tokens=40)
    script = scripts[tuple(chat)]
    want = script[: script.index(eos) + 1]
    assert [(c.ids, c.finish_reason) for c in chat_result] == [(want, "stop")], f"eos through the glue: {chat_result}"


def main(model_dir: str, report_path: str, target: str) -> None:
    report: dict[str, str] = {}
    ctx = None
    try:
        ctx = Ctx(model_dir, target)
    except Exception:
        report["check_versions"] = "building the context failed:\n" + traceback.format_exc()
    for name in checks_in_file() if ctx else []:
        try:
            globals()[name](ctx)
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
        print(f"{name}: {'ok' if report[name] == 'ok' else 'FAILED'}", flush=True)
        Path(report_path).write_text(json.dumps(report))
    Path(report_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
