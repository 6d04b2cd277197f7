"""The torch internals gemini relies on: each one holds in the installed torch, the check
at the start of ``gemini run`` names the first that does not in one line, and the list
covers every private torch name the launcher's source uses."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.tensor import placement_types

import launcher
from launcher import rendezvous_state, torch_boundary
from launcher.errors import ConfigError, TorchUnsupportedError
from launcher.torch_boundary import INTERNALS, Internal, check, problem

SOURCES = sorted(Path(launcher.__file__).parent.rglob("*.py"))

#: Private names the launcher's source uses that the scan below takes for torch's, and why
#: they are not in the registry.
UNREGISTERED = {
    "_local_tensor": "launcher.codec reads a DTensor's local shard through it as a shortcut, "
                     "and through the public to_local() where it is missing",
    "_metadata": "launcher.store.etcd sets it on the etcd client's watcher",
    "_start_method": "launcher.integrations.lightning reads it from a Lightning strategy "
                     "(torch's LocalElasticAgent has an attribute of that name too)",
    "_stopped": "launcher.store reads it of its own lease keep-alives",
    "_value2member_map_": "Python's Enum, read of launcher.memory's SlotState (torch's "
                          "_Action is an Enum too)",
}


@pytest.fixture(autouse=True)
def _fresh_check() -> Iterator[None]:
    """Each test asks the installed torch anew, and leaves no answer from a patched one."""
    check.cache_clear()
    yield
    check.cache_clear()


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda internal: internal.name)
def test_internal_holds(internal: Internal) -> None:
    owner = importlib.import_module(internal.module)
    *parents, leaf = internal.path.split(".")
    owner = functools.reduce(getattr, parents, owner)
    if internal.instance:
        assert leaf in torch_boundary.class_names(owner)
    elif isinstance(owner, type):  # its own or a base's, not its metaclass's (__call__)
        assert any(leaf in vars(klass) for klass in owner.__mro__)
    else:
        assert hasattr(owner, leaf)
    assert problem(internal) is None  # and its parameters and fields are as registered


def test_check_passes_on_the_installed_torch() -> None:
    check()


def test_a_missing_internal_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dynamic_rendezvous._RendezvousJoinOp, "__call__")
    with pytest.raises(TorchUnsupportedError) as raised:
        check()
    message = str(raised.value)
    assert message.startswith(f"torch {torch.__version__} has no torch.distributed.elastic."
                              "rendezvous.dynamic_rendezvous._RendezvousJoinOp.__call__ "
                              "(patched by launcher.rendezvous): ")
    assert "supports torch 2.13-2.14 (tested)" in message
    assert "\n" not in message
    assert isinstance(raised.value, ConfigError)  # exit code 2, as for other bad input


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def delay(secs: float) -> None:
        pass

    monkeypatch.setattr(dynamic_rendezvous, "_delay", delay)
    with pytest.raises(TorchUnsupportedError, match=r"changed the parameters of \S+\._delay "
                       r"\(patched by launcher\.rendezvous\) to \(secs\)"):
        check()


def test_a_changed_cpp_signature_is_named() -> None:
    swapped = Internal(module="torch._C._distributed_c10d", path="PrefixStore", use="called",
                       by="launcher.elastic_agent", params=("store", "prefix"))
    assert problem(swapped) == ("changed the parameters of torch._C._distributed_c10d."
                                "PrefixStore (called by launcher.elastic_agent) to "
                                "(prefix, store)")


def test_an_instance_attribute_the_class_no_longer_uses_is_missing() -> None:
    gone = Internal(module=dynamic_rendezvous.__name__,
                    path="DynamicRendezvousHandler._no_such_attribute", use="read",
                    by="launcher.rendezvous", instance=True)
    assert (problem(gone) or "").startswith("has no torch.distributed.elastic.rendezvous."
                                             "dynamic_rendezvous.DynamicRendezvousHandler."
                                             "_no_such_attribute (read by launcher.rendezvous)")


def test_an_older_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(TorchUnsupportedError,
                       match=r"^torch 2\.4\.1 is older than gemini supports: gemini \S+ "
                             r"supports torch 2\.13-2\.14 \(tested\)"):
        check()


def test_a_newer_torch_is_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch newer than the tested ones passes where every internal holds, the worker's
    too, and is refused when one of the worker's is missing (which a tested release is
    not checked for at start: the tests resolved them)."""
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    check()
    check.cache_clear()
    monkeypatch.delattr(placement_types, "_StridedShard")
    with pytest.raises(TorchUnsupportedError, match=r"^torch 2\.99\.0 has no \S+\._StridedShard "
                                                    r"\(called by launcher\.codec\)"):
        check()
    check.cache_clear()
    monkeypatch.undo()
    monkeypatch.delattr(placement_types, "_StridedShard")
    check()


def test_the_rendezvous_state_codec_writes_every_field_torch_has() -> None:
    """gemini encodes torch's rendezvous state field by field: exactly the fields the
    registry holds torch to."""
    (state,) = [i for i in INTERNALS if i.path == "_RendezvousState"]
    encoded = rendezvous_state.encode(dynamic_rendezvous._RendezvousState(), None)
    body = json.loads(encoded.split(b" ", 3)[3])
    assert sorted(body) == sorted(state.attributes)


# -- the list covers the source -------------------------------------------------------------

def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_bindings(tree: ast.AST) -> dict[str, object]:
    """The torch objects a module imports, by the names it binds them to."""
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                found = getattr(module, alias.name, None)
                if found is None:  # a submodule not imported by its package
                    found = importlib.import_module(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = found
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    name = alias.asname or alias.name.split(".")[0]
                    bound[name] = importlib.import_module(alias.name if alias.asname else name)
    return bound


class _PrivateNames(ast.NodeVisitor):
    """The private attribute names a module uses (``x._name``, ``getattr(x, "_name")``)
    and the torch objects it reaches (what it imports, and dotted names from there:
    ``torch.nn.Module``). A name of ``self`` in a class of its own counts only where a
    torch base class has that name too (``inherited``)."""

    def __init__(self, bound: dict[str, object]) -> None:
        self.bound = bound
        self.classes: list[list[type]] = []  # the torch bases of each enclosing class
        self.found: set[str] = set()
        self.inherited: set[str] = set()
        self.reached: list[object] = list(bound.values())

    def _resolve(self, node: ast.expr) -> object:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.bound:
            return None
        return functools.reduce(lambda found, part: getattr(found, part, None), parts,
                                self.bound[node.id])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self._resolve(base) for base in node.bases]
        self.classes.append([base for base in bases if isinstance(base, type)])
        self.generic_visit(node)
        self.classes.pop()

    def _note(self, base: ast.expr, name: str) -> None:
        if not _private(name):
            return
        if self.classes and isinstance(base, ast.Name) and base.id in ("self", "cls"):
            if any(name in torch_boundary.class_names(torch) for torch in self.classes[-1]):
                self.inherited.add(name)
        else:
            self.found.add(name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._note(node.value, node.attr)
        self.reached.append(self._resolve(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            self._note(node.args[0], node.args[1].value)
        self.generic_visit(node)


def _names_of(found: object) -> set[str]:
    """The private names of a torch module (its classes' included) or class (its
    instances' included), or of the class of a torch object."""
    if isinstance(found, types.ModuleType):
        names = set(vars(found))
        for value in vars(found).values():
            if isinstance(value, type) and value.__module__.startswith("torch"):
                names |= torch_boundary.class_names(value)
    elif found is None or not type(found).__module__.startswith("torch"):
        names = set() if not isinstance(found, type) else set(torch_boundary.class_names(found))
    else:
        names = set(torch_boundary.class_names(type(found)))
    return {name for name in names if _private(name)}


def test_every_private_torch_import_is_registered() -> None:
    registered = {(i.module, i.path.split(".")[0]) for i in INTERNALS}
    missing = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module is not None and module.split(".")[0] == "torch":
                private_module = any(map(_private, module.split(".")))
                missing += [f"{path.name}: {module}.{alias.name}" for alias in node.names
                            if (private_module or _private(alias.name))
                            and (module, alias.name) not in registered]
    assert not missing, "not in launcher.torch_boundary.INTERNALS: " + ", ".join(missing)


def test_every_private_torch_attribute_is_registered() -> None:
    """Every private name the launcher uses that is also a private name of a torch module
    or class it reaches, or of one in the registry, is registered (or excused)."""
    registered = {part for i in INTERNALS for part in i.path.split(".")}
    reached: list[object] = []
    for internal in INTERNALS:
        found: object = importlib.import_module(internal.module)
        reached.append(found)
        for part in internal.path.split("."):
            found = getattr(found, part, None)
            reached.append(found)
    used: dict[str, set[str]] = {}
    inherited: set[str] = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        visitor = _PrivateNames(_torch_bindings(tree))
        visitor.visit(tree)
        reached += visitor.reached
        for name in visitor.found | visitor.inherited:
            used.setdefault(name, set()).add(path.name)
        inherited.update(visitor.inherited)
    torch_names = inherited.union(*map(_names_of, reached))
    missing = sorted(f"{name} ({', '.join(sorted(files))})" for name, files in used.items()
                     if name in torch_names and name not in registered and name not in UNREGISTERED)
    assert not missing, "not in launcher.torch_boundary.INTERNALS: " + ", ".join(missing)
    assert set(UNREGISTERED) <= used.keys()  # no stale excuses


def test_every_registered_private_name_is_still_used() -> None:
    """A name gemini stopped using must leave the list: the check would refuse a torch
    release for it."""
    stale = []
    for internal in INTERNALS:
        source = (Path(launcher.__file__).parent / f"{internal.by.split('.')[1]}.py").read_text()
        leaf = internal.path.rpartition(".")[2]
        if (_private(leaf) or leaf == "__call__") and leaf not in source:
            stale.append(f"{internal.name} ({internal.by})")
    assert not stale, "registered but no longer used: " + ", ".join(stale)
