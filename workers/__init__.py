"""The node agent: one per machine, serves the gRPC contract in proto/, never imports Django."""

__version__ = "0.1.0"

#: What this agent does beyond the first protocol (NodeStatus.features). The control plane
#: plans by these, since an older agent silently ignores request fields it does not know:
#: "swa-window": LoadModelRequest.swa_window keeps only the window in sliding layers.
FEATURES = ("swa-window",)
