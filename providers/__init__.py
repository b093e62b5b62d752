"""Cloud providers: the `CloudProvider` protocol, typed errors, and one implementation per cloud."""

from providers.base import (
    AuthError,
    CapacityError,
    CloudProvider,
    Instance,
    InstanceState,
    LaunchRequest,
    LaunchResult,
    NodeBootstrap,
    NotFound,
    PriceQuote,
    ProviderError,
    QuotaError,
    TransientError,
)

__all__ = [
    "AuthError",
    "CapacityError",
    "CloudProvider",
    "Instance",
    "InstanceState",
    "LaunchRequest",
    "LaunchResult",
    "NodeBootstrap",
    "NotFound",
    "PriceQuote",
    "ProviderError",
    "QuotaError",
    "TransientError",
]
