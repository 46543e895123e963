from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.hostproject.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"
