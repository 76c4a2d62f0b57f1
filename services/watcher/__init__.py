"""The watcher: Kubernetes events in, checkpoint and restore requests out
(see ``service``)."""
