"""The operator table is the one list of operators: the API, the CLI, ``testing`` and the
combinators read it, and no other core module spells an operator's name."""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

import abstractdiff as ad
from abstractdiff import _prepare
from abstractdiff._backend import Backend
from abstractdiff._implicit_backend import IMPLICIT_OPERATORS, Implicit
from abstractdiff._operator_table import OPERATORS, operators_where
from abstractdiff.cli import COLUMN_NAMES
from abstractdiff.testing import _scenarios

PACKAGE = pathlib.Path(ad.__file__).parent
#: Where an operator's name may be written: its row, its preparation, and the protocol's
#: list of fast routes and primitives (which imports no other module, the table included).
MODULES_WITH_NAMES = 3


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_operator_has_its_function_its_prepare_twin_and_its_method(name):
    op = OPERATORS[name]
    assert callable(getattr(ad, name)) and name in ad.__all__
    assert callable(getattr(ad, op.prepare_name)) and op.prepare_name in ad.__all__
    assert callable(getattr(Backend, name))
    assert _prepare.PREPARED[name].operator == name
    assert _prepare.PREPARATIONS[name].operator == name
    assert (name in _prepare.TANGENT_OPERATORS) == op.takes_tangent


def test_the_preparations_cover_exactly_the_table():
    assert set(_prepare.PREPARED) == set(OPERATORS) == set(_prepare.PREPARATIONS)
    assert sorted(_prepare.__all__) == sorted(op.prepare_name for op in OPERATORS.values())


def test_the_cli_the_grid_and_implicit_mode_read_the_table():
    graded = operators_where(graded=True)
    assert _scenarios.OPERATORS == graded
    assert [name for name in COLUMN_NAMES if name in OPERATORS] == list(graded)
    assert _scenarios.SECOND_ORDER == {name for name in graded if OPERATORS[name].order == 2}
    assert all(parts == OPERATORS[name].parts for name, parts in _scenarios.COMBINED.items())
    assert set(IMPLICIT_OPERATORS) == {name for name, op in OPERATORS.items() if op.implicit}
    for name in OPERATORS:
        assert callable(getattr(Implicit, name))  # implicit's own, or its clear refusal


def test_operators_where_filters_in_table_order():
    assert operators_where(takes_tangent=True) == ("hvp", "gradient_and_hvp")
    assert operators_where(implicit=True, takes_aux=True) == ("gradient", "value_and_gradient")
    with pytest.raises(AttributeError):
        operators_where(no_such_flag=True)


def _modules_naming(names: set[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("testing/"):  # the conformance suite: it dispatches by operator
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value.removeprefix("prepare_")
                if value in names:
                    found[value].add(rel)
    return found


def test_each_operator_name_is_written_in_at_most_three_core_modules():
    found = _modules_naming(set(OPERATORS))
    too_many = {name: sorted(mods) for name, mods in found.items() if len(mods) > MODULES_WITH_NAMES}
    assert not too_many, f"operator names written outside the table, its preparations and the protocol: {too_many}"
    assert found["gradient"]  # the scan sees literals at all
