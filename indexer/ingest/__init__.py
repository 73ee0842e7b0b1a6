"""Ingest: ZMQ sockets and replay per engine rank, the subscriber, and trace replay."""
