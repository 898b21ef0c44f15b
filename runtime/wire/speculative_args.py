"""Speculative decoding's server arguments: SGLang's flag names, the values radixserve honours, and the checks.

Light (no torch), like server_args.py, which calls `check_speculative_args` from its `__post_init__`.

radixserve verifies chains (one draft token per position, no trees), so:
- `speculative_num_draft_tokens` is the length of the verified chain per request and step, counting the
  token sampled after the accepted drafts: at most `num_draft_tokens - 1` drafts are proposed;
- `speculative_num_steps`, when given, is the number of drafts (SGLang's chain depth) and must equal
  `num_draft_tokens - 1` when both are given;
- `speculative_eagle_topk` and the n-gram BFS breadths must be 1 (a wider tree is not verified here).
"""

from __future__ import annotations

from typing import Any, Optional

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# SGLang's other algorithms: named so that asking for one gets a clear refusal rather than "unknown".
UNSUPPORTED_SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "MTP", "NEXTN", "LOOKAHEAD")
NGRAM_MATCH_TYPES = ("BFS",)
DEFAULT_NUM_DRAFT_TOKENS = 6


def check_speculative_args(args: Any) -> None:
    """Raise ValueError for speculative settings radixserve cannot honour (see the module docstring); normalises
    the algorithm's name to upper case."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        given = [name for name in ("speculative_draft_model_path", "speculative_num_draft_tokens",
                                   "speculative_num_steps", "speculative_eagle_topk")
                 if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need speculative_algorithm (one of {SPECULATIVE_ALGORITHMS})")
        return
    algorithm = args.speculative_algorithm = algorithm.upper()  # SGLang's names are upper case; accept "ngram"
    if algorithm in UNSUPPORTED_SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm {algorithm} is not supported by radixserve (no trained draft "
                         f"heads are run); use one of {SPECULATIVE_ALGORITHMS}")
    if algorithm not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "STANDALONE" and args.speculative_draft_model_path is None:
        raise ValueError("speculative_algorithm STANDALONE needs speculative_draft_model_path")
    if algorithm == "STANDALONE" and args.tp_size > 1:
        raise ValueError("speculative_algorithm STANDALONE runs its draft model on one device: it needs tp_size 1")
    if algorithm == "NGRAM" and args.speculative_draft_model_path is not None:
        raise ValueError("speculative_algorithm NGRAM takes no speculative_draft_model_path (its drafts come "
                         "from the request's own tokens); use STANDALONE for a draft model")
    num_draft, steps = args.speculative_num_draft_tokens, args.speculative_num_steps
    if num_draft is not None and num_draft < 2:
        raise ValueError(f"speculative_num_draft_tokens must be >= 2 (one draft plus the sampled token), got "
                         f"{num_draft}")
    if steps is not None and steps < 1:
        raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
    if num_draft is not None and steps is not None and num_draft != steps + 1:
        raise ValueError(f"radixserve verifies chains: speculative_num_draft_tokens ({num_draft}) must be "
                         f"speculative_num_steps + 1 ({steps + 1})")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError(f"speculative_eagle_topk must be 1: radixserve verifies chains, not trees (got "
                         f"{args.speculative_eagle_topk})")
    if args.speculative_ngram_min_bfs_breadth != 1 or args.speculative_ngram_max_bfs_breadth != 1:
        raise ValueError("speculative_ngram_min_bfs_breadth and speculative_ngram_max_bfs_breadth must be 1: "
                         "radixserve proposes one chain per request, not a tree")
    if args.speculative_ngram_match_type not in NGRAM_MATCH_TYPES:
        raise ValueError(f"speculative_ngram_match_type must be one of {NGRAM_MATCH_TYPES}, got "
                         f"{args.speculative_ngram_match_type!r}")
    low, high = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= speculative_ngram_min_match_window_size ({low}) <= "
                         f"speculative_ngram_max_match_window_size ({high})")


def resolved_num_draft_tokens(args: Any) -> Optional[int]:
    """Verified chain length per request and step (drafts + 1), or None when speculation is off."""
    if args.speculative_algorithm is None:
        return None
    if args.speculative_num_draft_tokens is not None:
        return args.speculative_num_draft_tokens
    if args.speculative_num_steps is not None:
        return args.speculative_num_steps + 1
    return DEFAULT_NUM_DRAFT_TOKENS
