"""Array interop: which array namespace holds values (CuPy on a GPU, else NumPy), and
moving arrays between user types (NumPy, CuPy, torch, DLPack) and that namespace."""
import ml_dtypes
import numpy as np


def cupy_or_none():
    """The cupy module when it imports and sees a CUDA device, else None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        pass
    return None


def select(device="auto"):
    """(array namespace, device name) for 'cpu', 'cuda', 'cuda:N' or 'auto'."""
    name, colon, number = device.partition(":")
    if name not in ("cpu", "auto", "cuda") or colon and (name != "cuda" or not number.isascii()
                                                        or not number.isdigit()):
        raise ValueError(f"device {device!r} is not one of cpu, cuda, cuda:N, auto")
    if name == "cpu":
        return np, "cpu"
    cupy = cupy_or_none()
    if cupy is None:
        if name == "auto":
            return np, "cpu"
        raise RuntimeError(f"device {device!r} asked for, but CuPy sees no CUDA device")
    index, count = int(number or 0), cupy.cuda.runtime.getDeviceCount()
    if index >= count:
        raise RuntimeError(f"device {device!r} asked for, but CuPy sees {count} CUDA device(s)")
    cupy.cuda.Device(index).use()
    return cupy, f"cuda:{index}"


def array_module(array):
    """cupy for a CuPy array, numpy otherwise."""
    if type(array).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def to_host(value):
    """``value`` as a C-contiguous little-endian NumPy array, copying only when needed.

    Accepts NumPy arrays and scalars, CuPy arrays and torch tensors (copied to the host),
    and anything exposing ``__dlpack__`` or ``__array__``.
    """
    module = type(value).__module__
    if isinstance(value, np.ndarray):
        array = value
    elif module.startswith("cupy"):
        array = value.get()
    elif module.startswith("torch"):
        array = _torch_to_numpy(value)
    elif hasattr(value, "__array__"):
        array = np.asarray(value)
    elif hasattr(value, "__dlpack__"):
        array = np.from_dlpack(value)
    else:
        array = np.asarray(value)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    return np.asarray(array, order="C")


def to_namespace(value, xp):
    """``value`` as an array of namespace ``xp`` (NumPy or CuPy), staying on the GPU when it is there."""
    if xp is np:
        return to_host(value)
    module = type(value).__module__
    if module.startswith("cupy"):
        return value
    if module.startswith("torch") and value.is_cuda:
        return xp.from_dlpack(value)
    return xp.asarray(to_host(value))


def shape_dtype(value):
    """(shape, NumPy dtype) of any supported array without copying it."""
    module = type(value).__module__
    if module.startswith("torch"):
        return tuple(value.shape), _torch_dtype(value.dtype)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), np.dtype(value.dtype)
    array = np.asarray(value)
    return array.shape, array.dtype


def is_array(value):
    """Whether ``value`` is an array tensorkv accepts (not a list, which means one array per device)."""
    return (hasattr(value, "shape") and hasattr(value, "dtype")) or hasattr(value, "__array__") \
        or hasattr(value, "__dlpack__")


def host_copy(array):
    """A new NumPy array with the value of a NumPy or CuPy ``array``, sharing no memory with it."""
    if isinstance(array, np.ndarray):
        return array.copy()
    return array.get()


def _torch_dtype(torch_dtype):
    import torch
    if torch_dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=torch_dtype).numpy().dtype


def _torch_to_numpy(tensor):
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def write_into(out, value):
    """Copy ``value`` (NumPy or CuPy) into ``out`` in place, keeping ``out``'s type and device."""
    module = type(out).__module__
    if isinstance(out, np.ndarray):
        np.copyto(out, to_host(value))
    elif module.startswith("cupy"):
        import cupy
        with cupy.cuda.Device(out.device.id):
            out[...] = cupy.asarray(value)
    elif module.startswith("torch"):
        import torch
        if out.is_cuda and type(value).__module__.startswith("cupy"):
            out.copy_(torch.from_dlpack(value))
        else:
            host = to_host(value)
            if out.dtype == torch.bfloat16:
                out.copy_(torch.from_numpy(host.view(np.int16)).view(torch.bfloat16))
            else:
                out.copy_(torch.from_numpy(host))
    else:
        raise TypeError(f"cannot write into an output of type {type(out).__name__}")
