"""Unit tests of launcher.config: precedence, validation, file and environment parsing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.config import (
    DEFAULT_RUN_ROOT,
    RunConfig,
    env_values,
    field_docs,
    gemini_flags,
    read_config_file,
    resolve,
    shown_default,
)
from launcher.errors import ConfigError


def test_defaults_match_torchrun() -> None:
    import torch.distributed.run as torchrun

    parsed = vars(torchrun.get_args_parser().parse_args(["x.py"]))
    config = RunConfig()
    for name in ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_id", "max_restarts",
                 "monitor_interval", "start_method", "role", "redirects", "tee",
                 "master_addr", "master_port", "node_rank", "signals_to_handle"):
        assert getattr(config, name) == parsed[name], name


def test_precedence_cli_over_env_over_file() -> None:
    file_values = {"nproc_per_node": "3", "max_restarts": 1, "role": "file"}
    environ = {"GEMINI_MAX_RESTARTS": "2", "GEMINI_ROLE": "env"}
    config = resolve(cli={"role": "cli"}, environ=environ, file_values=file_values)
    assert (config.nproc_per_node, config.max_restarts, config.role) == ("3", 2, "cli")


def test_gemini_env_beats_torchrun_env() -> None:
    assert env_values({"PET_NNODES": "2", "GEMINI_NNODES": "3"}) == {"nnodes": "3"}
    assert env_values({"PET_NNODES": "2"}) == {"nnodes": "2"}


@pytest.mark.parametrize("value", ["0", "2:1", "a", "1:2:3", "-1", ""])
def test_malformed_nnodes(value: str) -> None:
    with pytest.raises(ConfigError, match="nnodes"):
        RunConfig(nnodes=value)


@pytest.mark.parametrize("value,expected", [("4", (4, 4)), ("1:4", (1, 4)), (" 2 ", (2, 2))])
def test_nnodes(value: str, expected: tuple[int, int]) -> None:
    assert RunConfig(nnodes=value).min_max_nodes == expected


@pytest.mark.parametrize("kwargs", [
    {"nproc_per_node": "0"}, {"nproc_per_node": "many"}, {"max_restarts": -1},
    {"start_method": "thread"}, {"redirects": "5"}, {"rdzv_conf": "novalue"},
    {"module": True, "no_python": True}, {"local_ranks_filter": "0,a"},
    {"preload": "a b"}, {"preload": "mypkg,"}, {"preload": "1pkg"}, {"preload": "a..b"},
])
def test_invalid_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RunConfig(**kwargs)  # type: ignore[arg-type]


def test_preload_takes_module_names() -> None:
    assert RunConfig(preload="mypkg.model,_private,pkg2").preload == "mypkg.model,_private,pkg2"


def test_file_unknown_key_suggests(tmp_path: Path) -> None:
    path = tmp_path / "gemini.yaml"
    path.write_text("nproc-per-nod: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'nproc_per_node'"):
        read_config_file(path)


def test_file_dash_keys_and_types(tmp_path: Path) -> None:
    path = tmp_path / "gemini.yaml"
    path.write_text("nproc-per-node: 2\nmax_restarts: 3\nstandalone: true\n")
    assert read_config_file(path) == {"nproc_per_node": "2", "max_restarts": 3,
                                      "standalone": True}


@pytest.mark.parametrize("text,match", [
    ("max_restarts: many\n", "not a valid int"),
    ("- a\n- b\n", "mapping"),
    ("nnodes: [\n", "line"),
    ("standalone: maybe\n", "not a valid bool"),
])
def test_file_invalid(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "gemini.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_config_file(path)


def test_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_config_file(tmp_path / "missing.yaml")


def test_env_bad_value() -> None:
    with pytest.raises(ConfigError, match="GEMINI_MAX_RESTARTS"):
        env_values({"GEMINI_MAX_RESTARTS": "x"})


def test_template_config_is_valid(tmp_path: Path) -> None:
    from importlib import resources

    text = resources.files("gemini_templates").joinpath("gemini.yaml").read_text()
    path = tmp_path / "gemini.yaml"
    path.write_text(text)
    assert RunConfig(**read_config_file(path)) == RunConfig()



def _documented_flags() -> dict[str, str]:
    """docs/configuration.md's flag table: each flag of a row's first cell -> the row's
    default cell, without its code marks."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    found = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `--") and len(cells) >= 3:
            for flag in re.findall(r"`(--[a-z-]+)", cells[0]):
                found[flag] = cells[1].replace("`", "")
    return found


def test_every_flag_is_documented_with_its_default() -> None:
    """``gemini run``'s own flags come from RunConfig (help = the field's docstring,
    default = the field's); docs/configuration.md lists each with the same default, and
    every field has a docstring to be its help."""
    documented = _documented_flags()
    docs = field_docs()
    for flag in gemini_flags():
        assert docs.get(flag.key), f"RunConfig.{flag.key} has no docstring (its --help)"
        assert flag.names[0] in documented, f"{flag.names[0]} is missing in docs/configuration.md"
        shown = shown_default(flag.key)
        assert documented[flag.names[0]].startswith(shown), (flag.names[0], shown)
        assert flag.help.endswith(f"[default: {shown}]")


def test_flag_help_names_flags_not_fields() -> None:
    """A docstring's ``a_field`` reads as its flag in the help."""
    help_of = {flag.key: flag.help for flag in gemini_flags()}
    assert "--store-key" in help_of["store_cert"] and "``" not in help_of["store_cert"]
    assert help_of["standby"].endswith("[default: standby]")
    assert help_of["exclude_divergent"].endswith("[default: no-exclude-divergent]")
    assert help_of["host_ttl"].endswith("[default: 10]")


def test_the_config_template_names_every_key_with_its_default() -> None:
    """``gemini template config`` shows each of gemini's keys; where it shows the default
    (a key whose example is not a default, a store URL say, has its default computed),
    it is RunConfig's."""
    from importlib import resources

    import yaml

    text = resources.files("gemini_templates").joinpath("gemini.yaml").read_text()
    for flag in gemini_flags():
        line = re.search(rf"^#? ?{flag.key}: (.*?)(\s+#.*)?$", text, re.M)
        assert line, f"{flag.key} is not in the template"
        field = RunConfig.__dataclass_fields__[flag.key]
        if not field.metadata.get("shown") and field.default not in ("", DEFAULT_RUN_ROOT):
            assert yaml.safe_load(line.group(1)) == field.default, flag.key
