"""Per-node NATS credentials: enrolment, the rendered server authorization, the auth callout, nkeys."""
