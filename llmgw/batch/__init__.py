"""The Batch API's shared parts (docs/batch.md): its settings (`config`), what a valid input file is
(`lines`), what a new batch must be and whether its key still lets it run (`rules`), OpenAI's shapes
(`shapes`), and how a batch's run task is sent (`kick`). The gateway's views (gateway/http/batches.py)
and the batch workers (workers/batch/) are the shells around them."""
