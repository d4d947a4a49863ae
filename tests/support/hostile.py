"""A leaf whose unpickling runs code (the attack restricted loading stops), and a harmless marker for it."""

from __future__ import annotations

import os


def leave_marker(path: str) -> str:
    """What the crafted leaf makes full pickle call: create ``path`` (proof that code ran)."""
    with open(path, "w") as f:
        f.write("ran")
    return "pwned"


class RunsOnLoad:
    """Unpickles as ``leave_marker(path)``; ``os.system`` would do as well."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __reduce__(self):
        return (leave_marker, (self.path,))
