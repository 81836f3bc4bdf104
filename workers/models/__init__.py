"""Model implementations on the paged KV cache."""
