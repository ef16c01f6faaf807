"""Array interop: which array namespace holds values (CuPy on a GPU, else NumPy), and
moving arrays between user types (NumPy, CuPy, torch, DLPack) and that namespace.

Arrays stay on their GPU wherever they can: CuPy arrays and torch CUDA tensors reach a
GPU namespace through DLPack without a host round trip, and only what must reach the host
(a value for the wire, a NumPy ``out``) is copied there.
"""
import dataclasses

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


class DeviceBFloat16:
    """A bfloat16 array on the GPU. CuPy has no bfloat16, so ``bits``, a CuPy uint16 array,
    holds the bit patterns; :mod:`tensorkv.update.kernels` converts them to float32 to compute."""

    __slots__ = ("bits",)
    dtype = BFLOAT16

    def __init__(self, bits):
        self.bits = bits

    shape = property(lambda self: self.bits.shape)
    size = property(lambda self: self.bits.size)
    nbytes = property(lambda self: self.bits.nbytes)
    ndim = property(lambda self: self.bits.ndim)
    device = property(lambda self: self.bits.device)

    def reshape(self, *shape):
        return DeviceBFloat16(self.bits.reshape(*shape))

    def __getitem__(self, index):
        return DeviceBFloat16(self.bits[index])

    def get(self):
        """A NumPy bfloat16 copy on the host."""
        return self.bits.get().view(BFLOAT16)

    def __repr__(self):
        return f"DeviceBFloat16(shape={self.shape}, device={self.bits.device.id})"


class DeviceBytes:
    """Bytes in GPU memory (``bits``, a CuPy uint8 array) that a decoder reads as an entry's
    value, as it reads host bytes: :meth:`view` is the CuPy array of a dtype over them (a
    DeviceBFloat16 for bfloat16), without a copy."""

    __slots__ = ("bits",)

    def __init__(self, bits):
        self.bits = bits

    def __len__(self):
        return self.bits.size

    def view(self, dtype):
        if np.dtype(dtype) == BFLOAT16:
            return DeviceBFloat16(self.bits.view(np.uint16))
        return self.bits.view(dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The contiguous bytes of a GPU value: ``ptr`` on CUDA device ``device``, and the stream
    (``stream``, a cudaStream_t) that orders the work on it: the current stream of its device
    in CuPy, or in torch for a torch tensor, so that a copy queued there comes after the work
    that wrote the value and before the work that reads it next."""

    ptr: int
    nbytes: int
    device: int
    stream: int

    def at(self, offset, nbytes):
        """The ``nbytes`` bytes from byte ``offset`` on."""
        return DeviceMemory(self.ptr + offset, nbytes, self.device, self.stream)


def device_memory(value):
    """The DeviceMemory of a GPU ``value`` (a CuPy array, DeviceBFloat16 or torch CUDA
    tensor) whose bytes are C-contiguous and not empty; None for any other value."""
    module = type(value).__module__
    if isinstance(value, DeviceBFloat16):
        value, module = value.bits, "cupy"
    if module.startswith("cupy"):
        if not value.flags.c_contiguous or not value.nbytes:
            return None
        import cupy
        device = value.device.id
        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream().ptr
        return DeviceMemory(value.data.ptr, value.nbytes, device, stream)
    if module.startswith("torch") and value.is_cuda and value.is_contiguous() and value.numel():
        import torch
        return DeviceMemory(value.data_ptr(), value.numel() * value.element_size(), value.device.index,
                            torch.cuda.current_stream(value.device).cuda_stream)
    return None


def on_gpu(value):
    """Whether ``value`` lives on a GPU: a CuPy array, a DeviceBFloat16 or a torch CUDA tensor."""
    module = type(value).__module__
    return module.startswith("cupy") or isinstance(value, DeviceBFloat16) or (
        module.startswith("torch") and value.is_cuda)


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
    """cupy for a CuPy array or a DeviceBFloat16, numpy otherwise."""
    if type(getattr(array, "bits", array)).__module__.startswith("cupy"):
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
    elif module.startswith("cupy") or isinstance(value, DeviceBFloat16):
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
    """``value`` as an array of namespace ``xp`` (NumPy, or CuPy on the current device),
    without a copy when it is one already. GPU values stay on the GPU (another device's
    are copied peer to peer); bfloat16 becomes a :class:`DeviceBFloat16` on CuPy."""
    if xp is np:
        return to_host(value)
    module = type(value).__module__
    if module.startswith("torch") and value.is_cuda:
        import torch
        if value.dtype == torch.bfloat16:
            value = DeviceBFloat16(xp.from_dlpack(value.view(torch.int16)).view(xp.uint16))
        else:
            value = xp.from_dlpack(value)
    elif not (module.startswith("cupy") or isinstance(value, DeviceBFloat16)):
        host = to_host(value)
        if host.dtype == BFLOAT16:
            return DeviceBFloat16(xp.asarray(host.view(np.uint16)))
        return xp.asarray(host)
    if value.device.id != xp.cuda.Device().id:
        return _to_current_device(value, xp)
    return value


def _to_current_device(value, xp):
    """A copy of a GPU ``value`` (CuPy or DeviceBFloat16) on CuPy's current device."""
    bits = getattr(value, "bits", value)
    with bits.device:
        bits = xp.ascontiguousarray(bits)
    copy = xp.empty(bits.shape, bits.dtype)
    copy.data.copy_from_device(bits.data, bits.nbytes)
    return DeviceBFloat16(copy) if isinstance(value, DeviceBFloat16) else copy


def empty(xp, shape, dtype):
    """An uninitialized array of namespace ``xp`` (a DeviceBFloat16 for bfloat16 on CuPy)."""
    if xp is not np and np.dtype(dtype) == BFLOAT16:
        return DeviceBFloat16(xp.empty(shape, xp.uint16))
    return xp.empty(shape, dtype)


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
    """A new NumPy array with the value of a NumPy or CuPy ``array`` (or DeviceBFloat16),
    sharing no memory with it."""
    if isinstance(array, np.ndarray):
        return array.copy()
    return array.get()


def _torch_dtype(torch_dtype):
    import torch
    if torch_dtype == torch.bfloat16:
        return BFLOAT16
    return torch.empty((), dtype=torch_dtype).numpy().dtype


def _torch_to_numpy(tensor):
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def _numpy_to_torch(array):
    """A CPU tensor of the NumPy ``array``: its memory, or a copy of a read-only array (which
    torch warns it cannot protect, e.g. a pulled value still in its received message)."""
    import torch

    if not array.flags.writeable:
        array = array.copy()
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def write_into(out, value):
    """Copy ``value`` (NumPy, CuPy or DeviceBFloat16) into ``out`` in place, keeping ``out``'s
    type and device: GPU to GPU stays on the GPUs (through DLPack for torch)."""
    module = type(out).__module__
    if isinstance(out, np.ndarray):
        np.copyto(out, to_host(value))
    elif module.startswith("cupy"):
        import cupy
        with out.device:
            out[...] = to_namespace(value, cupy)
    elif module.startswith("torch"):
        import torch
        # A tensor that requires grad (a Parameter) is written as its data, as MXNet users
        # pull into their weights; autograd still sees the change (its version counter).
        with torch.no_grad():
            if out.is_cuda and isinstance(value, DeviceBFloat16):
                out.view(torch.int16).copy_(torch.from_dlpack(value.bits.view("int16")))
            elif out.is_cuda and type(value).__module__.startswith("cupy"):
                out.copy_(torch.from_dlpack(value))
            else:
                out.copy_(_numpy_to_torch(to_host(value)))
    else:
        raise TypeError(f"cannot write into an output of type {type(out).__name__}")
