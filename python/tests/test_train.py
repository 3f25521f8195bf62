"""kiln.train: the CLI's flags as keywords, the summary as a dict, errors as exceptions."""
import json
import os

import pytest

import kiln


def test_train_returns_the_summary(fashion, tmp_path):
    s = kiln.train(model="cnn", epochs=1, max_steps=20, batch_size=64, lr=0.05, output=str(tmp_path),
                   progress="none", workers=1, save_every_minutes=0, hflip=False)
    assert s["steps"] == 20 and s["epochs_run"] == 1
    assert 0 < s["final_top1"] <= 100
    assert os.path.exists(s["checkpoint"])
    with open(tmp_path / "summary.json") as f:
        on_disk = json.load(f)
    assert on_disk  # the CLI's summary file is written as well


def test_train_keywords_come_from_the_flag_table():
    names = {n for n, _, _, _ in kiln.train_flags()}
    assert {"model", "batch-size", "lr", "epochs", "amp"} <= names
    with pytest.raises(TypeError, match="unexpected keyword 'batchsize'"):
        kiln.train(batchsize=3)


def test_train_errors_are_typed(tmp_path):
    with pytest.raises(kiln.InvalidArgumentError, match="sched"):
        kiln.train(sched="nope", output=str(tmp_path), progress="none")
    with pytest.raises(FileNotFoundError) as e:
        kiln.train(resume=str(tmp_path / "missing.safetensors"), output=str(tmp_path), progress="none")
    assert isinstance(e.value, kiln.Error)


def test_ctrl_c_stops_at_a_step_and_leaves_a_checkpoint(fashion, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    code = ("import json, kiln\n"
            f"s = kiln.train(model='cnn', epochs=1, batch_size=64, output={str(tmp_path)!r}, progress='none',\n"
            "               workers=1, save_every_steps=3, save_every_minutes=0)\n"
            "print(json.dumps(s))\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__))))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    ckpt = tmp_path / "last.safetensors"
    deadline = time.time() + 120
    while not ckpt.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.1)  # the first mid-epoch checkpoint: training has begun, the handler is kiln's
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    s = json.loads(out.strip().splitlines()[-1])
    assert s["stop_signal"] == signal.SIGINT and s["saved_at"] and s["steps"] < 938
    e = kiln.Engine(kiln.zoo("cnn"), batch=4, device="cpu")
    kiln.load(e, s["checkpoint"])  # the weights of the stopped run load


def test_the_callback_gets_each_epochs_row(fashion, tmp_path):
    import math

    rows = []
    s = kiln.train(model="cnn", epochs=2, max_steps=5, batch_size=64, lr=0.05, output=str(tmp_path),
                   progress="none", workers=1, save_every_minutes=0, callback=rows.append)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["step"] == s["steps"]
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    assert rows[-1]["test_top1"] == pytest.approx(s["final_top1"], abs=1e-6)


def test_an_exception_from_the_callback_ends_the_run_as_it_was_raised(fashion, tmp_path):
    def stop(row):
        raise KeyError(f"enough after epoch {row['epoch']}")

    with pytest.raises(KeyError, match="enough after epoch 1"):
        kiln.train(model="cnn", epochs=3, max_steps=3, batch_size=64, output=str(tmp_path), progress="none",
                   workers=1, save_every_minutes=0, callback=stop)
    assert (tmp_path / "last.safetensors").exists()  # epoch 1 was saved before the callback ran
