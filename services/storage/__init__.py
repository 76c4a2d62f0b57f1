"""Checkpoint storage: one layout, one backend contract, backends as peers.

    layout   where every object of a checkpoint lives (the only place keys are built)
    backend  the contract a backend implements, and its errors
    local    the local-directory backend (the embedded default)
    store    generations: commit (files, then manifest, then the latest pointer),
             list, fetch with sha256 verified before any byte reaches CRIU
"""
