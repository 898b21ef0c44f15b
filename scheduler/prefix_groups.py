"""Which requests of a decode batch hold the same KV slots for a cached prefix, read from the radix tree.

A running request's `last_node` ends the tree path whose slots fill the start of its `req_to_token` row: the
prefix it matched at admission, then (every extend batch inserts what it computes) its own prompt, whose row is
pointed at the tree's slots where the tree already had them. So two requests whose paths pass through the same
node hold the same slots for every position up to that node's end, the node's depth.

For each request, its group is named by the deepest node of its path that another request of the batch also
passes through, if that node ends at least `min_len` positions in; the group's shared length is that depth.
Nothing here touches the device: an attention backend that reads a group's shared keys once (cascade attention,
see the FlashInfer backend) plans from these host-side lists.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Optional, Sequence

from radixserve.model_runner.forward_batch import ForwardMode, PrefixGroups
from radixserve.scheduler.req import Req


def prefix_groups_for(mode: ForwardMode, decodes: Sequence[Req], backend: Any) -> Optional[PrefixGroups]:
    """The groups of a DECODE batch of `decodes` for an attention backend that uses them, else None."""
    if mode != ForwardMode.DECODE or not getattr(backend, "uses_prefix_groups", False) or len(decodes) < 2:
        return None
    return find_prefix_groups(decodes, max(1, backend.min_shared_prefix))


def find_prefix_groups(reqs: Sequence[Req], min_len: int) -> Optional[PrefixGroups]:
    """Groups of `reqs` (batch order) sharing at least `min_len` cached positions, or None when there are none."""
    depth: dict[int, int] = {}
    paths = [_path(req.last_node, depth) for req in reqs]
    passing = Counter(id(node) for path in paths for node in path)
    members: dict[int, list[int]] = defaultdict(list)
    for index, path in enumerate(paths):
        for node in path:  # deepest first: depths shrink and counts grow going up
            if passing[id(node)] >= 2:
                if depth[id(node)] >= min_len:
                    members[id(node)].append(index)
                break
    groups = [(depth[key], indices) for key, indices in members.items() if len(indices) >= 2]
    if not groups:
        return None
    return PrefixGroups(members=[indices for _, indices in groups], lengths=[length for length, _ in groups])


def _path(node: Any, depth: dict[int, int]) -> list[Any]:
    """The nodes from `node` up to its namespace root (excluded), deepest first, recording each one's depth."""
    path = []
    while node is not None and node.key:  # roots have an empty key
        path.append(node)
        node = node.parent
    above = 0
    for upper in reversed(path):
        above = depth.setdefault(id(upper), above + len(upper.key))
    return path
