"""Signed requests: RocketMQ 5's request signature (``MQv2-HMAC-SHA1``) checked against the
accounts of ``rmqtx serve`` (:mod:`rmq_spark.serve.accounts`).

A client signs the value of its ``x-mq-date-time`` header with its secret key and sends
``authorization: MQv2-HMAC-SHA1 Credential=<access key>, SignedHeaders=x-mq-date-time,
Signature=<hex>``. The server recomputes the signature with the secret it holds for that access
key, and refuses a date that is not one or is out of :data:`DATE_WINDOW`. The official clients
stamp the date in their host's local time with a literal ``Z``, so the window is as wide as
the world's time zones: a captured header can be replayed for about a day. A signature proves
that the holder of the secret signed *some* date, not this request: serve over TLS on any
network you do not trust.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from rmq_spark.serve.accounts import Account
from rmq_spark.serve.protocol import Code, RequestError

#: The signature algorithm of RocketMQ 5 clients.
ALGORITHM = "MQv2-HMAC-SHA1"
AUTHORIZATION = "authorization"
DATE_TIME = "x-mq-date-time"
#: The format of ``x-mq-date-time``.
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
#: How far a request's date may be from the server's UTC clock, before and after: the time
#: zones of the clients' local clocks (UTC-12 to UTC+14), and 15 minutes of clock skew.
DATE_WINDOW = (timedelta(hours=12, minutes=15), timedelta(hours=14, minutes=15))


@functools.lru_cache(maxsize=1024)
def signature(secret: str, date_time: str) -> str:
    """The signature a client sends: hex HMAC-SHA1 of ``date_time`` keyed with ``secret``
    (remembered: a client's calls of one second share their date, hence their signature)."""
    return hmac.new(secret.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def authenticate(
    metadata: Mapping[str, str], accounts: Mapping[str, Account], now: datetime | None = None
) -> Account | None:
    """The account a request is signed by; None when the server has no accounts (every
    request is accepted).

    Parameters
    ----------
    metadata : mapping of str to str
        The request's gRPC metadata (header names in lower case).
    accounts : mapping of str to Account
        By access key.
    now : datetime, optional
        The server's clock (UTC; default: now).

    Raises
    ------
    RequestError
        ``UNAUTHORIZED``, saying why: unsigned, another algorithm, an unknown access key, a
        wrong signature, a date that is not one or is out of :data:`DATE_WINDOW`.
    """
    if not accounts:
        return None
    header, date_time = metadata.get(AUTHORIZATION), metadata.get(DATE_TIME)
    if not header or not date_time:
        raise _refused(f"the request is not signed (no {AUTHORIZATION} or {DATE_TIME} header)")
    algorithm, _, rest = header.partition(" ")
    if algorithm != ALGORITHM:
        raise _refused(f"unsupported signature algorithm {algorithm!r}; expected {ALGORITHM}")
    fields = dict(item.strip().partition("=")[::2] for item in rest.split(","))
    access = fields.get("Credential", "").split("/")[0]
    account = accounts.get(access)
    if account is None:
        raise _refused(f"unknown access key {access!r}")
    given = fields.get("Signature", "").lower().encode("utf-8", "replace")
    if not hmac.compare_digest(signature(account.secret_key, date_time).encode(), given):
        raise _refused(f"signature mismatch for access key {access!r} (wrong secret key)")
    _check_date(date_time, now or datetime.now(UTC))
    return account


@functools.lru_cache(maxsize=1024)
def _stamped(date_time: str) -> datetime:
    """``date_time`` read as :data:`DATE_FORMAT` (remembered: ``strptime`` costs more than the
    rest of a signature's check)."""
    return datetime.strptime(date_time, DATE_FORMAT).replace(tzinfo=UTC)


def _check_date(date_time: str, now: datetime) -> None:
    try:
        stamped = _stamped(date_time)
    except ValueError:
        raise _refused(f"{DATE_TIME} {date_time!r} is not a date ({DATE_FORMAT})") from None
    before, after = DATE_WINDOW
    if not now - before <= stamped <= now + after:
        raise _refused(
            f"{DATE_TIME} {date_time!r} is too far from the server's clock ({now:{DATE_FORMAT}}):"
            " a replayed request, or a client clock that is wrong"
        )


def _refused(why: str) -> RequestError:
    return RequestError(Code.UNAUTHORIZED, why)
