"""Scale-out over one Redis: rank leases, the engine registry, the status board, workers."""
