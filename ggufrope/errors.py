"""The one exception type for every user-facing error of ggufrope.

Anything the user can cause (a bad file, a bad path, a bad parameter) is raised as
:class:`GGUFRopeError` with a one-line message; the CLI prints it as
``ggufrope: error: <message>`` and exits with status 2, without a traceback. Any other
exception escaping ggufrope is a bug.
"""

from __future__ import annotations


class GGUFRopeError(Exception):
    """A user-facing error with a one-line message (newlines are folded into spaces)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))

    @property
    def message(self) -> str:
        return str(self.args[0])
