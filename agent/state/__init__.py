"""What the agent remembers and announces: the accepted master (fencing), the operation
log of mutating requests, and the event bus behind ``/agent/v1/events``."""

from agent.state._events import EventBus
from agent.state._fencing import Fencing
from agent.state._oplog import OPERATION_HEADER, OperationLog, describe_request

__all__ = ["OPERATION_HEADER", "EventBus", "Fencing", "OperationLog", "describe_request"]
