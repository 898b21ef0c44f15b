"""Role prefixes and suffixes taken from a model's own (Jinja) chat template.

A program builds a chat prompt piece by piece (`s += user_begin()`, text, `gen`, `user_end()`), so it needs
each role's prefix and suffix separately rather than a rendered conversation. `ChatTemplate.from_tokenizer`
finds them by rendering small conversations whose contents are marker strings with the tokenizer's
`apply_chat_template` and cutting the output at the markers:

- a role's prefix and suffix come from the segment a message of that role adds to a conversation;
- the first message's prefix is measured separately, because templates put a BOS token or a default
  system prompt there (SmolLM2 adds "You are a helpful AI assistant named SmolLM..." when the
  conversation does not start with a system message).

This assumes what common templates do: a conversation renders as the concatenation of its messages, each
`prefix + content + suffix`. A template that cannot render a probe conversation (one that requires strict
user/assistant alternation, say) leaves that role's pieces unknown; using the role then raises ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Markers that no template rewrites (letters only, so `| trim` and similar filters leave them alone).
_MARK = {"system": "RADIXSERVEMARKSYSTEM", "user": "RADIXSERVEMARKUSER", "assistant": "RADIXSERVEMARKASSISTANT",
         "user2": "RADIXSERVEMARKUSERTWO"}


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around message contents. `first_prefixes[role]` is used for the conversation's first
    message (it may hold a BOS token or a default system prompt); `prefixes[role]` for any later one."""

    prefixes: dict[str, str]
    suffixes: dict[str, str]
    first_prefixes: dict[str, str] = field(default_factory=dict)

    def prefix(self, role: str, first: bool) -> str:
        table = self.first_prefixes if first and role in self.first_prefixes else self.prefixes
        if role not in table:
            raise ValueError(f"the chat template cannot render a {role!r} message here")
        return table[role]

    def suffix(self, role: str) -> str:
        if role not in self.suffixes:
            raise ValueError(f"the chat template cannot render a {role!r} message")
        return self.suffixes[role]

    @staticmethod
    def from_tokenizer(tokenizer: Any, template: Optional[str] = None) -> "ChatTemplate":
        """Derive the pieces from `template` (a Jinja string), else the tokenizer's own chat template.

        Raises ValueError when there is no template or it renders no user message.
        """
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; pass chat_template= to the backend "
                             "to use system()/user()/assistant()")
        return _derive(_Renderer(tokenizer, template))


class _Renderer:
    def __init__(self, tokenizer: Any, template: Optional[str]):
        self.tokenizer = tokenizer
        self.template = template
        # Templates that write the BOS token themselves would double it when the text is tokenized again
        # with special tokens, so that leading BOS is dropped from the first prefix.
        bos = getattr(tokenizer, "bos_token", None)
        self.leading_bos = bos if bos and _tokenizer_adds_bos(tokenizer) else None

    def render(self, roles: list[str]) -> Optional[str]:
        """The conversation of one marker message per role, or None when the template refuses it."""
        messages = [{"role": "user" if role == "user2" else role, "content": _MARK[role]} for role in roles]
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=False)
        except Exception:  # jinja's raise_exception(), missing roles: this probe is not renderable
            return None

    def strip_bos(self, text: str) -> str:
        if self.leading_bos and text.startswith(self.leading_bos):
            return text[len(self.leading_bos):]
        return text


def _tokenizer_adds_bos(tokenizer: Any) -> bool:
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    ids = tokenizer.encode("a")
    return bool(ids) and ids[0] == bos_id


def _split(segment: str, role: str) -> Optional[tuple[str, str]]:
    """(prefix, suffix) around the single occurrence of role's marker in segment."""
    mark = _MARK[role]
    if segment.count(mark) != 1:
        return None
    before, after = segment.split(mark)
    return before, after


def _derive(renderer: _Renderer) -> ChatTemplate:
    prefixes: dict[str, str] = {}
    suffixes: dict[str, str] = {}
    first: dict[str, str] = {}

    # User: the segment a user message adds after a system message (or, failing that, the lone user message).
    system_only = renderer.render(["system"])
    system_user = renderer.render(["system", "user"])
    user_only = renderer.render(["user"])
    if system_only is not None and system_user is not None and system_user.startswith(system_only):
        pieces = _split(system_user[len(system_only):], "user")
        if pieces:
            prefixes["user"], suffixes["user"] = pieces
    if user_only is not None:
        pieces = _split(user_only, "user")
        if pieces:
            first["user"] = renderer.strip_bos(pieces[0])
            if "user" not in prefixes:
                suffixes["user"] = pieces[1]
                prefixes["user"] = first["user"]
    if "user" not in prefixes:
        raise ValueError("could not find the user role's prefix and suffix in the chat template")

    # System: its first prefix is whatever precedes the content when it opens the conversation.
    if system_only is not None:
        pieces = _split(system_only, "system")
        if pieces:
            first["system"] = renderer.strip_bos(pieces[0])
            prefixes["system"], suffixes["system"] = first["system"], pieces[1]

    # Assistant: the segment between a user message and the following user message, which keeps templates
    # that treat the final assistant turn specially out of the measurement.
    base = system_user if "system" in first and system_user is not None else user_only
    roles = ["system", "user"] if base is system_user else ["user"]
    full = renderer.render(roles + ["assistant", "user2"])
    tail = prefixes["user"] + _MARK["user2"] + suffixes["user"]
    if base is not None and full is not None and full.startswith(base) and full.endswith(tail):
        pieces = _split(full[len(base):len(full) - len(tail)], "assistant")
        if pieces:
            prefixes["assistant"], suffixes["assistant"] = pieces
    return ChatTemplate(prefixes=prefixes, suffixes=suffixes, first_prefixes=first)
