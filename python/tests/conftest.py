"""Shared pieces of kiln's Python tests: Fashion-MNIST from Debian's dataset-fashion-mnist."""
import gzip
import os

import numpy as np
import pytest

FASHION = "/usr/share/datasets/fashion-mnist"
# Fashion-MNIST's mean and std, as kiln's trainer normalises it.
MEAN, STD = 0.2860, 0.3530


def _idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


@pytest.fixture(scope="session")
def fashion():
    """The first 6,400 training images as uint8 [N, 28, 28, 1] and int64 labels."""
    images = os.path.join(FASHION, "train-images-idx3-ubyte.gz")
    if not os.path.exists(images):
        pytest.skip("Fashion-MNIST is not installed (scripts/setup.sh installs dataset-fashion-mnist)")
    x = _idx(images)[:6400, :, :, None].copy()
    y = _idx(os.path.join(FASHION, "train-labels-idx1-ubyte.gz"))[:6400].astype(np.int64)
    return x, y


def normalised(x_u8):
    """uint8 pixels to float32 NHWC, normalised as the trainer does."""
    return ((x_u8.astype(np.float32) / 255.0 - MEAN) / STD).astype(np.float32)


@pytest.fixture(scope="session")
def synthetic_images():
    """256 Fashion-MNIST-shaped uint8 images [N, 28, 28, 1] with int64 labels, from a fixed
    seed: each class a pattern of its own plus noise. For tests that compare two input paths
    bit for bit and need no real data (the GPU machine has no Fashion-MNIST)."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 256, size=(10, 28, 28, 1))
    y = rng.integers(0, 10, size=256).astype(np.int64)
    noise = rng.integers(-40, 41, size=(256, 28, 28, 1))
    x = np.clip(patterns[y] + noise, 0, 255).astype(np.uint8)
    return x, y
