"""The NCCL transport: the gloo transport's pair protocol (`gloo.py`) with NCCL for the
payload; the cache and staging buffers live on the GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.protocol import KVLayout
from kernels.block_copy import pack_kv_blocks, unpack_kv_blocks

from ._pair import CHUNK_BYTES, as_timedelta
from .base import KVTransferError, torch_dtype
from .gloo import GlooTransport
from .integrity import FaultPlan


class NcclTransport(GlooTransport):
    """Same protocol with NCCL for the payload; the cache and staging live on the GPU.
    Written against the torch.distributed API; exercised only where CUDA is available."""

    kind = "nccl"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
        device: torch.device | None = None,
        checksums: bool = True,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        """Checksums are taken by the Triton block-sums kernel on the GPU staging buffers
        (kernels.block_checksum), as gloo takes them on the CPU."""
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise KVTransferError("the nccl KV transport needs CUDA and an NCCL build of torch")
        super().__init__(host, port, connect_timeout_s, chunk_bytes, checksums, fault_plan)
        self._dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())

    def _device(self) -> torch.device:
        return self._dev

    def _make_group(self, store: dist.Store, rank: int):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = as_timedelta(3600)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)

    def _sync(self) -> None:
        torch.cuda.current_stream(self._dev).synchronize()

    def _pack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        # One gather kernel (Triton on CUDA) instead of one copy per run of consecutive ids.
        packed = pack_kv_blocks(self._cache, torch.tensor(ids, device=self._dev))
        region.copy_(packed.reshape(-1).view(torch.uint8))

    def _unpack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        assert self._cache is not None
        shape = (self._cache.shape[0], 2, len(ids)) + tuple(self._cache.shape[3:])
        unpack_kv_blocks(self._cache, torch.tensor(ids, device=self._dev), region.view(self._cache.dtype).view(shape))

    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        self._check_num_blocks(num_blocks)
        cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout), device=self._dev)
        self.register_cache(cache, layout)
        return cache

    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        if kv_cache.device != self._dev:
            raise ValueError(f"nccl transport for {self._dev} got a cache on {kv_cache.device}")
        super().register_cache(kv_cache, layout)
