"""The example codec plugin installs with pip and is found through its entry point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugins" / "zlib_codec"


def test_installed_codec_plugin_is_listed_and_carries_messages(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(PLUGIN)],
        check=True, timeout=300, capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    listing = subprocess.run([sys.executable, "-m", "framework.cli", "plugins"], env=env,
                             capture_output=True, text=True, check=True, timeout=120).stdout
    line = next(line for line in listing.splitlines() if "zlib-msgpack" in line)
    assert "framework_zlib_codec:ZlibMsgpackCodec" in line
    assert "entry point of framework-zlib-codec 0.1.0" in line

    script = textwrap.dedent("""
        import asyncio, tempfile
        from framework.messages import AbortReq
        from framework.registry import create_codec, create_transport
        transport = create_transport("zmq")
        workdir = tempfile.mkdtemp()
        address = transport.make_address(workdir, "plugin")
        receiver = transport.receiver(address, create_codec("zlib-msgpack"))
        sender = transport.sender(address, create_codec("zlib-msgpack"))
        sender.send_nowait(AbortReq(rid="r" * 100))
        msg = asyncio.run(asyncio.wait_for(receiver.recv(), 10))
        frames = create_codec("zlib-msgpack").encode(msg)
        print(msg.rid == "r" * 100, len(frames[0]) < 100)
        receiver.close(); sender.close()
    """)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["True", "True"], result.stderr
