"""kvindex indexer: wire decoding, residency model, stores and the event subscriber."""
