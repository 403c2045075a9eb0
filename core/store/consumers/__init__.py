"""The consumers' state (``room-outbox consume``): processed records, retries, partition leases."""
