"""Model weights on the node: downloads from the hub, the models root's inventory and
reclaim, and bounded reads of GGUF headers."""

from agent.weights._downloads import DownloadManager
from agent.weights._gguf import is_model_file, read_summary
from agent.weights._inventory import Weights

__all__ = ["DownloadManager", "Weights", "is_model_file", "read_summary"]
