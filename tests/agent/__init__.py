"""The node agent end to end: two simulated nodes on this machine."""
