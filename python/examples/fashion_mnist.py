import gzip

import numpy as np

import kiln


def idx(path):  # an IDX file of Debian's dataset-fashion-mnist, as a uint8 array
    data = gzip.open(path).read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


root = "/usr/share/datasets/fashion-mnist/"
x_train = idx(root + "train-images-idx3-ubyte.gz")[..., None]  # [60000, 28, 28, 1] uint8, NHWC
y_train = idx(root + "train-labels-idx1-ubyte.gz").astype(np.int64)
x_test = idx(root + "t10k-images-idx3-ubyte.gz")[..., None]
y_test = idx(root + "t10k-labels-idx1-ubyte.gz").astype(np.int64)

net = kiln.BluePrint("tiny", (28, 28, 1), 10,
                     kiln.seq(kiln.cbr(32, 3, 1, 1), kiln.maxpool(2, 2),
                              kiln.cbr(64, 3, 1, 1), kiln.maxpool(2, 2),
                              kiln.flatten(), kiln.fc(10)))
print(net)
# uint8 batches are normalised by kiln with this mean/std (0..1 units, per channel).
engine = kiln.Engine(net, batch=128, device="auto", seed=0, mean=[0.286], std=[0.353])
order = np.random.default_rng(0).permutation(len(x_train))
for step in range(200):
    i = order[step * 128:(step + 1) * 128]
    stats = engine.train_step(x_train[i], y_train[i], lr=0.05)
    if step % 50 == 0:
        print(f"step {step}: loss {stats.loss:.3f}, top-1 {stats.top1:.2f}")
hits = sum(engine.eval_step(x_test[i:i + 128], y_test[i:i + 128]).correct1
           for i in range(0, len(x_test), 128))
print(f"test top-1 {100 * hits / len(x_test):.2f}%")
kiln.save(engine, "tiny.safetensors")  # torchvision names; engine.state_dict() gives them as arrays
