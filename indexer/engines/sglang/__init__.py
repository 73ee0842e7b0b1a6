"""SGLang's KV-cache events, hashes, load and OpenAI front end (the ``sglang`` adapter)."""
