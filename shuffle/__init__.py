"""In-memory data: partitioned load, the store, batch sampling, decode/augment, group shuffle."""
