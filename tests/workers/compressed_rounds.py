"""A worker that pushes 2-bit compressed gradients (kv.set_gradient_compression): ROUNDS
rounds on two keys, 'w' (3 x 5) and 'big' (BIG elements: sliced over every server when
TENSORKV_BIGARRAY_BOUND is below it), each push a list of two arrays (two devices): push
then pull, pushpull, or one list push of both keys, in turn. Prints the values pulled after
each round as JSON: [[w, big] flattened, ...].

    python compressed_rounds.py ROUNDS THRESHOLD BIG
"""
import json
import sys

import numpy as np


def gradients(rank, key, size, t):
    """The two arrays worker ``rank`` pushes to ``key`` in round ``t``: multiples of 0.25 in
    [-2, 2], so that every sum and residual is exact in float32."""
    index = np.arange(size)
    offset = 1 if key == "w" else 2
    first = ((index * (rank + 3) + t * 5 + offset) % 17 - 8) * 0.25
    second = ((index * 7 + t * (rank + 2)) % 9 - 4) * 0.25
    return [first.astype(np.float32), second.astype(np.float32)]


def main(rounds, threshold, big):
    import tensorkv

    kv = tensorkv.create("dist_sync")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(["w", "big"], [np.zeros((3, 5), np.float32), np.zeros(big, np.float32)])
    pulled = []
    for t in range(1, rounds + 1):
        w = [g.reshape(3, 5) for g in gradients(kv.rank, "w", 15, t)]
        b = gradients(kv.rank, "big", big, t)
        values = [np.zeros((3, 5), np.float32), np.zeros(big, np.float32)]
        if t % 3 == 1:
            kv.push("w", w)
            kv.push("big", b)
            values = kv.pull(["w", "big"])
        elif t % 3 == 2:
            kv.pushpull(["w", "big"], [w, b], out=values)
        else:
            kv.push(["w", "big"], [w, b])
            kv.pull(["w", "big"], out=values)
        pulled.append([v.reshape(-1).tolist() for v in values])
    kv.close()
    print(json.dumps({"rank": kv.rank, "pulled": pulled}))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
