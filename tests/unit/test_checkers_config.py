from __future__ import annotations

import pytest

from rmq_spark.checkback.checkers import (
    CallableChecker,
    CheckerConfigError,
    ClientsChecker,
    TableChecker,
    checkers_from_config,
    resolve_function,
)


def test_config_builds_each_kind() -> None:
    checkers = checkers_from_config(
        {
            "orders": {"kind": "callable", "function": "json:dumps"},
            "payments": {"kind": "table", "table": "/t", "column": "id", "deadline": "2h"},
            "Orders": {"kind": "clients"},
        }
    )
    assert isinstance(checkers["orders"], CallableChecker)
    assert isinstance(checkers["Orders"], ClientsChecker)
    payments = checkers["payments"]
    assert isinstance(payments, TableChecker) and payments.deadline == 7200


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"bad group!": {"kind": "callable", "function": "json:dumps"}},
            r"\[checkers.bad group!\]",
        ),
        ({"g": {"kind": "rpc"}}, "kind = 'rpc'; valid kinds: callable, table, clients"),
        ({"g": {"kind": "callable"}}, "misses function"),
        (
            {"g": {"kind": "table", "table": "/t", "column": "c", "colour": 1}},
            "unknown key.*colour",
        ),
        ({"g": {"kind": "clients", "function": "json:dumps"}}, "unknown key.*function"),
    ],
)
def test_bad_config(config: dict, match: str) -> None:
    with pytest.raises(CheckerConfigError, match=match):
        checkers_from_config(config)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("json", "not of the form"),
        ("no_such_module_xyz:f", "cannot be imported"),
        ("json:no_such_function", "'no_such_function' not found in module 'json'"),
        ("json:__doc__", "not callable"),
    ],
)
def test_resolve_function_errors(spec: str, match: str) -> None:
    with pytest.raises(CheckerConfigError, match=match):
        resolve_function(spec)


def test_resolve_function() -> None:
    import json

    assert resolve_function("json:dumps") is json.dumps
