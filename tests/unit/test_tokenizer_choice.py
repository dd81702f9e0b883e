"""The class AutoTokenizer picks for a directory is remembered, keyed by the directory's files."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path
from typing import Any

import pytest

import framework.default_model
from framework.config import ServerArgs
from framework.runtime import tokenizer_choice
from framework.runtime.hf_tokenizer import load_tokenizer, tokenizer_class_path
from framework.runtime.launch import ComponentTree
from framework.runtime.tokenizer_choice import remember_tokenizer_class, remembered_tokenizer_class

DEFAULT_MODEL = Path(framework.default_model.__file__).parent


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the default model's tokenizer and config, under an empty user cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, directory / name)
    return directory


def test_a_class_is_remembered_for_the_same_files_only(model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert remembered_tokenizer_class(str(model_dir)) is None
    remember_tokenizer_class(str(model_dir), "some.module:SomeTokenizer")
    assert remembered_tokenizer_class(str(model_dir)) == "some.module:SomeTokenizer"
    # The same files elsewhere: the same choice.
    twin = tmp_path / "twin"
    shutil.copytree(model_dir, twin)
    assert remembered_tokenizer_class(str(twin)) == "some.module:SomeTokenizer"
    # Another file's content, another file, another transformers: chosen again.
    config = (twin / "tokenizer_config.json").read_text()
    (twin / "tokenizer_config.json").write_text(config.replace("{", '{"x": 1, ', 1))
    assert remembered_tokenizer_class(str(twin)) is None
    (model_dir / "tokenizer.model").write_bytes(b"\0")
    assert remembered_tokenizer_class(str(model_dir)) is None
    (model_dir / "tokenizer.model").unlink()
    real_version = importlib.metadata.version
    monkeypatch.setattr(tokenizer_choice.importlib.metadata, "version",
                        lambda name: "0.0.1" if name == "transformers" else real_version(name))
    assert remembered_tokenizer_class(str(model_dir)) is None


def test_a_cache_that_cannot_be_written_is_no_error(model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file, not a directory
    remember_tokenizer_class(str(model_dir), "some.module:SomeTokenizer")
    assert remembered_tokenizer_class(str(model_dir)) is None
    assert remembered_tokenizer_class(str(tmp_path / "absent")) is None


def test_the_second_load_takes_the_remembered_class_without_autotokenizer(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    text = "def fibonacci(n): 日本語"
    picked = load_tokenizer(str(model_dir))
    assert remembered_tokenizer_class(str(model_dir)) == tokenizer_class_path(picked)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("AutoTokenizer was asked again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    again = load_tokenizer(str(model_dir))
    assert type(again) is type(picked)
    assert again.encode(text) == picked.encode(text)


def test_a_remembered_class_that_no_longer_loads_is_picked_again(model_dir: Path) -> None:
    remember_tokenizer_class(str(model_dir), "framework.no_such_module:Tokenizer")
    picked = load_tokenizer(str(model_dir))
    assert remembered_tokenizer_class(str(model_dir)) == tokenizer_class_path(picked)


@pytest.mark.parametrize("launch_mode", ["process", "thread"])
def test_the_launcher_hands_out_a_remembered_class_at_once_to_processes(
        model_dir: Path, launch_mode: str) -> None:
    """The HTTP process and the Detokenizers then need not wait for the Scheduler's pick."""
    remember_tokenizer_class(str(model_dir), "some.module:SomeTokenizer")
    tree = ComponentTree(ServerArgs(model_path=str(model_dir), launch_mode=launch_mode))
    try:
        if launch_mode == "process":
            assert tree.tokenizer_class.result(timeout=0) == "some.module:SomeTokenizer"
        else:  # threads of one process wait, as transformers' lazy imports are not thread-safe
            assert not tree.tokenizer_class.done()
    finally:
        tree.stop()


@pytest.mark.parametrize("remembered", [True, False])
def test_a_scheduler_loads_a_remembered_class_in_the_background(
        model_dir: Path, remembered: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """It serves meanwhile; a stop string, which needs the tokenizer, waits for the load."""
    from framework.runtime import hf_tokenizer
    from tests.fake_worker import SchedulerHarness, reference_output
    from tests.model_fixtures import make_tiny_tokenizer

    if remembered:
        remember_tokenizer_class(str(model_dir), tokenizer_class_path(make_tiny_tokenizer()))
    backgrounded: list[str] = []
    real = hf_tokenizer.in_background

    def record(load: Any) -> Any:
        backgrounded.append(getattr(load, "__name__", ""))
        return real(load)

    monkeypatch.setattr(hf_tokenizer, "in_background", record)
    harness = SchedulerHarness(model_path=str(model_dir), launch_mode="process")
    try:
        scheduler = harness.scheduler
        assert backgrounded == (["load_tokenizer"] if remembered else [])
        assert scheduler.tokenizer_class == tokenizer_class_path(make_tiny_tokenizer())
        prompt = [5, 6, 7, 8]
        expected = reference_output(prompt, 12, ignore_eos=True)
        stop = scheduler.tokenizer.decode(expected[3:5])
        harness.submit("r", prompt, max_new_tokens=12, ignore_eos=True, stop=[stop])
        outcome = harness.run()["r"]
        assert outcome.finished_reason.matched == stop
        assert len(outcome.output_ids) < 12
    finally:
        harness.close()
