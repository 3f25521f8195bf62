"""Writes tests/data/python_numpy.safetensors with huggingface's safetensors library, the
reference kiln's reader and writer are tested against (tests/unit/io_safetensors_test.cpp).

    pip install safetensors numpy && python3 tests/data/make_safetensors_fixture.py

Made with safetensors 0.8.0 and numpy 2.4.6. The values are chosen to catch byte-order and
conversion mistakes (negative zero, a denormal, the largest half, int64 past 2^32); one metadata
key only, because the library writes several in hash order and the bytes would differ per run.
"""
import os

import numpy as np
from safetensors.numpy import save_file

here = os.path.dirname(os.path.abspath(__file__))
tensors = {
    "conv1.weight": np.array([[0.0, 1.5, -2.25], [1e-8, 3.4e38, -0.0]], dtype=np.float32),
    "bn1.running_var": np.array([1.0, 0.5, 65504.0, 6e-8], dtype=np.float16),
    "step": np.array(123456789012, dtype=np.int64),
    "labels": np.array([-1, 7], dtype=np.int32),
    "mask": np.array([0, 1, 255], dtype=np.uint8),
    "empty": np.zeros((0, 4), dtype=np.float32),
}
save_file(tensors, os.path.join(here, "python_numpy.safetensors"), metadata={"epoch": "7"})
