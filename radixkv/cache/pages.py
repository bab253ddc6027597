"""PagePool: the physical KV pages (K and V tensors per layer, in the storage dtype, with a scale
per (token, KV head) for int8) and a reference count per page. A page is on the free list exactly
when its refcount is 0; allocate and release are O(1) per page. Who holds the references (the
radix tree, running requests) is the callers' business.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixkv.cache.kv_dtype import SCALE_DTYPE, has_scales


# Pages zeroed together the first time allocation reaches past the zeroed ones (see
# PagePool._zero_up_to): a few MiB to a few tens of MiB of KV, at a few calls per layer.
ZERO_CHUNK_PAGES = 64


class OutOfPages(RuntimeError):
    """More pages were requested than are free."""

    def __init__(self, requested: int, num_free: int, num_pages: int):
        super().__init__(f"requested {requested} KV pages but only {num_free} of {num_pages} are free")
        self.requested = requested
        self.num_free = num_free
        self.num_pages = num_pages


class PagePool:
    """Fixed set of `num_pages` pages of `page_size` token slots each, with refcounts."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int = 0,
        num_kv_heads: int = 1,
        head_dim: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        """dtype: the storage dtype (radixkv.cache.kv_dtype); int8 pages get k_scales and
        v_scales, fp16 (SCALE_DTYPE) [num_pages, page_size, num_kv_heads] per layer (empty lists otherwise)."""
        _check_int("num_pages", num_pages, minimum=1)
        _check_int("page_size", page_size, minimum=1)
        _check_int("num_layers", num_layers, minimum=0)
        _check_int("num_kv_heads", num_kv_heads, minimum=1)
        _check_int("head_dim", head_dim, minimum=1)
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # Attention may read unwritten slots under a mask, and 0 * NaN = NaN, so a page is
        # zeroed before its first use. Zeroing lazily (pages below a high-water mark) keeps a
        # pool sized from free memory from costing that memory until it is used.
        self.k_cache: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        scale_layers = num_layers if has_scales(dtype) else 0
        self.k_scales: list[torch.Tensor] = [torch.empty(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(scale_layers)]
        self.v_scales: list[torch.Tensor] = [torch.empty(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(scale_layers)]
        self._num_zeroed_pages = 0
        # A plain list beats a numpy array for scalar reads and writes from Python.
        self._refcounts: list[int] = [0] * num_pages
        self._free: list[int] = []
        self.reset()

    @classmethod
    def bytes_per_page(
        cls, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page takes in K and V over all layers, in the storage dtype, with the
        scales of int8 pages."""
        scale_bytes = num_kv_heads * SCALE_DTYPE.itemsize if has_scales(dtype) else 0
        return 2 * num_layers * page_size * (num_kv_heads * head_dim * dtype.itemsize + scale_bytes)

    @classmethod
    def pages_for_memory(
        cls,
        free_bytes: int,
        memory_fraction: float,
        max_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many pages `memory_fraction` of `free_bytes` holds, at least 1, at most `max_pages`."""
        page_bytes = cls.bytes_per_page(page_size, num_layers, num_kv_heads, head_dim, dtype)
        pages = int(free_bytes * memory_fraction) // page_bytes
        return max(1, min(pages, max_pages))

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with refcount 1; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of pages to allocate must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), self.num_pages)
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()  # lowest page first: the free list is a stack with low ids on top
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] = 1
        self._zero_up_to(max(pages) + 1)
        return pages

    def _zero_up_to(self, end: int) -> None:
        if end > self._num_zeroed_pages:
            # At least ZERO_CHUNK_PAGES at a time: decode takes a page per sequence every few
            # steps, and zeroing each alone costs a call per layer tensor each time, a visible
            # share of a decode step while a fresh pool fills.
            end = min(self.num_pages, max(end, self._num_zeroed_pages + ZERO_CHUNK_PAGES))
            for cache in self._tensors():
                cache[self._num_zeroed_pages : end].zero_()
            self._num_zeroed_pages = end

    def incref(self, pages: Iterable[int]) -> None:
        refcounts = self._refcounts
        for page in pages:
            assert page >= 0 and refcounts[page] >= 1, f"incref of free or invalid page {page}"
            refcounts[page] += 1

    def release(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; returns how many went back on the free list."""
        refcounts, free = self._refcounts, self._free
        freed = 0
        for page in pages:
            count = refcounts[page] if page >= 0 else 0  # a negative id would index from the end
            if count <= 0:
                # A double release would put the page on the free list twice: two owners later.
                raise RuntimeError(f"release of page {page}, which is free or not a page id")
            refcounts[page] = count - 1
            if count == 1:
                free.append(page)
                freed += 1
        return freed

    @property
    def dtype(self) -> torch.dtype | None:
        """The storage dtype of the pages (None for a pool without layers)."""
        return self.k_cache[0].dtype if self.k_cache else None

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a page has a slice of, in page_bytes' order: K, V, then K and V scales."""
        return (*self.k_cache, *self.v_cache, *self.k_scales, *self.v_scales)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page's K and V (and scales) over all layers: what page_bytes returns."""
        return sum(cache[0].numel() * cache.element_size() for cache in self._tensors())

    def page_bytes(self, page: int) -> bytes:
        """One page's K then V of every layer, then their scales for int8, raw (for the disk tier)."""
        parts = [cache[page].detach().to("cpu").contiguous().view(torch.uint8).reshape(-1) for cache in self._tensors()]
        return torch.cat(parts).numpy().tobytes() if parts else b""

    def load_page(self, page: int, data: bytes) -> None:
        """Fill `page` with bytes page_bytes returned (same layout, dtype and shapes)."""
        self.load_pages([page], [data])

    def load_pages(self, pages: list[int], payloads: list[bytes]) -> None:
        """Fill each of `pages` with its payload (bytes page_bytes returned)."""
        nbytes = self.page_nbytes
        for data in payloads:
            if len(data) != nbytes:
                raise ValueError(f"a page holds {nbytes} bytes of KV, got {len(data)}")
        if len(pages) != len(payloads):
            raise ValueError(f"{len(pages)} pages for {len(payloads)} payloads")
        if not self.k_cache or not pages:
            return
        if self.k_cache[0].device.type == "cpu":
            # Page by page: one gather over the run measured no faster on CPU (its strided
            # source costs what the saved calls do).
            for page, data in zip(pages, payloads):
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                offset = 0
                for cache in self._tensors():
                    target = cache[page]
                    size = target.numel() * target.element_size()
                    target.copy_(raw[offset : offset + size].view(target.dtype).view(target.shape))
                    offset += size
        else:
            self._load_pages_gathered(pages, payloads)

    def _load_pages_gathered(self, pages: list[int], payloads: list[bytes]) -> None:
        """One transfer of the whole run to the device, then one indexed copy per layer's K and
        V: a device pays per transfer, and would otherwise take two per layer per page."""
        device = self.k_cache[0].device
        raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(pages), -1).to(device)
        index = torch.tensor(pages, dtype=torch.long, device=device)
        offset = 0
        for cache in self._tensors():
            size = cache[0].numel() * cache.element_size()
            run = raw[:, offset : offset + size].contiguous().view(cache.dtype).view(len(pages), *cache.shape[1:])
            cache.index_copy_(0, index, run)
            offset += size

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def refcounts(self) -> tuple[int, ...]:
        """Every page's refcount, in page order (a snapshot, for invariant checks)."""
        return tuple(self._refcounts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> set[int]:
        return set(self._free)

    def reset(self) -> None:
        """Every page free, every refcount 0 (the KV contents are left as they are)."""
        self._refcounts = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))

    def check_invariants(self) -> None:
        """Free list holds each page at most once, exactly the pages with refcount 0."""
        free = self.free_pages()
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        zero = {page for page, count in enumerate(self._refcounts) if count == 0}
        if free != zero:
            raise AssertionError(
                f"free list and refcount 0 disagree: free only {sorted(free - zero)[:8]}, "
                f"refcount 0 only {sorted(zero - free)[:8]}"
            )
        negative = [page for page, count in enumerate(self._refcounts) if count < 0]
        if negative:
            raise AssertionError(f"negative refcounts on pages {negative[:8]}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def available_memory_bytes(device: torch.device) -> int:
    """Memory a KV pool on `device` may take: the GPU's free memory, or the host's available
    memory (MemAvailable); without /proc, a modest 4 GiB."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
