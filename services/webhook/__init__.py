"""The mutating admission webhook: a pod opted in with a label or env var
gets the `smr` RuntimeClass, so the node's smr-runtime puts smr-init in front
of its containers; the pod author changes nothing else."""
