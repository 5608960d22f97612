"""Access keys: RocketMQ 5's request signature (``MQv2-HMAC-SHA1``) checked against the keys
``rmqtx serve`` was given.

A client signs the value of its ``x-mq-date-time`` header with its secret key and sends
``authorization: MQv2-HMAC-SHA1 Credential=<access key>, SignedHeaders=x-mq-date-time,
Signature=<hex>``. The server recomputes the signature with the secret it holds for that access
key. Like RocketMQ, it does not check the date against its own clock: clients stamp it in their
local time zone with a literal ``Z``. A signature proves that the holder of the secret signed
*some* date, not this request, so it can be replayed by anyone who sees it: use TLS on any
network you do not trust.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from rmq_spark.model.errors import InvalidOptionError

#: The signature algorithm of RocketMQ 5 clients.
ALGORITHM = "MQv2-HMAC-SHA1"
AUTHORIZATION = "authorization"
DATE_TIME = "x-mq-date-time"


def parse_access_keys(values: Iterable[str]) -> dict[str, str]:
    """Parse ``KEY:SECRET`` pairs into ``{access key: secret key}``.

    Parameters
    ----------
    values : iterable of str
        Each ``KEY:SECRET`` (the secret may contain ``:``).

    Raises
    ------
    InvalidOptionError
        For a pair without ``:``, an empty key or secret, or a key given twice.
    """
    keys: dict[str, str] = {}
    for value in values:
        access, sep, secret = value.partition(":")
        if not sep or not access or not secret:
            raise InvalidOptionError(
                f"an access key needs to be KEY:SECRET, e.g. 'orders:s3cr3t', but got "
                f"{access + ':***' if sep else value!r}."
            )
        if access in keys:
            raise InvalidOptionError(f"access key {access!r} is given twice; give it once.")
        keys[access] = secret
    return keys


def signature(secret: str, date_time: str) -> str:
    """The signature a client sends: hex HMAC-SHA1 of ``date_time`` keyed with ``secret``."""
    return hmac.new(secret.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def authorization_error(metadata: Mapping[str, str], keys: Mapping[str, str]) -> str | None:
    """Why a request's metadata is refused, or None when it may proceed.

    Parameters
    ----------
    metadata : mapping of str to str
        The request's gRPC metadata (header names in lower case).
    keys : mapping of str to str
        ``{access key: secret key}``; empty accepts every request.
    """
    if not keys:
        return None
    header, date_time = metadata.get(AUTHORIZATION), metadata.get(DATE_TIME)
    if not header or not date_time:
        return f"the request is not signed (no {AUTHORIZATION} or {DATE_TIME} header)"
    algorithm, _, rest = header.partition(" ")
    if algorithm != ALGORITHM:
        return f"unsupported signature algorithm {algorithm!r}; expected {ALGORITHM}"
    fields = dict(item.strip().partition("=")[::2] for item in rest.split(","))
    access = fields.get("Credential", "").split("/")[0]
    secret = keys.get(access)
    if secret is None:
        return f"unknown access key {access!r}"
    if not hmac.compare_digest(signature(secret, date_time), fields.get("Signature", "").lower()):
        return f"signature mismatch for access key {access!r} (wrong secret key)"
    return None
