"""The parts the base install leaves out, and the one command that adds each.

Everything a ``framework`` command or API feature needs is a dependency of the
package, but for these: the Triton attention plugin (GPU kernels, installed
from this repository) and matplotlib (the benchmarks' plots). ``framework
plugins`` lists them, and asking for one that is missing is one line naming
its install command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionalPart:
    """One optional part: what it is, the module that shows it installed, how to install it."""

    kind: str  # a registry's kind ("attention backend"), or what the part is for
    name: str  # the name a user asks for it by
    module: str
    install: str

    def installed(self) -> bool:
        """Whether its module can be imported (found without importing it)."""
        return importlib.util.find_spec(self.module) is not None

    def missing_message(self) -> str:
        """The one line for a user who asked for it without having it."""
        return f"{self.kind} {self.name!r} is not installed: {self.install}"


TRITON_ATTENTION = OptionalPart("attention backend", "triton", "framework_triton_attention",
                                "pip install -e plugins/triton_attention")
PLOTS = OptionalPart("benchmark plots", "matplotlib", "matplotlib", "pip install matplotlib")
OPTIONAL_PARTS: tuple[OptionalPart, ...] = (TRITON_ATTENTION, PLOTS)


def optional_part(kind: str, name: str) -> OptionalPart | None:
    """The optional part a registry of ``kind`` would hold as ``name``, if there is one."""
    return next((p for p in OPTIONAL_PARTS if p.kind == kind and p.name == name), None)

