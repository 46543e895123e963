"""An item's ``unflushed``: its file left by a flush that failed after its group committed,
not yet written again, seen by every process (NULL for no: added in place, not by copying
the table).
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
        migrations.AddIndex(
            model_name="item",
            index=models.Index(
                condition=models.Q(("unflushed", True)), fields=["id"], name="item_unflushed"
            ),
        ),
    ]
