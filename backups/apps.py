from django.apps import AppConfig


class BackupsConfig(AppConfig):
    """Backups and restore (seed 000 section 5); arrives with its own issue."""

    name = "backups"
    default_auto_field = "django.db.models.BigAutoField"
