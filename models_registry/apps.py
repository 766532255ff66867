from django.apps import AppConfig


class ModelsRegistryConfig(AppConfig):
    name = "models_registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The monitor (nodes) learns of measurements and agent restarts; the model
        # lifecycle acts on them, and the console's model rows aggregate replicas.
        # nodes may not import this app, so it is told here.
        from models_registry import lifecycle, services
        from nodes import hooks

        hooks.register(
            measurement=lifecycle.record_measurement,
            autostart=lifecycle.autostart_node,
            model_rows=services.model_rows,
        )
