"""PostgreSQL: drop the ``varchar_pattern_ops`` index Django makes beside a text primary key.

Django adds it to every ``CharField`` primary key on PostgreSQL so that ``LIKE 'x%'`` can use
an index. Nothing looks an item up by a prefix of its id (the admin's search is exact:
``=id``), and every item row written, each post and each change of status, paid for one
more index entry. Other databases have no such index: nothing to do there.
"""

from typing import Any

from django.db import migrations


# The name Django gave the index (``_create_index_name("taskhoster_item", ["id"],
# suffix="_like")``, a private method, so not called here): made again under it.
LIKE_INDEX = "taskhoster_item_id_59c89d8d_like"


def drop(apps: Any, schema_editor: Any) -> None:
    """Drop every ``varchar_pattern_ops`` index of the item table, found by what it is,
    whatever its name."""
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename = 'taskhoster_item' AND indexdef LIKE %s",
            ["%varchar_pattern_ops%"],
        )
        names = [row[0] for row in cursor.fetchall()]
    for name in names:
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(name)}")


def make_again(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        name = schema_editor.quote_name(LIKE_INDEX)
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {name} ON taskhoster_item (id varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("taskhoster", "0007_schedules"),
    ]

    operations = [migrations.RunPython(drop, make_again)]
