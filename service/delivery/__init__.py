"""Delivery of what the pipeline decided: the Redis outbox, webhooks, Alertmanager."""
