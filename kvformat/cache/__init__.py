"""The engine-neutral chunk cache behind the engine adapters (no engine import): ``_config`` (parameters),
``_lru`` (the LRU capacity index), ``_pool`` (the I/O thread pools), ``_rows`` (the row <-> file engine:
store, load, probe of one chunk), ``_counters`` (the metrics' counters), ``_scan`` (the start-up scan of
the root), ``_jobs`` (job bookkeeping, bounded shutdown). ``kvformat.vllm`` adapts them to vLLM's API."""
