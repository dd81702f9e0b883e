"""Loading a Hugging Face tokenizer from a local model directory, never from the network."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

# Any one of these marks a directory as holding a tokenizer that transformers can load.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
)


def load_tokenizer(path: str, chat_template: str | None = None,
                   tokenizer_class: str | None = None) -> Any:
    """Load the tokenizer stored in the directory ``path``.

    ``transformers.AutoTokenizer`` picks the class, unless ``tokenizer_class``
    (``"module:Name"``, see ``tokenizer_class_path``) names the one it picked
    for the same directory in another process: AutoTokenizer reads the model's
    configuration, which imports torch (seconds of a process's start), and a
    process that needs only a tokenizer (the HTTP process, the Detokenizer)
    skips that. Without ``tokenizer_class``, the class AutoTokenizer picked
    before for the same files is loaded directly (``tokenizer_choice``), and a
    new pick is remembered. Only local files are read. Raises ``ValueError`` when ``path``
    is not a directory, holds no tokenizer files, or transformers cannot build
    a tokenizer from them. ``chat_template`` (``--chat-template``: a file, or
    the template itself) replaces the tokenizer's own; see ``read_chat_template``.
    """
    # Read first: a bad template is refused before the (slower) tokenizer load.
    template = read_chat_template(chat_template) if chat_template is not None else None
    tokenizer = _load(path, tokenizer_class)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_class_path(tokenizer: Any) -> str:
    """``"module:Name"`` of ``tokenizer``'s class, for ``load_tokenizer(tokenizer_class=...)``."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def import_transformers() -> None:
    """Import transformers' top-level module, while the class to load is not yet known.

    It is most of what a tokenizer load costs a fresh process (about a second).
    """
    import transformers  # noqa: F401


def start_loading_tokenizer(
        path: str, chat_template: str | None = None,
        tokenizer_class: concurrent.futures.Future[str] | None = None,
) -> concurrent.futures.Future[Any]:
    """``load_tokenizer``, as a future of the tokenizer.

    With ``tokenizer_class`` (a future of the class AutoTokenizer picked
    elsewhere: the first Scheduler's) the load runs on a thread of its own once
    that class is known, while the caller goes on starting the components.
    Without, it runs here, before returning, with AutoTokenizer: for components
    that run as threads of this process, which import transformers themselves,
    and transformers' lazy module is not safe to import from two threads at
    once (one of them can find names missing from a half-initialised module).
    What can be checked at once still is, here (``ValueError``): a bad
    ``chat_template``, a path that is no directory or holds no tokenizer files.
    """
    _tokenizer_files(path)
    if chat_template is not None:
        read_chat_template(chat_template)
    if tokenizer_class is None:
        return at_once(lambda: load_tokenizer(path, chat_template))
    known_class = tokenizer_class

    def load() -> Any:
        import_transformers()  # meanwhile
        return load_tokenizer(path, chat_template, known_class.result())

    return in_background(load)


def start_loading_model_tokenizer(path: str, load: Callable[[], Any], may_defer: bool
                                  ) -> tuple[concurrent.futures.Future[Any], str]:
    """A Scheduler's tokenizer (``load()``, of the files at ``path``), as a future, and its
    class (``"module:Name"``).

    A class picked before for the same files (``tokenizer_choice``) is what the
    launcher hands out already; where ``may_defer`` (a Scheduler in a process of
    its own), the load then runs on a thread while the Scheduler starts serving,
    as only stop strings and grammars need it (and the load is mostly
    transformers' import, about a second). Otherwise it runs now, to report the
    class it picks.
    """
    from framework.runtime.tokenizer_choice import remembered_tokenizer_class

    remembered = remembered_tokenizer_class(path)
    if remembered is not None and may_defer:
        return in_background(load), remembered
    loaded = at_once(load)
    return loaded, tokenizer_class_path(loaded.result())


def at_once(load: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """``load()`` here and now, as a done future of what it returns (what it raises, raises)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(load())
    return future


def in_background(load: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """``load()`` on a thread of its own, as a future of what it returns (or raises)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(load())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    # A daemon: a start-up that fails meanwhile does not wait for the load to end.
    threading.Thread(target=run, name="tokenizer-load", daemon=True).start()
    return future


def read_chat_template(spec: str) -> str:
    """The Jinja chat template ``spec`` names: the text itself if it contains ``{%``, else a file's.

    Raises ``ValueError`` (one line) when the file cannot be read or the
    template does not parse, so that a bad ``--chat-template`` stops start-up
    instead of failing every chat request.
    """
    if "{%" in spec:
        template, where = spec, "the --chat-template string"
    else:
        try:
            with open(spec, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"cannot read the chat template file {spec!r}: {reason}") from None
        where = f"the chat template file {spec!r}"
    if not template.strip():
        raise ValueError(f"{where} is empty")
    import jinja2  # a dependency of transformers' chat templates

    try:
        _compile_chat_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not a valid Jinja template: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template


def _compile_chat_template(template: str) -> None:
    """Compile ``template`` as ``apply_chat_template`` will (its extensions and options)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers layout: plain Jinja with the same extension
        import jinja2

        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        return
    _compile_jinja_template(template)


def _tokenizer_files(path: str) -> list[str]:
    """The tokenizer files in ``path``; ``ValueError`` if it is no directory or holds none."""
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {path!r} is not a directory")
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
    if not present:
        raise ValueError(
            f"no tokenizer files in {path!r}: expected at least one of {', '.join(TOKENIZER_FILES)}"
        )
    return present


def _load(path: str, tokenizer_class: str | None) -> Any:
    present = _tokenizer_files(path)
    try:
        return _load_class(path, tokenizer_class)
    except Exception as exc:  # transformers and the Rust tokenizers raise assorted types
        raise ValueError(
            f"cannot load a tokenizer from {path!r} (found {', '.join(present)}): {exc}"
        ) from exc


def _load_class(path: str, tokenizer_class: str | None) -> Any:
    """The tokenizer, of ``tokenizer_class``, else of the class AutoTokenizer picks (remembered)."""
    from framework.registry import import_dotted
    from framework.runtime.tokenizer_choice import (
        remember_tokenizer_class,
        remembered_tokenizer_class,
    )

    if tokenizer_class is not None:
        return import_dotted(tokenizer_class).from_pretrained(path, local_files_only=True)
    remembered = remembered_tokenizer_class(path)
    if remembered is not None:
        with contextlib.suppress(Exception):  # a class that no longer loads: pick again
            return import_dotted(remembered).from_pretrained(path, local_files_only=True)
    # Imported here so that importing the runtime does not pay for transformers.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    remember_tokenizer_class(path, tokenizer_class_path(tokenizer))
    return tokenizer
