"""Virtual ranks: the replay assistant and slice-by-slice timing (paper §5.3, §6.1)."""
