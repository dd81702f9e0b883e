"""Chat out of the box: the default model's chat template, and ``--chat-template FILE``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import transformers

from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import ServerProcess, start_server

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function\nthat adds two numbers."},
]
GREEDY = {"temperature": 0.0, "max_tokens": 16}
# A template of another shape than the tiny tokenizer's own (which is removed).
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def client_of(server: ServerProcess) -> openai.OpenAI:
    """The official OpenAI client pointed at ``server``."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def served_model(client: openai.OpenAI) -> str:
    """The name the server answers to."""
    return client.models.list().data[0].id


def test_default_model_chats_out_of_the_box(default_server: ServerProcess) -> None:
    client = client_of(default_server)
    model = served_model(client)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0

    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                            **GREEDY)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == text  # greedy: the same text, streamed


def test_default_template_writes_comment_lines() -> None:
    from framework.default_model import default_model_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == ("# system: You write Python.\n# user: Write a function\n"
                      "# that adds two numbers.\n# assistant:\n")


@pytest.fixture(scope="module")
def untemplated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose tokenizer has no chat template."""
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("chat-none"), "llama")
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    assert not transformers.AutoTokenizer.from_pretrained(model_dir).chat_template
    return model_dir


def test_chat_template_file_serves_a_model_without_one(untemplated_model: Path,
                                                       tmp_path: Path) -> None:
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    server = start_server(untemplated_model, tmp_path, "--chat-template", str(template_file))
    try:
        client = client_of(server)
        reply = client.chat.completions.create(model=served_model(client), messages=MESSAGES,
                                               **GREEDY)
    finally:
        server.stop()
    tokenizer = transformers.AutoTokenizer.from_pretrained(untemplated_model)
    tokenizer.chat_template = TEMPLATE
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=True)
    if not isinstance(expected, list):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("value, message", [
    ("/no/such/template.jinja", "cannot read the chat template file"),
    ("{% for m in %}", "is not a valid Jinja template"),
])
def test_bad_chat_template_is_a_one_line_startup_error(value: str, message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "serve", "--chat-template", value,
         "--log-level", "warning"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("framework: error: "), proc.stderr
    assert message in lines[0]
