"""The gated delta rule's torch forms (model_runner/gated_delta.py) against a float64 token-by-token reference.

The chunked form (prefill) and the recurrent form (decode) must give the reference's outputs and final state from
any initial state, at every chunk size, including a sequence that ends mid-chunk; a sequence split in two and
resumed from the state of its first half gives the same as the whole. Where flash-linear-attention (`fla-core`)
imports and its Triton kernels run under the interpreter, its chunked and fused-recurrent kernels are checked
against the same reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from radixserve.model_runner.gated_delta import (causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                                 l2_normalize, recurrent_gated_delta_rule)


def reference(q, k, v, g, beta, state, scale):
    """float64, one token at a time, written from the recurrence; `[T, H, D]` inputs, `[H, Dk, Dv]` state."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state))
    state = state.clone()
    outputs = torch.zeros(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = state[h] * torch.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - s.T @ k[t, h])
            s = s + torch.outer(k[t, h], u)
            outputs[t, h] = s.T @ (q[t, h] * scale)
            state[h] = s
    return outputs, state


def inputs(num_tokens, heads=3, dk=8, dv=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_tokens, heads, dk, generator=gen))
    k = l2_normalize(torch.randn(num_tokens, heads, dk, generator=gen))
    v = torch.randn(num_tokens, heads, dv, generator=gen)
    # Log-decays from near 0 (long memory) to about -3, write strengths across (0, 1).
    g = -torch.rand(num_tokens, heads, generator=gen) * 3
    beta = torch.rand(num_tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def assert_matches(out, state, ref_out, ref_state):
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,chunk_size", [(1, 64), (17, 4), (64, 16), (100, 64), (130, 32)])
@pytest.mark.parametrize("zero_state", [True, False])
def test_chunked_form_matches_reference(num_tokens, chunk_size, zero_state):
    q, k, v, g, beta, state = inputs(num_tokens, seed=num_tokens)
    if zero_state:
        state = torch.zeros_like(state)
    scale = q.shape[-1] ** -0.5
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, scale, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == v.shape
    assert_matches(out, final, *reference(q, k, v, g, beta, state, scale))


def test_recurrent_form_matches_reference_for_a_batch():
    batch = [inputs(9, seed=s) for s in range(4)]
    stacked = [torch.stack(parts) for parts in zip(*batch)]
    scale = 8 ** -0.5
    out, final = recurrent_gated_delta_rule(*stacked[:5], stacked[5], scale)
    for i, parts in enumerate(batch):
        assert_matches(out[i], final[i], *reference(*parts, scale))


def test_resuming_from_a_state_equals_the_whole_sequence():
    """Prefill a prefix in chunks, continue in chunks, then decode token by token: the state carries it all."""
    q, k, v, g, beta, state = inputs(90, seed=7)
    state = torch.zeros_like(state)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_state = reference(q, k, v, g, beta, state, scale)
    first, s1 = chunk_gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], state, scale, chunk_size=16)
    second, s2 = chunk_gated_delta_rule(q[37:80], k[37:80], v[37:80], g[37:80], beta[37:80], s1, scale, chunk_size=16)
    outs = [first, second]
    s = s2[None]
    for t in range(80, 90):
        o, s = recurrent_gated_delta_rule(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1], g[None, t:t + 1],
                                          beta[None, t:t + 1], s, scale)
        outs.append(o[0])
    assert_matches(torch.cat(outs), s[0], ref_out, ref_state)


def test_inputs_are_not_written():
    q, k, v, g, beta, state = inputs(5)
    before = state.clone()
    chunk_gated_delta_rule(q, k, v, g, beta, state, 0.3)
    recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state[None], 0.3)
    assert torch.equal(state, before)


def test_causal_conv1d_prefill_then_steps_equals_one_pass():
    gen = torch.Generator().manual_seed(3)
    channels, width = 6, 4
    x = torch.randn(11, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64)
    # float64 reference: out[t, c] = silu(sum_j weight[c, j] * x[t - (K-1) + j, c]), zero before the start.
    padded = torch.cat([torch.zeros(width - 1, channels, dtype=torch.float64), x])
    ref = torch.stack([(padded[t:t + width].T * weight).sum(-1) for t in range(11)])
    ref = ref * torch.sigmoid(ref)
    zero = torch.zeros(channels, width - 1, dtype=torch.float64)
    whole, _ = causal_conv1d(x, zero, weight)
    torch.testing.assert_close(whole, ref)
    head, state = causal_conv1d(x[:6], zero, weight)
    outs = [head]
    state = state[None]
    for t in range(6, 11):
        out, state = causal_conv1d_step(x[None, t], state, weight)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), ref)


# ---- flash-linear-attention's kernels (Triton), where they run ---------------------------------------------------

def _fla():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as exc:  # noqa: BLE001 - any import failure means the kernels cannot be checked here
        pytest.skip(f"flash-linear-attention does not import here: {type(exc).__name__}: {exc}")
    return fla_chunk, fla_recurrent


def _fla_case(num_tokens, device):
    q, k, v, g, beta, state = inputs(num_tokens, heads=2, dk=16, dv=16, seed=11)
    return [x.to(device) for x in (q, k, v, g, beta, state)]


def test_fla_fused_recurrent_matches_reference():
    _, fla_recurrent = _fla()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta, state = _fla_case(6, device)
    scale = q.shape[-1] ** -0.5
    try:
        out, final = fla_recurrent(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=scale,
                                   initial_state=state[None], output_final_state=True)
    except Exception as exc:  # noqa: BLE001 - a kernel the interpreter cannot run is a skip, not a failure
        if torch.cuda.is_available():
            raise
        pytest.skip(f"fla's fused recurrent kernel does not run under the Triton interpreter: {exc}")
    assert_matches(out[0].cpu(), final[0].cpu(), *reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                                            state.cpu(), scale))


def test_fla_chunk_matches_reference():
    fla_chunk, _ = _fla()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta, state = _fla_case(70, device)
    scale = q.shape[-1] ** -0.5
    try:
        out, final = fla_chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=scale,
                               initial_state=state[None], output_final_state=True)
    except Exception as exc:  # noqa: BLE001
        if torch.cuda.is_available():
            raise
        pytest.skip(f"fla's chunked kernel does not run under the Triton interpreter: {exc}")
    ref_out, ref_state = reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), state.cpu(), scale)
    # fla's chunked kernel computes in tf32/bf16 blocks on the GPU: a looser bound there.
    tol = 2e-2 if torch.cuda.is_available() else 2e-4
    torch.testing.assert_close(out[0].double().cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(final[0].double().cpu(), ref_state, atol=tol, rtol=tol)
