"""What the tree holds after a given sequence: continuations other requests of a namespace already computed.

Used for speculative drafts (scheduler/speculative/proposers.py): when another request of the same namespace
ran through exactly the same tokens, what it produced next is a likely continuation. A read-only walk: no split,
no access time, no statistics, so proposing never changes what the cache evicts or reports.
"""

from __future__ import annotations

from typing import Any, Optional

from radixserve.radix_cache.keys import common_prefix_length


def _child_for(node: Any, key: list[int], pos: int) -> Optional[Any]:
    """The child of `node` whose key starts with `key[pos]` (children are keyed by their first token or, with
    pages, their first page; a query tail shorter than a page is compared child by child)."""
    for child in node.children.values():
        if child.key and child.key[0] == key[pos]:
            return child
    return None


def tree_continuation(ns_root: Any, token_ids: list[int], max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens that follow the whole of `token_ids` below `ns_root`, along the most recently used
    branch; [] when the tree does not hold all of `token_ids`."""
    node, pos, end = ns_root, 0, len(token_ids)
    tail: list[int] = []
    while pos < end:
        child = _child_for(node, token_ids, pos)
        if child is None:
            return []
        matched = common_prefix_length(child.key, token_ids, pos, end)
        if pos + matched == end:
            tail = list(child.key[matched: matched + max_tokens])  # the rest of this node, as far as wanted
            node = child
            break
        if matched < len(child.key):
            return []
        pos += matched
        node = child
    while len(tail) < max_tokens and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        tail.extend(node.key[: max_tokens - len(tail)])
    return tail
