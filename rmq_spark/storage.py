"""One storage configuration for a store root, translated for each client.

The store's ``[store] storage_options`` are written once, in deltalake's
vocabulary (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).  This module
translates them for fsspec (s3fs refuses deltalake's ``AWS_*`` keys) and for
Spark's Hadoop filesystems (``spark.hadoop.fs.s3a.*``), and refuses options
that would turn off the conditional writes that first-decision-wins and dense
offsets rest on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StorageConfigError(ValueError):
    """Storage options that cannot keep the store's semantic contract."""


# Options that make deltalake fall back from conditional puts to an external
# lock (or to no protection at all).
_UNSAFE = {
    "AWS_S3_LOCKING_PROVIDER": "a locking provider replaces conditional puts",
    "AWS_S3_ALLOW_UNSAFE_RENAME": "unsafe rename gives up atomic commits",
    "AWS_CONDITIONAL_PUT": "only the default (etag/If-None-Match) is safe",
}


def _upper(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).upper(): str(v) for k, v in options.items()}


def check_conditional_writes(options: Mapping[str, str]) -> None:
    """Refuse options that disable conditional writes.

    Parameters
    ----------
    options : mapping
        deltalake storage options.

    Raises
    ------
    StorageConfigError
        Naming the offending key and what to do instead.
    """
    for key, value in _upper(options).items():
        if key in _UNSAFE and value.strip().lower() not in ("", "false", "etag"):
            raise StorageConfigError(
                f"storage option {key}={value!r} turns off conditional writes "
                f"({_UNSAFE[key]}); rmq-spark needs If-None-Match commits. "
                f"Remove {key} from [store] storage_options and use a store "
                "that supports conditional PUT (AWS S3, MinIO)."
            )


def deltalake_options(options: Mapping[str, str]) -> dict[str, str] | None:
    """Return the options for ``deltalake`` (``None`` when empty), checked.

    Parameters
    ----------
    options : mapping
        The configured storage options.

    Returns
    -------
    dict or None
        Options for ``DeltaTable``/``write_deltalake``.
    """
    check_conditional_writes(options)
    return dict(options) or None


def fsspec_options(root: str, options: Mapping[str, str]) -> dict[str, Any]:
    """Translate the options into fsspec keyword arguments for ``root``'s scheme.

    Parameters
    ----------
    root : str
        The store root (``s3://``, ``gs://``, ``abfss://`` or a local path).
    options : mapping
        The configured (deltalake) storage options.

    Returns
    -------
    dict
        kwargs for ``fsspec.core.url_to_fs``: s3fs's ``key``/``secret``/
        ``endpoint_url``/``client_kwargs``; gcsfs's ``token``; adlfs's
        ``account_name``/``account_key``.  Empty for local roots.
    """
    scheme = root.split("://", 1)[0].lower() if "://" in root else "file"
    opts = _upper(options)
    if scheme in ("s3", "s3a"):
        kw: dict[str, Any] = {}
        if "AWS_ACCESS_KEY_ID" in opts:
            kw["key"] = opts["AWS_ACCESS_KEY_ID"]
        if "AWS_SECRET_ACCESS_KEY" in opts:
            kw["secret"] = opts["AWS_SECRET_ACCESS_KEY"]
        if "AWS_SESSION_TOKEN" in opts:
            kw["token"] = opts["AWS_SESSION_TOKEN"]
        endpoint = opts.get("AWS_ENDPOINT_URL") or opts.get("AWS_ENDPOINT")
        if endpoint:
            kw["endpoint_url"] = endpoint
        region = opts.get("AWS_REGION") or opts.get("AWS_DEFAULT_REGION")
        if region:
            kw["client_kwargs"] = {"region_name": region}
        return kw
    if scheme in ("gs", "gcs"):
        path = opts.get("GOOGLE_SERVICE_ACCOUNT") or opts.get("GOOGLE_SERVICE_ACCOUNT_PATH")
        return {"token": path} if path else {}
    if scheme in ("abfs", "abfss", "az", "adl"):
        kw = {}
        if "AZURE_STORAGE_ACCOUNT_NAME" in opts:
            kw["account_name"] = opts["AZURE_STORAGE_ACCOUNT_NAME"]
        if "AZURE_STORAGE_ACCOUNT_KEY" in opts:
            kw["account_key"] = opts["AZURE_STORAGE_ACCOUNT_KEY"]
        return kw
    return {}


def hadoop_settings(options: Mapping[str, str]) -> dict[str, str]:
    """Translate S3 options into Spark ``spark.hadoop.fs.s3a.*`` settings.

    Parameters
    ----------
    options : mapping
        The configured (deltalake) storage options.

    Returns
    -------
    dict
        Spark conf entries; ``s3://`` is mapped to ``S3AFileSystem``.
    """
    opts = _upper(options)
    p = "spark.hadoop.fs.s3a."
    conf = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
    }
    if "AWS_ACCESS_KEY_ID" in opts:
        conf[p + "access.key"] = opts["AWS_ACCESS_KEY_ID"]
    if "AWS_SECRET_ACCESS_KEY" in opts:
        conf[p + "secret.key"] = opts["AWS_SECRET_ACCESS_KEY"]
    if "AWS_SESSION_TOKEN" in opts:
        conf[p + "session.token"] = opts["AWS_SESSION_TOKEN"]
    endpoint = opts.get("AWS_ENDPOINT_URL") or opts.get("AWS_ENDPOINT")
    if endpoint:
        conf[p + "endpoint"] = endpoint
        conf[p + "path.style.access"] = "true"
        conf[p + "connection.ssl.enabled"] = str(not endpoint.lower().startswith("http://")).lower()
    if "AWS_REGION" in opts:
        conf[p + "endpoint.region"] = opts["AWS_REGION"]
    return conf
