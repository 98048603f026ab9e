"""FourierConv2d against Conv2d: the same layer, so the same outputs and gradients to rounding, on
every backend and for any geometry.  (Finite differences of FourierConv2d are in test_gradcheck;
the autograd oracle, which convolves with torch.nn.functional.conv2d, checks it inside the model.)"""
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet
from pycapsnet.core.fourier import FourierConv2d, dft_matrices, half_spectrum
from pycapsnet.core.layers import Conv2d
from tests.conftest import CPU_BACKENDS, GPU_BACKENDS, SMALL, assert_close

# (c_in, c_out, kernel, stride, padding, height, width)
GEOMETRIES = [
    (3, 4, 3, 1, 0, 6, 6),       # stride 1
    (3, 5, 3, 2, 1, 7, 8),       # padding, odd rectangular input
    (2, 3, 9, 2, 0, 20, 20),     # PrimaryCaps' geometry
    (4, 3, 5, 3, 0, 17, 13),     # kernel not a multiple of the stride; input cropped
    (2, 2, 4, 2, 2, 9, 11),      # even kernel, padding 2
    (1, 6, 9, 1, 0, 28, 28),     # conv1's geometry
    (3, 4, 1, 1, 0, 5, 5),       # 1x1
    (3, 2, 2, 3, 0, 8, 8),       # stride larger than the kernel
]


def _pair(B, geometry):
    c_in, c_out, k, s, p, h, w = geometry
    direct = Conv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0))
    fourier = FourierConv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = B.asarray(rng.standard_normal((3, h, w, c_in)))
    return direct, fourier, x, rng


def _compare(B, geometry, rtol, freq_chunk=None, channel_block=None, keep_spectrum=True):
    direct, fourier, x, rng = _pair(B, geometry)
    if freq_chunk:  # small chunks and blocks: several of each, the last ones shorter
        fourier.freq_chunk, fourier.channel_block = freq_chunk, channel_block
    fourier.keep_spectrum_mb = 1e6 if keep_spectrum else 0  # 0: backward makes V again, chunk by chunk
    y_d, y_f = direct.forward(x), fourier.forward(x)
    assert_close(B.to_numpy(y_f), B.to_numpy(y_d), rtol, "output")
    dy = B.asarray(rng.standard_normal(tuple(y_d.shape)))
    dx_d, dx_f = direct.backward(dy), fourier.backward(dy)
    assert_close(B.to_numpy(dx_f), B.to_numpy(dx_d), rtol, "input gradient")
    for name in ("W", "b"):
        assert_close(B.to_numpy(fourier.grads[name]), B.to_numpy(direct.grads[name]), rtol, f"d{name}")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fourier_conv_equals_im2col_conv_float64(backend, geometry):
    _compare(backends.get(backend, dtype="float64"), geometry, 1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_narrow_im2col_product_runs_in_cache_sized_chunks_with_the_same_results(backend):
    """At most ``narrow`` output columns (C_out forward and for dW, C_in for the stride-1 input
    gradient): chunks of narrow_chunk_bytes, here one image each; a wide product keeps chunk_bytes.
    Forward, dx, dW and db as one chunk's, to 1e-12 in float64."""
    B = backends.get(backend, dtype="float64")
    narrow = Conv2d(B, 16, 16, 3, 1, 1, rng=np.random.default_rng(0))
    assert narrow.chunk_limit(16) == narrow.narrow_chunk_bytes < narrow.chunk_limit(65) == narrow.chunk_bytes
    per_image = 32 * 32 * 9 * 16 * 8
    narrow.narrow_chunk_bytes = per_image
    assert len(narrow.chunks(3, 32, 32, 8)) == 3
    one = Conv2d(B, 16, 16, 3, 1, 1, rng=np.random.default_rng(0))
    one.narrow_chunk_bytes = one.chunk_bytes
    assert len(one.chunks(3, 32, 32, 8)) == 1
    rng = np.random.default_rng(2)
    x, dy = (B.asarray(rng.standard_normal((3, 32, 32, 16))) for _ in range(2))
    assert_close(B.to_numpy(narrow.forward(x)), B.to_numpy(one.forward(x)), 1e-12, "output")
    assert_close(B.to_numpy(narrow.backward(dy)), B.to_numpy(one.backward(dy)), 1e-12, "input gradient")
    for name in ("W", "b"):
        assert_close(B.to_numpy(narrow.grads[name]), B.to_numpy(one.grads[name]), 1e-12, f"d{name}")


@pytest.mark.parametrize("keep_spectrum", [True, False], ids=["V kept", "V made again"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[2], GEOMETRIES[3]], ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fourier_conv_in_several_frequency_chunks_and_channel_blocks(backend, geometry, keep_spectrum):
    """Frequency chunks of 3 and phase-channel blocks of 5: blocks that split a phase's channels,
    phases split over blocks, and a short last chunk and block; with the kernel spectrum V kept
    from forward and made again in backward."""
    _compare(backends.get(backend, dtype="float64"), geometry, 1e-12, freq_chunk=3, channel_block=5,
             keep_spectrum=keep_spectrum)


@pytest.mark.parametrize("batch,block", [(1, 4), (16, 64), (32, 128), (64, 256), (256, 256)])
def test_weight_gradient_block_is_no_larger_than_the_transformed_input(batch, block):
    """PrimaryCaps' shape (256 -> 256 channels, stride 2: C' = 1024 phase channels): dV's block
    (F, 2 C_out, block) holds at most as many numbers as X (F, 2N, C'), so 4N channels, up to
    channel_block (256); on a 224 x 224 input (6,272 frequencies) weight_grad_mb bounds it instead.
    (At batch 3, the tests above already run several such blocks where C' > C_out.)"""
    conv = FourierConv2d.__new__(FourierConv2d)  # the geometry alone: no 21 MB of weights
    conv.c_in, conv.c_out, conv.stride = 256, 256, 2
    assert conv.weight_grad_block(52, 4, batch) == block
    assert conv.weight_grad_block(6272, 4, 256) == 256 * 2**20 // (6272 * 2 * 256 * 4)
    assert conv.weight_grad_block(6272, 4, 2) == 8


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
def test_im2col_conv_in_bands_of_rows_equals_one_chunk(backend, geometry):
    """Conv2d's chunks: whole images while one image's im2col matrix fits chunk_bytes, else bands of
    output rows (whose input rows overlap where their windows do).  One row per chunk, a few rows,
    and whole images give the same output, dx, dW and db as a single chunk, to 1e-12 in float64."""
    B = backends.get(backend, dtype="float64")
    c_in, c_out, k, s, p, h, w = geometry
    rng = np.random.default_rng(1)
    x = B.asarray(rng.standard_normal((3, h, w, c_in)))
    one = Conv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0))
    one.chunk_bytes = 1 << 40
    y_ref = one.forward(x)
    dy = B.asarray(rng.standard_normal(tuple(y_ref.shape)))
    dx_ref = one.backward(dy)
    oh, ow = one.output_hw(h, w)
    per_row = ow * k * k * c_in * 8
    for chunk_bytes, expected in ((1, 3 * oh), (2 * per_row, 3 * -(-oh // 2)), (oh * per_row, 3)):
        conv = Conv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0))
        conv.chunk_bytes = chunk_bytes
        assert len(conv.chunks(3, h, w, 8)) == expected
        assert_close(B.to_numpy(conv.forward(x)), B.to_numpy(y_ref), 1e-12, "output")
        assert_close(B.to_numpy(conv.backward(dy)), B.to_numpy(dx_ref), 1e-12, "input gradient")
        for name in ("W", "b"):
            assert_close(B.to_numpy(conv.grads[name]), B.to_numpy(one.grads[name]), 1e-12, f"d{name}")


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
def test_fourier_conv_equals_im2col_conv_float32(backend):
    _compare(backends.get(backend, dtype="float32"), GEOMETRIES[2], 1e-5)


@pytest.mark.parametrize("geometry", [GEOMETRIES[2], GEOMETRIES[5]], ids=str)
def test_kernel_grid_copies_split_over_host_threads(geometry):
    """The copies between W and the kernel grid (both ways) run in parts of the tap rows on NumPy's
    host threads (B.over_host_threads): on 2 threads, the same layer as Conv2d in float64."""
    B = backends.get("numpy", dtype="float64")
    B.threads = 2
    parts, over = [], B.over_host_threads

    def spy(fn, n):
        over(lambda sl: (parts.append(sl), fn(sl)), n)

    B.over_host_threads = spy
    _compare(B, geometry, 1e-12)
    assert len(parts) > 2 and slice(None) not in parts  # forward's copy and backward's, each in parts


def test_gradients_accumulate_and_input_grad_can_be_skipped():
    B = backends.get("numpy", dtype="float64")
    direct, fourier, x, rng = _pair(B, GEOMETRIES[1])
    dy = rng.standard_normal(tuple(direct.forward(x).shape))
    for _ in range(2):  # two backward passes add up, as every layer's do
        fourier.forward(x)
        fourier.backward(dy)
    direct.forward(x)
    direct.backward(dy)
    assert_close(fourier.grads["W"], 2 * direct.grads["W"], 1e-12, "accumulated dW")
    fourier.forward(x)
    assert fourier.backward(dy, input_grad=False) is None


@pytest.mark.parametrize("n_h,n_w", [(10, 10), (7, 7), (6, 9), (1, 4)])
def test_half_spectrum_keeps_one_of_each_conjugate_pair(n_h, n_w):
    freqs, alpha = half_spectrum(n_h, n_w)
    keys = {tuple(f) for f in freqs}
    partners = {((-a) % n_h, (-b) % n_w) for a, b in freqs}
    assert keys | partners == {(a, b) for a in range(n_h) for b in range(n_w)}   # every frequency covered
    assert sum(alpha) == n_h * n_w                                               # ... exactly once
    self_conjugate = [(a, b) for a, b in freqs if ((-a) % n_h, (-b) % n_w) == (a, b)]
    assert sorted(alpha[[tuple(f) in self_conjugate for f in freqs]]) == [1.0] * len(self_conjugate)


def test_transforms_invert_on_the_valid_outputs():
    """Fy (X V) equals the direct correlation for a 1-channel grid: the convolution theorem itself."""
    n, kq, o = 10, 5, 6
    Fx, Fw, Fy = dft_matrices(n, n, kq, o, o)
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((n, n)), rng.standard_normal((kq, kq))
    X, V = (Fx @ xs.ravel()).reshape(-1, 2), (Fw @ ws.ravel()).reshape(-1, 2)
    Y = np.stack([X[:, 0] * V[:, 0] - X[:, 1] * V[:, 1], X[:, 0] * V[:, 1] + X[:, 1] * V[:, 0]], 1)
    direct = np.array([[np.sum(xs[p:p + kq, q:q + kq] * ws) for q in range(o)] for p in range(o)])
    np.testing.assert_allclose((Fy @ Y.ravel()).reshape(o, o), direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,kq,o", [(10, 5, 6), (7, 2, 6), (15, 5, 11)])
def test_transforms_are_exact_where_cos_or_sin_vanishes(n, kq, o):
    """At whole quarter turns cos and sin are exactly 0 and +-1, not 1e-16 residues: otherwise the
    zero imaginary parts of the self-conjugate frequencies hold residues in V and dY whose products
    are subnormal floats, which x86 CPUs multiply many times slower (fourier.dft_matrices)."""
    Fx, Fw, Fy = dft_matrices(n, n, kq, o, o)
    freqs, alpha = half_spectrum(n, n)
    for name, T in (("Fx", Fx), ("Fw", Fw), ("Fy", Fy * n * n)):
        magnitude = np.abs(T)
        assert not np.any((magnitude > 0) & (magnitude < 1e-9)), f"{name} holds rounding residues"
    self_conjugate = np.flatnonzero(alpha == 1)              # f = -f: the imaginary part is zero
    assert len(self_conjugate) and not np.any(Fw[2 * self_conjugate + 1])
    assert not np.any(Fx[2 * self_conjugate + 1]) and not np.any(Fy[:, 2 * self_conjugate + 1])
    # and V's imaginary part for those frequencies is exactly 0 in float32 too, whatever the kernel
    ws = np.random.default_rng(0).standard_normal((kq * kq, 8)).astype(np.float32)
    V = dft_matrices(n, n, kq, o, o, dtype=np.float32)[1] @ ws
    assert not np.any(V[2 * self_conjugate + 1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_train_step_multiplies_no_vanishing_residues(backend):
    """The whole step, paper geometry, float32: no matrix product gets an operand entry below 1e-20 that
    is not exactly 0, and no gradient holds one.  Residues of a quarter turn once put values from 1e-38 to
    1e-22 there (this step's smallest true values are near 1e-15): products of such pairs are subnormal,
    which made the Fourier input gradient three times slower on an Intel Xeon (docs/performance.md)."""
    from pycapsnet.training.data import load_embedded
    from pycapsnet.training.optim import Adam

    B = backends.get(backend, dtype="float32")
    train, _ = load_embedded()
    model = CapsNet(B, seed=0)
    optimizer = Adam(model)
    tiny = []

    def smallest_residue(t):
        """The smallest |entry| of t in (0, 1e-20), or None."""
        a = np.abs(B.to_numpy(t))
        residues = a[(a > 0) & (a < 1e-20)]
        return float(residues.min()) if residues.size else None

    def scanned(product):
        def wrapper(*operands, **kwargs):
            for t in operands[:2]:
                if (r := smallest_residue(t)) is not None:
                    tiny.append((tuple(t.shape), r))
            return product(*operands, **kwargs)
        return wrapper

    B.matmul, B.predictions = scanned(B.matmul), scanned(B.predictions)
    for _ in range(2):  # the second step multiplies weights that Adam has moved
        model.train_step_grads(train.x[:4], train.y[:4])
        optimizer.step()
    assert not tiny, f"products with vanishing residues among their operands (shape, smallest): {tiny[:5]}"
    for name, g in model.grads.items():
        assert smallest_residue(g) is None, f"gradient {name} holds a vanishing residue"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_model_with_either_convolution_gives_the_same_loss_and_gradients(backend):
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(0)
    x, y = rng.random((3, 1, 14, 14)), np.array([0, 2, 3])
    grads = {}
    for conv in ("fourier", "im2col"):
        m = CapsNet(B, seed=0, **SMALL, primary_conv=conv)
        m.zero_grad()
        loss = m.loss(x, y).loss
        m.backward()
        grads[conv] = (loss, {k: B.to_numpy(g) for k, g in m.grads.items()})
    assert abs(grads["fourier"][0] - grads["im2col"][0]) < 1e-12
    for k, g in grads["im2col"][1].items():
        assert_close(grads["fourier"][1][k], g, 1e-10, k)


def test_unknown_convolution_is_refused():
    from pycapsnet.core.capsules import PrimaryCaps

    with pytest.raises(ValueError, match="unknown convolution 'fft'.*fourier.*im2col"):
        PrimaryCaps(backends.get("numpy"), 8, conv="fft")
    with pytest.raises(ValueError, match=r"primary_conv must be one of \('fourier', 'im2col'\), got 'fft'"):
        CapsNet("numpy", **SMALL, primary_conv="fft")


def test_the_kernel_spectrum_is_kept_only_while_small():
    # V has 2 x F x C' x C_out numbers: 109 MB for the paper's PrimaryCaps (F = 52), 822 MB on a
    # 64 x 64 input (F = 392), which forward must not keep by default.
    from pycapsnet.core.fourier import FourierConv2d

    B = backends.get("numpy")
    conv = FourierConv2d(B, 256, 256, 9, 2, rng=np.random.default_rng(0))
    x = B.zeros((1, 20, 20, 256))
    assert conv.keeps_spectrum(conv._plan(20, 20), x)
    assert not conv.keeps_spectrum(conv._plan(56, 56), x)
    conv.keep_spectrum_mb = 0
    assert not conv.keeps_spectrum(conv._plan(20, 20), x)
