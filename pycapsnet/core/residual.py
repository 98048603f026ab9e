"""Residual blocks (He et al. 2016): the block's output is its body's plus its shortcut's,

    y = F(x) + S(x),   S the identity, or a projection where F changes the shape
                       (a 1x1 convolution of F's stride and channels, then batch norm: He et al.'s option B)

F and S are Sequentials of any layers (a description's lists), built from the flow the block takes;
both must emit the same flow.  The ReLU after the sum is the next layer of the description.

Backward.  y is a sum, so dL/dy reaches both branches unchanged, and x feeds both:

    dx = F'(x)ᵀ dy + S'(x)ᵀ dy        (S the identity: dx = F'(x)ᵀ dy + dy)

Each branch adds its parameters' gradients as any Sequential does.  Parameters are named
``block.body.LAYER.PARAM`` and ``block.shortcut.LAYER.PARAM``.
"""
from __future__ import annotations

from .sequential import Sequential


class Residual(Sequential):
    """y = body(x) + shortcut(x), or body(x) + x without a shortcut; see the module's docstring."""

    def __init__(self, backend, body: Sequential, shortcut: Sequential | None = None):
        super().__init__(backend, [("body", body)] + ([("shortcut", shortcut)] if shortcut is not None else []))

    def forward(self, x):
        # x: what the block takes, (N, H, W, C) for images; y: what both branches emit
        fx = self.layers[0].forward(x)
        return fx + (self.layers[1].forward(x) if len(self.layers) > 1 else x)

    def backward(self, dy, input_grad=True):
        dx = self.layers[0].backward(dy, input_grad)
        ds = self.layers[1].backward(dy, input_grad) if len(self.layers) > 1 else dy
        return dx + ds if input_grad else None
