"""API speculative execution (`@function(num_api_spec_tokens=N)`, SGLang's name for it).

A program whose gens are separated by constant text (`"Name:" + gen("name", stop="\\n") + "\\nBirthday:" + gen(...)`)
makes one request per gen. With `num_api_spec_tokens`, the first gen asks instead for N tokens with no stop string,
and the program's later gens are read from that text as long as it follows the program: each gen takes the text up to
its first stop string, and each constant piece of the program must be what the model wrote next. When the model
wrote something else, or ran out of speculated text, the next gen makes a request of its own, as without speculation.
The results are those of a greedy model that would have written the program's constant text itself; fewer requests
carry the prompt (SGLang's backends count it in `token_usage`).

Only plain gens speculate: one with a regex, a JSON schema, a dtype, logprobs or streaming makes its own request,
and a role change, a select or an image ends the speculation.
"""

from __future__ import annotations

from typing import Any, Optional


class Speculation:
    """The speculated text not yet consumed by the program."""

    def __init__(self, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_api_spec_tokens must be >= 1, got {num_tokens}")
        self.num_tokens = num_tokens
        self.pending = ""
        self.meta_info: dict[str, Any] = {}
        self.model_stopped = False  # the speculated text ends where the model ended it (not at the token limit)

    @staticmethod
    def eligible(sampling_params: dict[str, Any], options: dict[str, Any], stream: bool) -> bool:
        constrained = any(sampling_params.get(name) for name in ("regex", "json_schema", "ebnf"))
        wants_logprobs = bool(options.get("return_logprob")) or bool(options.get("top_logprobs_num"))
        return not (stream or constrained or wants_logprobs)

    def request_params(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """The one request that speculates: N tokens, no stop string (the gens cut the text themselves)."""
        return {**sampling_params, "max_new_tokens": self.num_tokens, "stop": [], "min_new_tokens": 0}

    def fill(self, text: str, meta_info: dict[str, Any]) -> None:
        self.pending, self.meta_info = text, meta_info
        finish = meta_info.get("finish_reason") or {}
        self.model_stopped = isinstance(finish, dict) and finish.get("type") == "stop"

    def take(self, stops: list[str]) -> Optional[str]:
        """The next gen's value: the pending text up to its first stop string (which stays pending, for the
        program's next constant piece to match); all of it when no stop string is given or occurs but the model
        itself ended the text there. None when there is nothing pending or the text ran out at the token limit
        before a stop string (the gen then makes its own request)."""
        if not self.pending:
            return None
        cuts = [i for i in (self.pending.find(stop) for stop in stops if stop) if i >= 0]
        if stops and not cuts and not self.model_stopped:
            self.pending = ""
            return None
        end = min(cuts) if cuts else len(self.pending)
        value, self.pending = self.pending[:end], self.pending[end:]
        return value

    def follow(self, text: str) -> None:
        """The program appended constant `text`: consume it when the model wrote it, else stop speculating."""
        if self.pending.startswith(text):
            self.pending = self.pending[len(text):]
        else:
            self.pending = ""

    def clear(self) -> None:
        self.pending = ""
