"""Philox-4x32-10 and carve's dropout masks in NumPy (runtime/include/carve/rt/philox.h).

An independent reimplementation for the tests: the mask element of dropout
node `node` at optimizer step `step` under `seed`, at row-major index `i` of the
full tensor, is kept when word `i % 4` of Philox(counter = (i // 4 low 32 bits,
high 32 bits, node, step), key = (seed low, seed high)), as its top 24 bits
times 2^-24, is >= p. Kept elements are scaled by float32(1 / float32(1 - p)).
"""

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
LO = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Arrays of uint32 counters and scalar keys; returns the four output words."""
    c = [np.asarray(x, dtype=np.uint32) for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint32(k0), np.uint32(k1)
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0 = np.uint32(k0 + W0)
                k1 = np.uint32(k1 + W1)
            p0 = M0 * c[0].astype(np.uint64)
            p1 = M1 * c[2].astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & LO).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & LO).astype(np.uint32)
            c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def keep_mask(seed, step, node, index, p):
    """Boolean keep decisions for an array of full-tensor indices."""
    index = np.asarray(index, dtype=np.uint64)
    block = index >> np.uint64(2)
    n = block.size
    words = philox4x32_10((block & LO).astype(np.uint32), (block >> np.uint64(32)).astype(np.uint32),
                          np.full(n, node, np.uint32), np.full(n, step, np.uint32),
                          seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    w = np.stack(words)[(index & np.uint64(3)).astype(np.int64), np.arange(n)]
    u = (w >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return (u >= np.float32(p)).reshape(index.shape)


def dropout_mask(shape, seed, step, node, p):
    """The float32 multiplier (0 or the scale) of a full tensor of `shape`."""
    n = int(np.prod(shape))
    keep = keep_mask(seed, step, node, np.arange(n, dtype=np.uint64), p).reshape(shape)
    scale = np.float32(1.0) / np.float32(1.0 - p)
    return np.where(keep, scale, np.float32(0)).astype(np.float32)


if __name__ == "__main__":
    # Random123's known answers (runtime/tests/PhiloxTest.cpp has the same).
    w = philox4x32_10([0], [0], [0], [0], 0, 0)
    assert ["%08x" % int(x[0]) for x in w] == ["6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8"], w
    w = philox4x32_10([0x243f6a88], [0x85a308d3], [0x13198a2e], [0x03707344], 0xa4093822,
                      0x299f31d0)
    assert ["%08x" % int(x[0]) for x in w] == ["d16cfe09", "94fdcceb", "5001e420", "24126ea1"], w
    print("philox known answers: ok")
    print("node 3, p 0.5, 12 elements: kept", int(keep_mask(0, 0, 3, np.arange(12), 0.5).sum()))
    print("node 7, p 0.25, 32 elements: kept", int(keep_mask(0, 0, 7, np.arange(32), 0.25).sum()))
