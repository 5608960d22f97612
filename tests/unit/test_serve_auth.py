"""The accounts of ``rmqtx serve`` as the settings file gives them, and the signature check of
every request: the access key, the secret and the request's date."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rmq_spark.model.errors import InvalidOptionError

pytest.importorskip("rocketmq", reason="the serve extra (rocketmq-python-client) is not installed")

from rmq_spark.serve.accounts import Account, accounts_from_settings  # noqa: E402
from rmq_spark.serve.auth import DATE_FORMAT, authenticate, signature  # noqa: E402
from rmq_spark.serve.protocol import Code, RequestError  # noqa: E402

NOW = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC)
ORDERS = Account("orders", "s3cr3t", ("Orders", "OrderEvents*"))


def signed(account: str, secret: str, date_time: str) -> dict[str, str]:
    return {
        "x-mq-date-time": date_time,
        "authorization": f"MQv2-HMAC-SHA1 Credential={account}, SignedHeaders=x-mq-date-time, "
        f"Signature={signature(secret, date_time)}",
    }


def refusal(metadata: dict[str, str]) -> str:
    with pytest.raises(RequestError) as refused:
        authenticate(metadata, {"orders": ORDERS}, NOW)
    assert refused.value.code == Code.UNAUTHORIZED
    return refused.value.message


def test_accounts_from_the_settings_file() -> None:
    accounts = accounts_from_settings(
        {
            "accounts": {
                "orders": {"secret_key": "s3cr3t", "topics": ["Orders", "OrderEvents*"]},
                "billing": {"secret_key_env": "BILLING_KEY", "topics": ["*"], "check_back": False},
                "ops": {"secret_key": "0ps", "dashboard": True},
            }
        },
        environ={"BILLING_KEY": "b1ll"},
    )
    assert accounts["orders"] == ORDERS and not ORDERS.dashboard
    assert accounts["billing"] == Account("billing", "b1ll", ("*",), check_back=False)
    assert accounts["ops"] == Account("ops", "0ps", (), dashboard=True)
    assert "s3cr3t" not in repr(accounts["orders"])
    orders = accounts["orders"]
    assert orders.may_publish("Orders") and orders.may_publish("OrderEvents-eu")
    assert not orders.may_publish("Orders2") and not orders.may_publish("Billing")
    assert not accounts["billing"].may_be_asked("Orders")


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ({"accounts": {" billing": {"secret_key": "x"}}}, "[serve.accounts. billing]: an access"),
        ({"accounts": {"a": {"secret_key": "x", "secret": "y"}}}, "unknown setting(s) secret"),
        ({"accounts": {"a": {"secret_key": "x", "dashboard": "yes"}}}, "dashboard needs to be"),
        ({"accounts": {"a": {"topics": ["A"]}}}, "needs one of secret_key or secret_key_env"),
        (
            {"accounts": {"a": {"secret_key": "x", "secret_key_env": "A_KEY"}}},
            "needs one of secret_key or secret_key_env",
        ),
        ({"accounts": {"a": {"secret_key_env": "NOT_SET"}}}, "'NOT_SET' is not set or empty"),
        ({"accounts": {"a": {"secret_key": "x", "topics": ["Or*ders"]}}}, "prefixes ending in"),
        ({"accounts": {"a": {"secret_key": "x", "topics": "Orders"}}}, "needs to be a list"),
        ({"accounts": {"a": {"secret_key": "x", "check_back": "yes"}}}, "true or false"),
        ({"access_keys": "a:b"}, "unknown setting(s) access_keys in [serve]"),
    ],
)
def test_a_bad_account_is_refused_by_name_without_its_secret(section: dict, error: str) -> None:
    with pytest.raises(InvalidOptionError) as refused:
        accounts_from_settings(section, environ={})
    assert error in refused.value.message
    assert "'x'" not in refused.value.message and "'y'" not in refused.value.message


def test_a_signed_request_of_any_time_zone_is_accepted() -> None:
    """The official clients stamp their local time with a literal ``Z``."""
    for hours in (0, -12, 14, 5.5):
        local = (NOW + timedelta(hours=hours)).strftime(DATE_FORMAT)
        assert authenticate(signed("orders", "s3cr3t", local), {"orders": ORDERS}, NOW) == ORDERS


def test_unsigned_wrong_and_replayed_requests_are_refused() -> None:
    now = NOW.strftime(DATE_FORMAT)
    assert "not signed" in refusal({})
    assert "unknown access key 'billing'" in refusal(signed("billing", "s3cr3t", now))
    assert "signature mismatch" in refusal(signed("orders", "wrong", now))
    assert "'not-a-date' is not a date" in refusal(signed("orders", "s3cr3t", "not-a-date"))
    replayed = signed("orders", "s3cr3t", "20190101T000000Z")
    assert "too far from the server's clock" in refusal(replayed)
    ahead = (NOW + timedelta(hours=15)).strftime(DATE_FORMAT)
    assert "too far" in refusal(signed("orders", "s3cr3t", ahead))


def test_a_server_without_accounts_accepts_every_request() -> None:
    assert authenticate({}, {}, NOW) is None
