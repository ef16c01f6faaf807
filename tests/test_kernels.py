"""The fused kernels: the C++ each one becomes on a GPU, compiled here for the host with g++
and run against the NumPy evaluation of the same statements (bit for bit: both round every
operation to the compute dtype), the float16/bfloat16 conversions it uses over every bit
pattern, and, where nvcc is installed, the same text compiled for a Hopper GPU.

This is how the CUDA code is tested on machines without a GPU; ``make test-gpu`` runs it
on one (tests/test_gpu.py).
"""
import ctypes
import itertools
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from tensorkv.update import kernels
from tensorkv import optimizer
from tensorkv.update.kernels import PREAMBLE, Kernel
from tensorkv.optimizer.optimizer import _compute_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)
C_TYPES = {"float32": "float", "float64": "double", "uint16": "unsigned short", "int8": "signed char",
           "int16": "short", "int32": "int", "int64": "long long", "uint8": "unsigned char"}
HOST_SHIMS = r"""
#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
"""
CONVERSIONS = r"""
extern "C" void f16_load(const unsigned short* in, float* out, long long n) { for (long long i = 0; i < n; ++i) out[i] = tk_f16_load(in[i]); }
extern "C" void f16_store(const float* in, unsigned short* out, long long n) { for (long long i = 0; i < n; ++i) out[i] = tk_f16_store(in[i]); }
extern "C" void bf16_load(const unsigned short* in, float* out, long long n) { for (long long i = 0; i < n; ++i) out[i] = tk_bf16_load(in[i]); }
extern "C" void bf16_store(const float* in, unsigned short* out, long long n) { for (long long i = 0; i < n; ++i) out[i] = tk_bf16_store(in[i]); }
"""
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


def _params(text):
    """[(C type, name)] of an ElementwiseKernel parameter list."""
    return [(C_TYPES[kind], name) for kind, name in (p.split() for p in text.split(",") if p.strip())]


def host_function(name, source):
    """A C++ function ``name(void** arrays, const double* scalars, long long n)`` that runs the
    kernel's operation over n elements, binding parameters as cupy.ElementwiseKernel does:
    inputs by value, outputs by reference, scalars converted to their declared type."""
    in_params, out_params, operation = source
    lines = [f'extern "C" void {name}(void** arrays, const double* scalars, long long n) {{',
             "  for (long long i = 0; i < n; ++i) {"]
    array_index = scalar_index = 0
    for c_type, param in _params(in_params):
        if param.startswith("s_"):
            lines.append(f"    const {c_type} {param} = ({c_type})scalars[{scalar_index}];")
            scalar_index += 1
        else:
            lines.append(f"    const {c_type} {param} = (({c_type}*)arrays[{array_index}])[i];")
            array_index += 1
    for c_type, param in _params(out_params):
        lines.append(f"    {c_type}& {param} = (({c_type}*)arrays[{array_index}])[i];")
        array_index += 1
    lines += ["    " + line for line in operation.splitlines()]
    lines += ["  }", "}"]
    return "\n".join(lines)


def compile_host(tmp_path, body):
    source = tmp_path / "kernels.cpp"
    source.write_text(HOST_SHIMS + PREAMBLE + body)
    library = tmp_path / "kernels.so"
    # No FMA contraction: every operation rounds to the compute dtype, as NumPy's ufuncs do.
    subprocess.run(["g++", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True, text=True, timeout=120)
    return ctypes.CDLL(str(library))


# ---- float16 and bfloat16 conversions ----------------------------------------------------

@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    return compile_host(tmp_path_factory.mktemp("conversions"), CONVERSIONS)


def _convert(function, values, out_dtype):
    values = np.ascontiguousarray(values)
    out = np.empty(values.shape, out_dtype)
    function(values.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
             ctypes.c_longlong(values.size))
    return out


def _floats_to_round():
    """float32 values around every float16/bfloat16 rounding case: exact values, ties, the
    neighbours of ties, subnormals, overflow, infinities, NaN, and random ones."""
    exact = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    exact = exact[np.isfinite(exact)]
    ordered = np.unique(exact)
    ties = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(np.float32)
    neighbours = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    rng = np.random.default_rng(1)
    with np.errstate(over="ignore"):
        random = (rng.standard_normal(200_000) * np.exp2(rng.integers(-140, 128, 200_000))).astype(np.float32)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, 65536, 1e-8, 6e-8, 3e-8,
                        3.4e38, -3.4e38, 1e-45], np.float32)
    return np.concatenate([exact, ties, neighbours, random, bits, special])


def _assert_same_bits(got, want):
    """``got`` (uint16 bits) holds the values of ``want`` (float16 or bfloat16), NaN as NaN."""
    got_nan, want_nan = np.isnan(got.view(want.dtype).astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~got_nan], want.view(np.uint16)[~want_nan])


def test_float16_loads_every_bit_pattern_exactly(conversions):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = _convert(conversions.f16_load, bits, np.float32)
    want = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])


def test_float16_stores_round_to_nearest_even_as_numpy(conversions):
    values = _floats_to_round()
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    _assert_same_bits(_convert(conversions.f16_store, values, np.uint16), want)


def test_bfloat16_loads_and_stores_as_ml_dtypes(conversions):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = _convert(conversions.bf16_load, bits, np.float32)
    want = bits.view(BF16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    values = _floats_to_round()
    with np.errstate(invalid="ignore"):
        want = values.astype(BF16)
    _assert_same_bits(_convert(conversions.bf16_store, values, np.uint16), want)


# ---- every kernel: generated C++ against the NumPy evaluation ------------------------------

OPTIMIZERS = [
    optimizer.SGD(learning_rate=0.1),
    optimizer.SGD(learning_rate=0.1, wd=0.01, clip_gradient=0.5),
    optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5),
    optimizer.Adam(learning_rate=0.01, wd=0.001, clip_gradient=1.0),
    optimizer.AdaGrad(learning_rate=0.1, wd=0.01),
    optimizer.RMSProp(learning_rate=0.01, clip_weights=2.0),
    optimizer.RMSProp(learning_rate=0.01, centered=True, wd=0.01, clip_gradient=0.8),
    optimizer.Signum(learning_rate=0.01, wd=0.01),
    optimizer.Signum(learning_rate=0.01, momentum=0, wd=0.1),
    optimizer.NAG(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.5),
    optimizer.AdaDelta(wd=0.01),
    optimizer.Adamax(wd=0.01, clip_gradient=1.0),
    optimizer.Nadam(wd=0.01),
    optimizer.Ftrl(lamda1=0.5, wd=0.01),
    optimizer.FTML(learning_rate=0.01, wd=0.01),
    optimizer.SGD(learning_rate=0.1, momentum=0.9, multi_precision=True),  # the master-copy kernels
    optimizer.Adam(learning_rate=0.01, multi_precision=True),
    optimizer.LAMB(learning_rate=0.01, wd=0.01, clip_gradient=1.0),  # two passes: direction_kernel, step_kernel
    optimizer.LAMB(bias_correction=False, multi_precision=True),
    optimizer.LARS(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.5),  # SGD's kernel, corrected momentum
    optimizer.LARS(learning_rate=0.1, multi_precision=True),
    optimizer.DCASGD(learning_rate=0.1, wd=0.01),
    optimizer.DCASGD(learning_rate=0.1, momentum=0.9, clip_gradient=0.5, multi_precision=True),
]
# (weight dtype, grad dtype): low-precision weights also take the float32 sum of their pushes.
OPTIMIZER_DTYPES = [("float32", "float32"), ("float64", "float64"), ("float16", "float16"),
                    ("float16", "float32"), (BF16, BF16), (BF16, "float32")]
SUM_DTYPES = ["float32", "float64", "int8", "int16", "int32", "int64", "uint8"]


def _random(rng, dtype, size):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    return (rng.standard_normal(size) * 2).astype(dtype)


def _passes(opt, dtype):
    """[(Kernel, scalars)] of each pass of ``opt``'s update of a weight of ``dtype``."""
    if isinstance(opt, optimizer.LAMB):
        return [opt.direction_kernel(dtype, t=3, wd=opt.wd), opt.step_kernel(dtype, lr=0.01)]
    kernel, _, scalars = opt.kernel(dtype, t=3, lr=opt.learning_rate)
    return [(kernel, scalars)]


def _cases():
    """(Kernel, {name: array}, {name: scalar}, compute dtype) covering every kernel the
    product runs, each in every dtype it runs in."""
    rng = np.random.default_rng(3)
    size = 4099
    for opt, (weight_dtype, grad_dtype) in itertools.product(OPTIMIZERS, OPTIMIZER_DTYPES):
        compute = _compute_dtype(np.dtype(weight_dtype))
        for kernel, scalars in _passes(opt, np.dtype(weight_dtype)):
            given = {"weight": weight_dtype, "grad": grad_dtype}
            # the states and LAMB's direction in the compute dtype, not negative (variances are not)
            arrays = {name: _random(rng, given[name], size) if name in given else np.abs(_random(rng, compute, size))
                      for name in kernel.inputs + kernel.outputs}
            yield f"{opt!r}-{kernel.name}-{np.dtype(weight_dtype)}-{np.dtype(grad_dtype)}", kernel, arrays, scalars, \
                compute
    for (count, accumulate), kernel in kernels._SUMS.items():
        for dtype in SUM_DTYPES + ["float16", BF16]:
            compute = np.dtype(np.float32) if np.dtype(dtype) in (np.float16, BF16) else np.dtype(dtype)
            arrays = {f"x{i}": _random(rng, dtype, size) for i in range(count)}
            arrays["total"] = _random(rng, compute if accumulate else dtype, size)
            yield f"{kernel.name}-{np.dtype(dtype)}", kernel, arrays, {}, compute


def _as_kernel_sees(array):
    """The array as a GPU kernel receives it: float16 and bfloat16 as their uint16 bits."""
    return array.view(np.uint16) if array.dtype in (np.float16, BF16) else array


@needs_gxx
def test_every_kernel_computes_in_cpp_what_numpy_computes(tmp_path):
    cases = list(_cases())
    functions = []
    for index, (_, kernel, arrays, _, compute) in enumerate(cases):
        kinds = {name: array.dtype for name, array in arrays.items()}
        functions.append(host_function(f"case{index}", kernel.cuda_source(kinds, compute)))
    library = compile_host(tmp_path, "\n".join(functions))
    for index, (label, kernel, arrays, scalars, compute) in enumerate(cases):
        expected = {name: array.copy() for name, array in arrays.items()}
        with np.errstate(all="ignore"):
            kernel(expected, scalars, compute)
        got = {name: array.copy() for name, array in arrays.items()}
        order = list(kernel.inputs) + list(kernel.outputs)
        pointers = (ctypes.c_void_p * len(order))(*[_as_kernel_sees(got[name]).ctypes.data for name in order])
        values = (ctypes.c_double * max(1, len(kernel.scalars)))(*[scalars[name] for name in kernel.scalars])
        getattr(library, f"case{index}")(pointers, values, ctypes.c_longlong(next(iter(arrays.values())).size))
        for name in kernel.outputs:
            want, have = _as_kernel_sees(expected[name]), _as_kernel_sees(got[name])
            assert np.array_equal(have, want) or np.array_equal(
                got[name].astype(np.float64), expected[name].astype(np.float64), equal_nan=True), \
                f"{label}: output {name!r} differs between the C++ kernel and NumPy"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_every_kernel_compiles_for_a_hopper_gpu(tmp_path):
    """The CUDA text as cupy.ElementwiseKernel compiles it (one kernel per case, parameters
    bound as CuPy binds them), through nvcc to PTX for sm_90."""
    functions = []
    for index, (_, kernel, arrays, _, compute) in enumerate(_cases()):
        kinds = {name: array.dtype for name, array in arrays.items()}
        in_params, out_params, operation = kernel.cuda_source(kinds, compute)
        params, binds = [], []
        for c_type, param in _params(in_params):
            if param.startswith("s_"):
                params.append(f"const {c_type} {param}")
            else:
                params.append(f"const {c_type}* _raw_{param}")
                binds.append(f"const {c_type} {param} = _raw_{param}[i];")
        for c_type, param in _params(out_params):
            params.append(f"{c_type}* _raw_{param}")
            binds.append(f"{c_type}& {param} = _raw_{param}[i];")
        functions.append(
            f'extern "C" __global__ void case{index}({", ".join(params)}, long long n) {{\n'
            "  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;"
            " i += (long long)gridDim.x * blockDim.x) {\n"
            + "\n".join(binds) + "\n" + operation + "\n  }\n}")
    source = tmp_path / "kernels.cu"
    source.write_text(PREAMBLE + "\n".join(functions))
    result = subprocess.run(["nvcc", "--ptx", "-arch=sm_90", "-o", str(tmp_path / "kernels.ptx"), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


# ---- the language ---------------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    ("y = x +", "invalid syntax"),
    ("y = z * x", "'z' is read before it is assigned"),
    ("y = x ** 2", "not in the kernel language"),
    ("y = exp(x)", "not in the kernel language"),
    ("x = 2 * x\ny = x", "'x' is an input"),
    ("t = x", r"outputs \['y'\] are never assigned"),
    ("y = x if x else 0", "not in the kernel language"),
])
def test_a_kernel_outside_the_language_is_refused(body, message):
    with pytest.raises((ValueError, SyntaxError), match=message):
        Kernel("bad", "x", "y", "", body)


def test_outputs_read_before_assignment_are_loaded_and_temporaries_are_not():
    kernel = Kernel("k", "x", "y, z", "a", "t = a * x\ny = y + t\nz = t * y")
    assert kernel.loaded == ["y", "x"]
    in_params, out_params, operation = kernel.cuda_source(
        {"x": np.dtype(np.float16), "y": BF16, "z": np.dtype(np.float32)}, np.float32)
    assert in_params == "uint16 p_x, float32 s_a"
    assert out_params == "uint16 p_y, float32 p_z"
    assert operation.splitlines() == [
        "float v_y = (float)tk_bf16_load(p_y);",
        "float v_x = (float)tk_f16_load(p_x);",
        "float v_t = (s_a * v_x);",
        "v_y = (v_y + v_t);",
        "float v_z = (v_t * v_y);",
        "p_y = tk_bf16_store((float)v_y);",
        "p_z = (float)v_z;",
    ]


def test_wide_computes_in_double_and_rounds_once():
    """``wide(x)``: every operation inside in double, as C++ computes a float expression that
    meets a double (MXNet's LAMB direction), then rounded to the compute dtype."""
    kernel = Kernel("k", "x", "y", "a", "y = wide(x / 3 + a * x) * 2")
    assert kernel.cuda_source({"x": np.dtype(np.float32), "y": np.dtype(np.float32)}, np.float32)[2].splitlines()[1] \
        == "float v_y = (((float)((((double)v_x) / 3.0) + (((double)s_a) * ((double)v_x)))) * 2.0f);"
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    y = np.empty_like(x)
    kernel({"x": x, "y": y}, {"a": 0.1}, np.float32)
    wide = (x.astype(np.float64) / 3 + np.float64(np.float32(0.1)) * x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(y, wide * np.float32(2))
    assert not np.array_equal(y, (x / np.float32(3) + np.float32(0.1) * x) * np.float32(2))  # float32 differs


@pytest.mark.parametrize("dtype", ["float16", BF16, "float32", "float64"])
def test_l2_norm_sums_squares_in_float64_chunk_by_chunk(dtype, monkeypatch):
    monkeypatch.setattr(kernels, "NORM_CHUNK", 7)
    x = np.random.default_rng(6).standard_normal(100).astype(dtype)
    wide = x.astype(np.float64)
    assert kernels.l2_norm(np, x.reshape(4, 25)) == pytest.approx(np.sqrt(np.dot(wide, wide)), rel=1e-15)
    assert kernels.l2_norm(np, np.zeros((0, 3), dtype)) == 0.0


def test_numpy_evaluation_writes_outputs_in_place_and_leaves_inputs():
    x = np.arange(4, dtype=np.float16)
    y = np.ones(4, BF16)
    z = np.zeros(4, np.float32)
    kernel = Kernel("k", "x", "y, z", "a", "t = a * x\ny = y + t\nz = t * y")
    kernel({"x": x, "y": y, "z": z}, {"a": 0.5}, np.float32)
    np.testing.assert_array_equal(x, [0, 1, 2, 3])
    np.testing.assert_array_equal(y.astype(np.float32), [1, 1.5, 2, 2.5])
    np.testing.assert_array_equal(z, [0, 0.75, 2, 3.75])


def test_sums_of_many_values_take_several_passes_and_accumulate():
    values = [np.full(5, i, np.int64) for i in range(kernels.MAX_SUMMED * 2 + 3)]
    total = np.empty(5, np.int64)
    kernels.sum_into(total, values)
    np.testing.assert_array_equal(total, sum(range(len(values))))
    kernels.sum_into(total, values[:2], accumulate=True)
    np.testing.assert_array_equal(total, sum(range(len(values))) + 1)


def test_arrays_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="'x1' has 3 elements"):
        kernels.sum_into(np.empty(4), [np.ones(4), np.ones(3)])
