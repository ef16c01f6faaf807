"""The optimizer-states file written by ``save_optimizer_states``: no pickle, ever.

The file is a NumPy ``.npz`` archive (read with ``allow_pickle=False``) holding a JSON
header and one array per state tensor::

    header    uint8 array: UTF-8 JSON {"format": "tensorkv-optimizer-states", "version": 2,
              "optimizer": {"name": ..., "params": {...}, "lr_scheduler": null or {"name": ..., "params": {...}}},
              "keys": [{"key": 3 or "w", "num_update": n, "num_states": m}, ...]}
    state_i   the i-th state tensor, key after key in the header's order

Version 1 files, written before schedules existed, have no "lr_scheduler" and are read too.

>>> import os, tempfile
>>> import numpy as np
>>> from tensorkv.optimizer import SGD
>>> fname = os.path.join(tempfile.mkdtemp(), 'states')
>>> save(fname, SGD(momentum=0.9), {3: (2, [np.ones(2, np.float32)])})
>>> optimizer, states = load(fname)
>>> optimizer.name, states[3][0], states[3][1][0]
('sgd', 2, array([1., 1.], dtype=float32))
"""
import json

import numpy as np

from .. import lr_scheduler
from ..backend import to_host
from ..errors import InvalidArgumentError
from ..optimizer import create
from ..words import plural
from .codec import check_key

FORMAT = "tensorkv-optimizer-states"
VERSION = 2
READABLE = (1, 2)


def save(fname, optimizer, states):
    """Write ``optimizer`` and ``states`` (``{key: (num_update, [arrays])}``) to the file ``fname``."""
    keys, arrays = [], {}
    for key, (num_update, tensors) in states.items():
        keys.append({"key": key, "num_update": int(num_update), "num_states": len(tensors)})
        for tensor in tensors:
            arrays[f"state_{len(arrays)}"] = to_host(tensor)
    header = {"format": FORMAT, "version": VERSION, "keys": keys, "optimizer": optimizer_header(optimizer)}
    with open(fname, "wb") as file:
        np.savez(file, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)


def optimizer_header(optimizer):
    """The JSON-ready description of ``optimizer``: name, params, lr_scheduler and the keys'
    multipliers (as [key, multiplier] pairs: a JSON object's names would turn int keys into str)."""
    schedule = optimizer.lr_scheduler
    return {"name": optimizer.name, "params": optimizer.params,
            "lr_scheduler": schedule and {"name": schedule.name, "params": schedule.params},
            "lr_mult": list(optimizer.lr_mult.items()), "wd_mult": list(optimizer.wd_mult.items())}


def optimizer_from_header(description):
    """The optimizer that :func:`optimizer_header` described."""
    schedule = description.get("lr_scheduler")
    if schedule is not None:
        schedule = lr_scheduler.create(schedule["name"], **schedule["params"])
    return create(description["name"], lr_scheduler=schedule, lr_mult=dict(description.get("lr_mult", ())),
                  wd_mult=dict(description.get("wd_mult", ())), **description["params"])


def load(fname):
    """(optimizer, ``{key: (num_update, [NumPy arrays])}``) read from ``fname``.

    Raises InvalidArgumentError for a file that is not a well-formed states file.
    """
    try:
        with np.load(fname, allow_pickle=False) as archive:
            header = json.loads(bytes(archive["header"]).decode())
            arrays = {name: archive[name] for name in archive.files if name != "header"}
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise InvalidArgumentError(f"{fname}: cannot read it: {error.strerror}") from None
    except (OSError, ValueError, KeyError) as error:
        raise InvalidArgumentError(f"{fname}: not a tensorkv optimizer-states file ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") not in READABLE:
        raise InvalidArgumentError(f"{fname}: not a {FORMAT} file of version {' or '.join(map(str, READABLE))}")
    try:
        optimizer = optimizer_from_header(header["optimizer"])
        states, index = {}, 0
        for entry in header["keys"]:
            num_update, count = entry["num_update"], entry["num_states"]
            if not isinstance(num_update, int) or not isinstance(count, int) or num_update < 0 or count < 0:
                raise InvalidArgumentError(f"bad entry {entry}")
            states[check_key(entry["key"])] = (num_update, [arrays.pop(f"state_{index + i}") for i in range(count)])
            index += count
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise InvalidArgumentError(f"{fname}: malformed optimizer-states header ({error!r})") from None
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{fname}: {error}") from None
    if arrays:
        raise InvalidArgumentError(f"{fname}: {plural(len(arrays), 'state array')} of no key")
    return optimizer, states
