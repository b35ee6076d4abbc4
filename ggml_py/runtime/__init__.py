"""How a graph runs: backend interfaces, the registry, allocation, scheduling, plans, the native ABI."""
