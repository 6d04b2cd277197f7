"""The state-tree codec: a training state (nested dicts, lists, tuples, scalars, tensors,
DTensors) as a JSON skeleton plus its tensors in order, and back.

The worker's hook encodes what it saves with :func:`encode`; restore and export decode a
slot with :func:`unflatten` / :func:`load_state`. A DTensor is saved as its local shard plus
its mesh and placements, and rebuilt on the live mesh it was on.
"""

from __future__ import annotations

import base64
import collections
import functools
import itertools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from launcher import memory
from launcher.errors import CheckpointError

_SCALARS = frozenset({type(None), bool, int, float, str})
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_STR, _DUNDER = itertools.repeat(str), itertools.repeat("__")
_DICTS = frozenset({dict, collections.OrderedDict})
_TABLE_KEYS = frozenset({int, str})
_chain = itertools.chain.from_iterable
_json_str = json.encoder.encode_basestring_ascii


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2, tensor parallelism): only once something
    imported ``torch.distributed.tensor`` can one exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (any other tensor itself), read as the DTensor keeps it:
    ``to_local()`` is an autograd function, about 5 us a call, and a save asks for the
    shard of every parameter and optimizer state."""
    if not is_dtensor(tensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()  # type: ignore[attr-defined]


def _tensor_leaf(tensor: torch.Tensor, path: str, tensors: list[tuple[str, torch.Tensor]]
                 ) -> dict[str, Any]:
    """The skeleton node of a tensor; a DTensor is saved as its local shard plus what
    rebuilds it around that shard (mesh, placements, global shape and stride)."""
    if type(tensor) in _PLAIN_TENSORS or not is_dtensor(tensor):
        tensors.append((path, tensor))
        return {"__tensor__": len(tensors) - 1}
    tensors.append((path, local_shard(tensor)))
    return {"__dtensor__": len(tensors) - 1,
            "mesh": _mesh_key(tensor.device_mesh),  # type: ignore[attr-defined]
            "placements": [_placement(p, path) for p in tensor.placements],  # type: ignore[attr-defined]
            "shape": list(tensor.shape), "stride": list(tensor.stride())}


def _mesh_key(mesh: Any) -> str:
    return json.dumps([mesh.device_type, mesh.mesh.tolist(), list(mesh.mesh_dim_names or [])])


def _placement(placement: Any, path: str) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(placement).__name__ == "_StridedShard":
        return ["_StridedShard", placement.dim, placement.split_factor]
    if isinstance(placement, Shard):
        return ["Shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["Replicate"]
    if isinstance(placement, Partial):
        return ["Partial", placement.reduce_op]
    raise CheckpointError(f"cannot checkpoint {path}: DTensor placement {placement!r}")


def _dtensor(node: dict[str, Any], local: torch.Tensor, meshes: dict[str, Any] | None
             ) -> torch.Tensor:
    """Rebuild a saved DTensor around its ``local`` shard, on the live mesh it was on."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if meshes is None:
        raise CheckpointError("it holds sharded (DTensor) state, which only a restore into "
                              "the model that saved it can rebuild")
    mesh = meshes.get(node["mesh"])
    if mesh is None:
        raise CheckpointError(f"it holds a DTensor on device mesh {node['mesh']}, which "
                              "no DTensor of the model or optimizer is on")
    placements = []
    for kind, *args in node["placements"]:
        if kind == "_StridedShard":
            placements.append(_StridedShard(args[0], split_factor=args[1]))
        else:
            placements.append({"Shard": Shard, "Replicate": Replicate,
                               "Partial": Partial}[kind](*args))
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(node["shape"]), stride=tuple(node["stride"]))


def live_meshes(*trees: Any) -> dict[str, Any]:
    """The device meshes of the DTensors in ``trees`` (nested lists and dicts)."""
    meshes: dict[str, Any] = {}
    stack = list(trees)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and is_dtensor(item):
            meshes.setdefault(_mesh_key(item.device_mesh), item.device_mesh)  # type: ignore[attr-defined]
    return meshes


# Complexity above 10: it runs at every save, so leaves are handled inline.
def flatten(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:  # noqa: C901
    """JSON-able skeleton of ``obj``; tensors are replaced by their index in ``tensors``.

    This runs at every save, so leaves (scalars and tensors, nearly every node) are handled
    in the loops over their containers rather than by a call each.
    """
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if isinstance(obj, torch.Tensor):
        return _tensor_leaf(obj, path, tensors)
    if isinstance(obj, dict):
        if all(map(isinstance, obj, _STR)) and not any(map(str.startswith, obj, _DUNDER)):
            out = {}
            for k, v in obj.items():
                if type(v) in _SCALARS:
                    out[k] = v
                elif type(v) in _PLAIN_TENSORS:  # the common case, without a call
                    tensors.append((f"{path}/{k}", v))
                    out[k] = {"__tensor__": len(tensors) - 1}
                elif isinstance(v, torch.Tensor):
                    out[k] = _tensor_leaf(v, f"{path}/{k}", tensors)
                else:
                    out[k] = flatten(v, f"{path}/{k}", tensors)
            return out
        return {"__items__": [[k if type(k) in _SCALARS else flatten(k, f"{path}/<key>", tensors),
                               flatten(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (tuple, list)):
        if _SCALARS.issuperset(map(type, obj)):  # e.g. param ids: no recursion
            items = list(obj)
        else:
            items = [flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise CheckpointError(f"cannot checkpoint {path or 'value'}: unsupported type "
                          f"{type(obj).__name__} (use tensors, numbers, strings, lists, dicts)")


def encode(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]],
            memo: dict[str, tuple[Any, str, list[str]]]) -> str:
    """``json.dumps(flatten(obj, path, tensors), separators=(",", ":"))``, faster at every
    save after the first.

    A *tensor table* (a dict of plain tensors, like a model's state_dict, or of such dicts,
    like an optimizer's per-parameter state) has a skeleton that depends only on its keys
    and on where its tensors start in ``tensors``. ``memo`` (path -> (structure, JSON, tensor
    paths)) keeps the last table seen at each path; a table with the same structure takes
    its JSON from there instead of building and encoding a node per tensor. The structure
    holds every key with its exact type, so the JSON is exactly what encoding would give.
    (A memo of the parts without tensors, keyed by marshal's bytes of them, halved their
    cost on warm caches and saved nothing within a training loop: not kept.)
    """
    if type(obj) in _DICTS:
        structure = _table_structure(obj, len(tensors))
        if structure is not None:
            known = memo.get(path)
            if known is not None and known[0] == structure:
                values = obj.values()
                if not structure[1]:  # a dict of dicts of tensors
                    values = _chain(map(dict.values, values))
                tensors.extend(zip(known[2], values, strict=True))
                return known[1]
            base = len(tensors)
            text = json.dumps(flatten(obj, path, tensors), separators=(",", ":"))
            memo[path] = (structure, text, [p for p, _ in tensors[base:]])
            return text
        if any(type(v) in _DICTS for v in obj.values()) and all(
                map(isinstance, obj, _STR)) and not any(map(str.startswith, obj, _DUNDER)):
            # a dict of parts (the state, an optimizer's state_dict): encode each on its own
            return "{" + ",".join(f"{_json_str(k)}:{encode(v, f'{path}/{k}', tensors, memo)}"
                                  for k, v in obj.items()) + "}"
    return json.dumps(flatten(obj, path, tensors), separators=(",", ":"))


def _table_structure(obj: dict[Any, Any], base: int) -> tuple[Any, ...] | None:
    """What the skeleton of ``obj`` depends on, if ``obj`` is a tensor table (see
    ``encode``): its first tensor's index and its keys (for a dict of dicts, each dict's
    keys); None if it is not one. Outer keys of a dict of dicts must be exactly int or
    str, so that equal keys are the same key (True == 1, but encodes otherwise); inner
    keys are strings, which equal only strings. Every pass runs in C (``map``)."""
    values = obj.values()
    if _PLAIN_TENSORS.issuperset(map(type, values)):
        return (base, True, tuple(obj)) if all(map(isinstance, obj, _STR)) else None
    if not (_DICTS.issuperset(map(type, values)) and _TABLE_KEYS.issuperset(map(type, obj))
            and _PLAIN_TENSORS.issuperset(map(type, _chain(map(dict.values, values))))):
        return None
    inner = tuple(map(tuple, values))
    if not all(map(isinstance, _chain(inner), _STR)):
        return None
    return (base, False, tuple(obj), inner)


def unflatten(node: Any, tensors: list[torch.Tensor], meshes: dict[str, Any] | None = None
               ) -> Any:
    """The state tree of a skeleton; DTensors are rebuilt on the live ``meshes`` (see
    ``live_meshes``), and None refuses them."""
    if isinstance(node, list):
        return [unflatten(v, tensors, meshes) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__dtensor__" in node:
        return _dtensor(node, tensors[node["__dtensor__"]], meshes)
    if "__tuple__" in node:
        return tuple(unflatten(v, tensors, meshes) for v in node["__tuple__"])
    if "__items__" in node:
        return {unflatten(k, tensors, meshes): unflatten(v, tensors, meshes)
                for k, v in node["__items__"]}
    if "__bytes__" in node:
        return base64.b64decode(node["__bytes__"])
    if "__dtype__" in node:
        return dtype_of(node["__dtype__"])
    return {k: unflatten(v, tensors, meshes) for k, v in node.items()}


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a slot's metadata names: only those of ``memory.DTYPE_SIZES`` (a
    name is never looked up in torch as such: ``"save"`` would be a function)."""
    dtype = getattr(torch, name, None) if name in memory.DTYPE_SIZES else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"element type {name[:40]!r} is not one this torch saves")
    return dtype


def slot_tensor(buf: Any, entry: dict[str, Any]) -> torch.Tensor:
    dtype = dtype_of(entry["dtype"])
    shape = tuple(entry["shape"])
    nbytes = int(entry["nbytes"])
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                            offset=memory.HEADER_SIZE + int(entry["offset"]))
    tensor = flat.view(dtype).view(shape)
    device = entry.get("device", "cpu")
    return tensor.to(device) if device != "cpu" else tensor


Resolve = Callable[[int], tuple[Any, dict[str, Any]]]
"""The buffer and metadata of the committed copy of the same step that another rank of the
host wrote: where the tensors it keeps for the host's ranks are (see :func:`assign_shares`)."""


def assign_shares(sizes: list[int], shareable: list[bool], members: list[int]
                  ) -> list[int | None]:
    """Which of ``members`` (the ranks of one host) keeps each tensor that every member
    holds bit for bit (``shareable``: a data-parallel replica's parameters and optimizer
    state); None for the others, which each rank keeps itself. The largest tensor first,
    each to the member with the fewest bytes so far (ties: the lowest rank), as
    torch.distributed.checkpoint's deduplicating planner spreads replicated tensors over
    the ranks. A pure function of the list: every member computes the same answer."""
    owners: list[int | None] = [None] * len(sizes)
    load = dict.fromkeys(members, 0)
    for i in sorted((i for i, s in enumerate(shareable) if s), key=lambda i: (-sizes[i], i)):
        owner = min(members, key=lambda m: (load[m], m))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


def slot_tensors(buf: Any, meta: dict[str, Any], resolve: Resolve | None = None, *,
                 prefetched: dict[int, torch.Tensor] | None = None, cpu: bool = False
                 ) -> list[torch.Tensor]:
    """The tensors of a committed slot in the order its tree numbers them: those the slot
    holds (``meta["tensors"]``; ``prefetched`` replaces some of them, by their index
    there) and those another rank of the host keeps for it (``meta["shared"]``: index,
    owner rank, path, dtype, shape), read from the owner's copy of the same step through
    ``resolve``. With ``cpu``, CUDA tensors stay in the slot's memory."""
    prefetched = prefetched or {}
    own = [prefetched[i] if i in prefetched
           else slot_tensor(buf, {**entry, "device": "cpu"} if cpu else entry)
           for i, entry in enumerate(meta["tensors"])]
    shared = {int(item[0]): item for item in meta.get("shared") or []}
    if not shared:
        return own
    if resolve is None:
        owners = sorted({int(item[1]) for item in shared.values()})
        raise CheckpointError(f"it holds tensors that rank(s) {owners} of its host keep")
    copies: dict[int, tuple[Any, dict[str, dict[str, Any]]]] = {}
    tensors, mine = [], iter(own)
    for index in range(len(own) + len(shared)):
        if index not in shared:
            tensors.append(next(mine))
            continue
        _, owner, path, dtype, shape = shared[index]
        if owner not in copies:
            owner_buf, owner_meta = resolve(int(owner))
            copies[owner] = (owner_buf, {e["path"]: e for e in owner_meta["tensors"]})
        owner_buf, entries = copies[owner]
        entry = entries.get(path)
        if entry is None or entry["dtype"] != dtype or list(entry["shape"]) != list(shape):
            raise CheckpointError(f"rank {owner}'s copy does not hold {path} as "
                                  f"{dtype}{list(shape)}")
        tensors.append(slot_tensor(owner_buf, {**entry, "device": "cpu"} if cpu else entry))
    return tensors


def tensor_paths(meta: dict[str, Any]) -> list[str]:
    """The paths of a slot's tensors in the order its tree numbers them, shared included."""
    shared = {int(item[0]): str(item[2]) for item in meta.get("shared") or []}
    own = iter(entry["path"] for entry in meta["tensors"])
    return [shared[i] if i in shared else next(own)
            for i in range(len(meta["tensors"]) + len(shared))]


def replica_ranks(node: dict[str, Any], rank: int) -> set[int]:
    """The ranks whose local shard of the DTensor ``node`` describes holds the same
    elements as ``rank``'s: those at its coordinates on every mesh dimension the tensor
    is not replicated over (HSDP's shards repeat across its replicate dimension). A rank
    off the mesh has only itself."""
    fixed = tuple(d for d, placement in enumerate(node["placements"])
                  if placement[0] != "Replicate")
    return set(_replicas_on(node["mesh"], fixed, rank))


@functools.lru_cache(maxsize=256)
def _replicas_on(mesh_key: str, fixed: tuple[int, ...], rank: int) -> frozenset[int]:
    coordinates: dict[int, tuple[int, ...]] = {}
    stack: list[tuple[Any, tuple[int, ...]]] = [(json.loads(mesh_key)[1], ())]
    while stack:
        item, at = stack.pop()
        if isinstance(item, list):
            stack.extend((value, (*at, i)) for i, value in enumerate(item))
        else:
            coordinates[int(item)] = at
    here = coordinates.get(rank)
    if here is None:
        return frozenset({rank})
    return frozenset(other for other, there in coordinates.items()
                     if all(there[d] == here[d] for d in fixed))


def load_state(buf: Any, meta: dict[str, Any], resolve: Resolve | None = None
               ) -> dict[str, Any]:
    """The state tree a committed slot holds (``{"model": ..., "optimizer": ..., "extra": ...,
    "rng": ...}``, each key only if it was saved), read from ``buf`` (a slot's bytes: a mapped
    segment, a mapped persisted file, a private copy) as described by its metadata ``meta``.

    Every tensor is a CPU copy that owns its memory, whatever device it was saved from, so
    the result outlives ``buf``. Checksums are the caller's business (``memory.verify``).
    ``resolve`` finds the copies that hold the tensors it shares (:func:`slot_tensors`).
    """
    tensors = slot_tensors(buf, meta, resolve, cpu=True)
    state: dict[str, Any] = clone_tensors(unflatten(meta["tree"], tensors))
    return state


def clone_tensors(obj: Any, owned: frozenset[int] = frozenset(),
                  keep: Callable[[torch.Tensor], bool] | None = None) -> Any:
    """A copy of ``obj`` whose tensors own their memory (never alias a slot); tensors whose
    id is in ``owned`` own theirs already, and those ``keep`` accepts, are kept."""
    if type(obj) in _SCALARS:  # the most common values: no call for them below
        return obj
    if isinstance(obj, torch.Tensor):
        kept = id(obj) in owned or (keep is not None and keep(obj))
        return obj if kept else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: v if type(v) in _SCALARS else clone_tensors(v, owned, keep)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [v if type(v) in _SCALARS else clone_tensors(v, owned, keep) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tensors(v, owned, keep) for v in obj)
    return obj


def dtensor_nodes(tree: Any) -> list[dict[str, Any]]:
    """The DTensor nodes of a skeleton."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "__dtensor__" in node:
                found.append(node)
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _shard_box(node: dict[str, Any], mesh_shape: list[int], coordinate: list[int]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset of the shard at ``coordinate`` of a mesh of
    ``mesh_shape`` (torch's own arithmetic, uneven splits included)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements: list[Any] = []
    for kind, *args in node["placements"]:
        if kind == "Shard":
            placements.append(Shard(args[0]))
        elif kind == "Replicate":
            placements.append(Replicate())
        else:  # a pending reduction, or a strided shard (FSDP2 over tensor parallelism)
            raise CheckpointError(f"a DTensor placed as {kind} ({Partial.__name__} sums and "
                                  "strided shards cannot be resharded)")
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(node["shape"]), tuple(mesh_shape), list(coordinate), placements)
    return tuple(shape), tuple(offset)


def _coordinate(mesh: list[Any], rank: int, at: tuple[int, ...] = ()) -> list[int] | None:
    """Where ``rank`` sits in a mesh given as nested lists of ranks."""
    for i, item in enumerate(mesh):
        if isinstance(item, list):
            found = _coordinate(item, rank, (*at, i))
            if found is not None:
                return found
        elif item == rank:
            return [*at, i]
    return None


def reshard(copies: list[tuple[int, Any, dict[str, Any]]], template: int,
            meshes: dict[str, Any]) -> dict[str, Any]:
    """The state tree of this rank after the job changed its number of ranks, from the
    committed copies of every rank of the world that wrote them (``copies``: (old rank,
    buffer, metadata)). Each DTensor (Shard and Replicate placements) gets this rank's
    shard on the live mesh of the same dimensions, assembled from the parts of the old
    shards that overlap it; everything else (plain tensors, RNG, ``extra``) comes from
    the copy of old rank ``template``. The result's tensors own their memory where they
    were assembled and alias the buffers elsewhere (the caller copies them)."""
    import copy

    by_rank = {rank: (buf, meta) for rank, buf, meta in copies}

    def resolve(owner: int) -> tuple[Any, dict[str, Any]]:
        if owner not in by_rank:
            raise CheckpointError(f"no copy of rank {owner}, which keeps shares of others")
        return by_rank[owner]

    lists = {rank: slot_tensors(buf, meta, resolve) for rank, buf, meta in copies}
    template_meta = by_rank[template][1]
    tensors, paths = list(lists[template]), tensor_paths(template_meta)
    olds = [(rank, lists[rank], {tensor_paths(meta)[n["__dtensor__"]]: n
                                 for n in dtensor_nodes(meta["tree"])})
            for rank, _, meta in copies]
    tree = copy.deepcopy(template_meta["tree"])
    for node in dtensor_nodes(tree):
        index = node["__dtensor__"]
        path = paths[index]
        mesh = _live_mesh(node, meshes, path)
        tensors[index] = _assemble(node, mesh, tensors[index].dtype, path, olds)
        node["mesh"] = _mesh_key(mesh)
    return unflatten(tree, tensors, meshes)  # type: ignore[no-any-return]


def _live_mesh(node: dict[str, Any], meshes: dict[str, Any], path: str) -> Any:
    """The one live device mesh with the dimensions of the one ``node`` was saved on."""
    saved = json.loads(node["mesh"])  # [device type, ranks as nested lists, dim names]
    live = [m for key, m in meshes.items() if json.loads(key)[2] == saved[2]
            and m.ndim == len(_mesh_shape(saved[1]))]
    if len(live) != 1:
        raise CheckpointError(f"{path}: no single live device mesh like the one it was "
                              "saved on to reshard it onto")
    return live[0]


def _assemble(node: dict[str, Any], mesh: Any, dtype: torch.dtype, path: str,
              olds: list[tuple[int, list[torch.Tensor], dict[str, Any]]]) -> torch.Tensor:
    """This rank's shard on ``mesh`` of the DTensor ``node`` describes, copied from the
    parts of the old ranks' shards (``olds``: rank, its tensors in tree order, DTensor
    nodes by path) that overlap it; every element must be covered."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointError(f"{path}: this rank is not on the live device mesh")
    shape, offset = _shard_box(node, list(mesh.shape), coordinate)
    local = torch.empty(shape, dtype=dtype)
    filled, done = 0, set()
    for rank, old_tensors, paths in olds:
        old = paths.get(path)
        if old is None:
            raise CheckpointError(f"{path}: rank {rank}'s copy does not hold it")
        old_mesh = json.loads(old["mesh"])[1]
        where = _coordinate(old_mesh, rank)
        box = None if where is None else _shard_box(old, list(_mesh_shape(old_mesh)), where)
        if box is None or box in done:
            continue  # no shard on that mesh, or a replica of one already copied
        done.add(box)
        old_shape, old_offset = box
        lo = [max(a, b) for a, b in zip(offset, old_offset, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in
              zip(offset, shape, old_offset, old_shape, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        src = old_tensors[old["__dtensor__"]]
        local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))] = src[
            tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, old_offset, strict=True))]
        filled += math.prod(h - low for low, h in zip(lo, hi, strict=True))
    if filled != local.numel():
        raise CheckpointError(f"{path}: the old shards cover {filled} of the "
                              f"{local.numel()} elements of this rank's shard")
    return local


def _mesh_shape(nested: Any) -> tuple[int, ...]:
    """The shape of a mesh given as nested lists."""
    shape = []
    while isinstance(nested, list):
        shape.append(len(nested))
        nested = nested[0] if nested else None
    return tuple(shape)
