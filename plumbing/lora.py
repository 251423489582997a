"""LoRA adapters (peft) on the HF path, beyond the paper (--lora-rank R > 0; 0, the default, is the paper's full
fine-tuning): the base weights frozen, low-rank adapters on its linear layers trained.

The training model stays the transformers model itself, with peft's LoRA layers in place of its linear layers (peft
injects them into the model it is given), so every pass that reaches inside it (the backbone without its LM head, the
LM head, the HF sampler) runs the adapted policy. The reference model is the same model with its adapters switched off
(AdaptersOff): right because the adapters start at zero (B = 0), so the adapted policy starts as the base.

An adapter checkpoint is peft's format (adapter_config.json, adapter_model.safetensors) beside the tokenizer, the
trainer state and base_model.json (the base's path and fingerprint); it has no config.json. Its adapters load onto a
base this project loaded itself, from a validated config: no auto class, no pickle.

  python -m plumbing.checkpoints merge runs/<run>/checkpoint merged/    # a plain transformers model: W + alpha/R B A
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from plumbing import UsageError, files, ranges, shown

ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_RECORD = "adapter_config.json", "adapter_model.safetensors", "base_model.json"
DEFAULT_TARGET = "all-linear"  # every linear layer of the attention and MLP blocks; never the LM head


def is_adapter_checkpoint(path: str | Path) -> bool:
    """A directory holding an adapter and no model of its own (config.json)."""
    path = Path(path)
    return path.is_dir() and (path / ADAPTER_CONFIG).exists() and not (path / "config.json").exists()


def has_adapters(model) -> bool:
    return bool(getattr(model, "peft_config", None))


def lora_config(rank: int, alpha: float | None, dropout: float, target: str, base: str = "", **scales):
    """peft's LoraConfig for --lora-rank, --lora-alpha (None: 2 x rank), --lora-dropout and --lora-target (all-linear,
    or module names separated by commas); `scales`: the SCALE_FIELDS a received adapter sets (a run sets none)."""
    from peft import LoraConfig

    modules = (
        DEFAULT_TARGET if target == DEFAULT_TARGET else [name.strip() for name in target.split(",") if name.strip()]
    )
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=dropout,
        target_modules=modules,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
        **scales,
    )


def run_adapters(args, device: str, precision=None, base: str = "") -> tuple:
    """A training run's (LoraConfig, dtype of the frozen base) from its --lora-* settings (`args`, a script's Args);
    (None, None) at --lora-rank 0. The base stays in bf16 where `precision` computes in bf16 on `device`; `base`: the
    base model as the checkpoint records it (an absolute path, or a hub id or alias)."""
    if not getattr(args, "lora_rank", 0):
        return None, None
    bf16 = precision is not None and torch.device(device).type in precision.bf16
    config = lora_config(args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target, base)
    return config, torch.bfloat16 if bf16 else None


def train_adapters(model, config, base_dtype: torch.dtype | None = None, source: str = "the checkpoint"):
    """The run's adapters on `model` (in place; returns it): new ones (add_adapters) on a fresh base, or, on a model
    loaded from an adapter checkpoint (--resume; `source`, its directory, names it in errors), its adapters checked
    against the run's --lora-rank, --lora-alpha and --lora-dropout (an edited adapter_config.json is refused; its
    target_modules, which peft writes out as module names, must fit the weights: load_adapter), kept in fp32, and the
    frozen base and its buffers cast to `base_dtype` as a fresh run's are, so that a resumed run computes what the
    uninterrupted one did."""
    if not has_adapters(model):
        return add_adapters(model, config, base_dtype)
    saved = model.peft_config["default"]
    for field, flag in (("r", "rank"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
        if float(getattr(saved, field)) != float(getattr(config, field)):
            raise UsageError(
                f"{source}/{ADAPTER_CONFIG} holds {field} {getattr(saved, field)!r}, the run's args.json "
                f"--lora-{flag} {getattr(config, field)!r}: the file was edited (--lora-* cannot change on --resume); "
                "restore it, or start a new run"
            )
    for field in SCALE_FIELDS:  # a run writes peft's defaults: another value would train at other scales from here on
        if getattr(saved, field) != getattr(config, field):
            raise UsageError(
                f"{source}/{ADAPTER_CONFIG} holds {field} {shown(json.dumps(getattr(saved, field)))}, where the run "
                f"trained at alpha / rank (its args.json has no {field}): the file was edited; restore it, or start a "
                "new run"
            )
    adapted, wanted = adapted_modules(model), targeted_modules(model, config.target_modules)
    if adapted != wanted:
        raise UsageError(
            f"{source}/{ADAPTER_CONFIG} puts adapters on {_short(adapted)}, where the run's args.json --lora-target "
            f"{shown(format_target(config.target_modules))} names {_short(wanted)}: one of the two was edited "
            "(--lora-target cannot change on --resume); restore it, or start a new run"
        )
    saved.base_model_name_or_path = config.base_model_name_or_path  # the base this run loaded, recorded on save
    if base_dtype is not None:
        trained = {name: parameter.data for name, parameter in model.named_parameters() if parameter.requires_grad}
        model.to(base_dtype)
        for name, parameter in model.named_parameters():
            if name in trained:
                parameter.data = trained[name]
    return model


def add_adapters(model, config, base_dtype: torch.dtype | None = None):
    """Inject `config`'s adapters into `model` (in place; returns it): its own weights frozen (in `base_dtype` when
    given: bf16 halves them), the adapters in fp32 and trainable, B = 0 so the model computes what it did. peft's
    PeftModel around it is kept as model.peft_wrapper (not a submodule), for loading and merging."""
    from peft import get_peft_model

    _check_targets(model, config)  # before peft allocates anything: --lora-rank 100000000 would ask for gigabytes
    if base_dtype is not None:
        model.to(base_dtype)
    # peft records the model's own name_or_path as the base; the run's (an absolute path for a local model) is kept
    if config.base_model_name_or_path:
        model.name_or_path = config.base_model_name_or_path
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias; nothing a user can act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            wrapper = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as error:  # peft: target modules not found in the base model
        reason = str(error).strip().splitlines()[0]
        raise UsageError(
            f"--lora-target {format_target(config.target_modules)}: {reason}; give module names the model has "
            f"(e.g. q_proj,v_proj) or {DEFAULT_TARGET}"
        ) from None
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()  # the adapters' master weights and optimizer state in fp32
    model.__dict__["peft_wrapper"] = wrapper  # in __dict__: not registered as a submodule (it holds the model)
    return model


def _check_targets(model, config) -> None:
    """Refuse a --lora-target naming a module the model lacks (peft refuses only a list none of whose names match) and a
    --lora-rank above the width of the narrowest layer the adapters would go on, as peft matches them: all-linear,
    every linear layer but the LM head; a list, every module whose name is one of them or ends in "." + one. A layer
    that a received adapter's rank_pattern matches is checked against its own rank."""
    from peft.utils.other import get_pattern_key

    names = dict(model.named_modules())
    if config.target_modules != DEFAULT_TARGET:
        matches = {t: [n for n in names if n == t or n.endswith(f".{t}")] for t in config.target_modules}
        if unmatched := sorted(t for t, found in matches.items() if not found):
            raise UsageError(
                f"--lora-target {format_target(config.target_modules)}: the model has no module named "
                f"{', '.join(unmatched)}; give module names the model has (e.g. q_proj,v_proj) or {DEFAULT_TARGET}"
            )
    too_wide = []  # (width, rank, name) of each layer whose rank is above its width
    for name in sorted(targeted_modules(model, config.target_modules)):
        module, pattern = names[name], config.rank_pattern or {}
        rank = pattern.get(get_pattern_key(pattern.keys(), name), config.r)
        if isinstance(module, torch.nn.Linear):
            too_wide.append((min(module.in_features, module.out_features), rank, name))
        elif isinstance(module, torch.nn.Embedding):
            too_wide.append((min(module.num_embeddings, module.embedding_dim), rank, name))
    if too_wide := sorted(entry for entry in too_wide if entry[1] > entry[0]):
        width, rank, name = too_wide[0]
        flag = f"--lora-rank {rank}" if rank == config.r else f"rank_pattern's rank {rank} for {name}"
        raise UsageError(
            f"{flag} is above the width of the narrowest adapted layer ({width}): an adapter of that rank is no longer "
            f"low-rank; give {'--lora-rank' if rank == config.r else 'a rank of'} {width} or less"
        )


def adapted_modules(model) -> set[str]:
    """The names of `model`'s modules that hold an adapter (peft's LoRA layers)."""
    from peft.tuners.lora import LoraLayer

    return {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def targeted_modules(model, target) -> set[str]:
    """The names of the modules that --lora-target `target` (all-linear or a list of names) puts adapters on, matched as
    _check_targets matches them, on `model` with or without its adapters (a LoRA layer counts as the layer it wraps;
    the adapters' own layers are not candidates)."""
    from peft.tuners.lora import LoraLayer

    head = model.get_output_embeddings()
    candidates = {
        name: module
        for name, module in model.named_modules()
        if name and not any(part == "base_layer" or part.startswith("lora_") for part in name.split("."))
    }
    if target == DEFAULT_TARGET:
        linear = (torch.nn.Linear, LoraLayer)
        return {n for n, m in candidates.items() if isinstance(m, linear) and m is not head and head not in m.modules()}
    return {n for n in candidates if any(n == t or n.endswith(f".{t}") for t in target)}


def _short(names: set[str]) -> str:
    return ",".join(sorted({name.rpartition(".")[2] for name in names})) or "no module"


def format_target(target) -> str:
    return target if isinstance(target, str) else ",".join(sorted(target))


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model for the `with` block: every LoRA layer of `model` computes its base layer alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersOff:
    """The reference model of a LoRA run: the training model, seen with its adapters off. It stands where a reference
    model goes (models.on_device switches the adapters off for the block of its passes); every attribute is the
    model's."""

    def __init__(self, model):
        self.__dict__["policy"] = model

    def __getattr__(self, name):
        return getattr(self.__dict__["policy"], name)

    def __call__(self, *args, **kwargs):
        return self.__dict__["policy"](*args, **kwargs)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model, directory: Path, base: str, fingerprint: str | None) -> None:
    """Write `model`'s adapter in peft's format (keys as PeftModel.save_pretrained writes them), and its base."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {f"base_model.model.{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(directory))
    record = {"model": base, "fingerprint": fingerprint}
    files.write_atomic(directory / BASE_RECORD, json.dumps(record, indent=1) + "\n", "the base-model record")


# What read_adapter_config makes of each field peft writes into adapter_config.json. Honoured: the fields of
# lora_config, and SCALE_FIELDS, which set each layer's scale and rank (peft computes the merge and the forward from
# them, as peft's own merge_and_unload does). INERT: fields that describe the file, or only how A and B start (the saved
# weights replace them). Every other field (use_dora, modules_to_save, bias, layers_to_transform, ...) and any field
# this project does not know must be peft's default (or null, false, empty), else the adapter is refused naming it:
# it would load as a different model than the one trained.
SCALE_FIELDS = ("use_rslora", "alpha_pattern", "rank_pattern")
INERT_FIELDS = {
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "revision",
    "inference_mode",
    "runtime_config",
    "megatron_core",  # the module megatron_config would name
    "qalora_group_size",  # used only with use_qalora
    "ensure_weight_tying",  # used only with modules_to_save or trainable_token_indices
}
INERT_INITS = (True, False, "gaussian")  # init_lora_weights that set A and B only


def read_adapter_config(directory: Path):
    """The checkpoint's LoraConfig, from validated fields only: the ones lora_config takes and SCALE_FIELDS; any other
    field that would change what the adapter computes is refused by name (unsupported_fields)."""
    raw = files.read_json(directory / ADAPTER_CONFIG, "the adapter's config")
    problems = []
    if raw.get("peft_type") != "LORA":
        problems.append(f"peft_type {raw.get('peft_type')!r} is not LORA")
    if not isinstance(raw.get("r"), int) or isinstance(raw.get("r"), bool) or raw["r"] < 1:
        problems.append(f"r {raw.get('r')!r} is not a positive integer")
    alpha = raw.get("lora_alpha")
    if not _is_alpha(alpha):
        problems.append(f"lora_alpha {alpha!r} is not a number in (0, {ranges.MAX_LORA_ALPHA:g}]")
    dropout = raw.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout {dropout!r} is not in [0, 1)")
    target = raw.get("target_modules")
    if not (
        target == DEFAULT_TARGET or isinstance(target, list) and target and all(isinstance(t, str) for t in target)
    ):
        problems.append(f"target_modules {target!r} is neither {DEFAULT_TARGET} nor a list of module names")
    scales = {
        "use_rslora": raw.get("use_rslora") or False,
        "alpha_pattern": raw.get("alpha_pattern") or {},
        "rank_pattern": raw.get("rank_pattern") or {},
    }
    if not isinstance(scales["use_rslora"], bool):
        problems.append(f"use_rslora {shown(json.dumps(scales['use_rslora']))} is not true or false")
    for field, valid, what in (
        ("alpha_pattern", _is_alpha, f"numbers in (0, {ranges.MAX_LORA_ALPHA:g}]"),
        ("rank_pattern", lambda r: type(r) is int and r >= 1, "positive integers"),
    ):
        pattern = scales[field]
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and k and valid(v) for k, v in pattern.items()):
            problems.append(f"{field} {shown(json.dumps(pattern))} does not map module names to {what}")
    if problems:
        raise UsageError(f"{directory / ADAPTER_CONFIG}: {'; '.join(problems)}: not an adapter this project wrote")
    if unsupported := unsupported_fields(raw):
        raise UsageError(
            f"{directory / ADAPTER_CONFIG} sets {', '.join(unsupported)}: peft options this project does not load "
            "(the model would differ from the one trained); merge it with peft itself (merge_and_unload), or give an "
            "adapter without them"
        )
    names = DEFAULT_TARGET if target == DEFAULT_TARGET else ",".join(target)
    scales["alpha_pattern"] = {k: float(v) for k, v in scales["alpha_pattern"].items()}
    return lora_config(
        raw["r"], float(raw["lora_alpha"]), float(dropout), names, raw.get("base_model_name_or_path", ""), **scales
    )


def _is_alpha(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= ranges.MAX_LORA_ALPHA


def unsupported_fields(raw: dict) -> list[str]:
    """The fields of an adapter_config.json that read_adapter_config does not honour and that are not at peft's
    default, each as "name value" (the value escaped): an empty list for an adapter this project can load as trained."""
    import dataclasses

    from peft import LoraConfig

    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(LoraConfig)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    honoured = {"r", "lora_alpha", "lora_dropout", "target_modules", "base_model_name_or_path", *SCALE_FIELDS}
    found = []
    for name, value in raw.items():
        if name in honoured or name in INERT_FIELDS:
            continue
        if name == "init_lora_weights" and any(value is v or value == v and type(v) is str for v in INERT_INITS):
            continue
        unset = value is None or value is False or type(value) in (dict, list, str) and not value
        if unset or name in defaults and value == defaults[name]:
            continue
        found.append(f"{shown(name)} {shown(json.dumps(value))[:80]}")
    return found


def base_record(directory: Path) -> dict:
    record = files.read_json(directory / BASE_RECORD, "the adapter's base-model record")
    if not isinstance(record.get("model"), str):
        raise UsageError(f"{directory / BASE_RECORD} names no base model: not an adapter checkpoint this project wrote")
    return record


def load_adapter(model, directory: Path):
    """Add the adapter checkpoint `directory` to `model` (its base, loaded by the caller; returns it)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    files.refuse_links(directory)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise UsageError(f"{directory} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: copy the whole checkpoint")
    model = add_adapters(model, read_adapter_config(directory))
    try:
        state = load_file(weights)
    except Exception as error:  # safetensors' own error type for a damaged file
        raise UsageError(f"{weights} is damaged ({type(error).__name__}): copy the checkpoint again") from None
    expected = model.peft_wrapper.state_dict()
    for key, tensor in state.items():  # peft's own message for these is a state_dict traceback, or nothing at all
        shape = expected.get(key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."))
        if shape is not None and tensor.shape != shape.shape:
            raise UsageError(
                f"{weights} holds {key} of shape {list(tensor.shape)}, where its {ADAPTER_CONFIG} (r "
                f"{model.peft_config['default'].r}) and its base model make {list(shape.shape)}: the files were "
                "edited, or written for another model; copy the checkpoint again"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UsageError(f"{weights} holds NaN or infinite values in {key}: the adapter is damaged")
    result = set_peft_model_state_dict(model.peft_wrapper, state)
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing or result.unexpected_keys:
        raise UsageError(
            f"{weights} does not fit its base model ({len(missing)} adapter weights missing, "
            f"{len(result.unexpected_keys)} unexpected): was the checkpoint written for another model?"
        )
    return model


def load_onto_base(name: str, directory: Path, load_model, fingerprint, base: str | None = None):
    """(model, tokenizer) of the adapter checkpoint `directory` (given as `name`): its base, `base` when given (a
    resumed run's --model), else the one base_model.json records, checked against the fingerprint recorded there.
    `load_model(base)` and `fingerprint(base)`: models.py's, which imports this module."""
    record = base_record(directory)
    base = base or record["model"]
    if is_adapter_checkpoint(Path(base).expanduser()):
        raise UsageError(
            f"cannot load the adapter {name}: its base model {base} is itself an adapter checkpoint; write the full "
            f"model it was trained on into {directory / BASE_RECORD}"
        )
    local = Path(base).expanduser()
    # a recorded fingerprint means the base was a local model directory when the adapter was trained
    if local.is_absolute() and not local.exists() or record.get("fingerprint") and fingerprint(base) is None:
        raise UsageError(
            f"cannot load the adapter {name}: its base model {base} is not there"
            + ("" if local.is_absolute() else f" (relative to where its run started, not to {Path.cwd()})")
            + f"; put it back, or write where it is now (an absolute path) into {directory / BASE_RECORD}"
        )
    if record.get("fingerprint") and fingerprint(base) != record["fingerprint"]:
        raise UsageError(
            f"cannot load the adapter {name}: its base model {base} is not the one it was trained on (fingerprint "
            f"{fingerprint(base)}, recorded {record['fingerprint']}); give that model"
        )
    model, tokenizer = load_model(base)
    return load_adapter(model, directory), tokenizer


def merged_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model as plain transformers would hold it: every adapted layer's weight merged, W + alpha
    / R B A (peft's get_delta_weight), computed out of place in fp32, under the base model's own parameter names (no
    `.base_layer`, no `lora_` tensors); other parameters as they are. The training model is never changed: no
    merge and unmerge in place, which on a bf16 base would round the weights a little further each time. One merged
    tensor at a time (the vLLM engine's weight sync streams them). A model without adapters: its named_parameters."""
    if not has_adapters(model):
        yield from model.named_parameters()
        return
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, parameter in model.named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        layer_name, found, attribute = name.partition(".base_layer.")
        if not found:
            yield name, parameter
            continue
        if attribute == "weight":
            layer = layers[layer_name]
            yield f"{layer_name}.weight", parameter.detach().float() + layer.get_delta_weight("default").float()
        else:
            yield f"{layer_name}.{attribute}", parameter


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` with every LoRA layer (if any) replaced by its base layer, trainable, in fp32: PPO's
    critic copies the policy's backbone this way (its own weights, trained in full; RUNNING.md, LoRA)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    module = copy.deepcopy(module)
    for name, child in list(module.named_modules()):
        if isinstance(child, BaseTunerLayer) and name:
            parent, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attribute, child.get_base_layer())
    return module.float().requires_grad_(True)
