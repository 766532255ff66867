"""Images: pulled when the engine does not hold one, with progress on the event stream;
and the list of what the engine holds, for ``GET /agent/v1/images``.

A pull has no deadline (a large image takes as long as it takes); its progress goes
out as ``image.pull`` events (layers, bytes done and total), at most two a second,
and on the instance itself while its start waits (``pull`` in its JSON).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Any

from agent._util import iso_time
from agent.engines.container._docker import DockerGateway, DockerRefused, NotThere
from agent.engines.container._instance import ContainerInstance
from agent.state import EventBus
from protocol.images import parse_image

__all__ = ["IMAGES_LIMIT", "ensure_image", "list_images"]

log = logging.getLogger("mirbad.agent.container")

# An answer the master reads whole and the console may show: a node that collected
# thousands of images still answers in bounded size (docs/agent-api.md,
# "GET /agent/v1/images").
IMAGES_LIMIT = 1000

# What older Docker engines put in RepoTags and RepoDigests of an untagged image.
_NONE = ("<none>:<none>", "<none>@<none>")


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
    # Bytes (done, total) per layer, from the engine's "Downloading" events only: Docker
    # reuses a layer's id for its extraction, whose figures start again from zero.
    layers: dict[str, tuple[int, int]] = {}
    # What the engine says of a layer once all its bytes are in.
    downloaded = ("Download complete", "Verifying Checksum", "Extracting", "Pull complete")
    last = [0.0]
    ended = [False]

    def figures() -> tuple[int, int, int]:
        """Read on the thread that changes ``layers``, or once that thread has returned."""
        return len(layers), sum(c for c, _ in layers.values()), sum(t for _, t in layers.values())

    def report(status: str, counted: tuple[int, int, int]) -> None:
        if ended[0]:
            return  # a stopped start's pull goes on in the engine; the instance moved on
        count, done, total = counted
        inst.pulling = {"image": image, "status": status, "layers": count,
                        "bytesDone": done, "bytesTotal": total}  # fmt: skip
        bus.publish("image.pull", {"instanceId": inst.instance_id, **inst.pulling})

    def pull() -> None:
        stream = docker.long_client.api.pull(
            ref.repository, tag=ref.digest or ref.tag or "latest", stream=True, decode=True
        )
        for event in stream:
            if "error" in event:
                raise DockerRefused(None, str(event["error"]))
            layer, status = event.get("id"), event.get("status")
            detail = event.get("progressDetail") or {}
            if layer and status == "Downloading" and detail.get("total"):
                seen = layers.get(layer, (0, 0))[0]
                current = max(seen, int(detail.get("current") or 0))
                layers[layer] = (current, int(detail["total"]))
            elif layer in layers and status in downloaded:
                # Podman never sends a last "Downloading" at the total (it reports once
                # a second), and Docker need not: the layer is whole all the same.
                layers[layer] = (layers[layer][1], layers[layer][1])
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                loop.call_soon_threadsafe(report, "pulling", figures())

    log.info("Pulling %s for %s", image, inst.instance_id)
    report("started", (0, 0, 0))
    try:
        await docker.unbounded(pull)
    except DockerRefused as exc:
        report("failed", figures())
        raise DockerRefused(exc.status, f"image {image} could not be pulled: {exc}") from None
    except Exception:
        report("failed", figures())
        raise
    else:
        report("done", figures())
        inst.pulling = None
    finally:
        ended[0] = True


async def list_images(docker: DockerGateway) -> dict[str, Any]:
    """What the engine holds: ``{"images": [...], "truncated": bool}``, sorted by first
    tag (untagged last), then id, at most :data:`IMAGES_LIMIT`."""
    # One GET /images/json: the SDK's images.list() inspects every image after it, one
    # call each, and an image removed in between would fail the whole listing.
    summaries = await docker.call(lambda: docker.client.api.images())
    images = [_image(s) for s in summaries if isinstance(s, dict)]
    images.sort(key=lambda i: (not i["tags"], i["tags"][:1], i["id"]))
    return {"images": images[:IMAGES_LIMIT], "truncated": len(images) > IMAGES_LIMIT}


def _image(summary: dict[str, Any]) -> dict[str, Any]:
    size = summary.get("Size")
    return {
        "id": str(summary.get("Id") or ""),
        "tags": _names(summary.get("RepoTags")),
        "digests": _names(summary.get("RepoDigests")),
        "sizeBytes": size if isinstance(size, int) and size >= 0 else 0,
        "createdAt": _created(summary.get("Created")),
    }


def _names(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []  # Docker sends null for an image without any
    return sorted({v for v in value if isinstance(v, str) and v and v not in _NONE})


def _created(value: Any) -> str | None:
    """Docker's list says seconds since the epoch and its inspect an RFC 3339 string
    (nanoseconds, any offset); Podman's may say either. One form for the master; null
    for what is not a time (Docker's zero time of an image without one included)."""
    if isinstance(value, str) and value:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        if moment.tzinfo is None:
            return None  # no offset: any reading of it would be a guess
        value = moment.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    try:
        return iso_time(value)
    except (OverflowError, OSError, ValueError):
        return None
