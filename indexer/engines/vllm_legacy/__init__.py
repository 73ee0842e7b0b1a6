"""The positional KV event wire of older vLLM releases, as its own engine adapter."""
