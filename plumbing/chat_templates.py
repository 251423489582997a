"""Chat templates, rendered within bounds. A model directory's chat template is a Jinja program that runs on every
prompt. transformers renders it in Jinja's sandbox, which refuses attribute escapes and file access but bounds neither
time nor memory: a template can loop for hours, or ask for gigabytes in one C call that no signal interrupts
(`'x' * 10**10`). An alarm in this process could not stop a C call, and an address-space limit here would bind the
model and CUDA too; so all of a task's prompts are rendered at once, by one short-lived worker process (this file and
transformers' own renderer, no torch) under an address-space limit and a CPU-time alarm, each prompt's size checked,
and the parent kills the worker past a wall-clock deadline. Whatever goes wrong is one UsageError naming the model
directory.

    prompts = chat_templates.render_user_prompts(tokenizer, ["What is 2 + 3?"])  # apply_chat_template's strings

The worker's start (some 0.7 s, mostly importing transformers) is paid once per call; each prompt then costs what
apply_chat_template costs (25 us for SmolLM2's template), so tasks.load_examples renders a run's training and
held-out prompts in one call.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from plumbing import UsageError, shown

# CPU seconds one call may render for: this, plus TEMPLATE_SECONDS_PER_PROMPT for each prompt. Real templates take
# 0.05-0.5 ms a prompt, so a template 20 times slower than the slowest still renders a million prompts.
TEMPLATE_SECONDS = 10.0
TEMPLATE_SECONDS_PER_PROMPT = 0.01
# Characters a template may add to a prompt's message (role markers, a default system prompt): some 5,000 tokens.
TEMPLATE_EXTRA_CHARS = 20_000
TEMPLATE_MEMORY = 1 << 30  # bytes the worker may map beyond its imports and request, plus 4 per message character
TEMPLATE_STARTUP_SECONDS = 120.0  # the worker's imports, on a busy machine
TEMPLATE_GRACE_SECONDS = 10.0  # wall-clock past the CPU budget before the parent kills a worker stuck in C code
ROOT = Path(__file__).resolve().parents[1]
# The worker imports this module alone (plumbing/__init__.py imports nothing), then transformers' renderer.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from plumbing import chat_templates; chat_templates._worker_main()"
)


def render_user_prompts(tokenizer, contents: list[str], seconds: float | None = None) -> list[str]:
    """For each of `contents`, what tokenizer.apply_chat_template([{"role": "user", "content": content}],
    tokenize=False, add_generation_prompt=True) returns, rendered by one bounded worker process (see above). seconds:
    the CPU budget (default: TEMPLATE_SECONDS plus TEMPLATE_SECONDS_PER_PROMPT per prompt)."""
    if not contents:
        return []
    seconds = seconds or TEMPLATE_SECONDS + TEMPLATE_SECONDS_PER_PROMPT * len(contents)
    where = shown(getattr(tokenizer, "name_or_path", "") or "the tokenizer")
    fix = 'fix the template (chat_template.jinja, or "chat_template" in tokenizer_config.json)'
    named = tokenizer.chat_template
    if isinstance(named, dict) and "default" not in named:
        names = ", ".join(shown(str(name))[:40] for name in list(named)[:5])
        raise UsageError(f'the chat template of {where} is named templates ({names}), none named "default"; {fix}')
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, TypeError) as error:
        raise UsageError(f"the chat template of {where} cannot be read ({_first_line(error)[:300]}); {fix}") from None
    if not isinstance(template, str):
        kind = f"{type(template).__name__} {shown(repr(template))[:60]}"
        raise UsageError(f"the chat template of {where} is not Jinja text but the {kind}; {fix}")
    request = {
        "template": template,
        # what apply_chat_template passes the template besides the messages
        "variables": {name: _plain(value) for name, value in tokenizer.special_tokens_map.items()},
        "contents": contents,
        "seconds": seconds,
        "extra_chars": TEMPLATE_EXTRA_CHARS,
        "memory": TEMPLATE_MEMORY,
    }
    reply = _run_worker(json.dumps(request).encode(), seconds + TEMPLATE_GRACE_SECONDS)
    if "error" in reply:
        raise UsageError(
            f"the chat template of {where} {shown(reply['error'])[:600]}; {fix} or use the model's original tokenizer "
            "files"
        )
    return reply["prompts"]


def _plain(value):
    return [str(item) for item in value] if isinstance(value, (list, tuple)) else str(value)


def _run_worker(request: bytes, deadline: float) -> dict:
    """Start a worker, wait for its imports, hand it `request` and return its reply ({"prompts": [...]} or
    {"error": "..."}); a worker that has not answered `deadline` seconds after its imports is killed."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: the worker never blocks on a full one
        worker = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(ROOT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            bufsize=0,  # unbuffered: reading "ready" takes no byte of the reply
        )
        try:
            ready, _, _ = select.select([worker.stdout], [], [], TEMPLATE_STARTUP_SECONDS)
            if not ready or worker.stdout.readline() != b"ready\n":
                worker.kill()
                worker.wait()
                errors.seek(0)
                last = (errors.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"the process that renders chat templates did not start: {last}")
            try:
                out, _ = worker.communicate(request, timeout=deadline)
            except subprocess.TimeoutExpired:
                return {"error": f"was still rendering after {deadline:g} s and was stopped"}
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    try:
        return json.loads(out)
    except ValueError:
        code = worker.returncode
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return {"error": f"killed the process rendering it ({how}; out of memory?)"}


# ----------------------------------------------------------------------------------------------
# The worker


class _OverTime(BaseException):
    """Not an Exception, so that no `except Exception` on the way up swallows it."""


def _over_time(signum, frame):
    raise _OverTime


def _worker_main() -> None:
    """Say "ready" once transformers is imported; read one request from stdin, write the reply to stdout."""
    from transformers.utils.chat_template_utils import render_jinja_template

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which kills this process
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    raw = sys.stdin.buffer.read()
    request = json.loads(raw)
    del raw
    # Relative to what the imports and the parsed request already use, so that any machine allows the same headroom.
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    memory = request["memory"] + 4 * sum(len(content) for content in request["contents"])
    resource.setrlimit(resource.RLIMIT_AS, (used + memory,) * 2)
    reply = _render_all(render_jinja_template, request, memory)
    sys.stdout.buffer.write(json.dumps(reply).encode())
    sys.stdout.buffer.flush()


def _render_all(render, request: dict, memory: int) -> dict:
    import jinja2.exceptions

    contents, prompts, seconds = request["contents"], [], request["seconds"]

    def which() -> str:
        return f"prompt {len(prompts) + 1:,} of {len(contents):,}"

    signal.signal(signal.SIGPROF, _over_time)
    # CPU time (ITIMER_PROF), not wall time: a busy machine does not make a template fail
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        for content in contents:
            chat = [{"role": "user", "content": content}]
            rendered, _ = render(
                conversations=[chat],
                chat_template=request["template"],
                add_generation_prompt=True,
                **request["variables"],
            )
            prompt = rendered[0]
            if not prompt:
                return {"error": f"rendered {which()} as empty text (the question is lost)"}
            if len(prompt) - len(content) > request["extra_chars"]:
                return {
                    "error": f"rendered {which()} as {len(prompt):,} characters, {len(prompt) - len(content):,} more "
                    f"than its message (at most {request['extra_chars']:,} are allowed)"
                }
            prompts.append(prompt)
    except _OverTime:
        return {"error": f"took over {seconds:g} s of CPU time (stopped at {which()})"}
    except MemoryError:  # what the failed render had built is freed on the way here
        return {"error": f"needed more than {memory / 2**30:.1f} GiB of memory (stopped at {which()})"}
    except jinja2.exceptions.SecurityError as error:
        return {"error": f"tried to leave Jinja's sandbox at {which()} (SecurityError: {_first_line(error)})"}
    except jinja2.exceptions.TemplateSyntaxError as error:
        return {"error": f"is not valid Jinja (line {error.lineno}: {_first_line(error)})"}
    except Exception as error:  # raise_exception('...') is a TemplateError; a template can raise most others
        return {"error": f"failed at {which()} ({type(error).__name__}: {_first_line(error)})"}
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    return {"prompts": prompts}


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]
