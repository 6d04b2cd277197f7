"""The random number generators' states of a worker: captured at every save, restored once.

A save captures Python's global generator, torch's CPU generator (and CUDA's, once CUDA
is in use) and numpy's global generator (once something has loaded ``numpy.random``:
torch's optimizers do, through torch._dynamo). Each state goes into the same tensor of
``kept`` (a Checkpointer's) at every save, which keeps its place, and its byte view, in
the batched copy of small tensors.

The public getters of Python's and numpy's generators copy their 624 state words into
new objects one by one, at every save, on the training loop's path. Both generators
keep those words in the memory of their C object, so this module reads them from there,
with ``ctypes``, at offsets that ``_probe_*`` first checks against the getters on a
private generator of the same type (drawing from it to change every field); where a
check fails (another Python or numpy build), the getters are used.
"""

from __future__ import annotations

import array
import ctypes
import random
import sys
from typing import Any

import torch

_MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words and a position


def capture(kept: dict[str, Any]) -> dict[str, Any]:
    """The RNG states of this process, in tensors of ``kept`` where they are large."""
    state: dict[str, Any] = {"python": _python_state(kept),
                             "torch": _keep(kept, "torch", torch.get_rng_state())}
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    # torch imports numpy but not numpy.random: until something loads that, nothing can
    # have drawn from numpy's global RNG.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        state["numpy"] = _numpy_state(kept, numpy_random.mtrand._rand)
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators to ``state`` (from :func:`capture`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))


def _keep(kept: dict[str, Any], name: str, tensor: torch.Tensor) -> torch.Tensor:
    mine = kept.get(name)
    if mine is None or mine.shape != tensor.shape or mine.dtype != tensor.dtype:
        mine = kept[name] = tensor.clone()
    else:
        mine.copy_(tensor)
    return mine


# -- Python's global generator -----------------------------------------------------------

def _python_state(kept: dict[str, Any]) -> list[Any]:
    """``random.getstate()`` as [version, int64 tensor of its 625 words, gauss_next]; the
    words are converted only when the generator's raw state changed (rarely, in training
    loops that draw from torch)."""
    generator = getattr(random.getstate, "__self__", None)  # random's hidden instance
    raw = None if generator is None else _python_raw(generator)
    if raw is None or raw != kept.get("python_raw"):
        version, internal, gauss = random.getstate()
        _keep(kept, "python", torch.frombuffer(array.array("q", internal), dtype=torch.int64))
        kept["python_raw"] = raw
        return [version, kept["python"], gauss]
    return [generator.VERSION, kept["python"], generator.gauss_next]  # type: ignore[union-attr]


_PYTHON_AT: int | None = None  # offset of the C state in a random.Random; -1: unreadable


def _python_raw(generator: random.Random) -> bytes | None:
    """The C state (position and words) of ``generator``, or None where unreadable."""
    global _PYTHON_AT
    if _PYTHON_AT is None:
        _PYTHON_AT = _probe_python(type(generator))
    if _PYTHON_AT < 0 or type(generator).__basicsize__ < _PYTHON_AT + 4 * (_MT_WORDS + 1):
        return None
    return ctypes.string_at(id(generator) + _PYTHON_AT, 4 * (_MT_WORDS + 1))


def _probe_python(kind: type[random.Random]) -> int:
    """Where CPython's ``RandomObject`` (``int index; uint32_t state[624]``) keeps its
    state in an object of type ``kind``, checked on a private one; -1 if not found."""
    at = object.__basicsize__  # the fields follow the object header
    size = 4 * (_MT_WORDS + 1)
    try:
        generator = kind(20231102)
        if kind.__basicsize__ < at + size:
            return -1
        for _ in range(3):
            raw = ctypes.string_at(id(generator) + at, size)
            index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
            words = tuple(array.array("I", raw[4:]))
            if generator.getstate()[1] != (*words, index):
                return -1
            generator.random()
            generator.getrandbits(64 * 700)  # past the 624 words: the twist runs
    except Exception:
        return -1
    return at


# -- numpy's global generator ----------------------------------------------------------------

def _numpy_state(kept: dict[str, Any], generator: Any) -> list[Any]:
    """``generator.get_state()`` (numpy's global RandomState) with its key array in
    ``kept["numpy"]`` (uint32)."""
    gauss_at = _numpy_gauss_at(generator)
    if gauss_at < 0:
        kind, keys, pos, has_gauss, gauss = generator.get_state()
        return [kind, _keep(kept, "numpy", torch.from_numpy(keys)), pos, has_gauss, gauss]
    keys = kept.get("numpy")
    if keys is None or keys.dtype != torch.uint32 or keys.shape != (_MT_WORDS,):
        keys = kept["numpy"] = torch.empty(_MT_WORDS, dtype=torch.uint32)
    return ["MT19937", keys, *_read_numpy(generator, gauss_at, keys)]


def _read_numpy(generator: Any, gauss_at: int, keys: torch.Tensor) -> list[Any]:
    """Copy ``generator``'s MT19937 words into ``keys``; return [pos, has_gauss, gauss]."""
    bits = generator._bit_generator
    with bits.lock:  # numpy draws without the GIL
        state_at = bits.ctypes.state_address  # mt19937_state: uint32_t key[624]; int pos
        ctypes.memmove(keys.data_ptr(), state_at, 4 * _MT_WORDS)
        return [ctypes.c_int.from_address(state_at + 4 * _MT_WORDS).value,
                ctypes.c_int.from_address(id(generator) + gauss_at).value,
                ctypes.c_double.from_address(id(generator) + gauss_at + 8).value]


# (RandomState type, bit generator type) -> offset of has_gauss; -1: unreadable. The bit
# generator's type is part of the key: numpy.random.set_bit_generator can swap MT19937 out.
_NUMPY_GAUSS: dict[tuple[type, type], int] = {}


def _numpy_gauss_at(generator: Any) -> int:
    kinds = (type(generator), type(generator._bit_generator))
    at = _NUMPY_GAUSS.get(kinds)
    if at is None:
        at = _NUMPY_GAUSS[kinds] = _probe_numpy(generator)
    return at


def _probe_numpy(generator: Any) -> int:
    """Where a RandomState like ``generator`` keeps ``has_gauss``, checked against
    ``get_state`` on a private one of the same types; -1 if not found.

    numpy's RandomState (numpy/random/mtrand.pyx) holds a bitgen_t (a state pointer and
    four function pointers) followed by an aug_bitgen_t: a pointer back to that bitgen_t,
    int has_gauss, double gauss. The probe looks for that pointer in ``generator``.
    """
    if type(generator._bit_generator).__name__ != "MT19937":  # the only state it reads
        return -1
    size, pointer = type(generator).__basicsize__, ctypes.sizeof(ctypes.c_void_p)
    base = id(generator)
    for at in range(object.__basicsize__ + 5 * pointer, size - 16 - pointer + 1, pointer):
        if ctypes.c_void_p.from_address(base + at).value == base + at - 5 * pointer:
            gauss_at = at + pointer
            break
    else:
        return -1
    try:
        private = type(generator)(type(generator._bit_generator)(20231102))
        keys = torch.empty(_MT_WORDS, dtype=torch.uint32)
        for draw in (private.random_sample, private.standard_normal, private.standard_normal,
                     lambda: private.randint(0, 10, size=1000)):
            kind, words, *rest = private.get_state()
            if kind != "MT19937" or _read_numpy(private, gauss_at, keys) != rest or not (
                    keys.numpy() == words).all():
                return -1
            draw()
    except Exception:
        return -1
    return gauss_at
