"""vLLM's adapter: its ZMQ KV event wire (:mod:`.wire`) and block hashing (:mod:`.hashing`)."""
