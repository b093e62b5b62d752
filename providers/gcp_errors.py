"""GCP errors -> the typed provider errors (``providers.base``): API call errors, operation errors.

Role: the error edge of ``providers.gcp``. GCE reports a stockout, a quota or a rate limit by reason or
code, either on the HTTP call (``GoogleAPICallError.errors``) or in a finished operation's ``error``; both
map to CapacityError, QuotaError or TransientError here. Pure: the google modules are imported lazily so
this module loads without the ``[gcp]`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from providers.base import AuthError, CapacityError, NotFound, ProviderError, QuotaError, TransientError
from wire import PoolKey

_CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                   "RESOURCE_POOL_EXHAUSTED", "STOCKOUT", "RESOURCE_NOT_AVAILABLE"}
_QUOTA_CODES = {"QUOTA_EXCEEDED", "quotaExceeded", "QUOTA_LIMIT"}
_RATE_CODES = {"rateLimitExceeded", "userRateLimitExceeded", "RATE_LIMIT_EXCEEDED"}


def reasons(e: Any) -> set[str]:
    """The reason and code strings of a google API call error."""
    out = set()
    for err in getattr(e, "errors", None) or []:
        if isinstance(err, Mapping):
            out |= {str(err.get("reason", "")), str(err.get("code", ""))}
    reason = getattr(e, "reason", None)
    if reason:
        out.add(str(reason))
    return out - {""}


def map_error(e: Exception, pool: PoolKey | None = None) -> ProviderError:
    """Any exception of the google clients (or of the transport under them) as a typed ProviderError."""
    from google.api_core import exceptions as gx
    from google.auth import exceptions as ax

    if isinstance(e, ProviderError):
        return e
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, ax.DefaultCredentialsError | ax.RefreshError):
        return AuthError(msg, pool=pool)
    if isinstance(e, gx.GoogleAPICallError):
        found = reasons(e)
        if found & _CAPACITY_CODES:
            return CapacityError(msg, pool=pool)
        if found & _QUOTA_CODES:
            return QuotaError(msg, pool=pool)
        if found & _RATE_CODES or isinstance(e, gx.TooManyRequests):
            return TransientError(msg, pool=pool)
        if isinstance(e, gx.Unauthenticated | gx.PermissionDenied):
            return AuthError(msg, pool=pool)
        if isinstance(e, gx.NotFound):
            return NotFound(msg, pool=pool)
        if isinstance(e, gx.ServerError | gx.DeadlineExceeded):
            return TransientError(msg, pool=pool)
        return ProviderError(msg, pool=pool)
    if isinstance(e, gx.RetryError | ConnectionError | TimeoutError):
        return TransientError(msg, pool=pool)
    try:
        import requests

        if isinstance(e, requests.ConnectionError | requests.Timeout):
            return TransientError(msg, pool=pool)
    except ImportError:  # pragma: no cover
        pass
    return ProviderError(msg, pool=pool)


def operation_error(op: Any, pool: PoolKey) -> ProviderError | None:
    """The typed error of a finished operation; None when it succeeded."""
    errors = list(op.error.errors) if op.error else []
    if not errors:
        return None
    codes = {e.code for e in errors}
    text = "; ".join(f"{e.code}: {e.message}" for e in errors)
    if codes & _CAPACITY_CODES:
        return CapacityError(text, pool=pool)
    if codes & _QUOTA_CODES:
        return QuotaError(text, pool=pool)
    if codes & _RATE_CODES:
        return TransientError(text, pool=pool)
    return ProviderError(text, pool=pool)
