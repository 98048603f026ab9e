"""What a run draws as it trains (random routing's coefficients, Dropout's masks) goes on, after a
resume or a continued ``fit``, exactly as in the uninterrupted run: every generator's state is in
the checkpoint, and scoring, pictures and predictions do not move it."""
import json

import numpy as np
import pytest

import pycapsnet
from pycapsnet.core import architecture as arch
from pycapsnet.training import checkpoint, trainer
from tests.test_faults import TINY, record, weights

TINY_RANDOM = ["--routing", "random", *TINY, "--decoder-hidden", "16", "32", "--seed", "3"]
DROPOUT = arch.network([arch.conv2d(8, 9, 2), arch.relu(), arch.dropout(0.3), arch.flatten(), arch.linear(10)],
                       head="logits", loss={"loss": "cross_entropy"}, decoder=None)


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = pycapsnet.load_digits()
    return x[:48], y[:48]


def _same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    differ = [k for k in wa if not np.array_equal(wa[k], wb[k])]
    assert not differ, f"{len(differ)} arrays differ: {differ[:5]}"
    assert record(a) == record(b)


@pytest.mark.parametrize("extra", [[], ["--network", "DESCRIPTION"]], ids=["random-routing", "dropout"])
def test_a_resumed_run_draws_what_the_uninterrupted_run_drew(tmp_path, extra):
    if extra:
        path = tmp_path / "dropout.json"
        path.write_text(json.dumps(DROPOUT))
        extra = ["--network", str(path), "--limit", "32", "--limit-test", "16", "--batch-size", "16", "--no-progress"]
    flags = extra or TINY_RANDOM
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert trainer.main("numpy", [*flags, "--epochs", "3", "--out", str(whole)]) == 0
    assert trainer.main("numpy", [*flags, "--epochs", "1", "--out", str(parts)]) == 0
    assert "generators" in checkpoint.load(str(parts))["header"]
    assert trainer.main("numpy", ["--resume", str(parts), "--epochs", "3", "--no-progress"]) == 0
    _same_run(whole, parts)


def test_without_the_states_the_resumed_run_would_differ(tmp_path, monkeypatch):
    """The check above can fail: a resume that does not restore the generators gives other weights."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert trainer.main("numpy", [*TINY_RANDOM, "--epochs", "2", "--out", str(whole)]) == 0
    assert trainer.main("numpy", [*TINY_RANDOM, "--epochs", "1", "--out", str(parts)]) == 0
    monkeypatch.setattr(checkpoint, "restore_generators", lambda ckpt, model: None)
    assert trainer.main("numpy", ["--resume", str(parts), "--epochs", "2", "--no-progress"]) == 0
    with pytest.raises(AssertionError, match="arrays differ"):
        _same_run(whole, parts)


@pytest.mark.parametrize("network", ["random", DROPOUT], ids=["random-routing", "dropout"])
def test_fit_continued_in_a_new_model_is_one_longer_fit(tmp_path, digits, network):
    x, y = digits
    small = dict(conv_channels=8, primary_types=2, decoder_hidden=(16, 32)) if network == "random" else {}
    one = pycapsnet.build(network, seed=3, **small)
    one.fit(x, y, epochs=2, batch_size=16, progress=False)
    first = pycapsnet.build(network, seed=3, **small)
    first.fit(x, y, epochs=1, batch_size=16, progress=False, out=str(tmp_path / "run"))
    first.predict(x)  # draws nothing that training would
    again = pycapsnet.load(str(tmp_path / "run"))
    again.fit(x, y, epochs=1, batch_size=16, progress=False)
    a, b = one.network.state_dict(), again.network.state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_damaged_generator_state_is_named(tmp_path):
    run = tmp_path / "run"
    assert trainer.main("numpy", [*TINY_RANDOM, "--epochs", "1", "--out", str(run)]) == 0
    ckpt = checkpoint.load(str(run))
    ckpt["header"]["generators"] = {"classcaps": {"bit_generator": "PCG64", "state": "nonsense"}}
    model = checkpoint.model_of(ckpt, "numpy")
    with pytest.raises(pycapsnet.CapsNetError, match="is damaged: the generator state of layer classcaps"):
        checkpoint.restore_model(ckpt, model)
