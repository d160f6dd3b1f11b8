"""A test generated from the config schema: every field, given a value of the wrong type or outside
its declared range, stops the run with exit 2 and exactly one ``error:`` line naming that field."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

import pytest
import yaml

from megatron_train.config import Check, ExperimentConfig, Range
from megatron_train.train import main
from tests.conftest import run_tool, write_config

# Strings some declared check may refuse; each Check field must refuse at least one of them.
_CANDIDATE_STRINGS = ["", "   ", "a,b", "0,1,1", "1,2,3,4", "-1,1,0"]


def _leaves(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name]


def _split(tp: Any) -> tuple[Any, list]:
    """(the base type, its declared rules), with an Optional's None taken away."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        if len(options) == 1:
            tp = options[0]
    if typing.get_origin(tp) is Annotated:
        base, *rules = typing.get_args(tp)
        return base, rules
    return tp, []


def _out_of_range(base: Any, rule: Range) -> list[Any]:
    step = 1 if base is int else 0.5
    values = []
    if rule.low is not None:
        values.append(rule.low if rule.low_open else rule.low - step)
    if rule.high is not None:
        values.append(rule.high if rule.high_open else rule.high + step)
    return [base(v) for v in values]


def bad_values(tp: Any) -> list[Any]:
    """Values the declaration of ``tp`` must refuse: the wrong type, then outside its range."""
    base, rules = _split(tp)
    origin = typing.get_origin(base)
    if origin is Literal:
        values = ["not-a-choice", 3]
    elif origin is list:
        values = ["not-a-list", [{"a": 1}]]
    elif origin in (typing.Union, types.UnionType):
        values = [{"a": 1}]
    elif base is bool:
        values = ["maybe", 1]
    elif base is int:
        values = ["ten", 1.5, True]
    elif base is float:
        values = ["ten", float("nan"), float("inf"), True]
    else:
        values = [[1, 2], {"a": 1}, 7]
    for rule in rules:
        if isinstance(rule, Range):
            values += _out_of_range(base, rule)
        if isinstance(rule, Check):
            refused = [s for s in _CANDIDATE_STRINGS if not rule.accepts(s)]
            assert refused, f"add a string that {rule.describe!r} refuses to _CANDIDATE_STRINGS"
            values += refused
    return values


CASES = [(key, value) for key, tp in _leaves(ExperimentConfig) for value in bad_values(tp)]


def test_the_schema_declares_every_numeric_range():
    for key, tp in _leaves(ExperimentConfig):
        base, rules = _split(tp)
        if base in (int, float):
            assert any(isinstance(r, Range) for r in rules), f"{key} declares no Range"


@pytest.fixture(scope="module")
def good_config(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("schema")
    return write_config(d / "cfg.yaml", corpus, d / "run")


def _override(key: str, value: Any) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_every_field_refuses_bad_values_in_one_line(good_config, monkeypatch, capsys, key, value):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--config", str(good_config), _override(key, value)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert f"'{key}'" in lines[0] and "Fix:" in lines[0], err


@pytest.mark.parametrize("index", [0, len(CASES) // 2, len(CASES) - 1])
def test_through_the_real_cli(good_config, index):
    key, value = CASES[index]
    result = run_tool(
        "-m", "megatron_train.train", "--config", str(good_config), _override(key, value), check=False
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("error:") == 1 and f"'{key}'" in result.stderr
    assert "Traceback" not in result.stderr
