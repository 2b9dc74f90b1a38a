"""Stage 3: hybrid emulation — the ranks of interest run for real, every other rank is replayed."""
