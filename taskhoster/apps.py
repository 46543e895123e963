from django.apps import AppConfig


class TaskhosterConfig(AppConfig):
    name = "taskhoster"
    verbose_name = "Taskhoster"
    default_auto_field = "django.db.models.BigAutoField"
