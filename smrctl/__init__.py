"""The programs that compose smr's services: the `smr` command line, the
embedded mode (`smr up`: every service of a node in one process) and the
demo. The top layer: it may import `services` and `smr`; nothing imports it
(docs/architecture.md, the import contracts in pyproject.toml)."""
