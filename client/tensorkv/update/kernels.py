"""Fused element-wise kernels: each update written once, as a few statements, and run as
one CUDA kernel through CuPy on a GPU or as NumPy ufuncs on the host.

A :class:`Kernel` is statements in a small Python-syntax language (``name = expression``
with ``+ - * /``, unary ``-``, numbers, and the functions ``sqrt``, ``sign``, ``abs``,
``clip(x, bound)``, ``maximum(x, y)``, ``above(x, y)`` (1 where x > y, else 0) and ``wide(x)``
(x computed in float64, then rounded to the compute dtype: what C++ does where a float
expression meets a double, as in MXNet's LAMB)) over named arrays and scalars. On CuPy it
becomes one ``cupy.ElementwiseKernel``: every element is loaded once, computed in registers in the
compute dtype and stored once, so an optimizer step is one pass over its arrays with no
temporaries. float16 and bfloat16 reach the kernel as their uint16 bits and are converted
there (CuPy has no bfloat16), so low-precision values are computed in float32. On NumPy
the same statements run as ufunc calls. ``tests/test_kernels.py`` compiles the generated
C++ for the host and checks it against the NumPy evaluation, so the text a GPU compiles is
tested where there is no GPU.

>>> import numpy as np
>>> axpy = Kernel('axpy', inputs='x', outputs='y', scalars='a', body='y = a * x + y')
>>> y = np.ones(3, np.float32)
>>> axpy({'x': np.arange(3, dtype=np.float32), 'y': y}, {'a': 2.0}, np.float32)
>>> print(y)
[1. 3. 5.]
"""
import ast
import math
import threading

import numpy as np

from ..backend import BFLOAT16

# NumPy dtype -> (C type of the element the kernel sees, CuPy's name for it, kind).
# float16 and bfloat16 travel as uint16 bits; the kind says how to convert them.
_STORAGE = {
    np.dtype(np.float16): ("unsigned short", "uint16", "f16"),
    BFLOAT16: ("unsigned short", "uint16", "bf16"),
    np.dtype(np.float32): ("float", "float32", "plain"),
    np.dtype(np.float64): ("double", "float64", "plain"),
    np.dtype(np.int8): ("signed char", "int8", "plain"),
    np.dtype(np.int16): ("short", "int16", "plain"),
    np.dtype(np.int32): ("int", "int32", "plain"),
    np.dtype(np.int64): ("long long", "int64", "plain"),
    np.dtype(np.uint8): ("unsigned char", "uint8", "plain"),
}

# Helpers every kernel may call. Plain C++ over the bits, no CUDA header: the same text
# compiles for the host in the tests (which define __device__, __forceinline__ and the two
# bit casts). Conversions round to nearest even, as NumPy and ml_dtypes do.
PREAMBLE = r"""
__device__ __forceinline__ float tk_f16_load(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16, exp = ((unsigned int)h >> 10) & 0x1fu,
                 man = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0u) {
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}
__device__ __forceinline__ unsigned short tk_f16_store(float f) {
    unsigned int x = __float_as_uint(f), sign = x & 0x80000000u, o;
    x ^= sign;
    if (x >= 0x47800000u) {
        o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < 0x38800000u) {
        o = __float_as_uint(__uint_as_float(x) + 0.5f) - 0x3f000000u;
    } else {
        o = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
    }
    return (unsigned short)(o | (sign >> 16));
}
__device__ __forceinline__ float tk_bf16_load(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}
__device__ __forceinline__ unsigned short tk_bf16_store(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float tk_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }
__device__ __forceinline__ double tk_sign(double x) { return x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : x); }
__device__ __forceinline__ float tk_clip(float x, float c) { return x < -c ? -c : (x > c ? c : x); }
__device__ __forceinline__ double tk_clip(double x, double c) { return x < -c ? -c : (x > c ? c : x); }
__device__ __forceinline__ float tk_abs(float x) { return x < 0.0f ? -x : (x == 0.0f ? 0.0f : x); }
__device__ __forceinline__ double tk_abs(double x) { return x < 0.0 ? -x : (x == 0.0 ? 0.0 : x); }
__device__ __forceinline__ float tk_maximum(float x, float y) { return x != x ? x : (x > y ? x : y); }
__device__ __forceinline__ double tk_maximum(double x, double y) { return x != x ? x : (x > y ? x : y); }
__device__ __forceinline__ float tk_above(float x, float y) { return x > y ? 1.0f : 0.0f; }
__device__ __forceinline__ double tk_above(double x, double y) { return x > y ? 1.0 : 0.0; }
"""

_C_COMPUTE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_BINARY = {ast.Add: ("+", np.add), ast.Sub: ("-", np.subtract), ast.Mult: ("*", np.multiply),
           ast.Div: ("/", np.divide)}
_FUNCTIONS = {"sqrt": 1, "sign": 1, "abs": 1, "clip": 2, "maximum": 2, "above": 2, "wide": 1}
_WIDE = np.dtype(np.float64)


def _names(text):
    return tuple(name.strip() for name in text.split(",") if name.strip()) if isinstance(text, str) else tuple(text)


def _check_expression(node, known, kernel):
    """Raise ValueError unless ``node`` uses only the kernel language and ``known`` names."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check_expression(node.left, known, kernel)
        _check_expression(node.right, known, kernel)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check_expression(node.operand, known, kernel)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if len(node.args) != _FUNCTIONS[node.func.id] or node.keywords:
            raise ValueError(f"kernel {kernel}: {node.func.id} takes {_FUNCTIONS[node.func.id]} arguments")
        for arg in node.args:
            _check_expression(arg, known, kernel)
    elif isinstance(node, ast.Name):
        if node.id not in known:
            raise ValueError(f"kernel {kernel}: {node.id!r} is read before it is assigned")
    elif not (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
        raise ValueError(f"kernel {kernel}: {ast.unparse(node)!r} is not in the kernel language")


def _reads(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - set(_FUNCTIONS)


class Kernel:
    """An element-wise computation over same-sized arrays, written once as statements.

    ``inputs`` are arrays the kernel reads, ``outputs`` arrays it writes (and reads, when a
    statement uses one before assigning it), ``scalars`` numbers passed per call. Names
    not among them are temporaries. Call it with ``{name: array}``, ``{name: number}`` and
    the compute dtype; it runs on CuPy when the arrays are CuPy arrays (or
    :class:`tensorkv.backend.DeviceBFloat16`), else on NumPy.
    """

    def __init__(self, name, inputs, outputs, scalars, body):
        self.name = name
        self.inputs, self.outputs, self.scalars = _names(inputs), _names(outputs), _names(scalars)
        self.statements = []
        known, assigned = set(self.inputs) | set(self.scalars), set()
        self.loaded = []  # outputs read before they are assigned, then inputs
        for line in body.strip().splitlines():
            tree = ast.parse(line.strip(), mode="exec").body
            if len(tree) != 1 or not isinstance(tree[0], ast.Assign) or len(tree[0].targets) != 1 \
                    or not isinstance(tree[0].targets[0], ast.Name):
                raise ValueError(f"kernel {name}: {line.strip()!r} is not 'name = expression'")
            target, expression = tree[0].targets[0].id, tree[0].value
            for read in _reads(expression):
                if read in self.outputs and read not in assigned and read not in self.loaded:
                    self.loaded.append(read)
                    known.add(read)
            _check_expression(expression, known, name)
            if target in self.inputs or target in self.scalars:
                raise ValueError(f"kernel {name}: {target!r} is an input; it cannot be assigned")
            self.statements.append((target, expression))
            known.add(target)
            assigned.add(target)
        missing = [output for output in self.outputs if output not in assigned]
        if missing:
            raise ValueError(f"kernel {name}: outputs {missing} are never assigned")
        self.loaded += list(self.inputs)
        self._compiled = {}

    def __repr__(self):
        return f"Kernel({self.name!r})"

    def __call__(self, arrays, scalars, compute):
        """Run over ``arrays`` {name: array} (one per input and output, all of one size) with
        ``scalars`` {name: number}, computing in ``compute`` (float32 or float64; an integer
        dtype for integer sums). Outputs are written in place."""
        compute = np.dtype(compute)
        physical, kinds, size = {}, {}, None
        for name in self.inputs + self.outputs:
            array = arrays[name]
            dtype = np.dtype(array.dtype)
            bits = getattr(array, "bits", None)  # a DeviceBFloat16
            physical[name] = array if bits is None else bits
            kinds[name] = dtype
            if size is None:
                size = array.size
            elif array.size != size:
                raise ValueError(f"kernel {self.name}: array {name!r} has {array.size} elements, "
                                 f"the others {size}")
        on_gpu = type(physical[self.outputs[0]]).__module__.startswith("cupy")
        if on_gpu:
            self._run_cupy(physical, kinds, scalars, compute)
        else:
            self._run_numpy(physical, scalars, compute)

    # ---- NumPy ------------------------------------------------------------------------

    def _run_numpy(self, arrays, scalars, compute):
        scalar = compute.type
        env = {name: scalar(scalars[name]) for name in self.scalars}
        flat = {}
        for name, array in arrays.items():
            flat[name] = array.reshape(-1)
            if name in self.outputs and not (array.flags.c_contiguous and array.flags.writeable):
                raise ValueError(f"kernel {self.name}: output {name!r} must be a writable C-contiguous array")
        size = flat[self.outputs[0]].size
        taken = []  # scratch arrays of this call

        def scratch(dtype=compute):
            taken.append(_SCRATCH.take(size * dtype.itemsize))
            return taken[-1][:size * dtype.itemsize].view(dtype)

        try:
            # Arrays are read as they are: each ufunc converts its operands to the compute
            # dtype as it goes (dtype=), so a load costs no pass of its own.
            for name in self.loaded:
                env[name] = flat[name]
            for target, expression in self.statements:
                direct = flat[target] if target in self.outputs and flat[target].dtype == compute else None
                env[target] = self._evaluate(expression, env, scalar, scratch, direct)[0]
            for name in self.outputs:
                if env[name] is not flat[name]:
                    np.copyto(flat[name], env[name], casting="unsafe")
        finally:
            _SCRATCH.give_back(taken)

    def _evaluate(self, node, env, scalar, scratch, out=None):
        """(value, whether it is a temporary this evaluation may overwrite). New temporaries
        come from ``scratch()``; ``out`` receives the value when given."""
        if isinstance(node, (ast.Name, ast.Constant)):
            value = env[node.id] if isinstance(node, ast.Name) else scalar(node.value)
            if out is None:
                return value, False
            out[...] = value
            return out, False
        if isinstance(node, ast.Call) and node.func.id == "wide":
            return self._evaluate_wide(node.args[0], env, scalar, scratch, out)
        if isinstance(node, ast.Call):
            args = [self._evaluate(arg, env, scalar, scratch) for arg in node.args]
            target = _target(out, args if _FUNCTIONS[node.func.id] == 2 and node.func.id != "clip" else args[:1],
                             scratch)
            if node.func.id == "clip":
                bound = args[1][0]
                value = np.clip(args[0][0], -bound, bound, out=target, dtype=scalar)
            elif node.func.id == "maximum":
                value = np.maximum(args[0][0], args[1][0], out=target, dtype=scalar)
            elif node.func.id == "above":  # a comparison's result is bool: cast into the compute dtype
                value = np.greater(args[0][0], args[1][0], out=target)
            else:
                value = getattr(np, node.func.id)(args[0][0], out=target, dtype=scalar)
        elif isinstance(node, ast.UnaryOp):
            operand = self._evaluate(node.operand, env, scalar, scratch)
            value = np.negative(operand[0], out=_target(out, [operand], scratch), dtype=scalar)
        else:
            left = self._evaluate(node.left, env, scalar, scratch)
            right = self._evaluate(node.right, env, scalar, scratch)
            same = _identity(type(node.op), left[0], right[0])
            if same is not None:  # x * 1, x + 0, 0 * x...: no pass over the arrays
                if out is None:
                    return same
                out[...] = same[0]
                return out, False
            value = _BINARY[type(node.op)][1](left[0], right[0], out=_target(out, [left, right], scratch),
                                              dtype=scalar)
        return value, out is None and isinstance(value, np.ndarray)

    def _evaluate_wide(self, node, env, scalar, scratch, out):
        """:meth:`_evaluate` of ``wide(node)``: ``node`` in float64, rounded to the compute dtype."""
        value, _ = self._evaluate(node, env, _WIDE.type, lambda: scratch(_WIDE))
        if not isinstance(value, np.ndarray):
            return scalar(value), False
        target = out if out is not None else scratch()
        np.copyto(target, value, casting="unsafe")
        return target, out is None

    # ---- CuPy -------------------------------------------------------------------------

    def cuda_source(self, kinds, compute):
        """(in_params, out_params, operation) of the ``cupy.ElementwiseKernel`` for arrays of
        dtypes ``kinds`` {name: NumPy dtype} computing in ``compute``. Parameters are named
        ``p_<array>`` and ``s_<scalar>``; locals ``v_<name>``."""
        compute = np.dtype(compute)
        c_compute = _C_COMPUTE.get(compute) or _STORAGE[compute][0]
        params = {name: f"{_STORAGE[np.dtype(kinds[name])][1]} p_{name}" for name in self.inputs + self.outputs}
        scalar_type = _STORAGE[compute][1]
        in_params = ", ".join([params[name] for name in self.inputs] + [f"{scalar_type} s_{s}" for s in self.scalars])
        out_params = ", ".join(params[name] for name in self.outputs)
        lines, declared = [], set()
        for name in self.loaded:
            lines.append(f"{c_compute} v_{name} = {_load(kinds[name], f'p_{name}', c_compute)};")
            declared.add(name)
        for target, expression in self.statements:
            text = self._c(expression, compute)
            lines.append(f"v_{target} = {text};" if target in declared else f"{c_compute} v_{target} = {text};")
            declared.add(target)
        for name in self.outputs:
            lines.append(f"p_{name} = {_store(kinds[name], f'v_{name}')};")
        return in_params, out_params, "\n".join(lines)

    def _c(self, node, compute, wide=False):
        """The C++ of ``node`` in ``compute``; ``wide``: inside ``wide()``, where every operand
        is cast to double so that each operation runs in double."""
        if isinstance(node, ast.Name):
            name = f"s_{node.id}" if node.id in self.scalars else f"v_{node.id}"
            return f"((double){name})" if wide else name
        if isinstance(node, ast.Constant):
            if compute.kind != "f":
                return str(int(node.value))
            return repr(float(node.value)) + ("f" if compute == np.float32 else "")
        if isinstance(node, ast.UnaryOp):
            return f"(-{self._c(node.operand, compute, wide)})"
        if isinstance(node, ast.Call) and node.func.id == "wide":
            return f"(({_C_COMPUTE[compute]}){self._c(node.args[0], _WIDE, wide=True)})"
        if isinstance(node, ast.Call):
            args = ", ".join(self._c(arg, compute, wide) for arg in node.args)
            name = {"sqrt": "sqrtf" if compute == np.float32 else "sqrt"}.get(node.func.id, f"tk_{node.func.id}")
            return f"{name}({args})"
        op = _BINARY[type(node.op)][0]
        return f"({self._c(node.left, compute, wide)} {op} {self._c(node.right, compute, wide)})"

    def _run_cupy(self, arrays, kinds, scalars, compute):
        import cupy

        key = (tuple(kinds[name] for name in self.inputs + self.outputs), compute)
        kernel = self._compiled.get(key)
        if kernel is None:
            in_params, out_params, operation = self.cuda_source(kinds, compute)
            kernel = self._compiled[key] = cupy.ElementwiseKernel(
                in_params, out_params, operation, f"tensorkv_{self.name}", preamble=PREAMBLE)
        args = []
        for name in self.inputs + self.outputs:
            array = arrays[name]
            if name in self.outputs and not array.flags.c_contiguous:
                raise ValueError(f"kernel {self.name}: output {name!r} must be C-contiguous")
            array = array.reshape(-1)  # a view for outputs; same-sized arrays of any shapes line up
            args.append(array.view(cupy.uint16) if array.dtype == np.float16 else array)
        scalars = [compute.type(scalars[name]) for name in self.scalars]
        kernel(*args[:len(self.inputs)], *scalars, *args[len(self.inputs):])


def _identity(op, left, right):
    """The result, as (value, temporary), of ``left op right`` when a scalar operand makes it
    one of the operands or zero (multiplying by 0 skips a pass; it would only differ where
    the other operand is inf or NaN, and every update adds its weight unscaled, so a weight
    that is NaN stays NaN); else None."""
    def scalar_is(value, number):
        return not isinstance(value, np.ndarray) and value == number

    if op is ast.Mult:
        if scalar_is(left, 1):
            return right, False
        if scalar_is(right, 1):
            return left, False
        if scalar_is(left, 0) or scalar_is(right, 0):
            return (left if scalar_is(left, 0) else right), False
    elif op is ast.Add:
        if scalar_is(left, 0):
            return right, False
        if scalar_is(right, 0):
            return left, False
    elif op in (ast.Sub, ast.Div) and scalar_is(right, 0 if op is ast.Sub else 1):
        return left, False
    return None


def _target(out, operands, scratch):
    """Where an operation writes: ``out``, else the first operand that is a temporary, else
    new scratch (None when every operand is a scalar)."""
    if out is not None:
        return out
    for value, temporary in operands:
        if temporary:
            return value
    if any(isinstance(value, np.ndarray) for value, _ in operands):
        return scratch()
    return None


class _Scratch:
    """Host scratch buffers kept between kernel calls, up to ``limit`` bytes: fresh large
    allocations are mapped page by page on first touch, which costs more than the arithmetic."""

    def __init__(self, limit):
        self.limit = limit
        self._free = []
        self._lock = threading.Lock()

    def take(self, nbytes):
        """A uint8 buffer of at least ``nbytes``."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: len(self._free[i])))
        return np.empty(max(nbytes, 1), np.uint8)

    def give_back(self, buffers):
        with self._lock:
            self._free = sorted(self._free + buffers, key=len, reverse=True)
            while sum(len(b) for b in self._free) > self.limit:
                self._free.pop(0)


_SCRATCH = _Scratch(limit=256 << 20)


def _load(dtype, param, c_compute):
    kind = _STORAGE[np.dtype(dtype)][2]
    if kind == "plain":
        return f"({c_compute}){param}"
    return f"({c_compute})tk_{kind}_load({param})"


def _store(dtype, local):
    c_type, _, kind = _STORAGE[np.dtype(dtype)]
    if kind == "plain":
        return f"({c_type}){local}"
    return f"tk_{kind}_store((float){local})"


# ---- sums ---------------------------------------------------------------------------------

# Low-precision dtypes whose sums (and copies) are computed in float32.
_WIDENED = {BFLOAT16, np.dtype(np.float16)}


def accumulator_dtype(dtype):
    """The dtype values of ``dtype`` are summed in: float32 for float16 and bfloat16."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _WIDENED else dtype


# Values summed per kernel launch; more are added into the total by further launches.
MAX_SUMMED = 8


def _sum_kernel(count, accumulate):
    names = [f"x{i}" for i in range(count)]
    terms = (["total"] if accumulate else []) + names
    return Kernel(f"{'add' if accumulate else 'sum'}{count}", names, "total", "", f"total = {' + '.join(terms)}")


_SUMS = {(count, accumulate): _sum_kernel(count, accumulate)
         for count in range(1, MAX_SUMMED + 1) for accumulate in (False, True)}


def sum_into(total, values, accumulate=False):
    """Write the sum of ``values`` (arrays of one size) into ``total``, plus ``total``'s own
    value when ``accumulate``; one pass per :data:`MAX_SUMMED` values, computed in
    ``accumulator_dtype(total.dtype)``. One value is a copy, converted to ``total``'s dtype."""
    if len(values) == 1 and _host_writable(total) and type(values[0]) is np.ndarray \
            and values[0].size == total.size:
        # The kernel's own NumPy calls without its per-call setup, which a list of many
        # small keys pays once per key.
        value = values[0] if values[0].shape == total.shape else values[0].reshape(total.shape)
        if not accumulate:
            np.copyto(total, value, casting="unsafe")
            return
        if total.dtype == accumulator_dtype(total.dtype):
            np.add(total, value, out=total, dtype=total.dtype)
            return
    compute = accumulator_dtype(total.dtype)
    for start in range(0, len(values), MAX_SUMMED):
        batch = values[start:start + MAX_SUMMED]
        arrays = {f"x{i}": value for i, value in enumerate(batch)}
        arrays["total"] = total
        _SUMS[len(batch), accumulate or start > 0](arrays, {}, compute)


def _host_writable(array):
    return type(array) is np.ndarray and array.flags.c_contiguous and array.flags.writeable


# ---- norms ------------------------------------------------------------------------------------

# Elements widened to float64 at a time by l2_norm: its scratch is 8 MiB whatever the array.
NORM_CHUNK = 1 << 20


def l2_norm(xp, array):
    """The L2 norm of all of ``array`` (namespace ``xp``, any floating dtype, a DeviceBFloat16
    too) as a Python float: a reduction, where the kernels above are element-wise.

    The squares are summed in float64, chunk by chunk, so the norm of a float32 or narrower
    array, rounded to float32, is the correctly rounded one on NumPy and on CuPy alike
    (their summation orders differ far below float32's precision). On CuPy, reading the
    result back waits for the GPU.

    >>> l2_norm(np, np.array([3, 4], np.float16))
    5.0
    """
    flat = array.reshape(-1)
    if flat.dtype == np.float64:  # wide already: no copy
        return math.sqrt(float(xp.dot(flat, flat)))
    wide = xp.empty(min(flat.size, NORM_CHUNK), np.float64)  # one scratch for every chunk
    total = 0.0
    for start in range(0, flat.size, NORM_CHUNK):
        part = wide[:min(NORM_CHUNK, flat.size - start)]
        sum_into(part, [flat[start:start + NORM_CHUNK]])
        total = total + xp.dot(part, part)
    return math.sqrt(float(total))
