"""From probed rows to trainable ones: the manifest, validation, quarantine, splits, licences and rights."""
