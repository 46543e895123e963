"""The host project's own app: products, in its own admin."""
