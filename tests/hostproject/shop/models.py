from django.db import models


class Product(models.Model):
    name = models.CharField(max_length=100, unique=True)
    price_cents = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.name
