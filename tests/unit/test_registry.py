"""The plugin registry: built-ins, entry points, lazy loading, clear errors, `framework plugins`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from framework.config import ServerArgs
from framework.registry import (
    LOAD_BALANCERS,
    SCHEDULE_POLICIES,
    Registry,
    UnknownPluginError,
    import_dotted,
)


def _install_fake_plugin(root: Path, group: str, name: str, module: str, body: str) -> None:
    """A real installed distribution on sys.path: a module plus a dist-info with entry points."""
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    dist_info = root / f"fake_plugin_{module}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: fake-plugin-{module}\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[{group}]\n{name} = {module}:Plugin\n")


def test_entry_point_plugins_load_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_plugin(
        tmp_path, "framework.test_plugins", "hello", "fw_fake_hello",
        """
        LOADED = True
        class Plugin:
            greeting = "hello"
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry[type] = Registry("test plugin", "framework.test_plugins")
    registry.register("builtin", "framework.comm.codec:JsonCodec")

    assert registry.names() == ["builtin", "hello"]
    entry = {e.name: e for e in registry.entries()}["hello"]
    assert entry.target == "fw_fake_hello:Plugin"
    assert "fake-plugin-fw_fake_hello 1.0" in entry.source
    assert "fw_fake_hello" not in sys.modules  # listing imports nothing
    assert registry.get("hello").greeting == "hello"
    assert "fw_fake_hello" in sys.modules


def test_built_ins_win_a_name_clash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_plugin(tmp_path, "framework.test_clash", "json", "fw_fake_json",
                         "class Plugin:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry[type] = Registry("codec", "framework.test_clash")
    registry.register("json", "framework.comm.codec:JsonCodec")
    assert registry.get("json").__name__ == "JsonCodec"


def test_unknown_name_lists_the_known_ones() -> None:
    registry: Registry[type] = Registry("transport", "framework.no_such_group")
    registry.register("zmq", "framework.comm.zmq:ZmqTransport")
    registry.register("inproc", "framework.comm.inproc:InprocTransport")
    with pytest.raises(UnknownPluginError, match=r"unknown transport 'tcp2'; known: inproc, zmq"):
        registry.get("tcp2")


def test_a_broken_target_says_where_it_came_from() -> None:
    registry: Registry[type] = Registry("codec", "framework.no_such_group")
    registry.register("bad", "framework.no_such_module:Thing", source="tests")
    with pytest.raises(UnknownPluginError, match=r"codec 'bad' \(tests\)"):
        registry.get("bad")


def test_register_an_object_directly() -> None:
    registry: Registry[type] = Registry("codec", "framework.no_such_group")

    class Local:
        pass

    registry.register("local", Local, source="tests")
    assert registry.get("local") is Local
    registry.unregister("local")
    assert registry.names() == []
    with pytest.raises(UnknownPluginError, match="unknown codec 'local'; known: none"):
        registry.get("local")


@pytest.mark.parametrize(("field", "registry", "message"), [
    ("schedule_policy", SCHEDULE_POLICIES,
     "--schedule-policy: unknown schedule policy 'nosuch'; known: fcfs, lpm"),
    ("load_balance_method", LOAD_BALANCERS, "--load-balance-method: unknown load balancer "
     "'nosuch'; known: round_robin, shortest_queue"),
])
def test_server_args_take_the_names_their_registry_holds(
        field: str, registry: Registry[Any], message: str,
        request: pytest.FixtureRequest) -> None:
    with pytest.raises(ValueError) as refused:
        ServerArgs(**{field: "nosuch"})
    assert str(refused.value) == message
    registry.register("nosuch", "framework.no_such_module:Thing", source="tests")
    request.addfinalizer(lambda: registry.unregister("nosuch"))
    assert getattr(ServerArgs(**{field: "nosuch"}), field) == "nosuch"  # nothing imported


def test_import_dotted_accepts_both_spellings() -> None:
    from framework.comm.codec import MsgpackCodec

    assert import_dotted("framework.comm.codec.MsgpackCodec") is MsgpackCodec
    assert import_dotted("framework.comm.codec:MsgpackCodec") is MsgpackCodec
    with pytest.raises(UnknownPluginError):
        import_dotted("framework.comm.codec.Nope")


def test_framework_plugins_lists_every_kind_of_plugin() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "framework", "plugins"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    lines = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert {"zmq", "inproc", "shm", "pickle", "msgpack", "json", "torch", "cpu", "xgrammar",
            "fcfs", "lpm", "round_robin", "shortest_queue",
            "LlamaForCausalLM", "BertModel"} <= lines
    assert "transports (entry-point group framework.transports):" in out
    assert "schedule policies (entry-point group framework.schedule_policies):" in out
    assert "load balancers (entry-point group framework.load_balancers):" in out
    assert "model architectures (entry-point group framework.models):" in out
    assert "[built-in]" in out


def test_a_missing_optional_part_names_its_install_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from framework import cli, optional

    missing = optional.OptionalPart("attention backend", "triton", "fw_no_such_module",
                                    "pip install -e plugins/triton_attention")
    monkeypatch.setattr(optional, "OPTIONAL_PARTS", (missing,))
    registry: Registry[type] = Registry("attention backend", "framework.no_such_group")
    registry.register("torch", "framework.comm.codec:JsonCodec")
    with pytest.raises(UnknownPluginError) as asked:
        registry.get("triton")
    assert str(asked.value) == ("attention backend 'triton' is not installed: "
                                "pip install -e plugins/triton_attention")
    with pytest.raises(UnknownPluginError, match="unknown attention backend 'other'; known: "
                                                  "auto, torch"):
        registry.check("other", ("auto",))
    assert cli.main(["plugins"]) == 0
    listed = capsys.readouterr().out.split("optional, not installed:\n")[1].split()
    assert listed[:3] == ["triton", "attention", "backend"]
    assert "pip install -e plugins/triton_attention]" in " ".join(listed)
