"""Recovery across a restart of every worker (``torchrun``): spills to shared memory (:mod:`.spill`), nodes taking
back their old ranks (:mod:`.renumber`), decoding and re-sharding the spills (:mod:`.reshard`), and where a
restarted job resumes (:mod:`.resume`)."""
