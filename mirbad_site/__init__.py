"""The MirbadLLM master."""

# Every process that loads Django loads the project's Celery app, so a task queued
# from the web (rotate now) goes to our broker: without it ``shared_task`` falls back
# to Celery's default app, whose broker is amqp://localhost (docs/decisions.md D59).
from mirbad_site.celery import app as celery_app

__version__ = "0.1.0"
__all__ = ["__version__", "celery_app"]
