"""Durable, versioned publication: atomic writes, digests, the data root in a folder or an object store."""
