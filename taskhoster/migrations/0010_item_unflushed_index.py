"""The partial index of the few rows marked ``unflushed`` (0009).

On PostgreSQL it is built ``CONCURRENTLY``, outside a transaction, so that a big item table
takes writes while it is; an index an interrupted build left (``INVALID``, which the planner
never uses) is dropped first, so running this again builds it whole. Elsewhere, Django's own.
"""

from typing import Any

from django.db import migrations, models

INDEX = models.Index(fields=["id"], condition=models.Q(unflushed=True), name="item_unflushed")


def add_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute('DROP INDEX CONCURRENTLY IF EXISTS "item_unflushed"')
        schema_editor.execute(
            'CREATE INDEX CONCURRENTLY "item_unflushed" '
            'ON "taskhoster_item" ("id") WHERE "unflushed"'
        )
    else:
        schema_editor.add_index(apps.get_model("taskhoster", "Item"), INDEX)


def drop_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute('DROP INDEX CONCURRENTLY IF EXISTS "item_unflushed"')
    else:
        schema_editor.remove_index(apps.get_model("taskhoster", "Item"), INDEX)


class Migration(migrations.Migration):
    atomic = False  # (CREATE INDEX CONCURRENTLY runs outside a transaction)

    dependencies = [
        ("taskhoster", "0009_item_unflushed"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="item", index=INDEX)],
            database_operations=[migrations.RunPython(add_index, drop_index)],
        ),
    ]
