"""The README's and the quickstart's commands run as written, on the embedded default model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_harness import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
# The address the README and the quickstart write; their commands run against the test's
# server, which listens on a free port instead.
DOCS_BASE = "http://127.0.0.1:30000"


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
def readme_server(default_server: ServerProcess) -> ServerProcess:
    """The README's serve command, on a free port (``.ci/run`` runs it as written, with
    its install, in a fresh venv)."""
    assert default_server.args[-4:] == readme_serve_command().split()[2:]
    return default_server


def run_shell(command: str, server: ServerProcess) -> str:
    result = subprocess.run(command.replace(DOCS_BASE, server.base_url), shell=True, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_curl_example(readme_server: ServerProcess) -> None:
    curl = [c for c in commands(code_blocks(ROOT / "README.md", "bash")[1])
            if c.startswith("curl")]
    assert curl, "the README has a curl example"
    body = json.loads(run_shell(curl[0], readme_server))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 32


def test_quickstart_shell_commands(readme_server: ServerProcess) -> None:
    quickstart = ROOT / "docs" / "quickstart.md"
    curls = [c for block in code_blocks(quickstart, "bash") for c in commands(block)
             if c.startswith("curl")]
    assert len(curls) == 3
    completion = json.loads(run_shell(curls[0], readme_server))
    assert completion["choices"][0]["finish_reason"] in ("stop", "length")
    events = [line for line in run_shell(curls[1], readme_server).splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2
    generated = json.loads(run_shell(curls[2], readme_server))
    assert generated["meta_info"]["completion_tokens"] <= 8


def test_quickstart_client_snippet(readme_server: ServerProcess, tmp_path: Path) -> None:
    """The ``openai`` client snippet, run as a file (the Engine's: test_docs_snippets.py)."""
    snippets = [s for s in code_blocks(ROOT / "docs" / "quickstart.md", "python")
                if "Engine(" not in s]
    assert len(snippets) == 1
    script = tmp_path / "client.py"
    script.write_text(snippets[0].replace(DOCS_BASE, readme_server.base_url))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_default_model_completes_code_like_code(readme_server: ServerProcess) -> None:
    out = httpx.post(f"{readme_server.base_url}/generate", timeout=120, json={
        "text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 48,
                                                          "temperature": 0}}).json()
    text = out["text"]
    # A code model's continuation: an indented body with Python keywords or calls.
    assert "\n    " in text or "\n        " in text, text
    assert re.search(r"\b(return|if|for|while|def|self|None|in|=)\b|=", text), text


def test_server_info_names_the_embedded_model(readme_server: ServerProcess) -> None:
    from framework.default_model import default_model_path

    info = httpx.get(f"{readme_server.base_url}/get_server_info", timeout=30).json()
    path = default_model_path()
    assert (info["model_path"], info["tokenizer_path"]) == (path, path)
    assert info["served_model_name"] == path
    models = httpx.get(f"{readme_server.base_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [info["served_model_name"]]
