"""The process that supervises the ranks: torchrun with a failure account, and the fault policy of a launch."""
