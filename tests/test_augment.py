"""Efficient-CapsNet's augmentation (pycapsnet/training/augment.py): each transform against an
independent reference (SciPy's bilinear affine map, NumPy's rot90, hand-placed digits), the
whole pipeline's draws, its shards, and the flag from the command line and from Python."""
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import ndimage

import pycapsnet
from pycapsnet import CapsNetError
from pycapsnet.training import augment, checkpoint, data, distributed, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blob(n=1, h=28, w=28, top=6, left=9, size=(12, 8), seed=0):
    """n images, each a random block of ink of ``size`` at (top, left); the rest blank."""
    x = np.zeros((n, 1, h, w))
    x[:, 0, top:top + size[0], left:left + size[1]] = np.random.default_rng(seed).uniform(0.2, 1, (n, *size))
    return x


def test_rotation_is_scipys_bilinear_affine_map():
    x = np.random.default_rng(0).random((5, 2, 28, 23))
    degrees = np.array([0.0, 7, -13, 29, -29])
    out = augment.rotate(x, degrees)
    centre = np.array([27 / 2, 22 / 2])
    for i, d in enumerate(degrees):
        t = np.deg2rad(d)
        turn = np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])  # output p reads c + R(p - c)
        for c in range(2):
            # grid-constant: zeros outside the image, interpolated across its edge (zero padding)
            ref = ndimage.affine_transform(x[i, c], turn, offset=centre - turn @ centre, order=1, mode="grid-constant")
            np.testing.assert_allclose(out[i, c], ref, atol=1e-12, err_msg=f"image {i} channel {c}")
    np.testing.assert_array_equal(out[0], x[0])


def test_a_quarter_turn_is_rot90_and_no_turn_is_the_image():
    x = np.random.default_rng(1).random((3, 1, 9, 9))
    np.testing.assert_allclose(augment.rotate(x, np.full(3, 90.0)), np.rot90(x, -1, axes=(2, 3)), atol=1e-12)
    assert augment.rotate(x, np.zeros(3)) is x


def test_margins_and_shifts_keep_the_ink_whole():
    x = _blob(top=6, left=9, size=(12, 8))  # margins: 6 above, 10 below, 9 left, 11 right
    assert [int(m[0]) for m in augment.ink_box(x)] == [6, 10, 9, 11]
    assert [int(m[0]) for m in augment.ink_box(np.zeros((1, 1, 5, 5)))] == [0, 0, 0, 0]
    one = np.ones(1)
    # the largest fraction moves the ink to the very edge on the side drawn, never over it
    up_left = augment.shift_within_margins(x, 0.9999 * one, 0.9999 * one, 0 * one, 0 * one)
    np.testing.assert_array_equal(up_left[0, 0, :12, :8], x[0, 0, 6:18, 9:17])
    down_right = augment.shift_within_margins(x, 0.9999 * one, 0.9999 * one, one, one)
    np.testing.assert_array_equal(down_right[0, 0, 16:, 20:], x[0, 0, 6:18, 9:17])
    half = augment.shift_within_margins(x, 0.5 * one, 0.5 * one, 0 * one, one)  # up by 3, right by 6
    np.testing.assert_array_equal(half[0, 0, 3:15, 15:23], x[0, 0, 6:18, 9:17])
    for moved in (up_left, down_right, half):
        assert moved.sum() == pytest.approx(x.sum())


def test_the_squeeze_narrows_by_its_width_and_keeps_a_constant():
    for n_in, n_out in ((28, 27), (28, 21), (13, 10)):
        m = augment.lanczos_matrix(n_in, n_out)
        np.testing.assert_allclose(m.sum(axis=1), 1, atol=1e-12)
    x = np.ones((3, 1, 28, 28))
    out = augment.squeeze_horizontally(x, np.array([1, 4, 7]), np.array([0, 1, 0]))
    for i, (narrower, start) in enumerate([(1, 0), (4, 3), (7, 3)]):
        np.testing.assert_allclose(out[i, 0, :, start:start + 28 - narrower], 1, atol=1e-12)
        assert (out[i, 0, :, :start] == 0).all() and (out[i, 0, :, start + 28 - narrower:] == 0).all()
    # ringing is clipped to [0, 1]; the ink's extent shrinks
    y = augment.squeeze_horizontally(_blob(w=28, left=4, size=(12, 20)), np.array([7]), np.array([0]))
    assert y.min() >= 0 and y.max() <= 1
    cols = np.flatnonzero(y[0, 0].max(axis=0) > 0.05)
    assert cols[-1] - cols[0] + 1 < 20


def test_erasure_zeroes_one_four_by_four_patch():
    x = np.ones((2, 3, 28, 28))
    out = augment.erase(x, np.array([4, 22]), np.array([22, 4]))
    assert (out == 0).sum(axis=(1, 2, 3)).tolist() == [48, 48]  # 16 pixels in each of 3 channels
    assert (out[0, :, 4:8, 22:26] == 0).all() and (out[1, :, 22:26, 4:8] == 0).all()


def test_the_pipelines_draws():
    x = _blob(n=4000, seed=2).astype(np.float32)
    rng = np.random.default_rng(0)
    out = augment.efficient(x, rng)
    assert out.shape == x.shape and out.dtype == np.float32 and out.min() >= 0 and out.max() <= 1
    again = augment.efficient(x, np.random.default_rng(0))
    np.testing.assert_array_equal(out, again)
    assert (out != x).any(axis=(1, 2, 3)).all()  # every image changed: each is at least squeezed
    # the draws themselves, replayed: half the images unturned, the angles whole degrees within ±29
    g = np.random.default_rng(0)
    angle = np.trunc(30 * np.clip(g.normal(0, 0.33, 4000), -0.9999, 0.9999))
    unturned = np.clip(g.normal(0, 0.33, 4000), -0.9999, 0.9999) > 0
    assert 0.45 < unturned.mean() < 0.55 and np.abs(angle).max() <= 29 and (angle == np.round(angle)).all()


def test_a_shard_is_augmented_as_one_process_augments_the_batch():
    x = _blob(n=10, seed=3).astype(np.float32)
    split = data.Split(x, np.arange(10))
    whole = list(data.batches(split, 7, np.random.default_rng(3), augment="efficient"))
    parts = [list(data.batches(split, 7, np.random.default_rng(3), 0, lambda n, k=k: distributed.shard(n, k, 3),
                               augment="efficient")) for k in range(3)]
    for step, (xw, yw) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[step][0] for p in parts]), xw)
        np.testing.assert_array_equal(np.concatenate([p[step][1] for p in parts]), yw)
    # and evaluation batches are never augmented
    np.testing.assert_array_equal(np.concatenate([b for b, _ in data.batches(split, 4, augment="efficient")]), x)


def test_the_flag_trains_records_and_refuses(tmp_path):
    out = tmp_path / "run"
    argv = ["--conv-channels", "16", "--primary-types", "4", "--limit", "64", "--limit-test", "32",
            "--batch-size", "16", "--epochs", "1", "--no-progress", "--augment", "efficient"]
    assert trainer.main("numpy", [*argv, "--out", str(out)]) == 0
    assert checkpoint.load(str(out))["header"]["recipe"]["augment"] == "efficient"
    plain = tmp_path / "plain"
    assert trainer.main("numpy", [*argv[:-2], "--out", str(plain)]) == 0
    assert checkpoint.load(str(plain))["header"]["recipe"]["augment"] == "shift"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_numpy.py"), *argv, "--shift", "1",
                        "--out", str(tmp_path / "refused")], capture_output=True, text=True)
    assert r.returncode == 2 and "--shift with --augment efficient" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "refused").exists()


def test_fit_takes_augment_and_refuses_what_it_cannot_do():
    rng = np.random.default_rng(0)
    model = pycapsnet.build("capsnet", input_shape=(1, 8, 8), seed=0, conv_channels=8, conv_kernel=3,
                            primary_types=2, primary_kernel=3)
    x, y = rng.random((8, 1, 8, 8)), rng.integers(0, 10, 8)
    with pytest.raises(CapsNetError, match="augment must be 'shift' or 'efficient'"):
        model.fit(x, y, epochs=1, augment="effcient", progress=False)
    with pytest.raises(CapsNetError, match="needs images of 10 pixels a side or more, not 8"):
        model.fit(x, y, epochs=1, augment="efficient", progress=False)
