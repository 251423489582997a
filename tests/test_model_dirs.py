"""Model directories are untrusted input: custom code is refused before anything loads (and nothing asks on stdin),
weights that do not cover the config are refused, and chat templates render within bounds (plumbing/model_dirs.py,
plumbing/chat_templates.py)."""

import builtins
import doctest
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import grpo_baseline
from conftest import smoke_args, write_jsonl
from plumbing import UsageError, chat_templates, model_dirs, models, tasks
from plumbing.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]


def copy_model(tiny: Path, target: Path, **config) -> Path:
    """A copy of the tiny model whose config.json has `config` merged in."""
    shutil.copytree(tiny, target)
    settings = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**settings, **config}))
    return target


def with_custom_code(tiny: Path, target: Path, marker: Path, where: str) -> Path:
    """The tiny model with Python files that write `marker` when imported, and an auto_map (in config.json or
    tokenizer_config.json) or an unknown model_type that asks transformers to import them."""
    code = (
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom'\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomForCausalLM"}
    if where == "config auto_map, unknown model_type":
        copy_model(tiny, target, model_type="custom", auto_map=auto_map)
    elif where == "config auto_map, known model_type":
        copy_model(tiny, target, auto_map=auto_map)
    elif where == "unknown model_type":
        copy_model(tiny, target, model_type="custom")
    else:
        copy_model(tiny, target)
        tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
        tokenizer_config["auto_map"] = {"AutoTokenizer": ["custom.CustomTokenizer", "custom.CustomTokenizer"]}
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (target / "custom.py").write_text(code)
    return target


CUSTOM_CODE = [
    ("config auto_map, unknown model_type", r"config\.json asks to run the model's own code \(auto_map AutoConfig"),
    ("config auto_map, known model_type", r"delete the \"auto_map\" entry to load it with transformers' own llama"),
    ("tokenizer auto_map", r"tokenizer_config\.json asks to run the tokenizer's own code"),
    ("unknown model_type", r"names model_type 'custom', which transformers .* has no class for"),
]


@pytest.mark.parametrize("where, message", CUSTOM_CODE, ids=[case for case, _ in CUSTOM_CODE])
def test_a_model_that_asks_for_custom_code_is_refused_before_anything_loads(
    where, message, tiny_model_dir, tmp_path, monkeypatch
):
    marker = tmp_path / "MARKER"
    model = with_custom_code(tiny_model_dir, tmp_path / "model", marker, where)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")  # yes, if anything asked
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    with pytest.raises(UsageError, match=message) as refused:
        models.load_model(str(model))
    assert str(model) in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists() and not asked


def test_the_fixture_would_run_its_code_if_transformers_were_asked(tiny_model_dir, tmp_path, monkeypatch):
    """The check above is not vacuous: transformers left to decide (trust_remote_code unset) asks on stdin, and a
    "y" runs the directory's code."""
    from transformers import AutoConfig

    marker = tmp_path / "MARKER"
    model = with_custom_code(tiny_model_dir, tmp_path / "model", marker, "config auto_map, unknown model_type")
    monkeypatch.setattr(builtins, "input", lambda prompt="": "y")
    AutoConfig.from_pretrained(model)
    assert marker.exists()


def test_custom_code_is_refused_before_the_run_directory_is_made(tiny_model_dir, gsm8k_jsonl, tmp_path):
    marker = tmp_path / "MARKER"
    model = with_custom_code(tiny_model_dir, tmp_path / "model", marker, "config auto_map, unknown model_type")
    with pytest.raises(UsageError, match="asks to run the model's own code"):
        grpo_baseline.main(smoke_args(grpo_baseline, model, gsm8k_jsonl, tmp_path / "runs"))
    assert not (tmp_path / "runs").exists() and not marker.exists()


def test_custom_code_is_one_line_from_the_command_line_with_yes_on_stdin(tiny_model_dir, gsm8k_jsonl, tmp_path):
    marker = tmp_path / "MARKER"
    model = with_custom_code(tiny_model_dir, tmp_path / "model", marker, "config auto_map, unknown model_type")
    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--model", str(model), "--task", str(gsm8k_jsonl), "--limit", "2"],
        input="y\ny\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr and "[y/N]" not in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: cannot load model '{model}': {model}/config")
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Weights that do not cover the config


def test_weights_for_fewer_layers_than_the_config_declares_are_refused(tiny_model_dir, tmp_path, caplog):
    deeper = copy_model(tiny_model_dir, tmp_path / "deeper", num_hidden_layers=4)
    with pytest.raises(UsageError) as refused:
        models.load_model(str(deeper))
    message = str(refused.value)
    assert message.startswith(f"cannot load model '{deeper}': {deeper} holds no weights for 18 of the ")
    assert "(layers 2-3; e.g. model.layers.2." in message and "\n" not in message
    assert "LOAD REPORT" not in caplog.text  # the one line, without transformers' table


def test_a_missing_output_head_is_refused(tiny_model_dir, tmp_path):
    headless = tmp_path / "headless"
    shutil.copytree(tiny_model_dir, headless)
    weights = load_file(headless / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"holds no weights for 1 of the .* \(e\.g\. lm_head\.weight\)"):
        models.load_model(str(headless))


def test_tied_embeddings_are_not_missing(tiny_model_dir, tmp_path):
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    settings = json.loads((tied / "config.json").read_text())
    config = LlamaConfig(**{**settings, "tie_word_embeddings": True})
    LlamaForCausalLM(config).save_pretrained(tied)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")  # saved once, as embed_tokens
    model, _ = models.load_model(str(tied))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_extra_weights_still_show_transformers_report(tiny_model_dir, tmp_path, caplog):
    """Only a refusal drops the held-back LOAD REPORT: weights the config does not use are reported as before."""
    shallower = copy_model(tiny_model_dir, tmp_path / "shallower", num_hidden_layers=1)
    models.load_model(str(shallower))
    assert "LOAD REPORT" in caplog.text and "UNEXPECTED" in caplog.text


def test_the_doctests_hold():
    assert doctest.testmod(model_dirs).failed == 0


# ----------------------------------------------------------------------------------------------
# Chat templates

SMOL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_with_template(tiny: Path, target: Path, template: str):
    """The tiny model's tokenizer with `template` as its chat template, saved to and loaded from `target`."""
    tokenizer = AutoTokenizer.from_pretrained(tiny, trust_remote_code=False)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return AutoTokenizer.from_pretrained(target, trust_remote_code=False)


def test_the_bounded_rendering_is_what_apply_chat_template_renders(tiny_model_dir, tmp_path):
    tokenizer = tokenizer_with_template(tiny_model_dir, tmp_path / "chat", SMOL_TEMPLATE)
    questions = ["What is 2 + 3?", "  Spaces around  ", "Ünïcode 🙂 and \x1b[31m escapes", "a\ud800b"]
    expected = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{q}\n{tasks.BOXED_INSTRUCTION}"}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    assert tasks.MATH_PROMPT.prompts(questions, tokenizer) == expected
    assert expected[0].startswith("<bos><|im_start|>system\n")


BAD_TEMPLATES = [
    (
        "sandbox escape",
        "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
        r"tried to leave Jinja's sandbox at prompt 1 of 2 \(SecurityError: access to attribute '__init__'",
    ),
    (
        "raise_exception",
        "{% if messages[0]['role'] == 'user' %}{{ raise_exception('Only \x1b[31msystem roles') }}{% endif %}",
        r"failed at prompt 1 of 2 \(TemplateError: Only \\x1b\[31msystem roles\)",
    ),
    (
        "huge string",
        "{{ 'x' * 10000000 }}",
        r"rendered prompt 1 of 2 as 10,000,000 characters, .*at most 20,000 are allowed",
    ),
    ("huge memory", "{% set s = 'x' * 10**11 %}{{ s | length }}", r"needed more than 1\.0 GiB of memory"),
    (
        "long loop",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        r"took over 1 s of CPU time \(stopped at prompt 1 of 2\)",
    ),
    ("not jinja", "{% for %}", r"is not valid Jinja \(line 1: "),
    ("empty", "{{ '' }}", r"rendered prompt 1 of 2 as empty text \(the question is lost\)"),
    ("named, no default", {"tool_use": "{{ 'x' }}", "rag": "{{ 'y' }}"}, r"is named templates \(tool_use, rag\), none"),
    ("a number", 7, r"is not Jinja text but the int 7;"),
    ("a default that is a dict", {"default": {"a": 1}}, r"is not Jinja text but the dict \{'a': 1\};"),
]


@pytest.mark.parametrize("case, template, message", BAD_TEMPLATES, ids=[case for case, _, _ in BAD_TEMPLATES])
def test_a_bad_chat_template_is_one_line_naming_the_model(case, template, message, tiny_model_dir, tmp_path):
    tokenizer = tokenizer_with_template(tiny_model_dir, tmp_path / "chat", "{{ 'x' }}")
    tokenizer.chat_template = template  # as transformers reads it from tokenizer_config.json, whatever its type
    started = time.monotonic()
    with pytest.raises(UsageError, match=message) as refused:
        chat_templates.render_user_prompts(tokenizer, ["What is 2 + 3?", "And 4 + 5?"], seconds=1.0)
    assert time.monotonic() - started < 60
    text = str(refused.value)
    assert text.startswith(f"the chat template of {tmp_path / 'chat'} ") and "\n" not in text and "\x1b" not in text
    assert not (tmp_path / "MARKER").exists() and not (ROOT / "MARKER").exists()


def test_a_worker_stuck_past_its_wall_clock_deadline_is_killed(tiny_model_dir, tmp_path):
    """The parent's deadline, for what the worker's CPU alarm cannot stop (a long C call): here the alarm is set past
    the deadline, and the worker is killed at the deadline."""
    request = {
        "template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "variables": {},
        "contents": ["x"],
        "seconds": 600,
        "extra_chars": 100,
        "memory": 1 << 30,
    }
    started = time.monotonic()
    assert chat_templates._run_worker(json.dumps(request).encode(), 1.0) == {
        "error": "was still rendering after 1 s and was stopped"
    }
    assert time.monotonic() - started < 60


def test_a_run_whose_chat_template_fails_leaves_no_run_directory(tiny_model_dir, tmp_path, capsys):
    """The template is rendered after the run directory is made (load_examples needs the tokenizer); its UsageError
    goes through run_cli, which removes the new, untrained run's directory."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer_with_template(tiny_model_dir, model, "{{ raise_exception('no') }}")
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    with pytest.raises(SystemExit) as ended:
        run_cli(grpo_baseline.main, smoke_args(grpo_baseline, model, data, tmp_path / "runs"))
    assert str(ended.value).startswith(f"error: the chat template of {model} failed at prompt 1 of 2 (TemplateError")
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_model_whose_template_renders_trains_as_before(tiny_model_dir, tmp_path):
    """Training and held-out prompts are rendered in one call, and the examples get the same prompts as before."""
    tokenizer = tokenizer_with_template(tiny_model_dir, tmp_path / "chat", SMOL_TEMPLATE)
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(5)]
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.warns(UserWarning, match="--eval-task is the training file"):
        train, held_out = tasks.load_examples(str(data), str(data), 1024, 2, 0, tokenizer)
    for example in train + held_out:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{example.question}\n{tasks.BOXED_INSTRUCTION}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert example.prompt == prompt and example.prompt_ids == tasks.encode_prompt(prompt, tokenizer)
    assert len(train) == 5 and len(held_out) == 2


def test_a_tokenizer_without_a_chat_template_starts_no_worker(tiny_model_dir, monkeypatch):
    """make_tiny_model's tokenizer has no chat template: its prompts stay the Rho format, rendered here."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, trust_remote_code=False)
    monkeypatch.setattr(chat_templates, "_run_worker", lambda *a: pytest.fail("a worker was started"))
    assert tasks.MATH_PROMPT.prompts(["1+1?"], tokenizer) == [tasks.RHO_PROMPT.format(question="1+1?")]
