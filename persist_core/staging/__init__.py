"""Host staging buffers, shared by the flows (save/ and memory/): where buffers come from (``allocators``: pinned
host memory, mapped files, the memory tier's slots), the pool that hands them out with back-pressure (``pool``),
the copy of a planned state into one (``stage``), and how far a deferred copy has got (``filling``)."""
