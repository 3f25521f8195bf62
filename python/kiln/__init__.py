"""kiln for Python: compiled CNN training steps from NumPy arrays and PyTorch tensors.

    import kiln
    model = kiln.zoo("cnn")                       # or kiln.BluePrint(..., kiln.seq(...))
    engine = kiln.Engine(model, batch=128)        # planned, memory placed, compiled
    stats = engine.train_step(images, labels, lr=0.05)   # images NHWC float32
    sd = engine.state_dict()                      # torchvision names and layouts
    ema = engine.state_dict(ema=True)             # the EMA model (Engine(..., ema=True))
    opt = engine.optimizer_state_dict()           # momentum / Adam moments, step counts
    summary = kiln.train(model="cnn", epochs=1)   # the CLI's trainer, its flags as keywords
"""
from __future__ import annotations

from . import _kiln
from ._kiln import (  # noqa: F401  (the public names)
    BluePrint, DeviceError, Error, FileError, InvalidArgumentError, Layer, StepStats,
    adaptive_avgpool, avgpool, bn2d, cbr, conv, dropout, fc, flatten, gap, identity, maxpool,
    hardswish, relu, residual, seq, silu, train_flags, zoo, zoo_names,
)

__all__ = [
    "BluePrint", "DeviceError", "Engine", "Error", "FileError", "InvalidArgumentError", "Layer",
    "StepStats", "adaptive_avgpool", "avgpool", "bn2d", "cbr", "conv", "dropout", "fc", "flatten",
    "Memory", "Plan", "gap", "hardswish", "identity", "load", "maxpool", "memory", "plan", "relu", "residual", "save", "seq", "silu", "train", "train_flags", "zoo",
    "zoo_names",
]


def _as_torch(arrays: dict) -> dict:
    import torch

    return {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in arrays.items()}


class Engine:
    """A model compiled into one training step (kiln::Engine).

    model: a BluePrint (kiln.zoo(...) or one built with the DSL) or a zoo name.
    batch: the batch the step is compiled for (eval_step also takes fewer).
    amp: FP16 mixed precision (GPU). device: "auto", "cpu" or "cuda".
    seed: torchvision's initialisation from this seed. compile=False stops in PLANNING, for
    lock_memory() and compile(seed) by hand. mean/std: per-channel normalisation (0..1 units)
    for uint8 batches. The optimizer options are kiln's CompileOptions.
    """

    def __init__(self, model, batch=32, amp=False, device="auto", seed=0, compile=True,
                 optimizer="sgd", momentum=0.9, weight_decay=0.0, nesterov=False, ema=False,
                 ema_decay=0.9999, clip_grad=0.0, mean=None, std=None):
        if isinstance(model, str):
            model = zoo(model)
        self.model = model
        self._e = _kiln._Engine(model, batch, amp, device, seed, compile, optimizer, momentum,
                                weight_decay, nesterov, ema, ema_decay, clip_grad,
                                list(mean or []), list(std or []))

    @property
    def state(self) -> str:
        """The lifecycle: "PLANNING", "MEMORY_LOCKED" or "COMPILED"."""
        return self._e.state

    @property
    def batch(self) -> int:
        """The batch the step was compiled for."""
        return self._e.batch

    @property
    def backend(self) -> str:
        """The backend running the step ("cpu" or "cuda")."""
        return self._e.backend

    @property
    def steps(self) -> int:
        """Training steps taken."""
        return self._e.steps

    def lock_memory(self) -> None:
        """PLANNING -> MEMORY_LOCKED: compile the program and place its memory."""
        self._e.lock_memory()

    def compile(self, seed: int = 0) -> None:
        """MEMORY_LOCKED -> COMPILED: allocate, prepare every node, initialise the weights."""
        self._e.compile(seed)

    def train_step(self, images, labels, *, lr: float) -> StepStats:
        """One SGD/AdamW/LARS step on a batch; returns its StepStats.

        images: [batch, H, W, C] float32 (NHWC), or [batch, C, H, W] in channels_last memory,
        or uint8 with the engine's mean/std; a NumPy array or anything with __dlpack__. A CUDA
        tensor on the engine's GPU is copied device to device once the work queued on its
        producer's current stream is done (DLPack's stream protocol).
        labels: [batch] int32 or int64, on the host or on the images' GPU.
        The StepStats' values are read from the device when first asked for (as loss.item()
        in PyTorch), so a loop that reads them only now and then runs ahead of the GPU.
        """
        return self._e.train_step(images, labels, lr=lr)

    def eval_step(self, images, labels, *, ema: bool = False) -> StepStats:
        """Loss and accuracy of a batch (up to `batch` images) without training."""
        return self._e.eval_step(images, labels, ema=ema)

    def state_dict(self, as_torch: bool = False, *, ema: bool = False) -> dict:
        """Parameters and BatchNorm buffers under torchvision's names and layouts (OIHW).

        ema=True gives the EMA model instead (an Engine built with ema=True): the EMA of the
        weights and of the BatchNorm running statistics, which evaluate together as timm's
        ModelEmaV3 module does; num_batches_tracked is the live count, as timm copies it. The
        dict loads into a torchvision model as it is.
        """
        sd = self._e.state_dict(ema=ema)
        return _as_torch(sd) if as_torch else sd

    def load_state_dict(self, state_dict, strict: bool = True, *, ema: bool = False) -> None:
        """Loads torchvision-named tensors (NumPy or torch), as a torchvision model's
        state_dict() gives them; every parameter and buffer must be there with its shape, and
        with strict, nothing else.

        Loading the model restarts the EMA at the loaded weights and statistics; ema=True
        then loads an EMA model (state_dict(ema=True)'s dict) into the EMA alone, so restore
        the model first and its EMA second.
        """
        import numpy as np  # here, not at import: the wheel's build imports kiln for its stub

        sd = {}
        for k, v in state_dict.items():
            if hasattr(v, "detach"):  # a torch tensor
                v = v.detach().cpu()
                v = v.numpy() if k.endswith("num_batches_tracked") else v.float().contiguous().numpy()
            if not k.endswith("num_batches_tracked"):
                v = np.ascontiguousarray(v, dtype=np.float32)
            sd[k] = v
        self._e.load_state_dict(sd, strict, ema=ema)

    def optimizer_state_dict(self, as_torch: bool = False) -> dict:
        """The optimizer's state, as torch.optim keeps it but keyed by torchvision parameter
        name (map names to torch's indices with enumerate(model.named_parameters())):

            {"optimizer": "sgd" | "adamw" | "lars",
             "step": steps taken (the engine's count),
             "state": {"conv1.weight": {"momentum_buffer": array}, ...}}      # sgd, lars
             "state": {"conv1.weight": {"exp_avg": array, "exp_avg_sq": array,
                                        "step": updates applied}, ...}          # adamw

        Arrays are float32 in torchvision's layouts. SGD without momentum keeps no state
        ("state" is empty). AdamW's "step" counts applied updates (AMP's skipped steps not
        counted), kiln's one count for every parameter. The loss scale is not part of it.
        """
        sd = self._e.optimizer_state_dict()
        if as_torch:
            sd["state"] = {k: _as_torch(v) for k, v in sd["state"].items()}
        return sd

    def load_optimizer_state_dict(self, state_dict, strict: bool = True) -> None:
        """Loads optimizer_state_dict()'s dict (NumPy or torch arrays) into an engine with the
        same optimizer: every parameter's state must be there with its shape and, with strict,
        nothing else; a refused dict changes nothing."""
        import numpy as np

        sd = dict(state_dict)
        if isinstance(sd.get("state"), dict):
            state = {}
            for name, slots in sd["state"].items():
                if not isinstance(slots, dict):
                    state[name] = slots
                    continue
                state[name] = {}
                for k, v in slots.items():
                    if k == "step":
                        v = int(v.item()) if hasattr(v, "item") else int(v)
                    else:
                        if hasattr(v, "detach"):
                            v = v.detach().cpu().float().contiguous().numpy()
                        v = np.ascontiguousarray(v, dtype=np.float32)
                    state[name][k] = v
            sd["state"] = state
        if "step" in sd and hasattr(sd["step"], "item"):
            sd["step"] = int(sd["step"].item())
        self._e.load_optimizer_state_dict(sd, strict)

    def save(self, path) -> None:
        """Writes the weights as safetensors under torchvision's names, as `kiln export` does
        (safetensors.torch.load_file gives a state_dict torchvision loads)."""
        self._e.save_weights(str(path))

    def load(self, path) -> None:
        """Loads torchvision-named safetensors weights: an export, a torchvision model's
        save_file, or a kiln checkpoint's weights."""
        self._e.load_weights(str(path))

    def __repr__(self):
        return f"Engine({self.model.name}, batch={self.batch}, state={self.state})"


class Plan:
    """What the planner made of a model (`kiln plan`): print it for the CLI's text.
    layers: the plan's nodes after fusion; notes: what each pass did."""

    def __init__(self, engine: Engine):
        self.model = engine.model.name
        self.text = engine._e.plan_text()
        self.layers = engine._e.plan_layers()
        self.notes = list(engine._e.plan_notes())

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"Plan({self.model}, {self.layers} layers)"


class Memory:
    """The step's memory (`kiln memory`): print it for the CLI's text. regions: bytes by
    region; total_bytes; features_without_reuse: the features region without liveness reuse."""

    def __init__(self, engine: Engine):
        self.model = engine.model.name
        self.batch = engine.batch
        self.text = engine._e.memory_text()
        self.regions, self.total_bytes, self.features_without_reuse = engine._e.memory_bytes()

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"Memory({self.model}, batch={self.batch}, total_bytes={self.total_bytes})"


def plan(model, amp: bool = False, device: str = "auto") -> Plan:
    """The plan of a model (a BluePrint or zoo name) as the Engine would build it on `device`."""
    return Plan(Engine(model, batch=1, amp=amp, device=device, compile=False))


def memory(model, batch: int = 256, amp: bool = False, device: str = "auto") -> Memory:
    """The memory of a model's compiled step at this batch (nothing is allocated)."""
    e = Engine(model, batch=batch, amp=amp, device=device, compile=False)
    e.lock_memory()
    return Memory(e)


def save(engine: Engine, path) -> None:
    """engine.save(path): the weights as torchvision-named safetensors."""
    engine.save(path)


def load(engine: Engine, path) -> None:
    """engine.load(path): torchvision-named safetensors weights into the engine."""
    engine.load(path)


_FLAGS = {name: is_switch for name, _, _, is_switch in train_flags()}


def train(callback=None, **kwargs) -> dict:
    """Runs kiln's trainer; each keyword is a `kiln train` flag with '_' for '-'
    (kiln.train_flags() lists them; config= reads a run file underneath). Returns the summary.
    callback(row), if given, gets each epoch's metrics row as a dict (epoch, step, lr,
    train_loss, ..., test_top1 when evaluated) once the epoch is saved; an exception it
    raises ends the run and comes out of kiln.train, the epochs before kept.

        kiln.train(model="cnn", data="fashion-mnist", epochs=1, max_steps=50, progress="none")
    """
    args = []
    for key, value in kwargs.items():
        flag = key.replace("_", "-")
        if flag != "config" and flag not in _FLAGS:
            close = sorted(f.replace("-", "_") for f in _FLAGS if flag.split("-")[0] in f)
            hint = f"; did you mean {', '.join(close)}" if close else ""
            raise TypeError(f"kiln.train() got an unexpected keyword '{key}'{hint} "
                            f"(kiln.train_flags() lists every flag)")
        if _FLAGS.get(flag):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, (list, tuple)):
            args.append(f"--{flag}={','.join(str(v) for v in value)}")
        else:
            args.append(f"--{flag}={value}")
    on_epoch = None
    if callback is not None:
        import json

        def on_epoch(row_json):
            callback(json.loads(row_json))
    return _kiln._train(args, on_epoch)
