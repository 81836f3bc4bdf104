"""The `baton` CLI, configuration, Ray start-up and worker pools."""
