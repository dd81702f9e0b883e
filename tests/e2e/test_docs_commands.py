"""The README's and the quickstart's commands run as written, on the embedded default model."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:30000"


def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in a Markdown file."""
    pattern = re.compile(rf"```{language}\n(.*?)```", re.S)
    return pattern.findall(path.read_text())


def commands(block: str) -> list[str]:
    """Shell commands of a block: comments dropped, continuation lines joined."""
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def readme_serve_command() -> str:
    """The server part of the README's first set-up command."""
    first = commands(code_blocks(ROOT / "README.md", "bash")[0])[0]
    install, serve = first.split(" && ")
    assert install.startswith("pip install -c constraints/cpu.txt -e .")
    assert serve.startswith("framework serve")
    return serve


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The README's serve command, run as written (the install step is what CI runs)."""
    log = (tmp_path_factory.mktemp("readme") / "server.log").open("w")
    # `exec`: the shell becomes the server, so a signal reaches the server itself.
    proc = subprocess.Popen(f"exec {readme_serve_command()}", shell=True, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the README's server exited with {proc.returncode}")
        try:
            if httpx.get(f"{BASE}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the README's server did not become healthy")
        time.sleep(0.2)
    yield
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_shell(command: str) -> str:
    result = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_curl_example(readme_server: None) -> None:
    curl = [c for c in commands(code_blocks(ROOT / "README.md", "bash")[1])
            if c.startswith("curl")]
    assert curl, "the README has a curl example"
    body = json.loads(run_shell(curl[0]))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 32


def test_quickstart_shell_commands(readme_server: None) -> None:
    quickstart = ROOT / "docs" / "quickstart.md"
    curls = [c for block in code_blocks(quickstart, "bash") for c in commands(block)
             if c.startswith("curl")]
    assert len(curls) == 3
    completion = json.loads(run_shell(curls[0]))
    assert completion["choices"][0]["finish_reason"] in ("stop", "length")
    events = [line for line in run_shell(curls[1]).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2
    generated = json.loads(run_shell(curls[2]))
    assert generated["meta_info"]["completion_tokens"] <= 8


def test_quickstart_python_snippets(readme_server: None) -> None:
    snippets = code_blocks(ROOT / "docs" / "quickstart.md", "python")
    assert len(snippets) == 2
    for snippet in snippets:
        result = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True,
                                text=True, timeout=300,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()


def test_default_model_completes_code_like_code() -> None:
    from framework import Engine

    with Engine() as engine:
        out = engine.generate("def fibonacci(n):", {"max_new_tokens": 48, "temperature": 0})
    text = out["text"]
    # A code model's continuation: an indented body with Python keywords or calls.
    assert "\n    " in text or "\n        " in text, text
    assert re.search(r"\b(return|if|for|while|def|self|None|in|=)\b|=", text), text
