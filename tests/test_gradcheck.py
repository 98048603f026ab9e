"""Finite-difference checks (float64, fourth-order central differences) of every hand-written
backward: each layer, and the full loss w.r.t. every parameter tensor and the input, in both
routing-gradient modes.  Max relative error < 1e-6 (see pycapsnet.tools.finite_diff for the metric)."""
import pytest

from pycapsnet import backends
from pycapsnet.tools import finite_diff, gradcheck

B64 = backends.get("numpy", dtype="float64")


def _assert_all_pass(results):
    assert results, "no check ran"
    bad = [f"{r.layer} / {r.tensor}: max rel {r.max_rel:.2e} (abs {r.max_abs:.2e})" for r in results if not r.passed]
    assert not bad, "gradient check failed:\n" + "\n".join(bad)


def test_every_layer():
    results = gradcheck.layer_checks(B64, samples=25)
    names = {r.layer for r in results}
    for expected in ["Conv2d 3x3/2 pad1", "ReLU", "Sigmoid", "Linear", "squash", "softmax",
                     "FourierConv2d 3x3/2 pad1", "FourierConv2d 5x5/3", "PrimaryCaps fourier", "PrimaryCaps im2col",
                     "ClassCaps routing=full", "ClassCaps routing=final", "ClassCaps routing=full shared",
                     "CapsuleLength", "MarginLoss", "ReconstructionLoss", "BatchNorm training image",
                     "BatchNorm evaluation features", "DepthwiseConv2d 3x3/2 pad1", "PrimaryCaps depthwise squash=efficient"]:
        assert expected in names
    _assert_all_pass(results)


@pytest.mark.parametrize("mode", ["full", "final"])
@pytest.mark.parametrize("share", [False, True])
def test_full_loss_every_parameter_and_input(mode, share):
    results = gradcheck.model_checks(B64, samples=15, routing_grad=mode, share_spatial=share)
    assert {r.tensor for r in results} >= {"input", "conv1.W", "conv1.b", "primary.W", "primary.b",
                                           "classcaps.W", "decoder1.W", "decoder3.b"}
    _assert_all_pass(results)


def test_full_loss_with_the_im2col_primarycaps():
    results = gradcheck.model_checks(B64, samples=15, primary_conv="im2col")
    assert results[0].layer.endswith("im2col")
    _assert_all_pass(results)


def test_full_loss_paper_weighting_and_more_iterations():
    # the paper's reconstruction weight and 5 routing iterations, batch of 4
    _assert_all_pass(gradcheck.model_checks(B64, samples=10, routing_iters=5, batch=4, seed=3))


def test_check_catches_a_wrong_gradient(monkeypatch):
    """The checker itself can fail: a squash backward off by 1% is reported."""
    from pycapsnet.core import squash as sq

    orig = sq.squash_backward
    monkeypatch.setattr(sq, "squash_backward", lambda *a, **k: 1.01 * orig(*a, **k))
    monkeypatch.setattr(gradcheck, "squash_backward", sq.squash_backward)
    results = gradcheck.layer_checks(B64, samples=10)
    assert any(not r.passed and r.layer == "squash" for r in results)


def test_squash_finite_at_zero():
    import numpy as np

    from pycapsnet.core.squash import squash, squash_backward

    s = np.zeros((2, 3, 4))
    v, n = squash(B64.xp, s)
    ds = squash_backward(B64.xp, s, n, np.ones_like(s))
    assert np.all(np.isfinite(v)) and np.all(v == 0)
    assert np.all(np.isfinite(ds)) and np.all(ds == 0)  # v = O(|s|^2): zero Jacobian at the origin


def test_model_check_catches_a_routing_backward_bug(monkeypatch):
    """Dropping the '- sum_j c dc' term of the softmax backward breaks the gradient through the
    routing iterations: the full-mode model check fails; the final mode never uses it and passes."""
    from pycapsnet.core import routing

    monkeypatch.setattr(routing, "softmax_backward", lambda xp, c, dc, axis=-1: c * dc)
    broken = gradcheck.model_checks(B64, samples=8, routing_grad="full")
    assert any(not r.passed for r in broken if r.tensor == "classcaps.W")
    _assert_all_pass(gradcheck.model_checks(B64, samples=8, routing_grad="final"))


def test_rounding_of_a_large_loss_is_not_a_failure_and_an_error_still_is():
    """A loss of 3000 rounds to about 5e-13, so the quotient at h = 1e-5 to about 3e-8: beyond 1e-6 of
    a gradient of 0.001.  The check counts errors beyond what its two step sizes disagree by, so the
    exact gradient passes with every entry checked (none taken for a kink), and one off by 1e-4 of
    its size still fails."""
    import numpy as np

    x = B64.asarray(np.linspace(-1.0, 1.0, 12))
    g = np.linspace(0.001, 0.05, 12)

    def loss():  # exact gradient g; the constant is what rounds
        return 3000.0 + float(np.sum(g * B64.to_numpy(x)))

    exact = finite_diff.check_tensors(B64, "big loss", loss, {"x": x}, {"x": B64.asarray(g)}, samples=12)
    off = finite_diff.check_tensors(B64, "big loss", loss, {"x": x}, {"x": B64.asarray(g * (1 + 1e-4))}, samples=12)
    assert exact[0].max_abs > 1e-6 * g.min(), "the rounding this test is about did not occur"
    _assert_all_pass(exact)
    assert exact[0].n_checked == 12 and exact[0].kinks == 0
    assert not off[0].passed
