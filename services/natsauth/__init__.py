"""smr's NATS auth callout: each node agent logs in to NATS with its pod's
ServiceAccount token, and gets a user held to its own node's subjects
(docs/security.md, "An agent held to its node")."""
