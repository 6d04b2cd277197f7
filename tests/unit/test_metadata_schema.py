"""Property-based tests (hypothesis) of slot metadata validation, through every reader.

A slot's metadata is hash-checked, but the hash only says the bytes are what their writer
wrote: a peer with the secret, a co-tenant of a persist directory, a bug. Metadata built
from a valid slot and then mutated at random (or replaced by adversarial values: torch
attribute names as dtypes, indexes out of range, shapes that lie about their bytes, deep
nesting, ``null``) is read by each reader: restore (read, verify, decode), replica
receive (stream verifier, commit), the persisted-file reader, inspect (shared memory and
--dir) and export's reader. The property: each either succeeds, with a state of data
only, or raises CheckpointError; nothing else escapes, and nothing is ever decoded into
anything but tensors, scalars, bytes, dtypes and containers.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import codec, export, memory, persist
from launcher.errors import CheckpointError

RUN = "schema-run"
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _valid() -> tuple[dict[str, Any], bytes]:
    """The metadata and data bytes of a small valid slot (every kind of tree node)."""
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).view(2, 3),
                       "b": torch.ones(3, dtype=torch.bfloat16)},
             "extra": {"lr": 0.5, "k": (1, b"x\x00"), "dt": torch.float16, 3: [None, True],
                       (1, "t"): "tuple key", "n": torch.zeros(0, dtype=torch.int64)}}
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = codec.flatten(state, "", tensors)
    records, data = [], bytearray()
    for path, tensor in tensors:
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        offset = len(data)
        data += raw + b"\0" * (-len(raw) % memory.ALIGN)
        records.append({"path": path, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "offset": offset, "nbytes": len(raw),
                        "device": "cpu", "xxh3": f"{xxhash.xxh3_64_intdigest(raw):016x}"})
    meta = {"step": 3, "replicated": False, "sharded": False, "tensors": records,
            "blocks": [], "tree": tree}
    return meta, bytes(data)


VALID_META, DATA = _valid()

ADVERSARIAL = st.sampled_from([
    None, True, -1, 0, 1, 2, 7, 2**31, 2**64, -(2**63), 1.5, float("inf"), "", "save", "os",
    "load", "__import__", "float32", "uint8", "cuda:0", "../x", "00000000000000zz",
    "0000000000000000", "@", [], {}, [[]], [-1], [2**40, 2**40], {"__dtype__": "os"},
    {"__dtype__": "save"}, {"__tensor__": -1}, {"__tensor__": 99}, {"__tensor__": True},
    {"__bytes__": "!!"}, {"__bytes__": 5}, {"__items__": [[[1], 2]]}, {"__items__": [[1]]},
    {"__tuple__": 3}, {"__weird__": 1}, {"__tensor__": 0, "x": 1},
    {"__dtensor__": 0, "mesh": "[", "placements": [], "shape": [], "stride": []},
    {"__dtensor__": 0, "mesh": '["cpu", [0, 1], []]', "placements": [["Shard", 0]],
     "shape": [4], "stride": [1]},
    [0, 1, "x", "float32", [2]], [[0, 0, "/model/w", "float32", [2, 3]]],
])
JSON = st.recursive(
    st.one_of(ADVERSARIAL, st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
              st.booleans(), st.none()),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(
                                   ["tree", "tensors", "shared", "blocks", "path", "dtype",
                                    "shape", "offset", "nbytes", "xxh3", "device",
                                    "__tensor__", "__dtype__", "__items__", "x"]),
                                   children, max_size=4)),
    max_leaves=12)


def _places(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position (path of keys and indexes) in a JSON value."""
    found = [at]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _places(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _places(value, (*at, i))
    return found


def _replace(node: Any, at: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not at:
        return value
    copy = json.loads(json.dumps(node))
    parent = copy
    for key in at[:-1]:
        parent = parent[key]
    if delete:
        del parent[at[-1]]
    else:
        parent[at[-1]] = value
    return copy


@st.composite
def metadata(draw: st.DrawFn) -> bytes:
    """Raw metadata: the valid one mutated once or twice, random JSON, or deep nesting."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "random", "deep"]))
    if kind == "random":
        return json.dumps(draw(JSON)).encode()
    if kind == "deep":
        depth = draw(st.integers(60, 5000))
        return (b'{"tensors":[],"tree":' + b"[" * depth + b"]" * depth + b"}")
    meta: Any = VALID_META
    for _ in range(draw(st.integers(1, 2))):
        places = _places(meta)
        at = draw(st.sampled_from(places))
        delete = bool(at) and draw(st.booleans()) and draw(st.booleans())
        meta = _replace(meta, at, draw(JSON), delete)
    return json.dumps(meta).encode()


def _header(raw: bytes, state: memory.SlotState = memory.SlotState.COMMITTED
            ) -> memory.SlotHeader:
    meta_offset = memory.HEADER_SIZE + len(DATA)
    return memory.SlotHeader(state, 3, 7, 0, 2, len(DATA), meta_offset, len(raw),
                             xxhash.xxh3_64_intdigest(raw), meta_offset + len(raw), RUN)


def _slot(raw: bytes) -> tuple[mmap.mmap, memory.SlotHeader]:
    """A committed slot (private memory) holding ``DATA`` and the metadata ``raw``."""
    header = _header(raw)
    buf = mmap.mmap(-1, header.meta_offset + len(raw))
    buf[memory.HEADER_SIZE:memory.HEADER_SIZE + len(DATA)] = DATA
    memory.write_commit(buf, step=header.step, seq=header.seq, rank=0, world_size=2,
                        run_id=RUN, data_len=len(DATA), meta=raw)
    committed = memory.read_header(buf)
    assert committed is not None
    return buf, committed


def _only_data(obj: Any) -> None:
    """Fail unless ``obj`` is made of containers, scalars, bytes, tensors and dtypes."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _only_data(key)
            _only_data(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _only_data(value)
    else:
        assert isinstance(obj, (type(None), bool, int, float, str, bytes, torch.Tensor,
                                torch.dtype)), f"decoded a {type(obj).__name__}: {obj!r}"
        assert not isinstance(obj, (types.ModuleType, types.FunctionType))


def _restore(raw: bytes) -> None:
    """What a worker's restore does with its slot: read, verify, decode."""
    buf, header = _slot(raw)
    meta = memory.read_meta(buf, header)
    memory.verify(buf, header, meta)
    _only_data(codec.load_state(buf, meta))
    _only_data(codec.unflatten(meta["tree"], codec.slot_tensors(buf, meta, None, cpu=True), {}))


def _receive(raw: bytes) -> None:
    """What a host receiving a replica does: verify while the bytes arrive, commit."""
    header = _header(raw)
    buf = mmap.mmap(-1, header.capacity)
    memory.set_state(buf, memory.SlotState.WRITING)
    verifier = memory.stream_verifier(buf, header, raw)
    buf[memory.HEADER_SIZE:memory.HEADER_SIZE + len(DATA)] = DATA
    verifier.advance(len(DATA))
    memory.commit_received(buf, header, raw, verifier)
    assert memory.read_header(buf) is not None


def _publish(directory: Path, raw: bytes) -> Path:
    """The slot as a published persisted file of rank 0, step 3 (with its manifest)."""
    buf, header = _slot(raw)
    path = persist.slot_path(directory, RUN, 0, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(buf))
    manifest = persist.Manifest(RUN, 0, 3, header.seq, 2, len(buf),
                                xxhash.xxh3_64_intdigest(buf[:memory.HEADER_SIZE]),
                                header.meta_hash, "h0", time.time())
    persist.manifest_path(path).write_bytes(manifest.to_json())
    return path


def _persisted(directory: Path, raw: bytes) -> None:
    """The persisted-file reader (restore from the persistent tier, export --from-dir)."""
    path = _publish(directory, raw)
    with persist.read_slot_file(path) as image:
        _only_data(codec.load_state(image.buf, image.meta))


def _exported(directory: Path, raw: bytes) -> None:
    """Export's reader (``gemini export --from-dir``): the newest verified step, decoded."""
    _publish(directory, raw)
    with export.open_checkpoint(RUN, rank=0, directory=directory) as image:
        _only_data(codec.load_state(image.buf, image.meta))


def _inspected(directory: Path, raw: bytes) -> None:
    """``gemini inspect`` of shared memory and of --dir: a row per slot, never an error."""
    buf, _ = _slot(raw)
    path = directory / memory.slot_name(memory.segment_prefix(RUN, "h0"), 0, 0)
    path.write_bytes(bytes(buf))
    segment = memory.Segment(path.name, os.open(path, os.O_RDWR), len(buf), populate=False)
    try:
        info = memory.describe(segment)
    finally:
        segment.close()
    assert info.error is not None or info.meta is not None
    _publish(directory, raw)
    for found in persist.inspect_dir(directory, RUN):
        assert found.error is not None or found.meta is not None


def _outcome(read: Any, *args: Any) -> str:
    """"ok" or "refused"; valid DTensor state counts as "ok" where a reader decodes it
    without the live model (only a restore into that model can rebuild it, a receiver
    takes it as it is)."""
    try:
        read(*args)
    except CheckpointError as exc:
        assert str(exc) and "\n" not in str(exc)
        return "ok" if "only a restore into the model that saved it" in str(exc) else "refused"
    return "ok"


def test_the_valid_slot_reads_everywhere(tmp_path: Path) -> None:
    """The baseline the mutations start from passes every reader (else they prove nothing)."""
    raw = json.dumps(VALID_META).encode()
    for read, args in [(_restore, (raw,)), (_receive, (raw,)),
                       (_persisted, (tmp_path / "p", raw)), (_exported, (tmp_path / "e", raw))]:
        assert _outcome(read, *args) == "ok", read
    (tmp_path / "i").mkdir()
    _inspected(tmp_path / "i", raw)


@pytest.mark.parametrize("lie", [
    ("tree", {"extra": {"x": {"__dtype__": "os"}}}),
    ("tree", {"extra": {"x": {"__dtype__": "save"}}}),
    ("tree", {"extra": {"x": {"__tensor__": -1}}}),
    ("dtype", "save"),
    ("shape", [4, 4]),
    ("nbytes", 1 << 40),
    ("root", None),
])
def test_hash_valid_lies_are_refused_by_every_reader(tmp_path: Path, lie: tuple[str, Any]
                                                     ) -> None:
    """The issue's cases: a dtype that names a torch function or module, a module in
    ``extra``, a shape whose bytes are not the tensor's, ``null`` metadata: one clean
    CheckpointError from each reader (the module was restored into ``extra`` before)."""
    key, value = lie
    meta: Any = json.loads(json.dumps(VALID_META))
    if key == "root":
        meta = value
    elif key == "tree":
        meta["tree"] = value
    else:
        meta["tensors"][0][key] = value
    raw = json.dumps(meta).encode()
    assert _outcome(_restore, raw) == "refused"
    assert _outcome(_receive, raw) == "refused"
    assert _outcome(_persisted, tmp_path / "p", raw) == "refused"
    assert _outcome(_exported, tmp_path / "e", raw) == "refused"
    (tmp_path / "i").mkdir()
    _inspected(tmp_path / "i", raw)
    with pytest.raises(CheckpointError, match="malformed metadata"):
        memory.parse_meta(raw, _header(raw))


@FAST
@given(raw=metadata())
def test_any_metadata_is_read_or_refused_cleanly_by_every_reader(raw: bytes) -> None:
    """Random and adversarial metadata (hash-valid) through restore, replica receive, the
    persisted-file reader, export's reader and inspect: success with data only, or one
    CheckpointError; and all readers agree, since they share one validation."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "i").mkdir()
        outcomes = {_outcome(_restore, raw), _outcome(_receive, raw),
                    _outcome(_persisted, where / "p", raw), _outcome(_exported, where / "e", raw)}
        _inspected(where / "i", raw)
    assert len(outcomes) == 1, outcomes


def test_the_dtype_allow_list_is_torchs() -> None:
    """Every allowed name is a torch dtype of the size the schema says, spelled as the
    writer spells it; nothing else maps to a dtype."""
    for name, size in memory.DTYPE_SIZES.items():
        dtype = codec.dtype_of(name)
        assert dtype.itemsize == size and str(dtype) == f"torch.{name}"
    for name in ("save", "os", "load", "Tensor", "float"):
        with pytest.raises(CheckpointError):
            codec.dtype_of(name)
