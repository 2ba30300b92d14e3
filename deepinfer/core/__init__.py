"""CPU-only bookkeeping: requests, paged blocks, prefix cache and the scheduler. No torch here."""
