"""Double backward through mok.moe (a gradient of a gradient: create_graph=True) is a typed
mok.UnsupportedError naming what is unsupported, never torch's "no autograd formula" RuntimeError;
first-order gradients are unchanged."""
from __future__ import annotations

import pytest
import torch

import mok


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    T, H, I, E = 5, 8, 6, 4
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).requires_grad_()
    return hidden, logits, w13, w2


@pytest.mark.parametrize("replay", [False, True])
def test_double_backward_is_a_typed_error(replay):
    hidden, logits, w13, w2 = _layer()
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]]) if replay else None
    out = mok.moe(hidden, logits, w13, w2, 2, topk_ids=ids)
    with pytest.raises(mok.UnsupportedError, match="second derivative"):
        grad_hidden, = torch.autograd.grad(out.square().sum(), hidden, create_graph=True)
        grad_hidden.sum().backward()


def test_first_order_gradients_still_work():
    hidden, logits, w13, w2 = _layer()
    mok.moe(hidden, logits, w13, w2, 2).square().sum().backward()
    again = _layer()
    grads = torch.autograd.grad(mok.moe(*again, 2).square().sum(), again)
    for tensor, grad in zip((hidden, logits, w13, w2), grads):
        assert torch.equal(tensor.grad, grad)
