"""The node agent: one per machine, serves the gRPC contract in proto/, never imports Django."""

__version__ = "0.1.0"
