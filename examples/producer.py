"""Post a few greetings and print each result as it comes.

Run from the repository root while ``scripts/serve`` and ``examples/worker.py`` run:

    .venv/bin/python examples/producer.py

The server and key come from TASKHOSTER_URL and TASKHOSTER_KEY, else from the defaults of
``scripts/serve`` (http://127.0.0.1:8000 and the key it saved in var/credentials.json).
"""

from taskhoster.client import ItemFailed, Producer

with Producer() as producer:
    producer.put_queue("greetings", lease_seconds=30, max_attempts=3)
    names = ["Ada", "Grace", "Linus", ""]
    items = producer.post_many("greetings", [{"name": name} for name in names])
    for item in items:
        try:
            print(f"{item.payload} -> {producer.result(item.id, timeout=60)}")
        except ItemFailed as failed:
            print(f"{item.payload} -> failed: {failed.message}")
