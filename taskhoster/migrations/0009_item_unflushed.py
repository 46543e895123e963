"""An item's ``unflushed``: its file left by a flush that failed after its group committed,
not yet written again, seen by every process (its index: 0010).

The column is nullable, without a default, so that it is added in place (NULL reads as
no; SQLite would copy the whole table to add a NOT NULL one).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("taskhoster", "0008_no_pattern_index_on_item_ids"),
    ]

    operations = [
        migrations.AddField(
            model_name="item",
            name="unflushed",
            field=models.BooleanField(default=None, null=True),
        ),
    ]
