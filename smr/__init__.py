"""smr: save, migrate and resume stateful workloads.

The ``smr`` package holds what every service shares: the message contract
(``messages``, ``contract``), the JetStream bus (``bus``), tracing, retry
policies, settings, the CRIU engine and the local job registry. The services
themselves live in ``services/`` and talk to each other only through the bus.
"""

__version__ = "0.1.0"
