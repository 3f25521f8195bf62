"""The EMA model and the optimizer state through state_dict: state_dict(ema=True),
optimizer_state_dict() and their loaders (issue 19), against kiln's C++ side and float64."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

import kiln
from conftest import normalised


def read_safetensors(path):
    """A safetensors file as {name: array} (the format: u64 header length, JSON, bytes)."""
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    kinds = {"F32": np.float32, "I64": np.int64, "I32": np.int32}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=kinds[t["dtype"]]).reshape(t["shape"])
    return out


def batches(fashion, n, batch):
    x, y = fashion
    xf = normalised(x[:n * batch])
    yl = y[:n * batch].astype(np.int32)
    return [(xf[i * batch:(i + 1) * batch], yl[i * batch:(i + 1) * batch]) for i in range(n)]


def test_ema_state_equals_the_cpp_engines(fashion, tmp_path):
    ref = os.environ.get("KILN_PY_REFERENCE")
    if not ref or not os.path.exists(ref):
        pytest.skip("KILN_PY_REFERENCE (the C++ reference program) is not built; make test sets it")
    batch, steps, lr, seed, decay = 32, 6, 0.05, 7, 0.8
    bs = batches(fashion, steps, batch)
    np.concatenate([b[0] for b in bs]).tofile(tmp_path / "x.f32")
    np.concatenate([b[1] for b in bs]).tofile(tmp_path / "y.i32")
    subprocess.run([ref, "cnn", str(batch), str(steps), str(lr), str(seed), str(tmp_path / "x.f32"),
                    str(tmp_path / "y.i32"), str(decay), str(tmp_path / "ck.safetensors")],
                   check=True, capture_output=True)
    ck = read_safetensors(tmp_path / "ck.safetensors")
    e = kiln.Engine(kiln.zoo("cnn"), batch=batch, device="cpu", seed=seed, ema=True, ema_decay=decay)
    for xb, yb in bs:
        e.train_step(xb, yb, lr=lr)
    # The same program on the same backend: bit-identical.
    ema = e.state_dict(ema=True)
    for k, v in ema.items():
        want = ck[k] if k.endswith("num_batches_tracked") else ck["ema." + k]
        np.testing.assert_array_equal(v, want, err_msg=k)
    live = e.state_dict()
    assert any(not np.array_equal(ema[k], live[k]) for k in ema if k.endswith("running_var"))
    opt = e.optimizer_state_dict()
    assert opt["optimizer"] == "sgd" and opt["step"] == steps
    for name, s in opt["state"].items():
        np.testing.assert_array_equal(s["momentum_buffer"], ck["optimizer.moment1." + name], err_msg=name)


# The EMA of weights and buffers replayed in float64 from the live state_dict after each step.
# FP32 on the device rounds d*e, (1-d)*w and their sum: 4 * steps * 2^-24 of the magnitude.
def test_ema_follows_its_recurrence_over_the_live_state(fashion):
    steps, decay = 5, 0.7
    d = float(np.float32(decay))  # the engine's decay is an FP32 number
    e = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=3, ema=True, ema_decay=decay)
    want = {k: v.astype(np.float64) for k, v in e.state_dict().items() if not k.endswith("num_batches_tracked")}
    for k, v in e.state_dict(ema=True).items():
        if k in want:
            np.testing.assert_array_equal(v, want[k], err_msg=k)  # the EMA starts at the model
    for xb, yb in batches(fashion, steps, 32):
        e.train_step(xb, yb, lr=0.05)
        live = e.state_dict()
        for k in want:
            want[k] = d * want[k] + (1 - d) * live[k]
    ema = e.state_dict(ema=True)
    for k, w in want.items():
        tol = 4 * steps * 2.0 ** -24 * (np.abs(w).max() + 1)
        np.testing.assert_allclose(ema[k], w, rtol=0, atol=tol, err_msg=k)
    assert all(ema[k] == e.steps for k in ema if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_round_trip_continues_the_same_run(fashion, optimizer):
    """A second engine given the first's model, EMA and optimizer state takes the same next
    step, bit for bit (the same program on the same backend)."""
    opts = dict(batch=32, device="cpu", ema=True, ema_decay=0.9, optimizer=optimizer, weight_decay=1e-4)
    bs = batches(fashion, 5, 32)
    a = kiln.Engine(kiln.zoo("cnn"), seed=1, **opts)
    for xb, yb in bs[:4]:
        a.train_step(xb, yb, lr=0.01)
    b = kiln.Engine(kiln.zoo("cnn"), seed=2, **opts)
    b.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict(ema=True), ema=True)
    b.load_optimizer_state_dict(a.optimizer_state_dict())
    assert b.steps == a.steps == 4
    if optimizer == "adamw":
        st = next(iter(b.optimizer_state_dict()["state"].values()))
        assert set(st) == {"exp_avg", "exp_avg_sq", "step"} and st["step"] == 4
    for e in (a, b):
        e.train_step(*bs[4], lr=0.01)
    for ema in (False, True):
        sa, sb = a.state_dict(ema=ema), b.state_dict(ema=ema)
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=f"{k} (ema={ema})")
    oa, ob = a.optimizer_state_dict(), b.optimizer_state_dict()
    assert oa["step"] == ob["step"] == 5
    for name in oa["state"]:
        for slot, v in oa["state"][name].items():
            np.testing.assert_array_equal(v, ob["state"][name][slot], err_msg=f"{name} {slot}")
    x, y = bs[0]
    assert a.eval_step(x, y, ema=True).loss == b.eval_step(x, y, ema=True).loss


def test_torch_tensors_round_trip(fashion):
    torch = pytest.importorskip("torch")
    a = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=1, ema=True)
    a.train_step(*batches(fashion, 1, 32)[0], lr=0.05)
    opt = a.optimizer_state_dict(as_torch=True)
    assert all(isinstance(v, torch.Tensor) for s in opt["state"].values() for v in s.values())
    b = kiln.Engine(kiln.zoo("cnn"), batch=32, device="cpu", seed=2, ema=True)
    b.load_state_dict(a.state_dict(as_torch=True, ema=True), ema=True)
    b.load_optimizer_state_dict(opt)
    for k, v in a.state_dict(ema=True).items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(v, b.state_dict(ema=True)[k], err_msg=k)


def test_bad_names_and_shapes_are_refused_by_name():
    e = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu", ema=True)
    opt = e.optimizer_state_dict()
    name = next(iter(opt["state"]))
    extra = {**opt, "state": {**opt["state"], "head.weight": {"momentum_buffer": np.zeros(3, np.float32)}}}
    with pytest.raises(kiln.InvalidArgumentError, match=re.escape("state['head.weight']")):
        e.load_optimizer_state_dict(extra)
    e.load_optimizer_state_dict(extra, strict=False)
    slot = {**opt, "state": {**opt["state"], name: {"momentum_buffer": opt["state"][name]["momentum_buffer"],
                                                     "exp_avg": np.zeros(1, np.float32)}}}
    with pytest.raises(kiln.InvalidArgumentError, match=re.escape(f"state['{name}']['exp_avg']")):
        e.load_optimizer_state_dict(slot)
    missing = {**opt, "state": {k: v for k, v in opt["state"].items() if k != name}}
    with pytest.raises(kiln.InvalidArgumentError, match=f"state of parameter '{name}' is missing"):
        e.load_optimizer_state_dict(missing)
    shape = {**opt, "state": {**opt["state"], name: {"momentum_buffer": np.zeros((2, 2), np.float32)}}}
    with pytest.raises(kiln.InvalidArgumentError, match=re.escape(f"state['{name}']['momentum_buffer'] has shape")):
        e.load_optimizer_state_dict(shape)
    with pytest.raises(kiln.InvalidArgumentError, match="optimizer='adamw'"):
        e.load_optimizer_state_dict({**opt, "optimizer": "adamw"})
    # The EMA model's dict is checked as the model's is.
    sd = e.state_dict(ema=True)
    with pytest.raises(kiln.InvalidArgumentError, match="'head.weight'"):
        e.load_state_dict({**sd, "head.weight": np.zeros(3, np.float32)}, ema=True)
    key = next(k for k in sd if k.endswith("running_var"))
    with pytest.raises(kiln.InvalidArgumentError, match=f"tensor '{key}' has shape"):
        e.load_state_dict({**sd, key: np.zeros(7, np.float32)}, ema=True)
    # No EMA, no EMA state.
    plain = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu")
    with pytest.raises(kiln.InvalidArgumentError, match="without --ema"):
        plain.state_dict(ema=True)
    with pytest.raises(kiln.InvalidArgumentError, match="compiled without EMA"):
        plain.load_state_dict(sd, ema=True)
