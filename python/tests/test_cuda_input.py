"""CUDA tensors through DLPack: copied device to device into the step's input after the
producer's stream (GPU, torch with CUDA; skipped otherwise), and, on the CPU backend, a tensor
claiming CUDA memory refused with one clear error."""
import ctypes

import numpy as np
import pytest

import kiln
from conftest import MEAN, STD, normalised


def small_model():
    return kiln.BluePrint("tiny", (28, 28, 1), 10,
                          kiln.seq(kiln.cbr(8, 3, 1, 1), kiln.maxpool(2, 2), kiln.cbr(16, 3, 1, 1),
                                   kiln.maxpool(2, 2), kiln.flatten(), kiln.fc(10)))


# --- A DLPack capsule that claims CUDA memory, made without a GPU (DLPack's C structs). ---

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_KEEP = []  # the structs behind the capsules (no deleter: they live as long as the test module)
_kDLCUDA = 2


def cuda_capsule(shape, device_id=0):
    """A float32 'dltensor' capsule saying its (never dereferenced) bytes are on cuda:device_id."""
    dims = (ctypes.c_int64 * len(shape))(*shape)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = 0x1000
    mt.dl_tensor.device = _DLDevice(_kDLCUDA, device_id)
    mt.dl_tensor.ndim = len(shape)
    mt.dl_tensor.dtype = _DLDataType(2, 32, 1)  # kDLFloat, 32 bits
    mt.dl_tensor.shape = dims
    mt.dl_tensor.strides = None
    mt.deleter = None
    name = b"dltensor"
    _KEEP.extend([dims, mt, name])
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(mt), name, None)


class ClaimsCuda:
    """What a torch CUDA tensor shows a consumer: __dlpack_device__ and __dlpack__."""

    def __init__(self, shape):
        self.shape = shape
        self.streams = []

    def __dlpack_device__(self):
        return (_kDLCUDA, 0)

    def __dlpack__(self, stream=None, **kwargs):
        self.streams.append(stream)
        return cuda_capsule(self.shape)


def test_cuda_memory_on_a_cpu_engine_is_one_clear_error():
    e = kiln.Engine(small_model(), batch=16, device="cpu", seed=2)
    labels = np.zeros(16, np.int64)
    shape = (16, 28, 28, 1)
    for make in (lambda: cuda_capsule(shape), lambda: ClaimsCuda(shape)):  # a capsule is read once
        with pytest.raises(kiln.DeviceError, match=r"cpu backend reads host memory only, and the batch is in CUDA "
                                                   r"memory \(device 0\); pass a CPU tensor \(tensor\.cpu\(\)\)"):
            e.train_step(make(), labels, lr=0.1)
        with pytest.raises(kiln.DeviceError, match=r"pass a CPU tensor"):
            e.eval_step(make(), labels)
    # A CPU engine has no stream to hand a CUDA producer.
    fake = ClaimsCuda((16, 28, 28, 1))
    with pytest.raises(kiln.DeviceError):
        e.train_step(fake, labels, lr=0.1)
    assert fake.streams == [None]
    assert e.steps == 0  # nothing was run
    with pytest.raises(kiln.InvalidArgumentError, match=r"images must be a NumPy array or have __dlpack__"):
        e.train_step([[1.0]], labels, lr=0.1)


# --- The GPU: torch CUDA tensors. ---

def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


torch = _torch_cuda()
needs_cuda = pytest.mark.skipif(torch is None, reason="needs torch with CUDA and a GPU")


def _engines(monkeypatch, **kw):
    # Two engines that must give the same bits: cuDNN engines that are bitwise reproducible.
    monkeypatch.setenv("KILN_DETERMINISTIC", "1")
    return [kiln.Engine(small_model(), batch=32, device="cuda", seed=7, **kw) for _ in range(2)]


@needs_cuda
def test_cuda_channels_last_tensor_trains_as_the_cpu_tensor(synthetic_images, monkeypatch):
    x, y = synthetic_images
    on_cpu, on_gpu = _engines(monkeypatch)
    assert on_gpu.backend == "cuda"
    for s in range(4):
        xs = torch.from_numpy(normalised(x[s * 32:(s + 1) * 32])).permute(0, 3, 1, 2)  # NCHW view, NHWC memory
        ys = torch.from_numpy(y[s * 32:(s + 1) * 32])
        xd = xs.contiguous(memory_format=torch.channels_last).cuda()
        assert xd.is_contiguous(memory_format=torch.channels_last) and xd.shape == (32, 1, 28, 28)
        want = on_cpu.train_step(xs, ys, lr=0.05)
        got = on_gpu.train_step(xd, ys.cuda(), lr=0.05)  # int64 labels on the device too
        assert (got.loss, got.correct1) == (want.loss, want.correct1), f"step {s}"
    ev_cpu = on_cpu.eval_step(xs[:10], ys[:10])
    ev_gpu = on_gpu.eval_step(xd[:10], ys[:10].cuda())
    assert (ev_gpu.loss, ev_gpu.count) == (ev_cpu.loss, ev_cpu.count)


@needs_cuda
def test_uint8_cuda_tensor_is_normalised_as_on_the_host(synthetic_images, monkeypatch):
    x, y = synthetic_images
    a, b = _engines(monkeypatch, mean=[MEAN], std=[STD])
    xs, ys = torch.from_numpy(x[:32]), torch.from_numpy(y[:32])
    want = a.train_step(xs, ys, lr=0.05)
    got = b.train_step(xs.cuda(), ys, lr=0.05)  # labels from the host
    assert (got.loss, got.correct1) == (want.loss, want.correct1)


@needs_cuda
def test_the_callers_stream_is_honoured(synthetic_images, monkeypatch):
    """The batch is written on a side stream that is still busy (a spin kernel) when train_step
    is called under it: torch orders that work before kiln's staging stream (__dlpack__(stream=)),
    so the step sees the new bytes, not the NaNs that were there."""
    x, y = synthetic_images
    ref, e = _engines(monkeypatch)
    xs, ys = torch.from_numpy(normalised(x[:32])), torch.from_numpy(y[:32])
    want = ref.train_step(xs, ys, lr=0.05)
    src = xs.cuda()
    xd = torch.full_like(src, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 28)  # some 0.1 s of GPU cycles before the copy
        xd.copy_(src)
        got = e.train_step(xd, ys.cuda(), lr=0.05)
    assert (got.loss, got.correct1) == (want.loss, want.correct1), (
        f"loss {got.loss} from a tensor written on a busy stream, {want.loss} from the host "
        "(NaN: kiln copied before the stream's work)")


@needs_cuda
def test_bad_cuda_inputs_name_what_is_expected(synthetic_images, monkeypatch):
    x, y = synthetic_images
    e = _engines(monkeypatch)[0]
    xd, yd = torch.from_numpy(normalised(x[:32])).cuda(), torch.from_numpy(y[:32]).cuda()
    with pytest.raises(kiln.InvalidArgumentError, match=r"float32.*got float16"):
        e.train_step(xd.half(), yd, lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"labels must be int32 or int64, got float32"):
        e.train_step(xd, yd.float(), lr=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match=r"labels are in CUDA memory but the images on the host"):
        e.train_step(xd.cpu(), yd, lr=0.1)
    if torch.cuda.device_count() > 1:
        with pytest.raises(kiln.InvalidArgumentError, match=r"on cuda:1 but the engine runs on cuda:0"):
            e.train_step(xd.to("cuda:1"), yd.to("cuda:1"), lr=0.1)
