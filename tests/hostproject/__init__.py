"""A Django project of someone else's, with Taskhoster added: its own app (``shop``), its own
admin, and Taskhoster under ``/tasks/``.

``tests/integration/test_embedding.py`` serves it with daphne and drives the API, the socket
and the admin; ``docs/embedding.md`` is made of its files.
"""
