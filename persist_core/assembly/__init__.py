"""A state from verified bytes, shared by the flows (load/ and memory/): which byte ranges each target overlaps
(``plan``), those ranges read in runs of verified checksum blocks (``blocks``), and the shard bytes put together
into the state (``assemble``)."""
