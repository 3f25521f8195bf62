"""kiln.Engine from NumPy: training, the C++ API's bits, input layouts and their errors."""
import os
import subprocess

import numpy as np
import pytest

import kiln
from conftest import MEAN, STD, normalised


def small_model():
    return kiln.BluePrint("tiny", (28, 28, 1), 10,
                          kiln.seq(kiln.cbr(8, 3, 1, 1), kiln.maxpool(2, 2), kiln.cbr(16, 3, 1, 1),
                                   kiln.maxpool(2, 2), kiln.flatten(), kiln.fc(10)))


def test_dsl_and_zoo():
    m = small_model()
    assert m.input == (28, 28, 1) and m.num_classes == 10
    assert "conv(out=8, k=3" in repr(m) and "maxpool(k=2" in repr(m)
    assert "resnet18" in kiln.zoo_names()
    r = kiln.zoo("resnet18", num_classes=7, small=True)
    assert r.num_classes == 7 and r.input == (32, 32, 3)
    with pytest.raises(kiln.InvalidArgumentError) as e:
        kiln.zoo("resnet19")
    assert isinstance(e.value, ValueError) and isinstance(e.value, kiln.Error)


def test_loss_falls_in_50_steps(fashion):
    x, y = fashion
    xf = normalised(x)
    e = kiln.Engine(small_model(), batch=64, device="cpu", seed=1)
    assert e.state == "COMPILED" and e.backend == "cpu"
    losses = []
    for s in range(50):
        sl = slice(s * 64, (s + 1) * 64)
        losses.append(e.train_step(xf[sl], y[sl], lr=0.05).loss)
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    # From ~2.3 (10 classes at chance) a small CNN reaches well under 1.2 in 50 steps.
    assert last < 0.6 * first, losses
    assert e.steps == 50
    st = e.eval_step(xf[6336:6400], y[6336:6400])
    assert 0.5 < st.top1 <= 1.0 and st.top5 >= st.top1 and st.count == 64 and not st.overflowed


def test_same_seed_same_bits_as_cpp(fashion, tmp_path):
    ref = os.environ.get("KILN_PY_REFERENCE")
    if not ref or not os.path.exists(ref):
        pytest.skip("KILN_PY_REFERENCE (the C++ reference program) is not built; make test sets it")
    x, y = fashion
    batch, steps, lr, seed = 32, 8, 0.05, 7
    xf = normalised(x[:batch * steps])
    yl = y[:batch * steps].astype(np.int32)
    xf.tofile(tmp_path / "x.f32")
    yl.tofile(tmp_path / "y.i32")
    out = subprocess.run([ref, "cnn", str(batch), str(steps), str(lr), str(seed), str(tmp_path / "x.f32"),
                          str(tmp_path / "y.i32")], check=True, capture_output=True, text=True).stdout.split("\n")
    want = [(float.fromhex(l.split()[0]), int(l.split()[1])) for l in out if l]
    e = kiln.Engine(kiln.zoo("cnn"), batch=batch, device="cpu", seed=seed)
    got = []
    for s in range(steps):
        st = e.train_step(xf[s * batch:(s + 1) * batch], yl[s * batch:(s + 1) * batch], lr=lr)
        got.append((st.loss, st.correct1))
    assert got == want  # bit-identical: the same program on the same backend


def test_layouts_give_the_same_stats(fashion):
    x, y = fashion
    xf = normalised(x[:32])
    e = kiln.Engine(small_model(), batch=32, device="cpu", seed=3, mean=[MEAN], std=[STD])
    nhwc = e.eval_step(xf, y[:32])
    # An NCHW view of NHWC memory (what a channels_last tensor exports): no copy, same stats.
    nchw_view = xf.transpose(0, 3, 1, 2)
    assert nchw_view.shape == (32, 1, 28, 28)
    same = e.eval_step(nchw_view, y[:32].astype(np.int32))
    assert (same.loss, same.correct1) == (nhwc.loss, nhwc.correct1)
    # uint8 normalised by the engine: the same arithmetic up to float rounding (1e-5 relative).
    u8 = e.eval_step(x[:32], y[:32])
    assert u8.loss == pytest.approx(nhwc.loss, rel=1e-5)
    # A partial batch is padded and only its images count.
    part = e.eval_step(xf[:10], y[:10])
    assert part.count == 10


def test_bad_inputs_name_what_is_expected(fashion):
    x, y = fashion
    xf = normalised(x[:64])
    e = kiln.Engine(small_model(), batch=32, device="cpu")
    with pytest.raises(ValueError, match=r"float32.*got float64"):
        e.train_step(xf[:32].astype(np.float64), y[:32], lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"\[32, 28, 28, 1\] \(NHWC\)"):
        e.train_step(xf[:32, :14], y[:32], lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"compiled for a batch of 32, got 64"):
        e.train_step(xf, y, lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"dense; got shape \[32, 28, 28, 1\] with element strides"):
        e.train_step(xf[::2], y[:32], lr=0.1)  # every other image: not contiguous
    with pytest.raises(kiln.InvalidArgumentError, match=r"labels must be one-dimensional"):
        e.train_step(xf[:32], y[:16], lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"label 10 at index 0 is outside 0..9"):
        e.train_step(xf[:32], np.full(32, 10), lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"uint8 images need the normalisation"):
        e.train_step(x[:32], y[:32], lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"labels must be int32 or int64, got float32"):
        e.train_step(xf[:32], y[:32].astype(np.float32), lr=0.1)


def test_lifecycle_is_a_property():
    e = kiln.Engine(small_model(), batch=8, device="cpu", compile=False)
    assert e.state == "PLANNING"
    with pytest.raises(kiln.DeviceError, match=r"the next step is lock_memory\(\)") as err:
        e.train_step(np.zeros((8, 28, 28, 1), np.float32), np.zeros(8, np.int32), lr=0.1)
    assert isinstance(err.value, RuntimeError) and err.value.kind == "lifecycle error"
    e.lock_memory()
    assert e.state == "MEMORY_LOCKED"
    e.compile(seed=1)
    assert e.state == "COMPILED"


class DLPackOnly:
    """An array seen only through __dlpack__ (as a torch or JAX tensor is), not the buffer protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_producers(fashion):
    x, y = fashion
    xf = normalised(x[:16])
    e = kiln.Engine(small_model(), batch=16, device="cpu", seed=5)
    ref = e.eval_step(xf, y[:16])
    st = e.eval_step(DLPackOnly(xf.transpose(0, 3, 1, 2)), DLPackOnly(y[:16]))
    assert (st.loss, st.correct1) == (ref.loss, ref.correct1)


def test_plan_and_memory_print_what_the_cli_prints():
    p = kiln.plan("resnet18_small", device="cpu")
    assert p.layers > 10 and "layer1.0" in str(p)
    m = kiln.memory("cnn", batch=64, device="cpu")
    assert m.total_bytes == sum(m.regions.values()) and m.total_bytes > 0
    assert m.features_without_reuse > 0 and str(m).strip()


def test_step_stats_are_read_when_asked_for(synthetic_images):
    """train_step leaves its statistics on the device until read: the same values whether
    read at once or after 40 more steps (more than the device keeps slots for), or after the
    engine is gone."""
    x, y = synthetic_images
    images, labels = normalised(x[:32]), y[:32]
    eager = kiln.Engine(small_model(), batch=32, device="cpu", seed=5)
    read_at_once = [eager.train_step(images, labels, lr=0.05).loss for _ in range(40)]
    lazy = kiln.Engine(small_model(), batch=32, device="cpu", seed=5)
    kept = [lazy.train_step(images, labels, lr=0.05) for _ in range(40)]
    assert lazy.steps == 40
    assert [s.loss for s in kept] == read_at_once
    assert read_at_once[-1] < read_at_once[0]  # it trained
    last = lazy.train_step(images, labels, lr=0.05)
    del lazy
    assert np.isfinite(last.loss) and last.count == 32 and 0 <= last.top1 <= 1
