"""Prometheus metrics of the serving path, exposed at /metrics of the control plane."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: The model label of requests for a model nothing served here: labels come from the catalog
#: only, never from a client's string.
UNKNOWN_MODEL = "unknown"
_catalog_names: set[str] = set()  # models this process routed to (or found in the catalog)


def known_model(name: str) -> str:
    """Record that `name` is a catalog model (it routed) and return it as a label."""
    _catalog_names.add(name)
    return name


def model_label(name: str) -> str:
    return name if name in _catalog_names else UNKNOWN_MODEL


REQUESTS = Counter(
    "llamafleet_requests",
    "Generations by how they ended: ok, cancelled, error, rejected, migrated (ok after a move).",
    ["model", "deployment", "outcome"],
)
ERRORS = Counter(
    "llamafleet_request_errors", "Generations that ended in an error, by code.", ["model", "code"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    "llamafleet_time_to_first_token_seconds",
    "From the request reaching the control plane to its first token.",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10, 30),
)
TOKENS_PER_SECOND = Histogram(
    "llamafleet_decode_tokens_per_second",
    "Decode speed of one generation after its first token.",
    ["model"],
    buckets=(1, 5, 10, 20, 40, 60, 80, 100, 130, 160, 200, 300),
)
COMPLETION_TOKENS = Counter(
    "llamafleet_completion_tokens", "Tokens generated.", ["model", "deployment"]
)
IN_FLIGHT = Gauge("llamafleet_in_flight", "Generations streaming from this process.", ["model"])
MIGRATIONS = Counter(
    "llamafleet_migrations", "Streams moved to another replica mid-flight.", ["model"]
)
RETRIES = Counter(
    "llamafleet_retries", "Replicas skipped before the first token (failed or full).", ["model"]
)
PREFIX_ROUTING = Counter(
    "llamafleet_prefix_routing",
    "Prefix-policy decisions: hit (a replica holds the prefix), hashed (new prefix), "
    "overloaded (every slot of the preferred replica was busy; least connections chose).",
    ["decision"],
)
ROUTING_FALLBACKS = Counter(
    "llamafleet_routing_fallbacks", "Routing decisions taken without Redis (it did not answer)."
)


class FleetCollector:
    """Fleet-wide gauges read from the database at scrape time: replicas by deployment and
    state, and what the ready nodes cost per hour. Every web process reports the same values;
    dashboards take their max."""

    def describe(self):
        return []  # no samples at registration (no database then)

    def collect(self):
        from django.db.models import Count, Sum
        from prometheus_client.core import GaugeMetricFamily

        from apps.deployments.models import Replica
        from apps.nodes.models import Node

        replicas = GaugeMetricFamily(
            "llamafleet_replicas",
            "Replicas by deployment and state.",
            labels=["deployment", "state"],
        )
        for dep, state, n in (
            Replica.objects.exclude(state=Replica.State.STOPPED)
            .values_list("deployment__name", "state")
            .annotate(n=Count("pk"))
            .order_by()
        ):
            replicas.add_metric([dep, state], n)
        yield replicas
        cost = GaugeMetricFamily(
            "llamafleet_fleet_cost_per_hour",
            "Summed hourly price of the ready nodes.",
            labels=["currency"],
        )
        for currency, total in (
            Node.objects.filter(state=Node.State.READY)
            .values_list("currency")
            .annotate(total=Sum("price_per_hour"))
            .order_by()
        ):
            cost.add_metric([currency], float(total or 0))
        yield cost


#: Apart from the default registry: collecting it queries the database, which code that reads
#: the default registry (tests, in async contexts) must not do by surprise.
FLEET = CollectorRegistry(auto_describe=False)
FLEET.register(FleetCollector())
