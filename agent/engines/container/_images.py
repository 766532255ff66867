"""Images: pulled when the engine does not hold one, with progress on the event stream.

A pull has no deadline (a large image takes as long as it takes); its progress goes
out as ``image.pull`` events (layers, bytes done and total), at most two a second,
and on the instance itself while its start waits (``pull`` in its JSON).
"""

from __future__ import annotations

import asyncio
import logging
import time

from agent.engines.container._docker import DockerGateway, DockerRefused, NotThere
from agent.engines.container._instance import ContainerInstance
from agent.state import EventBus
from protocol.images import parse_image

__all__ = ["ensure_image"]

log = logging.getLogger("mirbad.agent.container")


async def ensure_image(docker: DockerGateway, bus: EventBus, inst: ContainerInstance) -> None:
    """Pull the image when the engine does not hold it, publishing its progress."""
    image = inst.image
    try:
        await docker.call(lambda: docker.client.images.get(image))
        return
    except NotThere:
        pass
    ref = parse_image(image)
    loop = asyncio.get_running_loop()
    layers: dict[str, tuple[int, int]] = {}
    last = [0.0]

    def report(status: str) -> None:
        done = sum(c for c, _ in layers.values())
        total = sum(t for _, t in layers.values())
        inst.pulling = {"image": image, "status": status, "layers": len(layers),
                        "bytesDone": done, "bytesTotal": total}  # fmt: skip
        bus.publish("image.pull", {"instanceId": inst.instance_id, **inst.pulling})

    def pull() -> None:
        stream = docker.long_client.api.pull(
            ref.repository, tag=ref.digest or ref.tag or "latest", stream=True, decode=True
        )
        for event in stream:
            if "error" in event:
                raise DockerRefused(None, str(event["error"]))
            detail = event.get("progressDetail") or {}
            if event.get("id") and detail.get("total"):
                layers[event["id"]] = (int(detail.get("current") or 0), int(detail["total"]))
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                loop.call_soon_threadsafe(report, "pulling")

    log.info("Pulling %s for %s", image, inst.instance_id)
    report("started")
    try:
        await docker.unbounded(pull)
    except DockerRefused as exc:
        raise DockerRefused(exc.status, f"image {image} could not be pulled: {exc}") from None
    report("done")
    inst.pulling = None
