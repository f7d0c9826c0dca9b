"""The batch workers (`celery -A workers worker -Q batch`): they feed the Batch API's lines to the
gateways at the lowest priority, into the capacity interactive requests leave (docs/batch.md)."""
