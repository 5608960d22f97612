"""The accounts of ``rmqtx serve``: who may send to which topic, and who is asked about which
transactions, modelled on RocketMQ 5's ACL 2.0 (users, resources, actions), kept small.

An account is an access key (RocketMQ's user), its secret key, and the topics it may publish
to (RocketMQ's ``Pub`` on ``Topic:<name>``; a name ending in ``*`` is a prefix, ``*`` alone is
every topic). Every call is checked: a route, a send, an end-transaction (against the topic of
the transaction's half messages, not the topic the request names) and the topics a client
declares in its settings. A consumer receives (and acknowledges) messages of a topic only if
its account may subscribe to the topic (RocketMQ's ``Sub`` on ``Topic:<name>``) and consume as
the group (``Sub`` on ``Group:<name>``). A client is asked about (sent check-back for) the
transactions of a topic only if its account may publish to it and ``check_back`` is on.
Accounts live in the settings file, never on the command line (a process list shows it to every
user of the host)::

    [serve.accounts.orders]               # the access key clients sign with
    secret_key_env = "ORDERS_SECRET_KEY"  # or secret_key = "..."
    topics = ["Orders", "OrderEvents*"]
    check_back = true                     # the default
    subscribe = ["Orders"]                # topics its consumers may receive from (default none)
    groups = ["inventory*"]               # as the consumer groups named here (default none)
    dashboard = false                     # the default: may it sign in to rmqtx ui from
                                          # another host (which shows the whole store)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.serve.protocol import Code, RequestError

#: The settings an account section may have.
_KEYS = (
    "secret_key",
    "secret_key_env",
    "topics",
    "check_back",
    "dashboard",
    "subscribe",
    "groups",
)
#: An access key: what RocketMQ's clients put in a signature's ``Credential``.
_ACCESS_KEY = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")
#: A topic pattern: a topic name, the same ending in ``*`` (a prefix), or ``*``.
_PATTERN = re.compile(r"^(\*|[A-Za-z0-9_%|-]{1,127}\*?)$")


@dataclass(frozen=True)
class Account:
    """One access key of ``rmqtx serve`` and what it may do.

    Parameters
    ----------
    access_key : str
        The name clients sign as (``Credentials(access_key, secret_key)``).
    secret_key : str
        The secret they sign with (never shown in logs or errors).
    topics : tuple of str
        The topics it may publish to: names, prefixes ending in ``*``, or ``*``.
    check_back : bool, default True
        Whether its clients are asked about open transactions of those topics.
    dashboard : bool, default False
        Whether it may sign in to ``rmqtx ui`` bound beyond loopback (every page shows the
        whole store: give it to operators).
    subscribe : tuple of str, default ()
        The topics its consumers may receive from (patterns as ``topics``).
    groups : tuple of str, default ()
        The consumer groups it may consume as (patterns as ``topics``).
    """

    access_key: str
    secret_key: str = field(repr=False)
    topics: tuple[str, ...]
    check_back: bool = True
    dashboard: bool = False
    subscribe: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def may_publish(self, topic: str) -> bool:
        """Whether this account may send to ``topic`` and end its transactions."""
        return _matches(self.topics, topic)

    def may_subscribe(self, topic: str, group: str) -> bool:
        """Whether this account's consumers may receive from ``topic`` as ``group``."""
        return _matches(self.subscribe, topic) and _matches(self.groups, group)

    def may_be_asked(self, topic: str) -> bool:
        """Whether this account's clients are sent check-back for ``topic``."""
        return self.check_back and self.may_publish(topic)


def check_publish(account: Account | None, topic: str) -> None:
    """Refuse (``FORBIDDEN``) an account that may not publish to ``topic``; a server without
    accounts (``account`` None) refuses nobody."""
    if account is not None and not account.may_publish(topic):
        raise RequestError(
            Code.FORBIDDEN,
            f"account {account.access_key!r} may not publish to topic {topic!r} (it may publish "
            f"to {', '.join(account.topics) or 'no topic'}); grant it in the settings file's "
            f"[serve.accounts.{account.access_key}] topics.",
        )


def check_route(account: Account | None, topic: str) -> None:
    """Refuse (``FORBIDDEN``) an account that may neither publish to ``topic`` nor subscribe to
    it: a route is what producers and consumers ask first."""
    if account is None or account.may_publish(topic) or _matches(account.subscribe, topic):
        return
    raise RequestError(
        Code.FORBIDDEN,
        f"account {account.access_key!r} may neither publish to nor subscribe to topic "
        f"{topic!r}; grant it in the settings file's [serve.accounts.{account.access_key}] "
        "topics or subscribe.",
    )


def check_subscribe(account: Account | None, topic: str, group: str) -> None:
    """Refuse (``FORBIDDEN``) an account that may not receive from ``topic`` as ``group``; a
    server without accounts (``account`` None) refuses nobody."""
    if account is not None and not account.may_subscribe(topic, group):
        raise RequestError(
            Code.FORBIDDEN,
            f"account {account.access_key!r} may not consume topic {topic!r} as group {group!r} "
            f"(it may subscribe to {', '.join(account.subscribe) or 'no topic'} as "
            f"{', '.join(account.groups) or 'no group'}); grant it in the settings file's "
            f"[serve.accounts.{account.access_key}] subscribe and groups.",
        )


def _matches(patterns: tuple[str, ...], name: str) -> bool:
    """Whether ``name`` is one of ``patterns`` (names, prefixes ending in ``*``, or ``*``)."""
    return any(
        p == "*" or p == name or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns
    )


def accounts_from_settings(
    serve: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> dict[str, Account]:
    """The accounts of the settings file's ``[serve.accounts.<access key>]`` sections.

    Parameters
    ----------
    serve : mapping
        The settings file's ``[serve]`` section (:attr:`rmq_spark.model.config.Settings.serve`).
    environ : mapping, default os.environ
        Where ``secret_key_env`` names are looked up.

    Raises
    ------
    InvalidOptionError
        Naming the account and the setting for: an access key that is not a plain name, an
        unknown setting, no secret or two, a secret's environment variable that is not set,
        a topic pattern that is not a name, a prefix or ``*``. Secrets are never echoed.
    """
    unknown = sorted(set(serve) - {"accounts"})
    if unknown:
        raise InvalidOptionError(
            f"unknown setting(s) {', '.join(unknown)} in [serve]; valid: accounts."
        )
    accounts = {}
    for access_key, given in dict(serve.get("accounts", {})).items():
        where = f"[serve.accounts.{access_key}]"
        if not _ACCESS_KEY.fullmatch(access_key):
            raise InvalidOptionError(
                f"{where}: an access key is 1 to 128 letters, digits or _ . @ -."
            )
        if not isinstance(given, Mapping):
            raise InvalidOptionError(f"{where} needs to be a table of settings.")
        unknown = sorted(set(given) - set(_KEYS))
        if unknown:
            raise InvalidOptionError(
                f"unknown setting(s) {', '.join(unknown)} in {where}; valid: {', '.join(_KEYS)}."
            )
        topics, subscribe, groups = (
            _patterns(given, key, where) for key in ("topics", "subscribe", "groups")
        )
        check_back, dashboard = given.get("check_back", True), given.get("dashboard", False)
        for name, value in (("check_back", check_back), ("dashboard", dashboard)):
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{where} {name} needs to be true or false.")
        secret = _secret(given, where, environ)
        accounts[access_key] = Account(
            access_key, secret, topics, check_back, dashboard, subscribe, groups
        )
    return accounts


def _patterns(given: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    patterns = given.get(key, [])
    if not isinstance(patterns, list) or not all(
        isinstance(t, str) and _PATTERN.fullmatch(t) for t in patterns
    ):
        names = "consumer group" if key == "groups" else "topic"
        raise InvalidOptionError(
            f"{where} {key} needs to be a list of {names} names, prefixes ending in '*' "
            f'or \'*\', e.g. ["Orders", "OrderEvents*"], not {patterns!r}.'
        )
    return tuple(patterns)


def _secret(given: Mapping[str, Any], where: str, environ: Mapping[str, str]) -> str:
    if ("secret_key" in given) == ("secret_key_env" in given):
        raise InvalidOptionError(
            f"{where} needs one of secret_key or secret_key_env (the name of an environment "
            "variable holding it)."
        )
    if "secret_key_env" in given:
        name = str(given["secret_key_env"])
        secret = environ.get(name)
        if not secret:
            raise InvalidOptionError(
                f"{where} secret_key_env: the environment variable {name!r} is not set or empty."
            )
        return secret
    secret = given["secret_key"]
    if not isinstance(secret, str) or not secret:
        raise InvalidOptionError(f"{where} secret_key needs to be a non-empty string.")
    return secret
