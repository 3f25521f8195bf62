"""state_dict / load_state_dict under torchvision's names, with and without torch."""
import numpy as np
import pytest

import kiln
from conftest import normalised


def test_state_dict_round_trip(fashion):
    x, y = fashion
    xf = normalised(x[:256])
    a = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=1)
    for s in range(4):
        a.train_step(xf[s * 32:(s + 1) * 32], y[s * 32:(s + 1) * 32], lr=0.05)
    sd = a.state_dict()
    conv = [k for k in sd if k.endswith(".weight") and sd[k].ndim == 4]
    assert conv and all(sd[k].dtype == np.float32 for k in conv)
    assert any(k.endswith("running_mean") for k in sd) and any(k.endswith("num_batches_tracked") for k in sd)
    # torchvision's OIHW: the first convolution takes one input channel.
    assert sd[conv[0]].shape[1] == 1
    b = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=2)
    before = b.eval_step(xf[128:160], y[128:160])
    b.load_state_dict(sd)
    want = a.eval_step(xf[128:160], y[128:160])
    got = b.eval_step(xf[128:160], y[128:160])
    assert (got.loss, got.correct1) == (want.loss, want.correct1) != (before.loss, before.correct1)
    # num_batches_tracked is the engine's own step count (0 here), not a loaded value.
    for k, v in b.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(v, sd[k], err_msg=k)


def test_load_state_dict_refuses_with_the_name():
    e = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu")
    sd = e.state_dict()
    name = next(k for k in sd if k.endswith(".weight"))
    missing = {k: v for k, v in sd.items() if k != name}
    with pytest.raises(kiln.InvalidArgumentError, match=f"tensor '{name}' is missing"):
        e.load_state_dict(missing)
    wrong = dict(sd)
    wrong[name] = np.zeros((3, 3), np.float32)
    with pytest.raises(kiln.InvalidArgumentError, match=f"tensor '{name}' has shape"):
        e.load_state_dict(wrong)
    extra = dict(sd)
    extra["head.weight"] = np.zeros(3, np.float32)
    with pytest.raises(kiln.InvalidArgumentError, match="'head.weight'"):
        e.load_state_dict(extra)
    e.load_state_dict(extra, strict=False)


def test_torch_tensors_both_ways(fashion):
    torch = pytest.importorskip("torch")
    x, y = fashion
    xf = normalised(x[:32])
    e = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=1)
    ref = e.eval_step(xf, y[:32])
    t = torch.from_numpy(xf).permute(0, 3, 1, 2)  # NCHW, channels_last memory
    assert t.is_contiguous(memory_format=torch.channels_last)
    st = e.eval_step(t, torch.from_numpy(y[:32]))
    assert (st.loss, st.correct1) == (ref.loss, ref.correct1)
    with pytest.raises(ValueError, match="dense"):
        e.eval_step(t.contiguous(), torch.from_numpy(y[:32]))  # NCHW memory
    sd = e.state_dict(as_torch=True)
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    e.load_state_dict(sd)


def test_save_and_load_files(tmp_path):
    a = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu", seed=1)
    kiln.save(a, tmp_path / "w.safetensors")
    b = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu", seed=2)
    kiln.load(b, tmp_path / "w.safetensors")
    for k, v in a.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(v, b.state_dict()[k], err_msg=k)
    with pytest.raises(FileNotFoundError):
        b.load(tmp_path / "missing.safetensors")


def test_torchvision_resnet18_both_ways():
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 64, 3)).astype(np.float32)  # NHWC
    y = np.array([0, 1, 2, 3])
    e = kiln.Engine(kiln.zoo("resnet18", num_classes=10, image_size=64), batch=4, device="cpu", seed=1)
    tv = torchvision.models.resnet18(num_classes=10).eval()

    def tv_loss():
        with torch.no_grad():
            logits = tv(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())
            return torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()

    # FP32 on both sides; the sums run in other orders, so 1e-4 relative on the loss.
    tv.load_state_dict(e.state_dict(as_torch=True))
    assert tv_loss() == pytest.approx(e.eval_step(x, y).loss, rel=1e-4)
    tv2 = torchvision.models.resnet18(num_classes=10).eval()
    e.load_state_dict(tv2.state_dict())
    tv = tv2
    assert tv_loss() == pytest.approx(e.eval_step(x, y).loss, rel=1e-4)
