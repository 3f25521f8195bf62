"""The README's Python example is python/examples/fashion_mnist.py, and it runs."""
import os
import re
import subprocess
import sys

import kiln

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLE = os.path.join(ROOT, "python", "examples", "fashion_mnist.py")


def test_readme_shows_the_example():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    with open(EXAMPLE) as f:
        assert f.read() in blocks, "README.md's Python example differs from python/examples/fashion_mnist.py"


def test_example_trains_and_prints_its_accuracy(fashion, tmp_path):
    # The child imports this kiln, wherever it came from (a relative PYTHONPATH would not do).
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__))))
    out = subprocess.run([sys.executable, EXAMPLE], cwd=tmp_path, env=env, check=True, capture_output=True,
                         text=True).stdout
    top1 = float(re.search(r"test top-1 ([0-9.]+)%", out).group(1))
    assert top1 > 75, out  # 200 steps of a small CNN: ~84% on Fashion-MNIST's test set
    assert (tmp_path / "tiny.safetensors").exists()
