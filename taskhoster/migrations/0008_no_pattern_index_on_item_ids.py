"""PostgreSQL: drop the ``varchar_pattern_ops`` index Django makes beside a text primary key.

Django adds it to every ``CharField`` primary key on PostgreSQL so that ``LIKE 'x%'`` can use
an index. Nothing looks an item up by a prefix of its id (the admin's search is exact:
``=id``), and every item row written, each post and each change of status, paid for one
more index entry. Other databases have no such index: nothing to do there.
"""

from typing import Any

from django.db import migrations


def _like_index(schema_editor: Any) -> str:
    return str(schema_editor._create_index_name("taskhoster_item", ["id"], suffix="_like"))


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"DROP INDEX IF EXISTS {schema_editor.quote_name(_like_index(schema_editor))}"
        )


def make_again(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        name = schema_editor.quote_name(_like_index(schema_editor))
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {name} ON taskhoster_item (id varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("taskhoster", "0007_schedules"),
    ]

    operations = [migrations.RunPython(drop, make_again)]
