from django.apps import AppConfig


class TaskhosterConfig(AppConfig):
    name = "taskhoster"
    verbose_name = "Taskhoster"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks

        checks.register()  # configuration errors as system checks (manage.py check)
