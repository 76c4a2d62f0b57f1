"""Checkpoint storage: one layout, one backend contract, backends as peers.

    layout    where every object of a checkpoint lives (the only place keys are built)
    backend   the contract a backend implements, and its errors
    local     the local-directory backend (the embedded default)
    s3        the S3 backend (aioboto3)
    codec     how a frame is stored: zstd, then AES-256-GCM
    upload    files cut into frames and sent while CRIU still writes them
    download  parallel ranged GETs, verified before a file gets its name
    store     generations (CheckpointStore), composed of its parts:
      commit      claim, files, manifest, then the latest pointer
      claims      a generation number claimed and its lease renewed
      listing     generations, the latest, the inventory
      fetching    a generation's files read and verified (streamed: for CRIU)
      retention   prune, delete, garbage collection
      generation  what a generation is; a hostile manifest refused
    cache     a node's template cache; mirror: the Checkpoint resources
    service   the storage service on NATS: queries, retention on ckpt.done, GC
"""
