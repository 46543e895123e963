"""Taskhoster: a task-queue server.

Producers post items over REST, workers hold a WebSocket at ``/work``, operators use the
Django admin, and ``manage.py sweep`` applies the clocks. Start reading at ``docs/architecture.md``.
"""
