"""smr: save, migrate and resume stateful workloads.

The ``smr`` package holds what every service shares, grouped by concept
(docs/architecture.md, "The base, by concept"): the message contract
(``contract``), the JetStream bus (``bus``), the GPU (``gpu``), CRIU and a
process tree (``process``), settings, telemetry, retry policies and the local
job registry. The services themselves live in ``services/`` and talk to each
other only through the bus.
"""

__version__ = "0.1.0"
