"""Serving a pipeline: the device queue that batches users' requests, the demo's requests, several hosts,
HTTP errors, and starting the demo and the CLI."""
