"""Internals of the vLLM tier that do not import vLLM: config parsing, the LRU capacity index,
the I/O thread pool and the row <-> file engine. ``kvformat.vllm`` adapts them to vLLM's API."""
