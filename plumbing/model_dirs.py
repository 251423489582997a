"""What a model directory may ask of the process that loads it. No code of its own: a config.json or
tokenizer_config.json with an "auto_map" entry, or a model_type transformers has no class for (only the directory's
own Python files could load it), is refused before anything is loaded, so transformers never reaches its "run the
custom code? [y/N]" prompt; every load passes trust_remote_code=False as well. And weights for every tensor its
config declares: a config.json that describes more than the weights hold (num_hidden_layers 4 over the weights of 2
layers) would otherwise train a model whose missing layers transformers filled with random values.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from plumbing import UsageError, files, shown

NO_CODE = "which this project never runs"


def custom_code_problem(path: str | Path) -> str | None:
    """What in a local model directory asks for custom code, in words (None: nothing does). Reads config.json and, if
    present, tokenizer_config.json; a damaged one is named."""
    path = Path(path)
    try:
        config = files.read_json(path / "config.json", "the model's config")
        tokenizer_config = (
            files.read_json(path / "tokenizer_config.json", "the tokenizer's config")
            if (path / "tokenizer_config.json").is_file()
            else {}
        )
    except UsageError as error:
        return str(error)
    model_type = config.get("model_type")
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if config.get("auto_map") is not None:
        instead = (
            f'delete the "auto_map" entry to load it with transformers\' own {shown(model_type)} classes'
            if known
            else "give a model of an architecture transformers supports"
        )
        asks = f"asks to run the model's own code ({_first(config['auto_map'])})"
        return f"{shown(path / 'config.json')} {asks}, {NO_CODE}; {instead}"
    if tokenizer_config.get("auto_map") is not None:
        return (
            f"{shown(path / 'tokenizer_config.json')} asks to run the tokenizer's own code "
            f'({_first(tokenizer_config["auto_map"])}), {NO_CODE}; delete its "auto_map" entry if the directory '
            "has a tokenizer.json (transformers then loads that), or give a model whose tokenizer needs no code"
        )
    if not known:
        named = f"names model_type {shown(model_type)!r}" if model_type is not None else "names no model_type"
        return (
            f"{shown(path / 'config.json')} {named}, which transformers {transformers.__version__} has no class for "
            f"(only the model's own code could load it, {NO_CODE}); give a model of an architecture transformers "
            "supports, or a newer transformers that has it"
        )
    return None


def _first(auto_map: object) -> str:
    """The first class an auto_map names, for the message: {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}."""
    if isinstance(auto_map, dict) and auto_map:
        name, target = next(iter(auto_map.items()))
        target = target[0] if isinstance(target, list) and target else target
        return f"auto_map {shown(name)} -> {shown(target)[:200]}"
    return f"auto_map {shown(auto_map)[:200]}"


class _HeldReport(logging.Filter):
    """Holds back transformers' LOAD REPORT (a table of missing and unexpected weights) while a model loads: a model
    refused for missing weights says so in one line; any other model's report is logged as it would have been."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True


def load_causal_lm(path: str, dtype) -> PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained(path) without custom code, refusing weights that leave a tensor of its
    config without a value (one UsageError naming the directory, how many are missing and the first). Weights tied to
    others (lm_head to embed_tokens with tie_word_embeddings) are not missing: transformers leaves them out of
    missing_keys."""
    logger = logging.getLogger("transformers.modeling_utils")
    held, problem = _HeldReport(), None
    logger.addFilter(held)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=False, output_loading_info=True
        )
        problem = missing_weights_problem(path, sorted(loading["missing_keys"]), len(model.state_dict()))
    finally:
        logger.removeFilter(held)
        if problem is None:  # any other model's report (a size mismatch's error points at it) is shown as it was
            for record in held.records:
                logger.handle(record)
    if problem:
        raise UsageError(problem)
    return model


def missing_weights_problem(path: str, missing: list[str], tensors: int) -> str | None:
    """The one line for weights that do not cover a model's config (None: nothing is missing).

    >>> print(missing_weights_problem("m", ["model.layers.2.w", "model.layers.3.w"], 40).split(": ")[0])
    m holds no weights for 2 of the 40 tensors its config.json declares (layers 2-3; e.g. model.layers.2.w)
    """
    if not missing:
        return None
    layers = sorted({int(found[1]) for name in missing if (found := re.search(r"\.layers\.(\d+)\.", name))})
    where = f"layers {layers[0]}-{layers[-1]}; " if len(layers) > 1 else f"layer {layers[0]}; " if layers else ""
    return (
        f"{shown(path)} holds no weights for {len(missing):,} of the {tensors:,} tensors its config.json declares "
        f"({where}e.g. {shown(missing[0])}): they would start from random values. The weights are from a smaller "
        "model than config.json describes, or incomplete (a shard missing); give a complete save_pretrained directory"
    )
