"""Data parallelism on one host (`--dp-size N`): a controller process in front of N scheduler replicas.

    TokenizerManager --> DP controller --> replica i's scheduler (or TP group) --> the one DetokenizerManager
                              ^                      |
                              +---- ReplicaLoad -----+   (load, evicted prefixes, flushes)

The controller (controller.py) picks a replica for each generate request by `--load-balance-method`
(policy.py; `cache_aware` uses the approximate per-namespace prefix tree of prefix_tree.py) and fans control
messages (aborts, flush, server info, cache trees) out to every replica; the TokenizerManager gathers the N
replies (tokenizer_manager/replicas.py). The tree is generic over sequences, so the Ray Serve router can use it
on text.
"""
