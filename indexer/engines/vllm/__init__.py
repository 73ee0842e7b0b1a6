"""vLLM's adapter (:mod:`.adapter`) over its ZMQ KV event wire (:mod:`.wire`) and block
hashing (:mod:`.hashing`)."""
