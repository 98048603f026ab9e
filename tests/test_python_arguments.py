"""The Python face refuses what the command line refuses, in one CapsNetError naming the argument and
the fix: never a value quietly rounded, clamped, reinterpreted or recorded while something else runs,
and never a raw TypeError, ValueError or IndexError from inside."""
import os

import numpy as np
import pytest

import pycapsnet
import pycapsnet.study as study
from pycapsnet import CapsNetError, datasets
from pycapsnet.optim import SGD, Adam, batches

TINY = dict(conv_channels=8, primary_types=2, decoder_hidden=(16, 32))


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = pycapsnet.load_digits()
    return x[:32], y[:32]


@pytest.fixture(scope="module")
def model():
    return pycapsnet.build("capsnet", **TINY)


# ---- 3: build refuses what the layer would not run --------------------------------------------------
@pytest.mark.parametrize("network,options", [("self", dict(routing_iters=5)), ("uniform", dict(routing_iters=5)),
                                             ("random", dict(routing_iters=2)), ("self", dict(routing_grad="final")),
                                             ("attention", dict(routing_iters=2))])
def test_build_refuses_settings_the_routing_does_not_run(network, options):
    with pytest.raises(CapsNetError, match=f"{next(iter(options))} does nothing with routing"):
        pycapsnet.build(network, **options)


def test_build_keeps_settings_the_routing_runs():
    model = pycapsnet.build("vb", routing_iters=2, routing_grad="final", **TINY)
    layer = model.network.classcaps
    assert (layer.iters, layer.routing_grad) == (2, "final")


# ---- 4, 5, 21: optimizers and batches ----------------------------------------------------------------
def test_adam_refuses_eps_zero_which_divides_zero_by_zero(model):
    with pytest.raises(CapsNetError, match="eps must be a finite number > 0, got 0.0"):
        Adam(model, eps=0.0)


def test_optimizers_take_a_model_and_refuse_what_is_none(model):
    assert Adam(model).model is model.network and SGD(model).model is model.network
    with pytest.raises(CapsNetError, match="give it a Model"):
        Adam("net")


@pytest.mark.parametrize("kwargs,said", [(dict(augment="rot"), "augment must be one of 'shift', 'efficient'"),
                                         (dict(y=["a", "b"]), "y holds <U1 values"),
                                         (dict(y=[0, np.nan]), "whole class indices"),
                                         (dict(batch_size=0), "batch_size must be a whole number"),
                                         (dict(seed=-1), "seed must be a whole number")])
def test_batches_refuse_what_fit_would_not_take(kwargs, said):
    x = np.zeros((2, 1, 28, 28), np.float32)
    args = {"x": x, "y": [0, 1], **kwargs}
    with pytest.raises(CapsNetError, match=said):
        batches(**args)  # refused when called, before a batch is asked for


# ---- 6, 15, 22, 23: datasets -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,said", [(dict(test_fraction=-0.5), "test_fraction must be a finite number in"),
                                         (dict(test_fraction=1.5), "test_fraction"),
                                         (dict(test_fraction=float("nan")), "test_fraction"),
                                         (dict(image_size=14), "image_size must be"),
                                         (dict(image_size="28x28"), "image_size must be"),
                                         (dict(channels=2), "channels must be 1"),
                                         (dict(seed="0"), "seed must be")])
def test_load_folder_refuses_what_the_command_line_refuses(tmp_path, kwargs, said):
    with pytest.raises(CapsNetError, match=said):
        datasets.load_folder(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs,said", [(dict(seed=-1), "seed must be"), (dict(seed="1"), "seed must be"),
                                         (dict(canvas="40"), "canvas must be a whole number of at least 28"),
                                         (dict(canvas=20), "canvas must be a whole number of at least 28"),
                                         (dict(scale=1.0), r"scale must be \(low, high\)"),
                                         (dict(scale=(0.1, 1.0)), "scale 0.1 1 must satisfy"),
                                         (dict(canvas=60000), "more than half this machine")])
def test_affine_refuses_bad_arguments_before_it_allocates(digits, kwargs, said):
    with pytest.raises(CapsNetError, match=said):
        datasets.affine(digits[0][:2], **kwargs)


@pytest.mark.parametrize("kwargs,said", [(dict(pairs=0), "pairs must be"), (dict(seed=-2), "seed must be"),
                                         (dict(shift=9), "shift 9 moves a 28x28 digit"),
                                         (dict(pairs=10**9), "more than half this machine"),
                                         (dict(y=["a"] * 4), "y holds <U1 values")])
def test_multimnist_refuses_bad_arguments_before_it_allocates(digits, kwargs, said):
    args = {"x": digits[0][:4], "y": digits[1][:4], **kwargs}
    with pytest.raises(CapsNetError, match=said):
        datasets.multimnist(**args)


# ---- 7, 12, 13, 14, 17, 20, 22, 23: study --------------------------------------------------------------
@pytest.mark.parametrize("kwargs,said", [(dict(capsule=2.7), "capsule .a class index. must be a whole number from 0 to 9"),
                                         (dict(capsule=-1), "capsule .a class index. must be"),
                                         (dict(capsule=10), "capsule .a class index. must be"),
                                         (dict(reach=float("nan")), "reach must be a finite number above 0"),
                                         (dict(steps=0), "steps must be"), (dict(steps=10**7), "steps must be"),
                                         (dict(path="."), "is a folder")])
def test_figure_4_refuses_what_it_would_reinterpret(model, digits, kwargs, said):
    with pytest.raises(CapsNetError, match=said):
        study.figure_4(model, digits[0][:1], **kwargs)


@pytest.mark.parametrize("kwargs,said", [(dict(samples=0), "samples"), (dict(samples=-3), "samples"),
                                         (dict(tol=float("nan")), "tol must be"), (dict(tol=-1), "tol must be"),
                                         (dict(batch=10**6), "batch must be")])
def test_gradcheck_refuses_settings_that_would_fail_every_tensor(model, kwargs, said):
    with pytest.raises(CapsNetError, match=said):
        study.gradcheck(model, **kwargs)


def test_gradcheck_given_images_says_it_draws_its_own(model, digits):
    with pytest.raises(CapsNetError, match="gradcheck draws its own batch"):
        study.gradcheck(model, *digits)


def test_crosscheck_honours_rtol_zero_and_refuses_nan(model):
    report = study.crosscheck(model, "numpy", "numpy", rtol=0.0, batch=2)
    assert report.note == "tolerance 0" and report.passed  # the same backend twice: equal to the last bit
    with pytest.raises(CapsNetError, match="rtol must be"):
        study.crosscheck(model, rtol=float("nan"))


def test_crosscheck_compares_a_round_off_gradient_at_the_scale_it_was_rounded_in():
    from pycapsnet.study import _compared

    big = ("gradient", np.array([1.0, -0.5]))
    results = [{"a": big, "b": ("gradient", np.array([1e-16, -1e-16]))},
               {"a": big, "b": ("gradient", np.array([-5e-17, 2e-17]))}]
    rows = {r["tensor"]: r for r in _compared(results, 1e-9, np.finfo(np.float64).eps)}
    assert rows["b"]["agree"] and rows["b"]["max_rel"] < 1e-9
    real = [{"a": big, "b": ("gradient", np.array([1e-3, 0.0]))}, {"a": big, "b": ("gradient", np.array([1.1e-3, 0.0]))}]
    assert not {r["tensor"]: r for r in _compared(real, 1e-9, np.finfo(np.float64).eps)}["b"]["agree"]


def test_inspect_draws_an_em_model_and_refuses_a_bool_index(digits, tmp_path):
    em = pycapsnet.build("em", conv_channels=8, primary_types=2, matrix_types=(2, 2))
    written = study.inspect(em, *digits, out=str(tmp_path / "em"))
    assert "activations.png" in {os.path.basename(p) for p in written}
    with pytest.raises(CapsNetError, match="index must be"):
        study.inspect(em, *digits, index=True, out=str(tmp_path / "em"))


def test_coupling_runs_in_batches(model, digits):
    found = study.coupling(model, digits[0], batch_size=5)
    whole = study.coupling(model, digits[0])
    assert [c.shape[0] for c in found["classcaps"]] == [32] * 3
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(found["classcaps"], whole["classcaps"]))


@pytest.mark.parametrize("call,said", [(lambda m, x, y: study.autograd_twin(m, dtype="float16"), "dtype must be"),
                                       (lambda m, x, y: study.autograd_twin("model"), "autograd_twin takes a Model"),
                                       (lambda m, x, y: study.autograd_twin(m).grads(x[:, :, :20], y), "x has shape"),
                                       (lambda m, x, y: study.autograd_twin(m).grads(x, np.full(len(x), 99)),
                                        "y holds classes 99..99")])
def test_autograd_twin_refuses_bad_input_in_one_line(model, digits, call, said):
    pytest.importorskip("torch", reason="the autograd twin is PyTorch")
    with pytest.raises(CapsNetError, match=said):
        call(model, digits[0][:2], digits[1][:2])


def test_autograd_twin_of_the_em_network_is_its_exact_oracle(digits):
    pytest.importorskip("torch", reason="the autograd twin is PyTorch")
    em = pycapsnet.build("em", conv_channels=8, primary_types=2, matrix_types=(2, 2), dtype="float64")
    x, y = digits[0][:2].astype(np.float64), digits[1][:2]
    loss, grads = study.autograd_twin(em).grads(x, y)
    net = em.network
    net.zero_grad()
    assert net.loss(x, y).loss == pytest.approx(loss, rel=1e-12)
    net.backward()
    for k, g in grads.items():
        np.testing.assert_allclose(net.grads[k], g, rtol=1e-8, atol=1e-8 * np.abs(g).max(), err_msg=k)


def test_fit_speaks_to_python_callers_in_keywords_not_flags(digits, tmp_path):
    """95.16: fit's refusals name fit's keywords and pycapsnet.load, never --resume or --overwrite."""
    x, y = digits
    run = str(tmp_path / "run")
    pycapsnet.build("capsnet", **TINY).fit(x, y, epochs=1, batch_size=16, out=run, progress=False)
    other = pycapsnet.build("capsnet", **TINY)
    with pytest.raises(CapsNetError, match=r"continue it with pycapsnet.load\(.*\).fit\(...\).*overwrite=True") as e:
        other.fit(x, y, epochs=1, batch_size=16, out=run, reset=True, progress=False)
    assert "--" not in str(e.value)
    with pytest.raises(CapsNetError, match="use a smaller shift") as e:
        other.fit(x, y, epochs=1, shift=40, progress=False)
    assert "--" not in str(e.value)
