"""MXNet's '2bit' gradient compression (``kv.set_gradient_compression``) of a worker's pushes.

A worker adds each value it pushes (the sum of its arrays for a key) to a residual kept for
that key, and sends a 2-bit code per element in place of the value: +threshold where the
residual reached threshold, -threshold where it reached -threshold, 0 elsewhere; what was
sent is taken off the residual, so nothing is lost, only delayed (MXNet's quantize_2bit,
element by element in float32). The codes travel packed four to a byte, 16 times fewer
bytes than float32; a server turns them back into float32 values (:func:`decompressed`) and
merges them as any push. The layout is TwoBitCodes in protos/tensorkv/v1/tensor.proto (and
docs/protocol.md).

Each function works on NumPy or CuPy arrays alike, in the namespace of its input. Host
arrays take one compiled pass instead (numba): a worker's values to quantize and a
server's codes to read (:class:`Compressor`, :func:`decompressed`); the tests hold these
passes to the functions, which CuPy arrays go through.

>>> import numpy as np
>>> residual = np.zeros(5, np.float32)
>>> codes = quantize(np.array([0.25, 0.75, -1.0, 0.5, 1.5], np.float32), residual, 0.5)
>>> print(dequantize(pack(codes), 5, 0.5), residual)
[ 0.   0.5 -0.5  0.5  0.5] [ 0.25  0.25 -0.5   0.    1.  ]
"""
import functools
import math

import numpy as np

from ..backend import array_module, to_namespace
from ..errors import InvalidArgumentError, key_repr
from ..wire.codec import Item

TYPE = "2bit"
DEFAULT_THRESHOLD = 0.5  # MXNet's, when compression_params gives only the type
# Multiplying a little-endian uint32 of four codes (one per byte, b0 first) by this puts
# b0 << 6 | b1 << 4 | b2 << 2 | b3 in its top byte: the other products land in bits the
# shift drops, without carries (each code is 2 bits wide).
_SPREAD = np.uint32((1 << 30) | (1 << 20) | (1 << 10) | 1)
_BLOCK = 1 << 17  # elements quantized at a time on the host


def parse(params):
    """The threshold (a float32 value) of MXNet's ``compression_params``; InvalidArgumentError
    for what MXNet refuses (no type, a type other than '2bit', a threshold <= 0) and for a
    parameter '2bit' does not take."""
    if not isinstance(params, dict):
        raise InvalidArgumentError(
            f"compression_params is a dict such as {{'type': '2bit', 'threshold': 0.5}}, not {type(params).__name__}")
    if "type" not in params:
        raise InvalidArgumentError("compression_params has no 'type': the one type is '2bit'")
    if params["type"] != TYPE:
        raise InvalidArgumentError(f"unknown type for gradient compression {params['type']!r}: the one type is '2bit'")
    others = sorted(map(repr, set(params) - {"type", "threshold"}))
    if others:
        raise InvalidArgumentError(f"'2bit' gradient compression takes 'threshold' only, not {', '.join(others)}")
    threshold = params.get("threshold", DEFAULT_THRESHOLD)
    try:
        value = np.float32(threshold)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"the threshold of '2bit' gradient compression is a number, not {threshold!r}") \
            from None
    if not (value > 0 and math.isfinite(value)):
        raise InvalidArgumentError(
            f"the threshold of '2bit' gradient compression must be greater than 0 (and finite), got {threshold!r}")
    return float(value)


def check_float32(key, dtype):
    """InvalidArgumentError unless a value of ``dtype`` may be compressed (float32 only, as in MXNet)."""
    if dtype != np.float32:
        raise InvalidArgumentError(
            f"key {key_repr(key)}: gradient compression is only for float32 values (as in MXNet); pushed dtype {dtype}")


def quantize(value, residual, threshold):
    """The 2-bit codes (uint8, one per element, ``value``'s shape) of float32 ``value`` with
    ``residual`` (float32, same shape, C-contiguous), which takes ``value`` in and gives the
    codes out, in place."""
    return _take_codes(residual, threshold, (residual, value))


def _take_codes(residual, threshold, addends):
    """The codes of ``residual`` once it holds the sum of ``addends`` (two arrays of its
    shape, which it may be one of), taken off it."""
    xp = array_module(residual)
    flat = residual.reshape(-1)
    first, second = (addend.reshape(-1) for addend in addends)
    codes = xp.empty(flat.size, xp.uint8)
    # On the host, block by block: the scratch arrays stay in the cache and are reused.
    block = min(_BLOCK if xp is np else flat.size, max(flat.size, 1))
    up, down = xp.empty(block, xp.bool_), xp.empty(block, xp.bool_)
    steps, sent = xp.empty(block, xp.int8), xp.empty(block, xp.float32)
    value = xp.float32(threshold)
    for start in range(0, flat.size, block):
        part = flat[start:start + block]
        size = part.size
        xp.add(first[start:start + size], second[start:start + size], out=part)  # while the block is in the cache
        xp.greater_equal(part, value, out=up[:size])
        xp.less_equal(part, -value, out=down[:size])
        # 0b11 up, 0b10 down, 0b00 elsewhere
        code = xp.multiply(up[:size].view(xp.uint8), xp.uint8(3), out=codes[start:start + size])
        code += down[:size].view(xp.uint8)
        code += down[:size].view(xp.uint8)
        # what is sent, +-threshold or 0 (exact: 1 or -1 times threshold), is taken off
        xp.subtract(up[:size].view(xp.int8), down[:size].view(xp.int8), out=steps[:size])
        sent[:size] = steps[:size]
        sent[:size] *= value
        part -= sent[:size]
    return codes.reshape(residual.shape)


def pack(codes):
    """The bytes of ``codes`` (uint8, one per element): element i in byte i // 4, at bits
    7-6, 5-4, 3-2 or 1-0 for i % 4 = 0, 1, 2, 3; unused bits of the last byte are 0."""
    xp = array_module(codes)
    flat = codes.reshape(-1)
    if flat.size % 4 or not flat.flags.c_contiguous:
        padded = xp.zeros(-(-flat.size // 4) * 4, xp.uint8)
        padded[:flat.size] = flat
        flat = padded
    words = flat.view("<u4")  # little-endian: element 4j in the low byte
    return ((words * _SPREAD) >> 24).astype(xp.uint8)


def dequantize(packed, count, threshold):
    """The float32 values of the first ``count`` codes in ``packed`` (see :func:`pack`)."""
    xp = array_module(packed)
    return xp.take(xp.asarray(_byte_values(threshold)), packed, axis=0).reshape(-1)[:count]


def _dequantized(packed, count, threshold):
    """What :func:`dequantize` gives, through one compiled pass for host codes."""
    if array_module(packed) is not np:
        return dequantize(packed, count, threshold)
    packed = np.ascontiguousarray(packed).reshape(-1)
    result = np.empty(4 * packed.size, np.float32)
    # 16 bytes per byte of codes, copied as two 8-byte words: the values' bits, whatever they are
    _host_dequantizer()(packed, _byte_values(threshold).view(np.uint64), result.view(np.uint64).reshape(-1, 2))
    return result[:count]


@functools.lru_cache(maxsize=8)
def _byte_values(threshold):
    """The float32 values (256 x 4, read-only) of each byte's four codes: 0b00 and 0b01 -> 0
    (as MXNet's dequantize_2bit reads them), 0b10 -> -threshold, 0b11 -> +threshold."""
    value = np.float32(threshold)
    table = np.array([0, 0, -value, value], np.float32)[_UNPACKED]
    table.flags.writeable = False
    return table


_UNPACKED = np.array([[(byte >> shift) & 0b11 for shift in (6, 4, 2, 0)] for byte in range(256)], np.uint8)


class Compressor:
    """A store's '2bit' compression: the threshold and the residuals (float32, each of its
    value's shape, in the namespace of the pushed values): one per key on a dist worker, one
    per key and device on a 'device' store. A push takes a residual and makes a new one
    (:meth:`codes`), which becomes the key's once the push is sent (:meth:`keep`); a push
    (or its part on one server) that then fails puts back what it took (:meth:`restore`)."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.residuals = {}
        _host_quantizer()  # compiled now, not in the first push

    def codes(self, key, value, ranges=(None,), slot=None):
        """([packed codes (see :func:`pack`) of each element range (start, stop), or None for
        all, of ``value`` pushed to ``key``], the residual after them), with the residual of
        ``slot`` (default: the key), which stays the slot's until :meth:`keep`."""
        check_float32(key, value.dtype)
        xp = array_module(value)
        before = self.residuals.get(key if slot is None else slot)
        if before is None or before.shape != value.shape or array_module(before) is not xp:
            before = xp.zeros(value.shape, xp.float32)  # the first push of the key: no residual yet
        residual = xp.empty(value.shape, xp.float32)
        if xp is not np:
            codes = _take_codes(residual, self.threshold, (before, value)).reshape(-1)
            return [pack(codes if where is None else codes[where[0]:where[1]]) for where in ranges], residual
        flat, old, new = np.ascontiguousarray(value).reshape(-1), before.reshape(-1), residual.reshape(-1)
        quantize_packed, threshold, parts = _host_quantizer(), np.float32(self.threshold), []
        for start, stop in ((0, flat.size) if where is None else where for where in ranges):
            packed = np.empty(-(-(stop - start) // 4), np.uint8)
            quantize_packed(new[start:stop], old[start:stop], flat[start:stop], threshold, packed)
            parts.append(packed)
        return parts, residual

    def keep(self, residuals):
        """Make {slot: residual} the residuals (their push was sent)."""
        self.residuals.update(residuals)

    def restore(self, befores):
        """Put back what a push that failed (and changed nothing) took of the residuals:
        {slot: (the residual before it, or None; the element range (start, stop) of the
        failed part, or None for all)}."""
        for slot, (before, where) in befores.items():
            if where is None:
                if before is None:
                    self.residuals.pop(slot, None)
                else:
                    self.residuals[slot] = before
                continue
            current = self.residuals.get(slot)
            if current is not None and current is not before:  # a slice: the other servers took theirs
                start, stop = where
                current.reshape(-1)[start:stop] = 0 if before is None else before.reshape(-1)[start:stop]

    def values(self, packed, shape):
        """The float32 values of ``shape`` that ``packed`` codes stand for (what a server reads)."""
        return _dequantized(packed, math.prod(shape), self.threshold).reshape(shape)


@functools.cache
def _host_quantizer():
    """What :func:`quantize` then :func:`pack` do, in one pass over float32 host arrays, compiled
    by numba (about 4x faster than NumPy's passes): ``quantize_packed(residual, before, value,
    threshold, packed)`` writes ``residual`` (before + value, less what is sent) and ``packed``,
    element by element with the same float32 arithmetic."""
    import numba  # here, not at the top: importing and compiling take ~0.5 s, paid only with compression

    @numba.njit(inline="always")
    def code(residual, before, value, i, threshold):
        total = before[i] + value[i]
        up, down = total >= threshold, total <= -threshold
        residual[i] = total - (threshold if up else (-threshold if down else np.float32(0)))
        return 3 * up + 2 * down  # 0b11 up, 0b10 down, 0b00 elsewhere

    @numba.njit("void(float32[::1], float32[::1], float32[::1], float32, uint8[::1])", nogil=True)
    def quantize_packed(residual, before, value, threshold, packed):
        whole = residual.size // 4
        for j in range(whole):  # unrolled: numba then keeps the four codes in registers
            i = 4 * j
            packed[j] = (code(residual, before, value, i, threshold) << 6
                         | code(residual, before, value, i + 1, threshold) << 4
                         | code(residual, before, value, i + 2, threshold) << 2
                         | code(residual, before, value, i + 3, threshold))
        if whole < packed.size:  # the last byte's unused bits stay 0
            bits = 0
            for i in range(4 * whole, 4 * whole + 4):
                bits <<= 2
                if i < residual.size:
                    bits |= code(residual, before, value, i, threshold)
            packed[whole] = bits

    return quantize_packed


def host_reader_ready():
    """Whether the compiled pass that reads host codes is there (:func:`load_host_reader`)."""
    return _host_dequantizer.cache_info().currsize > 0


def load_host_reader():
    """Import numba and compile the pass that reads host codes (about 0.5 s, once): a server
    does it in a thread, not on its event loop."""
    _host_dequantizer()


@functools.cache
def _host_dequantizer():
    """:func:`dequantize` of host codes in one compiled pass (numba; about 1.3x faster than
    NumPy's take, which first widens every byte to an index): ``dequantize_words(packed,
    table, words)`` writes row ``table[b]`` (two uint64 words: the four float32 values of
    byte b) to ``words[j]`` for each byte ``b = packed[j]``."""
    import numba

    readonly = functools.partial(numba.types.Array, layout="C", readonly=True)  # codes may be read-only bytes

    @numba.njit(numba.void(readonly(numba.uint8, 1), readonly(numba.uint64, 2), numba.uint64[:, ::1]), nogil=True)
    def dequantize_words(packed, table, words):
        for j in range(packed.size):
            byte = packed[j]
            words[j, 0] = table[byte, 0]
            words[j, 1] = table[byte, 1]

    return dequantize_words


def decompressed(item, xp=np):
    """``item`` with the float32 values its 2-bit codes stand for, in namespace ``xp``; an item
    without codes as it is."""
    if item.two_bit is None:
        return item
    count = math.prod(item.shape) if item.slice is None else item.slice[1] - item.slice[0]
    values = _dequantized(to_namespace(item.array, xp), count, item.two_bit)
    return Item(item.key, values.reshape(item.shape if item.slice is None else (count,)), item.shape, item.slice,
                owned=True)
