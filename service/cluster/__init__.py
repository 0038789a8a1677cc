"""Many replicas as one: partition leases, ownership, domain snapshots, worker processes."""
