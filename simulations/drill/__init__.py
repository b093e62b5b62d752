"""The production drill: orchd run as an operator would, on loopback, watched by Prometheus and
Alertmanager.

It starts a 3-server NATS cluster (TLS, the auth callout: cluster_secrets.py), two orchd (HA, the local
provider: agents as processes on this machine, enrolled with per-node credentials, reading a stub NVML;
secrets from $CREDENTIALS_DIRECTORY), Debian's Prometheus scraping both orchd with the project's alert
rules, and Debian's Alertmanager sending to a webhook receiver the drill runs; orchctl works under the
operator role. It drives a training job through the
scenarios of ``scenarios.py`` and checks through Prometheus's and Alertmanager's HTTP APIs that each
alert of config/prometheus/alerts.yml fires in its scenario and resolves afterwards, that every query
of the Grafana dashboard returns data, and which metrics of orchd's registry changed.

The short run (default) multiplies every ``for:`` and range window of the rules by one factor derived
from the rules file (``rules.auto_scale``); ``--full`` runs the rules as shipped.
"""
