"""The text of a program so far, with the chat messages it holds and the role currently open.

Both the executor (running a program) and the prefix tracer (finding a batch's constant prefix) append to a
Transcript, so a traced prefix is exactly the text the real programs begin with.
"""

from __future__ import annotations

import copy
from typing import Optional

from radixserve.frontend.chat_template import ChatTemplate


class Transcript:
    """Append-only program text plus `messages` ({"role", "content"} dicts, in order) and the open role."""

    def __init__(self) -> None:
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.role: Optional[str] = None
        self._content_start = 0  # where the open message's content begins in text
        self._frozen_until = 0  # text before this belongs to finished messages

    def copy(self) -> "Transcript":
        return copy.deepcopy(self)

    def append(self, text: str) -> None:
        self.text += text

    def replace(self, start: int, end: int, new: str) -> None:
        """Replace text[start:end] by `new`: text of the open message, or after the last message. ValueError
        for text that a finished message (or the open one's prefix) already holds."""
        limit = self._content_start if self.role is not None else self._frozen_until
        if start < limit:
            raise ValueError("cannot rewrite text of a finished chat message: put separate_reasoning inside the "
                             "message, e.g. assistant(separate_reasoning(gen(\"answer\"), model_type=...))")
        self.text = self.text[:start] + new + self.text[end:]

    def begin_role(self, role: str, template: ChatTemplate) -> str:
        """Open a message of `role`; returns the prefix it appended. ValueError if a message is open."""
        if self.role is not None:
            raise ValueError(f"{role}_begin inside an open {self.role} message (end it with {self.role}_end first)")
        prefix = template.prefix(role, first=not self.messages)
        self.text += prefix
        self.role, self._content_start = role, len(self.text)
        return prefix

    def end_role(self, role: str, template: ChatTemplate) -> str:
        """Close the open message, which must be of `role`; returns the suffix it appended."""
        if self.role != role:
            raise ValueError(f"{role}_end without an open {role} message (open: {self.role})")
        self.messages.append({"role": role, "content": self.text[self._content_start:]})
        suffix = template.suffix(role)
        self.text += suffix
        self.role = None
        self._frozen_until = len(self.text)
        return suffix
