"""framework/session/errors.py and the CLIs' failure paths (issue 29): only validation is bad
input (exit 2, one line); an exception from the user's own code is a bug report (exit 1) showing
the user's file and line, and the --resume command when results exist; --debug shows everything;
argparse conflicts are one line; Ctrl-C says what was kept."""

from __future__ import annotations

import json
import textwrap

import pytest

from framework.runner.cli import main

RUN = [
    "--logger",
    "none",
    "--model",
    "tiny-random",
    "--categories",
    "qa,code",
    "--limit",
    "1",
    "--max-new-tokens",
    "4",
    "--warmup",
    "0",
]

PLUGIN = '''
from framework import LayerPlan, LayerSelector, register_selector

CALLS = [0]


@register_selector("{name}")
class BrokenSelector(LayerSelector):
    """Fails on the round it is told to."""

    def setup(self, info):
        self.num_layers = info.num_layers

    def plan(self, state):
        CALLS[0] += 1
        if CALLS[0] >= {fail_at}:
            raise {error}("my selector broke")
        return LayerPlan.full(self.num_layers)
'''


@pytest.fixture(autouse=True)
def _forget_plugins():
    """Each test's plugin registers a selector under its module's name; drop them afterwards."""
    from framework import REGISTRIES

    before = set(REGISTRIES["selector"].names())
    yield
    for name in set(REGISTRIES["selector"].names()) - before:
        REGISTRIES["selector"]._entries.pop(name)


def _plugin(tmp_path, monkeypatch, name: str, error: str, fail_at: int = 1) -> str:
    """A module ``name`` registering selector ``name`` whose plan raises ``error`` from its
    ``fail_at``-th call."""
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(PLUGIN).format(name=name, error=error, fail_at=fail_at)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("error", ["ValueError", "RuntimeError"])
def test_an_exception_in_a_users_strategy_is_a_bug_report_with_its_file_and_line(
    tmp_path, monkeypatch, capsys, error
):
    mod = _plugin(tmp_path, monkeypatch, f"zz_plugin_{error.lower()}", error)
    out = tmp_path / "r.jsonl"
    code = main(["--import", mod, "--selector", mod, *RUN, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    src = tmp_path / f"{mod}.py"
    assert f"error: {error}: my selector broke" in err
    assert f'File "{src}", line {_line_of(src, "raise ")}, in plan' in err
    assert len(err.strip().splitlines()) <= 8, err  # no Lightning traceback
    assert "--resume" not in err  # nothing finished, nothing to continue


def test_a_failure_after_some_prompts_names_the_resume_command(tmp_path, monkeypatch, capsys):
    mod = _plugin(tmp_path, monkeypatch, "zz_plugin_late", "RuntimeError", fail_at=4)
    out = tmp_path / "late"
    code = main(["--import", mod, "--selector", mod, *RUN, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    done = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert done, "the first prompt finished before the failure"
    assert f"finished prompt records are in {out / 'records.jsonl'}" in err
    assert "continue with: python experiments/run.py --import zz_plugin_late" in err and "--resume" in err


def test_a_module_that_fails_while_imported_is_reported_with_its_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "zz_bad_import.py").write_text("x = 1\ny = undefined_name + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["--import", "zz_bad_import", "--list"])
    err = capsys.readouterr().err
    assert code == 1 and "NameError" in err
    assert f'File "{tmp_path / "zz_bad_import.py"}", line 2, in <module>' in err
    (tmp_path / "zz_bad_syntax.py").write_text("def f(:\n")
    code = main(["--import", "zz_bad_syntax", "--list"])
    err = capsys.readouterr().err
    assert code == 1 and "SyntaxError" in err and f'File "{tmp_path / "zz_bad_syntax.py"}", line 1' in err
    # a module that is not there is bad input: one line, exit 2
    code = main(["--import", "zz_no_such_module_here", "--list"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--import" in err


def test_debug_shows_the_whole_traceback(tmp_path, monkeypatch):
    mod = _plugin(tmp_path, monkeypatch, "zz_plugin_debug", "RuntimeError")
    with pytest.raises(RuntimeError, match="my selector broke"):
        main(
            [
                "--debug",
                "--import",
                mod,
                "--selector",
                mod,
                *RUN,
                "--output",
                str(tmp_path / "d.jsonl"),
            ]
        )


def test_validation_errors_stay_one_line_with_status_2(capsys, tmp_path):
    code = main([*RUN, "--device", "cuda:7", "--output", str(tmp_path / "v.jsonl")])
    err = capsys.readouterr().err.splitlines()[-1]  # (after the datasets progress line)
    assert code == 2 and err.startswith("error: --device 'cuda:7' requested but CUDA is not available"), err


def test_conflicting_flags_print_one_line(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    with pytest.raises(SystemExit) as exited:  # argparse exits
        main(["--method", "swift", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert (
        exited.value.code == 2
        and err.count("\n") == 1
        and "not allowed with argument" in err
        and "usage:" not in err
    )


def test_ctrl_c_before_any_result_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    import framework.runner.cli as cli

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    code = main([*RUN, "--output", str(tmp_path / "i.jsonl")])
    err = capsys.readouterr().err
    assert code == 130 and "nothing was written yet" in err and "every finished prompt" not in err
