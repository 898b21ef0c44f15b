"""Workloads for the serving benchmark (benchmarks/serving.py): prompts built from random token ids.

Every workload is a list of `Session`s. A session is what one simulated user does after it arrives: a single
request (datasets `random` and `generated-shared-prefix`) or a conversation of several turns sent one after
the other (`multi-turn`). Prompts are token ids drawn uniformly from the tokenizer's vocabulary (special tokens
excluded), so no data set has to be downloaded; each turn carries its ids and their decoded text, and the
client sends whichever its API takes (ids to the native `/generate`, text to OpenAI `/v1/completions`).

- `random`: input and output lengths drawn uniformly from [L * r, L] (r = `range_ratio`; 1.0 = fixed lengths);
- `generated-shared-prefix`: `num_groups` system prompts of `system_len` tokens, each followed by
  `prompts_per_group` questions of `question_len` tokens; all requests shuffled together, so a radix cache can
  serve the system prompt from memory for all but the first request of each group;
- `multi-turn`: conversations whose turn k prompt is turn k-1's prompt + the answer the server gave to it +
  `user_len` new tokens; the next turn's prompt is only known once the previous answer is in, so a turn holds
  only its new user text and `Session.next_prompt` builds the full prompt at run time.

Seeded: the same arguments give the same prompts; each dataset has its own random stream, so two datasets
with the same seed share no prompt prefix (nor does the warmup request).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

DATASETS = ("random", "generated-shared-prefix", "multi-turn")


@dataclass
class Turn:
    """One request of a session. `new_ids` / `new_text`: the user tokens this turn adds (the whole prompt for a
    single-request session); `output_len`: the planned number of output tokens (sent with ignore_eos)."""

    new_ids: list[int]
    new_text: str
    output_len: int


@dataclass
class Session:
    """A user's requests, sent in order; each turn's prompt extends the previous prompt and answer when
    `extends_history` is true (multi-turn), else each turn stands alone."""

    turns: list[Turn]
    extends_history: bool = False
    history_ids: list[int] = field(default_factory=list)
    history_text: str = ""

    def next_prompt(self, index: int) -> tuple[list[int], str]:
        """The full prompt of turn `index` (ids, text), given the history recorded so far."""
        turn = self.turns[index]
        if not self.extends_history:
            return turn.new_ids, turn.new_text
        return self.history_ids + turn.new_ids, self.history_text + turn.new_text

    def record_answer(self, index: int, prompt_ids: list[int], prompt_text: str, answer_ids: list[int],
                      answer_text: str) -> None:
        """Remember turn `index`'s prompt and answer as the history the next turn extends."""
        if self.extends_history:
            self.history_ids = prompt_ids + answer_ids
            self.history_text = prompt_text + answer_text


class TokenSampler:
    """Random prompts of a given number of token ids (special tokens excluded), with their decoded text."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        self.vocab = [token for token in range(len(tokenizer)) if token not in special]

    def ids(self, length: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(length)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _length(rng: random.Random, full: int, range_ratio: float) -> int:
    """A length drawn uniformly from [full * range_ratio, full], at least 1."""
    return max(1, rng.randint(max(1, int(full * range_ratio)), full))


def random_sessions(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 1.0,
                    seed: int = 0) -> list[Session]:
    """`num_prompts` single requests with input and output lengths drawn from [L * range_ratio, L]."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(f"random-{seed}")
    sampler = TokenSampler(tokenizer, rng)
    sessions = []
    for _ in range(num_prompts):
        ids = sampler.ids(_length(rng, input_len, range_ratio))
        sessions.append(Session([Turn(ids, sampler.decode(ids), _length(rng, output_len, range_ratio))]))
    return sessions


def shared_prefix_sessions(tokenizer, num_groups: int = 64, prompts_per_group: int = 16, system_len: int = 2048,
                           question_len: int = 128, output_len: int = 256, seed: int = 0) -> list[Session]:
    """`num_groups * prompts_per_group` single requests: a group's system prompt + a question of its own, shuffled.

    The text of a prompt is the system prompt's text followed by the question's, so text clients share the
    prefix too (its token count may differ by a few tokens at the join after re-tokenization).
    """
    rng = random.Random(f"generated-shared-prefix-{seed}")
    sampler = TokenSampler(tokenizer, rng)
    sessions = []
    for _ in range(num_groups):
        system_ids = sampler.ids(system_len)
        system_text = sampler.decode(system_ids)
        for _ in range(prompts_per_group):
            question_ids = sampler.ids(question_len)
            turn = Turn(system_ids + question_ids, system_text + sampler.decode(question_ids), output_len)
            sessions.append(Session([turn]))
    rng.shuffle(sessions)
    return sessions


def multi_turn_sessions(tokenizer, num_conversations: int, num_turns: int = 4, first_len: int = 256,
                        user_len: int = 64, output_len: int = 64, seed: int = 0) -> list[Session]:
    """`num_conversations` conversations of `num_turns` turns: a first prompt of `first_len` tokens, then
    `user_len` new tokens per later turn on top of the previous prompt and answer."""
    rng = random.Random(f"multi-turn-{seed}")
    sampler = TokenSampler(tokenizer, rng)
    sessions = []
    for _ in range(num_conversations):
        turns = []
        for index in range(num_turns):
            ids = sampler.ids(first_len if index == 0 else user_len)
            turns.append(Turn(ids, sampler.decode(ids), output_len))
        sessions.append(Session(turns, extends_history=True))
    return sessions


def warmup_session(tokenizer) -> Session:
    """A short request that shares no prefix with the workloads (its ids come from a separate stream)."""
    sampler = TokenSampler(tokenizer, random.Random("warmup"))
    ids = sampler.ids(8)
    return Session([Turn(ids, sampler.decode(ids), 4)])
