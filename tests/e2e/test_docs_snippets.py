"""Every docs snippet that starts an Engine runs as a file, as a user saves and runs it.

As a file, not with ``python -c``: the Engine's processes are spawned, and each imports
the script again, so a snippet works only under ``if __name__ == "__main__":``. Model
paths the snippets leave to the reader run on a tiny checkpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from framework.default_model import default_model_path
from framework.runtime.hf_tokenizer import load_tokenizer
from framework.runtime.launch import UNGUARDED_MAIN_MESSAGE

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What the snippets write for "your model directory".
MODEL_PLACEHOLDERS = ("path/to/model", "/models/my-model", "DIR")
GUARD = 'if __name__ == "__main__":'


def engine_snippets() -> list[tuple[str, str]]:
    """(``file:index``, code) of every Python block that starts an Engine."""
    found = []
    for path in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
        found += [(f"{path.name}:{i}", block) for i, block in enumerate(blocks)
                  if "Engine(" in block]
    return found


SNIPPETS = engine_snippets()


def run_file(code: str, directory: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    script = directory / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT)]), **env_vars}
    return subprocess.run([sys.executable, str(script)], cwd=directory, capture_output=True,
                          text=True, timeout=300, env=env)


def test_the_docs_start_engines_in_several_places() -> None:
    names = {name.split(":")[0] for name, _ in SNIPPETS}
    assert {"quickstart.md", "engine.md", "extending.md", "parallelism.md"} <= names


@pytest.mark.parametrize(("name", "code"), SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_an_engine_snippet_runs_as_a_file(name: str, code: str, tmp_path: Path,
                                          tiny_checkpoint: object) -> None:
    assert GUARD in code, f"{name} starts an Engine without the {GUARD} guard"
    model = str(tiny_checkpoint("llama", seed=4))  # type: ignore[operator]
    for placeholder in MODEL_PLACEHOLDERS:
        code = code.replace(f'"{placeholder}"', repr(model))
    result = run_file(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), result.stderr


@pytest.mark.parametrize("tokenizer_known", [False, True],
                         ids=["first-start", "tokenizer-class-remembered"])
def test_an_engine_started_without_the_guard_says_what_to_add(
        tmp_path: Path, tokenizer_known: bool) -> None:
    """Whether the Detokenizer was handed its tokenizer class before it died (a class
    remembered from an earlier start) or not, the one error names the guard."""
    cache = tmp_path / "cache"
    if tokenizer_known:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("XDG_CACHE_HOME", str(cache))
            load_tokenizer(default_model_path())  # remembers the class AutoTokenizer picks
    quickstart = next(code for name, code in SNIPPETS if name.startswith("quickstart.md:"))
    head, _, body = quickstart.partition(GUARD)
    unguarded = head + textwrap.dedent(body.split("\n", 1)[1])
    assert GUARD not in unguarded and "Engine()" in unguarded
    result = run_file(unguarded, tmp_path, XDG_CACHE_HOME=str(cache))
    assert result.returncode == 1
    # One error, the script's own, whose last line says what to add; nothing from the
    # processes that imported the script again.
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(UNGUARDED_MAIN_MESSAGE), (
        result.stderr)
    assert "detokenizer" not in result.stderr.lower()
