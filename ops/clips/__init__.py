"""Clips and shards: the clip plan, WebDataset shards and their references, cache, profile and throughput."""
