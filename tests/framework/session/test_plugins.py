"""``--import`` modules are part of a run (issue 48, item 3): a saved configuration and the run's
metadata record each with a hash of its source; ``--config`` imports them again; a module that
cannot be found gets one line naming the ``--import`` to pass."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import yaml

from framework import REGISTRIES
from framework.config_fields import ConfigError
from framework.session.run_config import RunConfig

MODULE = "selfspec_test_plugin_mod"
SOURCE = textwrap.dedent(
    """
    from dataclasses import dataclass
    from framework import LayerPlan, LayerSelector, register_selector
    from framework.config_fields import param

    @dataclass(frozen=True)
    class EveryThirdConfig:
        offset: int = param(0, help="first block whose MLP is skipped")

    @register_selector("plugin_every_third", config=EveryThirdConfig)
    class EveryThird(LayerSelector):
        def plan(self, state):
            n = state.info.num_layers
            return LayerPlan.from_indices(n, mlp=range(self.config.offset, n, 3))
    """
)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module of one's own on the path (removed, with its selector, afterwards)."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / f"{MODULE}.py"
    sys.modules.pop(MODULE, None)
    REGISTRIES["selector"].unregister("plugin_every_third")


def _forget():
    sys.modules.pop(MODULE, None)
    REGISTRIES["selector"].unregister("plugin_every_third")


def test_a_saved_configuration_records_its_imports_and_reads_them_back(plugin, tmp_path):
    cfg = RunConfig.from_preset(
        None, imports=(MODULE,), selector="plugin_every_third", **{"selector.offset": 1}
    )
    saved = cfg.save(tmp_path / "run.config.yaml")
    data = yaml.safe_load(saved.read_text())
    (entry,) = data["method"]["imports"]
    assert entry["module"] == MODULE and len(entry["sha256"]) == 16
    assert cfg.describe()["imports"] == [entry]  # the metadata too
    _forget()  # a new process: nothing registered
    again = RunConfig.load(saved)
    assert again.method.selector.name == "plugin_every_third" and again.method.imports == (MODULE,)
    assert again.to_dict() == data


def test_a_changed_source_is_imported_with_a_warning(plugin, tmp_path):
    saved = RunConfig.from_preset(None, imports=(MODULE,), selector="plugin_every_third").save(
        tmp_path / "c.yaml"
    )
    _forget()
    plugin.write_text(SOURCE + "\n# edited\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=f"--import {MODULE}: its source changed"):
        RunConfig.load(saved)
    _forget()
    plugin.write_text(SOURCE, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunConfig.load(saved)  # the same source: no warning


def test_a_missing_module_names_the_import_to_pass(plugin, tmp_path):
    saved = RunConfig.from_preset(None, imports=(MODULE,), selector="plugin_every_third").save(
        tmp_path / "c.yaml"
    )
    _forget()
    plugin.unlink()
    with pytest.raises(
        ConfigError, match=f"put the folder that holds it on PYTHONPATH and pass --import {MODULE}"
    ):
        RunConfig.load(saved)


def test_an_unknown_strategy_says_how_one_of_your_own_is_loaded():
    from framework.registry import UnknownNameError

    with pytest.raises(UnknownNameError, match="--import MODULE"):
        RunConfig.from_preset(None, selector="nobody_registered_this")


def test_run_py_config_reimports_the_recorded_module(plugin, tmp_path, capsys):
    """``run.py --config`` of a saved configuration prints it back (``--print-config``) without
    any ``--import``: the recorded module is imported again."""
    from framework.runner.cli import main

    saved = RunConfig.from_preset(None, imports=(MODULE,), selector="plugin_every_third").save(
        tmp_path / "c.yaml"
    )
    _forget()
    assert main(["--config", str(saved), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["method"]["selector"]["name"] == "plugin_every_third"
    assert printed["method"]["imports"][0]["module"] == MODULE


def test_a_changed_source_is_one_warning_line_once_on_the_command_line(plugin, tmp_path, capsys):
    """Issue 55, item 5: the command line reads a saved configuration twice (its --import modules
    are imported before the parser is built); the warning printed twice, as a raw Python warning."""
    from framework.runner.cli import main
    from framework.session import plugins

    saved = RunConfig.from_preset(None, imports=(MODULE,), selector="plugin_every_third").save(
        tmp_path / "c.yaml"
    )
    _forget()
    plugins._WARNED.clear()
    plugin.write_text(SOURCE + "\n# edited again\n", encoding="utf-8")
    assert main(["--config", str(saved), "--print-config"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "its source changed" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: --import {MODULE}: its source changed"), err
    assert "UserWarning" not in err and "warnings.warn" not in err
    # from Python too: the same change is warned about once however often it is read
    _forget()
    plugins._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunConfig.load(saved)
        _forget()
        RunConfig.load(saved)
    assert [type(w.message) for w in caught] == [plugins.SourceChangedWarning]
