"""Speculative decoding's small parts: n-gram proposals, the adaptive draft length, and the flag checks."""

from __future__ import annotations

import pytest

from radixserve.runtime.wire.server_args import ServerArgs, resolved_num_draft_tokens
from radixserve.scheduler.speculative.ngram import TokenIndex
from radixserve.scheduler.speculative.state import SpecState


def index_of(tokens: list[int]) -> TokenIndex:
    index = TokenIndex()
    index.extend_to(tokens)
    return index


def propose(index: TokenIndex, max_drafts: int, min_window: int, max_window: int) -> list[int]:
    """What the n-gram proposer copies: up to `max_drafts` tokens after the longest, latest match."""
    return index.continuation(index.longest_match(min_window, max_window)[1], max_drafts)


def test_proposes_what_followed_the_longest_latest_match():
    # "7 8 9" occurred twice; its latest earlier occurrence was followed by 4 5, the first one by 1 2.
    tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 8, 9]
    assert propose(index_of(tokens), 2, 1, 12) == [4, 5]
    # The longest match wins over a later, shorter one: "1 8 9" matches at the start, "2 8 9" only by "8 9".
    assert propose(index_of([1, 8, 9, 4, 2, 8, 9, 5, 3, 1, 8, 9]), 2, 1, 12) == [4, 2]
    assert propose(index_of(tokens), 2, 3, 12) == []  # no 3-token match of "0 8 9"
    assert propose(index_of([1, 2, 3]), 4, 1, 12) == []  # the last token never occurred before
    assert propose(index_of(tokens), 0, 1, 12) == []


def test_index_grows_with_the_sequence():
    index = index_of([5, 6, 7])
    index.extend_to([5, 6, 7, 5])
    assert propose(index, 3, 1, 12) == [6, 7, 5]  # proposals may run into the tail itself (a repeating loop)
    index.extend_to([5, 6, 7, 5, 6, 7, 5, 6])
    assert propose(index, 2, 1, 12) == [7, 5]


def test_draft_length_follows_the_acceptance_rate():
    state = SpecState(max_drafts=6)
    assert state.draft_len == 6
    for _ in range(4):
        state.on_verified(state.draft_len, 0)
    assert state.draft_len == 1
    for _ in range(4):
        state.on_verified(state.draft_len, state.draft_len)
    assert state.draft_len >= 5
    assert state.verify_ct == 8 and state.num_accepted <= state.num_proposed


def test_longest_match_reports_its_length_and_continuation():
    tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 8, 9]
    index = index_of(tokens)
    assert index.longest_match(1, 12) == (2, 9)  # "8 9" (the "0" before the tail never occurred), then 4 5 6
    assert index.continuation(9, 3) == [4, 5, 6]
    assert index.longest_match(1, 1) == (1, 9)  # the window caps the length; the latest occurrence wins
    assert index.longest_match(3, 12) == (0, -1)
    assert index_of([1, 2, 3]).longest_match(1, 12) == (0, -1)
    assert index.continuation(-1, 3) == [] and index.continuation(9, 0) == []


def test_ngram_draft_length_follows_the_match_and_the_acceptance_rate():
    state = SpecState(max_drafts=6)
    assert [state.ngram_draft_len(n) for n in (0, 1, 2, 5, 12)] == [0, 6, 6, 6, 6]
    for _ in range(4):
        state.on_verified(6, 0)  # every draft rejected: lone-token matches get one draft
    assert state.ngram_draft_len(1) == 1 and state.ngram_draft_len(2) == 6  # a longer match still gets a chain
    assert state.ngram_draft_len(0) == 0
    for _ in range(4):
        state.on_verified(6, 6)
    assert state.ngram_draft_len(1) >= 5


def test_ngram_proposer_sizes_each_chain_by_its_match():
    from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
    from radixserve.radix_cache.tree import RadixCache
    from radixserve.runtime.wire.sampling_params import SamplingParams
    from radixserve.scheduler.req import Req
    from radixserve.scheduler.speculative.proposers import NgramProposer

    allocator = KVAllocator(64, 1)
    proposer = NgramProposer(1, 12, RadixCache(ReqToTokenPool(2, 64), allocator, 1))
    strong_ids, weak_ids = [5, 6, 7, 8, 9, 10, 11, 3, 6, 7], [5, 6, 7, 8, 9, 10, 11, 3, 4, 7]  # "6 7" / "7" seen
    strong, weak = Req("strong", strong_ids, SamplingParams()), Req("weak", weak_ids, SamplingParams())
    cold_strong, cold_weak = Req("cs", strong_ids, SamplingParams()), Req("cw", weak_ids, SamplingParams())
    new = Req("new", [5, 6, 7, 8, 9, 10, 11, 3, 4, 12], SamplingParams())  # "12" never occurred before
    reqs = [strong, weak, cold_strong, cold_weak, new]
    for req in reqs:
        req.spec = SpecState(max_drafts=4)
    for req in (cold_strong, cold_weak):
        req.spec.acceptance_ema = 0.25  # their drafts were mostly rejected
    full = [8, 9, 10, 11]
    assert proposer.propose(reqs, [4] * len(reqs)) == [full, full, full, [8], []]
    assert proposer.propose([strong], [2]) == [[8, 9]]  # never more than the budget


def test_flags_resolve_and_refuse_what_cannot_be_honoured():
    assert resolved_num_draft_tokens(ServerArgs()) is None
    assert resolved_num_draft_tokens(ServerArgs(speculative_algorithm="NGRAM")) == 6
    assert ServerArgs(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    assert resolved_num_draft_tokens(ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=3)) == 4
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5, speculative_num_steps=4,
                      speculative_eagle_topk=1, disable_overlap_schedule=False)
    assert resolved_num_draft_tokens(args) == 5
    assert args.resolved_overlap_schedule()  # the overlap scheduler runs with speculative decoding
    refused = {
        "EAGLE": dict(speculative_algorithm="EAGLE"),
        "EAGLE3": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="x"),
        "bogus": dict(speculative_algorithm="MEDUSA"),
        "no algorithm": dict(speculative_num_draft_tokens=4),
        "steps mismatch": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, speculative_num_steps=2),
        "topk": dict(speculative_algorithm="NGRAM", speculative_eagle_topk=4),
        "bfs breadth": dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=10),
        "match type": dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="PROB"),
        "window": dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                       speculative_ngram_max_match_window_size=3),
        "too few drafts": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1),
        "ngram with a draft model": dict(speculative_algorithm="NGRAM", speculative_draft_model_path="x"),
    }
    for name, kwargs in refused.items():
        with pytest.raises(ValueError, match="speculative"):
            ServerArgs(**kwargs)
        assert name


def test_cli_accepts_sglang_flag_names():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-ngram-min-match-window-size", "2",
        "--speculative-ngram-max-match-window-size", "8",
    ]))
    assert args.speculative_algorithm == "NGRAM" and resolved_num_draft_tokens(args) == 4
    assert args.speculative_ngram_min_match_window_size == 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_continuation_follows_the_most_recent_branch(page_size):
    from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool
    from radixserve.radix_cache.tree import RadixCache

    allocator = KVAllocator(256, page_size)
    cache = RadixCache(ReqToTokenPool(4, 64), allocator, page_size)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    second = [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23]
    cache.insert(first, allocator.alloc(len(first)))
    slots = allocator.alloc(len(second))
    allocator.free(slots[: cache.insert(second, slots)])  # the caller frees its copies of the shared prefix
    cache.match_prefix(first)  # `first` is now the most recently used branch
    assert cache.continuation([1, 2, 3], (), 4) == [4, 5, 6, 7]
    assert cache.continuation([1, 2, 3, 4, 5, 6, 7, 8], (), 3) == [9, 10, 11]
    assert cache.continuation([1, 2, 3, 4, 5, 6, 7, 8, 20], (), 10) == [21, 22, 23]
    assert cache.continuation([1, 2, 3, 9], (), 4) == []  # not in the tree
    assert cache.continuation(first, (), 4) == []  # nothing after it
    assert cache.continuation([1, 2, 3], ("other",), 4) == []  # another namespace sees nothing
    cache.check_invariants(held_slots=0)


def test_meta_info_carries_sglang_spec_keys():
    from radixserve.runtime.wire.messages import SpecCounts
    from radixserve.tokenizer_manager.state import spec_meta_info

    meta = spec_meta_info(SpecCounts(verify_ct=10, accepted_drafts=12, proposed_drafts=30), completion_tokens=23)
    assert meta == {"spec_verify_ct": 10, "spec_accept_token_num": 12, "spec_draft_token_num": 30,
                    "spec_accept_rate": 0.4, "spec_accept_length": 2.3}
