"""An item's ``unflushed``: its file left by a flush that failed after its group committed,
not yet written again, seen by every process.

The column is nullable, without a default, so that it is added in place (NULL reads as
no; SQLite would copy the whole table to add a NOT NULL one). Its partial index holds only
the few marked rows; on PostgreSQL it is built ``CONCURRENTLY`` (the migration is not
atomic for it), so that a big item table takes writes while it is.
"""

from typing import Any

from django.db import migrations, models

INDEX = models.Index(fields=["id"], condition=models.Q(unflushed=True), name="item_unflushed")


def add_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            'CREATE INDEX CONCURRENTLY IF NOT EXISTS "item_unflushed" '
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
        ("taskhoster", "0008_no_pattern_index_on_item_ids"),
    ]

    operations = [
        migrations.AddField(
            model_name="item",
            name="unflushed",
            field=models.BooleanField(default=None, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="item", index=INDEX)],
            database_operations=[migrations.RunPython(add_index, drop_index)],
        ),
    ]
