"""The tensor-parallel cluster: a root that plans and streams weight slices, worker daemons that
run their slice of every layer, and the two all-reduces per layer through dllama.sync."""
