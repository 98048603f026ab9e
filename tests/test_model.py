"""Model structure, parameter counts, the no-autograd guarantee, and clear errors for bad input."""
import re

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet, CapsNetConfig, CapsNetError
from pycapsnet.core.model import param_shapes
from tests.conftest import CPU_BACKENDS, SMALL


def test_paper_mnist_parameter_count():
    m = CapsNet("numpy")
    # conv1 9*9*1*256+256, PrimaryCaps 9*9*256*256+256, W_ij 1152*10*16*8, decoder 160-512-1024-784
    assert m.n_params() == 20_992 + 5_308_672 + 1_474_560 + 82_432 + 525_312 + 803_600 == 8_215_568
    assert m.n_primary_capsules == 1152
    assert {k: tuple(v.shape) for k, v in m.params.items()} == param_shapes(m.config)


def test_share_spatial_keeps_large_inputs_small():
    big = CapsNetConfig(input_shape=(3, 224, 224), n_classes=276)
    per_position = sum(np.prod(s) for s in param_shapes(big).values())
    shared = sum(np.prod(s) for s in param_shapes(CapsNetConfig(**{**big.to_dict(), "share_spatial": True})).values())
    assert 11.5e9 < per_position < 12.5e9        # ~12 billion weights without sharing
    assert shared < 0.2e9                        # 104*104 positions share one transform per type
    routing = lambda cfg: int(np.prod(param_shapes(cfg)["classcaps.W"]))
    assert routing(big) == 104 * 104 * 32 * 276 * 16 * 8 == 12_227_444_736
    assert routing(CapsNetConfig(**{**big.to_dict(), "share_spatial": True})) == 32 * 276 * 16 * 8 == 1_130_496
    m = CapsNet("numpy", share_spatial=True, input_shape=(1, 36, 36), n_classes=3)
    assert tuple(m.params["classcaps.W"].shape) == (1, 32, 3, 16, 8)


def test_primary_capsules_follow_the_input_shape():
    m = CapsNet("numpy", **{**SMALL, "input_shape": (2, 15, 17)})
    # conv1 3x3 -> 13x15; PrimaryCaps 3x3/2 -> 6x7 positions
    assert m.primary_hw == (6, 7) and m.n_primary_capsules == 42 * 4
    x = np.random.default_rng(0).random((2, 2, 15, 17))
    out = m.loss(x, np.array([0, 3]))
    assert tuple(out.reconstruction.shape) == (2, 2, 15, 17) and np.isfinite(out.loss)


def test_routing_logits_are_per_sample():
    """A sample's prediction must not depend on what else is in the batch."""
    m = CapsNet(backends.get("numpy", dtype="float64"), **SMALL)
    x = np.random.default_rng(0).random((4, 1, 14, 14))
    alone = m.forward(x[:1]).lengths
    together = m.forward(x).lengths[:1]
    np.testing.assert_allclose(alone, together, rtol=1e-12)


def test_torch_train_step_builds_no_autograd_graph():
    torch = pytest.importorskip("torch")
    m = CapsNet(backends.get("torch"), **SMALL)
    x = np.random.default_rng(0).random((3, 1, 14, 14)).astype("float32")
    with torch.enable_grad():  # even with grad mode on, nothing asks for a graph
        out = m.train_step_grads(x, np.array([0, 1, 2]))
        seen = []

        def walk(obj, depth=0):
            if isinstance(obj, torch.Tensor):
                seen.append(obj)
            elif isinstance(obj, (list, tuple)) and depth < 4:
                for o in obj:
                    walk(o, depth + 1)
            elif isinstance(obj, dict) and depth < 4:
                for o in obj.values():
                    walk(o, depth + 1)

        walk([out.v, out.lengths, out.reconstruction, m.params, m.grads, m.classcaps.trace])
        m.forward(x, np.array([0, 1, 2]))  # fill the caches again and look at them too
        for _, layer in m.layers():
            walk([layer.cache, getattr(layer, "trace", None)])
    assert len(seen) > 20
    assert not any(t.requires_grad or t.grad_fn is not None for t in seen)


@pytest.mark.parametrize("bad,match", [
    (np.zeros((2, 14, 14), "float32"), "4-D batch.*add a channel axis"),
    (np.zeros((2, 3, 14, 14), "float32"), "3 channels but the model expects 1"),
    (np.zeros((2, 1, 12, 14), "float32"), "12x14 but the model expects 14x14"),
    (np.zeros((2, 1, 14, 14), "uint8"), "floating point.*astype"),
    (np.full((2, 1, 14, 14), np.nan, "float32"), "NaN or inf"),
    (np.full((2, 1, 14, 14), np.inf, "float32"), "NaN or inf"),
    (np.zeros((0, 1, 14, 14), "float32"), r"empty \(shape \(0, 1, 14, 14\)\); pass at least one image"),
    ([[0.0] * 14] * 14, "4-D batch"),
])
def test_bad_images(bad, match):
    m = CapsNet("numpy", **SMALL)
    with pytest.raises(CapsNetError, match=match):
        m.loss(bad, np.array([0, 1]))


@pytest.mark.parametrize("labels,match", [
    (np.array([0, 4]), r"in \[0, 3\] for 4 classes"),
    (np.array([-1, 0]), r"in \[0, 3\]"),
    (np.array([0.0, 1.0]), "must be integers"),
    (np.array([[0, 1]]), "1-D array of 2"),
    (np.array([0, 1, 2]), "1-D array of 2"),
])
def test_bad_labels(labels, match):
    m = CapsNet("numpy", **SMALL)
    with pytest.raises(CapsNetError, match=match):
        m.loss(np.zeros((2, 1, 14, 14), "float32"), labels)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_nested_lists_are_taken_as_arrays(backend):
    """Images and labels given as Python lists mean what np.asarray makes of them."""
    m = CapsNet(backends.get(backend, dtype="float64"), seed=0, **SMALL)
    x = np.random.default_rng(0).random((2, 1, 14, 14))
    assert m.predict(x.tolist()).tolist() == m.predict(x).tolist()
    assert m.loss(x.tolist(), [0, 1]).loss == m.loss(x, np.array([0, 1])).loss


@pytest.mark.parametrize("option,match", [
    ({"routing_iter": 2}, r"unknown option\(s\) routing_iter \(routing_iter: did you mean routing_iters\?\)"),
    ({"dtype": "float64"}, r"dtype and device belong to the backend, e\.g\. CapsNet\(backends\.get\('numpy'"),
    ({"colour": 1}, r"unknown option\(s\) colour; the options are the fields of CapsNetConfig: input_shape, "),
])
def test_an_unknown_model_option_is_named_with_the_ones_that_exist(option, match):
    with pytest.raises(CapsNetError, match=match):
        CapsNet("numpy", **option)


@pytest.mark.parametrize("v_shape,classes,match", [
    ((2, 3, 6), [0, 1], r"class capsules must have shape \(N, 4, 6\) .*got \(2, 3, 6\)"),
    ((2, 4, 6), [0, 4], r"classes must be 2 integers in \[0, 3\], one per sample; got \[0, 4\]"),
    ((2, 4, 6), [0], r"classes must be 2 integers"),
    ((2, 4, 6), [0.0, 1.0], r"classes must be 2 integers"),
])
def test_decode_names_a_bad_capsule_or_class(v_shape, classes, match):
    m = CapsNet("numpy", **SMALL)
    with pytest.raises(CapsNetError, match=match):
        m.decode(np.zeros(v_shape, "float32"), classes)


def test_a_backend_that_is_neither_a_name_nor_a_backend_is_named():
    with pytest.raises(backends.BackendError, match="unknown backend '42': choose one of numpy, cupy, torch"):
        CapsNet(42)


def test_predict_runs_in_batches_and_gives_the_same_classes(monkeypatch):
    """A forward holds ~2 MB per 28x28 digit, so predict must not take a whole test set at once."""
    m = CapsNet(backends.get("numpy", dtype="float64"), seed=3, **SMALL)
    x = np.random.default_rng(1).random((5, 1, 14, 14))
    whole = m.predict(x, batch_size=5)
    sizes = []
    forward = m.forward_on_device
    monkeypatch.setattr(m, "forward_on_device", lambda xb, *a, **k: sizes.append(xb.shape[0]) or forward(xb, *a, **k))
    assert m.predict(x, batch_size=2).tolist() == whole.tolist()
    assert sizes == [2, 2, 1] and m.cache is None  # released after each batch
    with pytest.raises(CapsNetError, match="batch_size must be a whole number of at least 1, got 0"):
        m.predict(x, batch_size=0)


def test_image_smaller_than_receptive_field():
    with pytest.raises(CapsNetError, match="smaller than the receptive field 17x17"):
        CapsNet("numpy", input_shape=(1, 16, 16))


def test_bad_routing_options():
    # the layer itself, for users who build their own network from it
    from pycapsnet.core.capsules import ClassCaps

    B = backends.get("numpy")
    with pytest.raises(ValueError, match="routing gradient mode 'exact'"):
        ClassCaps(B, 4, 2, 8, 3, 4, routing_grad="exact")
    with pytest.raises(ValueError, match="at least one iteration"):
        ClassCaps(B, 4, 2, 8, 3, 4, iters=0)


@pytest.mark.parametrize("field,value,match", [
    ("routing_iters", 0, "routing_iters must be an integer of at least 1, got 0"),
    ("conv_channels", 0, "conv_channels must be an integer of at least 1, got 0"),
    ("primary_types", -2, "primary_types must be an integer of at least 1, got -2"),
    ("class_dim", 2.5, "class_dim must be an integer of at least 1, got 2.5"),
    ("primary_stride", True, "primary_stride must be an integer of at least 1, got True"),
    ("decoder_hidden", (512, 0), r"decoder_hidden \(512, 0\) must be at least 1"),
    ("routing_grad", "exact", r"routing_grad must be one of \('full', 'final'\), got 'exact'"),
    ("primary_conv", "fft", r"primary_conv must be one of \('fourier', 'im2col'\), got 'fft'"),
])
def test_a_config_that_cannot_build_a_network_names_the_field(field, value, match):
    # Without the check these failed far from the cause: a zero fan-in in the initialiser, a reshape
    # of zero capsule types, or (2.5) a float shape.
    with pytest.raises(CapsNetError, match=match):
        CapsNetConfig(**{**SMALL, field: value})
    with pytest.raises(CapsNetError, match=match):
        CapsNet("numpy", **{**SMALL, field: value})


def test_evaluation_releases_what_forward_kept_for_backward():
    # After predict/evaluate no backward follows; the caches (the PrimaryCaps spectra, û) must not
    # be carried into the next train step, where they would add to its peak memory.
    from pycapsnet.training import data as data_mod
    from pycapsnet.training.loop import evaluate

    m = CapsNet("numpy", CapsNetConfig(conv_channels=8, primary_types=2), seed=0)
    x = np.random.default_rng(0).random((2, 1, 28, 28)).astype(np.float32)
    layers = [m.conv1, m.body["relu1"], m.primary, m.primary.conv, m.classcaps, m.head.length, *m.decoder.layers]
    m.forward(x)
    assert m.primary.conv.cache is not None and m.classcaps.cache is not None
    m.predict(x)
    assert all(layer.cache is None for layer in layers)
    m.forward(x)
    evaluate(m, data_mod.Split(x, np.array([1, 2])), batch_size=2)
    assert all(layer.cache is None for layer in layers)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_train_step_reads_the_device_once(backend, monkeypatch):
    """Host images are checked on the host; the losses and the predicted classes come back in one
    transfer: on a GPU each read is a wait for the whole queue of the step."""
    B = backends.get(backend, dtype="float64")
    model = CapsNet(B, seed=0, **SMALL)
    rng = np.random.default_rng(0)
    x, y = rng.random((3, *model.config.input_shape)), np.array([0, 3, 1])
    reads, real_to_numpy, real_all_finite = [], B.to_numpy, B.all_finite
    monkeypatch.setattr(B, "to_numpy", lambda a: reads.append(tuple(a.shape)) or real_to_numpy(a))
    monkeypatch.setattr(B, "all_finite", lambda a: reads.append("all_finite on the device")
                        if not isinstance(a, np.ndarray) else real_all_finite(a))
    out = model.train_step_grads(x, y)
    loss, parts, predictions = out.loss, out.parts, out.predictions
    assert reads == [(3 + 3,)]  # total, margin, reconstruction, then one class per sample
    assert loss == pytest.approx(parts["margin"] + parts["reconstruction"], rel=1e-12)
    np.testing.assert_array_equal(predictions, np.argmax(real_to_numpy(out.lengths), axis=1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode,iters", [("full", 3), ("final", 3), ("full", 1)])
def test_shared_routing_without_u_hat_is_the_materialised_routing(backend, mode, iters, monkeypatch):
    """share_spatial routes on u and W_tj (shared_routing.py), a chunk of positions at a time; the
    same layer with W tiled over positions forms û and routes it (routing.py).  Same v, du and dW
    (summed over positions), to 1e-12 in float64, in one chunk or one position per chunk."""
    from pycapsnet.core.capsules import ClassCaps

    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(0)
    u = B.asarray(rng.standard_normal((3, 10, 2, 4)) * 0.7)              # (N, P, T, K)
    dv = B.asarray(rng.standard_normal((3, 3, 5)))                        # (N, J, D)
    materialised = ClassCaps(B, 10, 2, 4, 3, 5, iters=iters, routing_grad=mode, rng=np.random.default_rng(1))
    shared = ClassCaps(B, 10, 2, 4, 3, 5, iters=iters, routing_grad=mode, share_spatial=True,
                       rng=np.random.default_rng(1))
    materialised.params["W"][...] = B.asarray(np.tile(B.to_numpy(shared.params["W"]), (10, 1, 1, 1, 1)))
    v_ref = B.to_numpy(materialised.forward(u))
    c_ref = [B.to_numpy(c) for c in materialised.coupling]
    du_ref = B.to_numpy(materialised.backward(dv))
    dW_ref = B.to_numpy(materialised.grads["W"]).sum(axis=0, keepdims=True)
    for chunk in (1 << 30, 1):  # one chunk; one position at a time
        monkeypatch.setattr(shared, "chunk_bytes", chunk)
        shared.zero_grad()
        v = shared.forward(u)
        np.testing.assert_allclose(B.to_numpy(v), v_ref, rtol=1e-12, atol=1e-15)
        for c, ref in zip(shared.coupling, c_ref):
            np.testing.assert_allclose(B.to_numpy(c), ref, rtol=1e-12, atol=1e-15)
        du = B.to_numpy(shared.backward(dv))
        np.testing.assert_allclose(du, du_ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(B.to_numpy(shared.grads["W"]), dW_ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layer_kind,mode", [("dynamic", "full"), ("dynamic", "final"), ("attention", "full")])
def test_routing_in_blocks_of_the_batch_is_routing_the_whole_batch(backend, layer_kind, mode):
    """ClassCaps and AttentionCaps route blocks of the batch (B.split_batch: on the CPU, blocks
    small enough for the cache, spread over the threads) and write dû over û block by block.  The
    same v, coupling coefficients, du, dW and bias gradient as one block, to 1e-12 in float64, with
    blocks of one sample and of two (in turn and on 2 threads)."""
    from pycapsnet.core.capsules import AttentionCaps, ClassCaps

    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(0)
    u = B.asarray(rng.standard_normal((5, 10, 2, 4)) * 0.7)              # (N, P, T, K)
    dv = B.asarray(rng.standard_normal((5, 3, 6)))                        # (N, J, D)

    def layer():
        if layer_kind == "attention":
            made = AttentionCaps(B, 10, 2, 4, 3, 6, rng=np.random.default_rng(1))
            made.params["bias"][...] = B.asarray(np.random.default_rng(2).standard_normal((10, 2, 3)))
            return made
        return ClassCaps(B, 10, 2, 4, 3, 6, iters=3, routing_grad=mode, rng=np.random.default_rng(1))

    def run(block, threads):
        B.sample_block, B.threads = block, threads
        made = layer()
        v = B.to_numpy(made.forward(u))
        coupling = [B.to_numpy(c) for c in made.coupling]
        du = B.to_numpy(made.backward(dv))
        return v, coupling, du, {k: B.to_numpy(g) for k, g in made.grads.items()}

    sample = 10 * 2 * 3 * 6  # elements of û per sample: I * J * D
    v_ref, c_ref, du_ref, grads_ref = run(None, 1)
    for block, threads in [(sample, 1), (2 * sample, 1), (2 * sample, 2)]:
        v, coupling, du, grads = run(block, threads)
        np.testing.assert_allclose(v, v_ref, rtol=1e-12, atol=1e-15)
        for c, ref in zip(coupling, c_ref, strict=True):
            np.testing.assert_allclose(c, ref, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(du, du_ref, rtol=1e-12, atol=1e-14)
        for k in grads_ref:
            np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-12, atol=1e-14, err_msg=k)


@pytest.mark.parametrize("settings,said", [
    (dict(recon_weight=float("nan")), "CapsNetConfig.recon_weight must be a finite number of at least 0, got nan"),
    (dict(recon_weight=-1.0), "CapsNetConfig.recon_weight must be a finite number of at least 0"),
    (dict(m_plus=2.0), "CapsNetConfig.m_plus must be a finite number from 0 to 1, got 2.0"),
    (dict(lam=float("inf")), "CapsNetConfig.lam must be a finite number of at least 0, got inf"),
    (dict(routing="em", em_lambda=float("inf")), "CapsNetConfig.em_lambda must be a finite number"),
])
def test_non_finite_or_absurd_settings_are_refused_at_construction(settings, said):
    with pytest.raises(CapsNetError, match=re.escape(said)):
        CapsNetConfig(**settings)


@pytest.mark.parametrize("value", [1e30, -0.5, 255.0])
def test_pixels_beyond_0_1_are_refused_not_turned_into_nan(value):
    model = CapsNet("numpy", conv_channels=4, primary_types=2)
    x = np.zeros((2, 1, 28, 28), np.float32)
    x[1, 0, 3, 3] = value
    with pytest.raises(CapsNetError, match=r"images must hold pixels in \[0, 1\], got values from .*8-bit pixels: x / 255"):
        model.loss(x, [1, 2])


def _wrong_inputs():
    """(layer factory, an input it cannot take, what the message must say) for each layer that reads
    an input's shape: a wrong channel count, a missing batch axis, an image smaller than the kernel."""
    from pycapsnet.core.batch_norm import BatchNorm
    from pycapsnet.core.capsules import PrimaryCaps
    from pycapsnet.core.depthwise import DepthwiseConv2d
    from pycapsnet.core.fourier import FourierConv2d
    from pycapsnet.core.layers import Conv2d, Linear
    from pycapsnet.core.conv_caps import ConvCaps
    from pycapsnet.core.matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, PrimaryMatrixCaps

    return {
        "conv channels": (lambda B: Conv2d(B, 3, 4, 3), (2, 8, 8, 1), r"Conv2d takes .*\(N, H, W, 3\)"),
        "conv no batch": (lambda B: Conv2d(B, 1, 4, 3), (8, 8, 1), r"Conv2d takes .*got \(8, 8, 1\)"),
        "conv too small": (lambda B: Conv2d(B, 1, 4, 9), (2, 5, 5, 1), r"at least 9x9 pixels; got \(2, 5, 5, 1\)"),
        "padded fits": (lambda B: Conv2d(B, 1, 4, 3, padding=1), (2, 1, 1, 1), None),
        "fourier": (lambda B: FourierConv2d(B, 2, 4, 5, 2), (2, 9, 9, 3), r"FourierConv2d takes .*\(N, H, W, 2\)"),
        "depthwise": (lambda B: DepthwiseConv2d(B, 6, 6, 3), (2, 5, 5, 5), r"DepthwiseConv2d takes .*\(N, H, W, 6\)"),
        "primary": (lambda B: PrimaryCaps(B, 8, 2, 4, 3, 2), (2, 7, 7, 7), r"PrimaryCaps takes .*\(N, H, W, 8\)"),
        "linear": (lambda B: Linear(B, 10, 3), (2, 9), r"Linear takes x \(N, 10\); got \(2, 9\)"),
        "batch norm": (lambda B: BatchNorm(B, 4), (2, 3, 3, 5), r"BatchNorm takes .*\(N, 4\); got \(2, 3, 3, 5\)"),
        "primary matrix": (lambda B: PrimaryMatrixCaps(B, 6, 2), (2, 3, 3, 5), r"PrimaryMatrixCaps takes h \(N, H, W, 6\)"),
        "conv caps": (lambda B: ConvCaps(B, (5, 5), 4, 8, 3, 6), (2, 24, 4, 8), r"ConvCaps takes u \(N, 25, 4, 8\)"),
        "conv caps 5-d": (lambda B: ConvCaps(B, (5, 5), 4, 8, 3, 6), (2, 5, 5, 4, 8), None),
        "conv matrix": (lambda B: ConvMatrixCaps(B, 4, 3), [(2, 5, 5, 3, 16), (2, 5, 5, 3)],
                        r"ConvMatrixCaps takes \(M \(N, H, W, 4, 16\), a \(N, H, W, 4\)\), H and W at least 3; "
                        r"got M \(2, 5, 5, 3, 16\)"),
        "conv matrix small": (lambda B: ConvMatrixCaps(B, 4, 3), [(2, 2, 5, 4, 16), (2, 2, 5, 4)], "at least 3"),
        "conv matrix a": (lambda B: ConvMatrixCaps(B, 4, 3), [(2, 5, 5, 4, 16), (2, 5, 5, 3)], r"a \(2, 5, 5, 3\)"),
        "conv matrix one": (lambda B: ConvMatrixCaps(B, 4, 3), (2, 5, 5, 4, 16), "takes a pair"),
        "class matrix": (lambda B: ClassMatrixCaps(B, (3, 3), 4, 10), [(2, 3, 4, 4, 16), (2, 3, 4, 4)],
                         r"ClassMatrixCaps takes \(M \(N, 3, 3, 4, 16\)"),
    }


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(_wrong_inputs()))
def test_a_layer_refuses_an_input_of_the_wrong_shape_in_one_line(backend, case):
    """Not the backend's own error from deep inside (a mismatched product, a negative dimension)."""
    make, shape, message = _wrong_inputs()[case]
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(0)
    x = [B.asarray(rng.random(s)) for s in shape] if isinstance(shape, list) else B.asarray(rng.random(shape))
    layer = make(B)
    if message is None:
        layer.forward(x)  # the check counts the padding
        return
    with pytest.raises(CapsNetError, match=message):
        layer.forward(x)
