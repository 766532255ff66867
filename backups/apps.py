from django.apps import AppConfig


class BackupsConfig(AppConfig):
    """Backups and restore; arrives with its own issue."""

    name = "backups"
    default_auto_field = "django.db.models.BigAutoField"
