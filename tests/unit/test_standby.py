"""What a standby imports before it waits (``launcher.standby.warm_recorded``), in fresh
interpreters: the import list a worker recorded, checked against where this interpreter
finds each module, and never a reason to fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = ("import sys; from launcher.standby import warm_recorded; n = warm_recorded(lambda: False); "
         "print(n, *(m in sys.modules for m in ('xml.dom.minidom', 'email.mime.text', 'csv')))")


def _warm(run_dir: Path, **env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**os.environ, "GEMINI_RUN_DIR": str(run_dir), **env}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _origin(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    return spec.origin


def test_recorded_modules_are_imported_only_from_the_file_recorded(tmp_path: Path) -> None:
    (tmp_path / "imports.json").write_text(json.dumps({"modules": [
        ["xml", _origin("xml")], ["xml.dom", _origin("xml.dom")],
        ["xml.dom.minidom", "/elsewhere/xml/dom/minidom.py"],  # found elsewhere here: skipped
        ["email", _origin("email")], ["email.mime", _origin("email.mime")],
        ["email.mime.text", _origin("email.mime.text")],
        ["no_such_module_anywhere", "/nowhere/no_such_module_anywhere.py"]]}))
    count, minidom, text, _ = _warm(tmp_path)
    assert (minidom, text) == ("False", "True") and int(count) >= 3


def test_preload_names_are_imported_and_a_bad_list_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "imports.json").write_text("{not json")
    assert _warm(tmp_path, GEMINI_PRELOAD="xml.dom.minidom,no_such_module")[1:3] == [
        "True", "False"]
    (tmp_path / "imports.json").unlink()
    os.mkfifo(tmp_path / "imports.json")  # never opened for writing: must not hang
    assert _warm(tmp_path)[0] == "0"


@pytest.mark.parametrize("listed", [{"modules": [["csv", 5]]}, {"modules": "csv"}, []])
def test_a_list_of_the_wrong_shape_imports_nothing_listed(tmp_path: Path, listed: object) -> None:
    (tmp_path / "imports.json").write_text(json.dumps(listed))
    assert _warm(tmp_path)[0] == "0"
