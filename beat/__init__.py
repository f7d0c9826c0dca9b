"""Celery beat's schedule for llmgw's control tasks (run exactly one `celery -A workers beat`)."""
