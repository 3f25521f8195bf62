#!/usr/bin/env python3
"""Writes the seed corpora of fuzz_idx and fuzz_cifar (tests/fuzz/corpus/{idx,cifar}): a few
small valid files and a few broken ones, so libFuzzer starts next to the interesting edges.
Standard library only. Run: python3 tests/fuzz/make_data_corpus.py"""
import gzip
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(sub, name, data):
    d = os.path.join(HERE, "corpus", sub)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def idx(dims, data, type_byte=0x08):
    return bytes([0, 0, type_byte, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + bytes(data)


images = idx([2, 3, 3], range(18))
labels = idx([4], [9, 0, 3, 1])
write("idx", "images_2x3x3", images)
write("idx", "labels_4", labels)
write("idx", "images_hwc_1x2x2x3", idx([1, 2, 2, 3], range(12)))
write("idx", "images_2x3x3.gz", gzip.compress(images, mtime=0))
write("idx", "truncated", images[:-5])
write("idx", "truncated.gz", gzip.compress(images, mtime=0)[:-6])
write("idx", "bad_magic", b"\x01\x00" + images[2:])
write("idx", "int32_type", idx([1], [0, 0, 0, 7], type_byte=0x0C))
write("idx", "trailing", labels + b"\x00")
write("idx", "huge_dims", idx([0xFFFFFFFF, 0xFFFFFFFF, 2], []))

def record(labels, seed):
    return bytes(labels) + bytes((seed + i * 7) % 256 for i in range(3072))


write("cifar", "cifar10_one", record([3], 1))
write("cifar", "cifar10_two", record([9], 2) + record([0], 3))
write("cifar", "cifar100_one", record([4, 77], 4))
write("cifar", "short", record([1], 5)[:-1])
write("cifar", "bad_label", record([200], 6))
