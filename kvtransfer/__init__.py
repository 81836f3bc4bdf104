"""Moving paged KV blocks between workers: one interface, several backends."""
