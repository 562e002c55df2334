"""Tensor <-> little-endian bytes for numpy arrays and torch tensors.

Nothing here imports numpy or torch unless the caller passes such an object (torch is looked
up in ``sys.modules``: a torch tensor cannot exist unless torch was imported)."""

import sys

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

if sys.byteorder != "little":  # pragma: no cover - no big-endian test machine
    raise ImportError("lightwire: tensor bodies are little-endian; big-endian hosts are not supported")


def _torch():
    return sys.modules.get("torch")


def is_torch_tensor(obj):
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def is_numpy_array(obj):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _torch_dtype_name(t):
    torch = _torch()
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    try:
        return names[t.dtype]
    except KeyError:
        raise TypeError("lightwire: unsupported torch dtype %s (float32, float16 or bfloat16)" % t.dtype)


def torch_dtype(name):
    torch = _torch()
    if torch is None:
        import torch  # noqa: F811
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _torch_bytes_view(flat):
    """A writable/readable byte memoryview over a contiguous 1-D CPU torch tensor."""
    torch = _torch()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)  # numpy has no bfloat16; same bits, same size
    return memoryview(flat.numpy()).cast("B")


class Wire(object):
    """What goes over the wire for one tensor, and how to build the reply."""

    __slots__ = ("kind", "dtype", "shape", "body", "_src")

    def __init__(self, kind, dtype, shape, body, src):
        self.kind = kind      # "numpy" or "torch"
        self.dtype = dtype    # "float32" | "float16" | "bfloat16"
        self.shape = shape    # tuple of ints
        self.body = body      # byte memoryview, len = nbytes
        self._src = src       # keeps the contiguous copy (if any) alive

    @property
    def nbytes(self):
        return self.body.nbytes

    def shape_param(self):
        """The ``shape`` query value, or None for 1-D (and 0-d, sent as one element)."""
        if len(self.shape) <= 1:
            return None
        return ",".join(str(int(d)) for d in self.shape)

    def empty_like(self):
        """(result object of the input's type/dtype/shape, writable byte memoryview over it)."""
        if self.kind == "torch":
            torch = _torch()
            out = torch.empty(self.shape, dtype=torch_dtype(self.dtype))
            return out, _torch_bytes_view(out.view(-1))
        import numpy as np
        out = np.empty(self.shape, dtype=np.dtype(self.dtype))
        return out, memoryview(out.reshape(-1)).cast("B")


def to_wire(tensor):
    """Describe ``tensor`` (numpy array or CPU torch tensor) for a raw-body request."""
    if is_torch_tensor(tensor):
        t = tensor.detach()
        if t.device.type != "cpu":
            raise ValueError("lightwire: only CPU tensors are supported by emit_gradient "
                             "(got device %s); the CUDA IPC path comes later" % t.device)
        if t.is_sparse:
            raise TypeError("lightwire: sparse tensors are not supported")
        name = _torch_dtype_name(t)
        shape = tuple(t.shape)
        flat = t.contiguous().reshape(-1)
        return Wire("torch", name, shape, _torch_bytes_view(flat), flat)
    if is_numpy_array(tensor):
        import numpy as np
        kind = tensor.dtype.kind
        if kind != "f" or tensor.dtype.itemsize not in (2, 4):
            raise TypeError("lightwire: unsupported numpy dtype %s (float32 or float16)" % tensor.dtype)
        name = "float32" if tensor.dtype.itemsize == 4 else "float16"
        arr = np.ascontiguousarray(tensor, dtype=np.dtype(name).newbyteorder("<"))
        shape = tuple(tensor.shape)
        return Wire("numpy", name, shape, memoryview(arr.reshape(-1)).cast("B"), arr)
    raise TypeError("lightwire: expected a numpy.ndarray or torch.Tensor, got %s" % type(tensor).__name__)
