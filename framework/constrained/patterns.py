"""Regular expressions: the features a grammar can enforce, and those it cannot.

A grammar is a finite automaton over the output's characters, so it can hold what a
regular language can say. Lookarounds, backreferences, word boundaries and inline flags
are beyond that (xgrammar drops a lookahead with a log line and matches the rest), and
Unicode property classes differ between dialects; a regex that uses one is refused, so
that an output never claims to match a pattern it breaks.
"""

from __future__ import annotations

# ``(?`` followed by one of these: what the construct is.
_GROUP_KINDS = (
    ("<=", "a lookbehind '(?<='"),
    ("<!", "a lookbehind '(?<!'"),
    ("=", "a lookahead '(?='"),
    ("!", "a lookahead '(?!'"),
    ("P<", "a named group '(?P<'"),
    ("P=", "a named backreference '(?P='"),
    ("<", "a named group '(?<'"),
)
# Escapes outside a character class that a grammar cannot follow.
_ESCAPES = {
    "b": "a word boundary '\\b'",
    "B": "a word boundary '\\B'",
    "k": "a named backreference '\\k'",
    "p": "a Unicode property class '\\p'",
    "P": "a Unicode property class '\\P'",
}


def unsupported_feature(pattern: str) -> str | None:
    """What in ``pattern`` a grammar cannot enforce, with its position, or None.

    Scans escapes and character classes as ECMA-262 and Python read them; inside a
    class, ``(?=`` and ``\\b`` are plain characters.
    """
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            problem = None if in_class else _escape_problem(pattern[i + 1:i + 2])
            if problem is not None:
                return f"{problem} at position {i}"
            i += 2
        elif in_class:
            in_class = char != "]"
            i += 1
        elif char == "[":
            in_class = True
            # A ']' first in the class (after an optional '^') is a literal.
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += 1 if pattern[i:i + 1] == "]" else 0
        elif pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
            return f"{_group_problem(pattern[i + 2:])} at position {i}"
        else:
            i += 1
    return None


def _escape_problem(escaped: str) -> str | None:
    if escaped.isdigit() and escaped != "0":
        return f"a backreference '\\{escaped}'"
    return _ESCAPES.get(escaped)


def _group_problem(rest: str) -> str:
    for prefix, problem in _GROUP_KINDS:
        if rest.startswith(prefix):
            return problem
    return f"an inline flag or extension '(?{rest[:1]}'"
