"""The one exception type for every user-facing error of ggufrope.

Anything the user can cause (a bad file, a bad path, a bad parameter) is raised as
:class:`GGUFRopeError` with a one-line message; the CLI prints it as
``ggufrope: error: <message>`` and exits with status 2, without a traceback. Any other
exception escaping ggufrope is a bug. :func:`show` and :func:`os_error` build such
messages for paths and failed system calls.
"""

from __future__ import annotations

import os
from typing import Any


class GGUFRopeError(Exception):
    """A user-facing error with a one-line message (newlines are folded into spaces)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))

    @property
    def message(self) -> str:
        return str(self.args[0])


def show(path: Any) -> str:
    """A path for a one-line message (non-printable names are quoted)."""
    s = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return s if s.isprintable() else repr(s)


def os_error(e: OSError, what: str, path: Any) -> GGUFRopeError:
    reason = e.strerror or str(e)
    return GGUFRopeError(f"{what} {show(path)}: {reason}")
