"""Mixture-of-experts layers shared by the MoE model families: routing, the stacked experts and their kernels."""

from radixserve.model_runner.moe.layer import FusedMoE, SharedExpert, SparseMoeBlock, use_batch_invariant_experts
from radixserve.model_runner.moe.routing import select_experts

__all__ = ["FusedMoE", "SharedExpert", "SparseMoeBlock", "select_experts", "use_batch_invariant_experts"]
