#!/usr/bin/env python3
"""Writes the PNG fixtures of tests/unit/data_image_folder_test.cpp with nothing but the Python
standard library (zlib, struct), so that kiln's libpng-based decoder is checked against files
it did not write. Run from anywhere: python3 tests/data/make_png_fixtures.py"""
import os
import struct
import zlib

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "png")


def chunk(kind, data):
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def png(width, height, depth, color, rows, extra=b""):
    # rows: bytes per row without the filter byte; filter type 0 (None) for every row
    raw = b"".join(b"\x00" + r for r in rows)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + extra +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


os.makedirs(OUT, exist_ok=True)
# 3x2 RGB, 8-bit: pixel (y, x) = (10 + 40x + 100y, 20 * x, 255 - 50y)
rgb_rows = [bytes(v for x in range(3) for v in (10 + 40 * x + 100 * y, 20 * x, 255 - 50 * y))
            for y in range(2)]
write("rgb_3x2.png", png(3, 2, 8, 2, rgb_rows))
# 2x2 palette (colour type 3) with 4 entries; a tRNS chunk that kiln must ignore (alpha dropped)
palette = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 7, 8, 9])
write("palette_2x2.png", png(2, 2, 8, 3, [bytes([0, 1]), bytes([2, 3])],
                             chunk(b"PLTE", palette) + chunk(b"tRNS", bytes([0, 128, 255, 255]))))
# 2x1 grey + alpha, 8-bit: grey 60 and 200
write("gray_alpha_2x1.png", png(2, 1, 8, 4, [bytes([60, 0, 200, 255])]))
# 2x1 RGB, 16-bit big-endian, scaled to 8 bits as round(v * 255 / 65535): 0x12FF -> 19 (not 18)
write("rgb16_2x1.png", png(2, 1, 16, 2,
                           [struct.pack(">6H", 0x1234, 0xFFFF, 0x0000, 0x8080, 0x7F7F, 0x12FF)]))
